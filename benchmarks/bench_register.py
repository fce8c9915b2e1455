"""A pool's agents registering at once, as after a power cut: N registrations with one join token.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/gpucp REDIS_URL=redis://127.0.0.1:6379/15 \
      .venv/bin/python benchmarks/bench_register.py [--nodes 250] [--clients 32] [--gpus 8]

It creates its own database (the DATABASE_URL's name + "_bench_reg", dropped and re-created),
starts gunicorn (gthread workers, as deployed) on 127.0.0.1, issues one join token with a use per
node, and sends the real POST /api/agent/v1/register of --nodes nodes from --clients
concurrent connections, each registration with its own registration key and try number, as
the agent sends them. No agent process starts: on a real cluster each agent runs on its own
host, so what is measured is the control plane's side only (bench_kueue_scenario.py --agents
real starts them all on this machine, where their start-up competes for its CPUs).

Prints the wall time until every node is registered, the registrations per second, the
latency p50 / p99 / max of one registration, and the web's CPU milliseconds per registration,
with the load average.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_heartbeat import (  # noqa: E402 - after the path set-up
    ROOT,
    bench_database_url,
    inventory,
    recreate_database,
    setup_django,
    start_gunicorn,
    stop,
)
from bench_kueue_scenario import _purge  # noqa: E402
from bench_throughput import loadavg, tree_cpu_s  # noqa: E402


def register_all(port: int, join_token: str, names: list[str], gpus: int, clients: int):
    """(latency of each registration in seconds, wall seconds for all of them)."""

    def some(batch: list[str]) -> list[float]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        took = []
        for name in batch:
            body = {
                **inventory(name, gpus),
                "registration_key": secrets.token_urlsafe(32),
                "registration_try": 1,
            }
            t0 = time.perf_counter()
            conn.request(
                "POST",
                "/api/agent/v1/register",
                body=json.dumps(body),
                headers={
                    "Authorization": f"Bearer {join_token}",
                    "Content-Type": "application/json",
                },
            )
            response = conn.getresponse()
            answer = response.read()
            took.append(time.perf_counter() - t0)
            if response.status != 201:
                sys.exit(f"register {name}: {response.status} {answer[:200]!r}")
        return took

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as executor:
        batches = list(executor.map(some, [names[i::clients] for i in range(clients)]))
    return [t for batch in batches for t in batch], time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=250)
    parser.add_argument("--clients", type=int, default=32, help="concurrent registrations")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--port", type=int, default=18455)
    parser.add_argument("--workers", type=int, default=2, help="gunicorn worker processes")
    parser.add_argument("--threads", type=int, default=16, help="gunicorn threads per worker")
    args = parser.parse_args()

    base_url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/gpucp")
    database_url, name = bench_database_url(base_url, "_bench_reg")
    recreate_database(base_url, name)
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "DEBUG": "0",
        "LOG_LEVEL": "WARNING",
        # Every registration asks for a cycle; no worker runs them here.
        "CELERY_QUEUE": "gpucp_bench_reg",
    }
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True
    )
    setup_django(database_url)
    import datetime as dt

    from django.utils import timezone

    from controlplane.cluster.agent_auth import issue_join_token
    from controlplane.cluster.models import Node, Pool

    pool = Pool.objects.create(name="bench")
    _, join_token = issue_join_token(
        pool, expires_at=timezone.now() + dt.timedelta(hours=2), max_uses=args.nodes + 1
    )
    server = start_gunicorn(args.port, args.workers, args.threads, env)
    try:
        # One registration first, not measured: each web process's first request loads what
        # the later ones reuse.
        register_all(args.port, join_token, ["warm-up"], args.gpus, 1)
        before_s = tree_cpu_s(server.pid)
        names = [f"bench-{i:05d}" for i in range(args.nodes)]
        took, wall_s = register_all(args.port, join_token, names, args.gpus, args.clients)
        web_ms = (tree_cpu_s(server.pid) - before_s) * 1000 / args.nodes
    finally:
        stop(server)
        _purge(env["CELERY_QUEUE"])  # the cycles the registrations asked for: no worker here
    registered = Node.objects.filter(name__startswith="bench-").count()
    took.sort()
    p99 = took[min(len(took) - 1, round(0.99 * (len(took) - 1)))]
    print(
        f"{registered} of {args.nodes} nodes ({args.gpus} GPUs each) registered with one join "
        f"token from {args.clients} connections in {wall_s:.1f} s -> "
        f"{args.nodes / wall_s:.1f} registrations/s; one registration p50 "
        f"{statistics.median(took) * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, max "
        f"{took[-1] * 1000:.0f} ms; web CPU {web_ms:.1f} ms per registration  (load {loadavg()})"
    )


if __name__ == "__main__":
    main()
