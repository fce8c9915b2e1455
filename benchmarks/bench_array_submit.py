"""How long POST /api/v1/arrays/ takes for a 1,000-task array, and in how many statements.

    DATABASE_URL=postgres://... .venv/bin/python benchmarks/bench_array_submit.py [--tasks 1000]

The request goes through the whole REST stack in this process (URL routing, middleware,
authentication by API token, DRF, validation, jobs.arrays.submit_array) against a throwaway
PostgreSQL database (benchmarks/_scheduling_db.py), with a tenant whose quota fits and a node
with GPUs of the type asked for. Each run submits a fresh array (the tasks of earlier runs
stay, as they would in a busy cluster); the figure is the median over --runs, after one warm-up
submit that primes the per-process caches as any long-running server has them.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from _scheduling_db import bench_database, median, setup_django


def world():
    from django.contrib.auth.models import User

    from controlplane.cluster.models import GPU, Node, Pool
    from controlplane.tenancy.models import ApiToken, Membership, Quota, Tenant

    tenant = Tenant.objects.create(slug="vision", name="Vision", max_array_size=10_000)
    Quota.objects.create(tenant=tenant, gpu_type="H100-SXM-80GB", guaranteed_gpus=8, limit_gpus=16)
    user = User.objects.create_user("alice", password="x")
    Membership.objects.create(user=user, tenant=tenant, role="member")
    pool = Pool.objects.create(name="default")
    node = Node.objects.create(name="n1", pool=pool, cpus=64, memory_mib=512 * 1024)
    for i in range(8):
        GPU.objects.create(
            node=node,
            index=i,
            uuid=f"GPU-n1-{i}",
            model="H100-SXM-80GB",
            memory_mib=81559,
            power_min_w=200.0,
            power_max_w=700.0,
            power_default_w=700.0,
            power_cap_w=700.0,
        )
    _, secret = ApiToken.issue(user, "bench")
    return secret


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    setup_django()
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    from controlplane.jobs.models import Job

    with bench_database("bench_arrays"):
        token = world()
        client = Client()
        headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
        body = {
            "tenant": "vision",
            "name": "sweep",
            "image": "registry.local/team/sweep:1",
            "command": ["python", "sweep.py", "--lr-index={{array_index}}"],
            "env": {"POINT": "{{array_index}}/{{array_size}}"},
            "gpus": 1,
            "gpu_type": "H100-SXM-80GB",
            "array": f"0-{args.tasks - 1}",
            "max_parallel": 50,
        }
        payload = json.dumps(body)

        def post():
            response = client.post(
                "/api/v1/arrays/", payload, content_type="application/json", **headers
            )
            if response.status_code != 201:
                raise SystemExit(f"submit refused: {response.status_code} {response.content[:300]}")

        post()  # warm-up
        times_s, statements = [], []
        for _ in range(args.runs):
            with CaptureQueriesContext(connection) as queries:
                began = time.perf_counter()
                post()
                times_s.append(time.perf_counter() - began)
            statements.append(len(queries))
        assert Job.objects.count() == args.tasks * (args.runs + 1)
    load = os.getloadavg()
    print(
        f"POST /api/v1/arrays/ with {args.tasks} tasks: median {median(times_s) * 1000:.0f} ms "
        f"(min {min(times_s) * 1000:.0f}, max {max(times_s) * 1000:.0f}) over {args.runs} runs, "
        f"{median([float(s) for s in statements]):.0f} SQL statements per request; "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )


if __name__ == "__main__":
    main()
