"""Instructions a web process executes per API request: a figure that the machine's noise leaves alone.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/gpucp REDIS_URL=redis://127.0.0.1:6379/15 \
      .venv/bin/python benchmarks/bench_request_instructions.py [--requests 200]

bench_throughput.py measures CPU milliseconds per request on the whole production stack, and on
a shared 2-core virtual machine those drift by a quarter between two runs of the same build
(its request floor, the same code in both runs, moved from 1.6 to 2.6 ms in one afternoon). A
change worth a tenth of a submit cannot be seen there. This counts what the web process itself
executes, with valgrind's callgrind, which does not depend on what else the machine does: two
runs of one build agree to within 0.3 %.

What runs is the production WSGI application (controlplane.wsgi: every middleware, DRF, the
bearer token, the rate counts in Redis, PostgreSQL through psycopg), called in one process by
this script, as a gunicorn worker thread calls it; gunicorn's own HTTP parsing and socket work
are not counted (bench_throughput's GET /favicon.ico floor measures them with the rest of the
middleware). PostgreSQL and Redis run as they do in production, in their own processes, and
what they execute is not counted either: a round trip saved shows here only as the client's
side of it.

For each request kind (GET /favicon.ico, a redirect answered by a plain view; GET /api/v1/;
POST /api/v1/jobs/ with one job; the same with a list of 100): 50 requests to warm up, then
callgrind's counters are zeroed, --requests requests run, and the counters are dumped. Prints
instructions per request (per job for the list), and the CPU time per request outside
valgrind beside it, with the load average. It creates its own database (DATABASE_URL's name +
"_bench_ir").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_heartbeat import bench_database_url, recreate_database, setup_django  # noqa: E402

JOB = {"image": "localhost/bench:1", "command": ["true"], "gpus": 1}
KINDS = {
    # name: (method, path, body, jobs per request)
    "GET /favicon.ico": ("GET", "/favicon.ico", None, 0),
    "GET /api/v1/": ("GET", "/api/v1/", None, 0),
    "POST /api/v1/jobs/, one job": ("POST", "/api/v1/jobs/", JOB, 1),
    "POST /api/v1/jobs/, a list of 100": ("POST", "/api/v1/jobs/", [JOB] * 100, 100),
}
WARM_UP = 50


def loadavg() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


# --- the child: requests through the WSGI application --------------------------------------


def run_requests(kind: str, count: int, token: str, under_callgrind: bool) -> None:
    """Call the production WSGI application `count` times with one request kind, after a
    warm-up; print the CPU seconds they took. Under callgrind, zero its counters before and
    dump them after, so that the dump holds these requests alone."""
    import io

    from controlplane.wsgi import application

    method, path, body, _ = KINDS[kind]
    payload = json.dumps(body).encode() if body is not None else b""
    expected = {"GET": (200, 301, 302), "POST": (201,)}[method]

    def one() -> None:
        environ = {
            "REQUEST_METHOD": method,
            "PATH_INFO": path,
            "QUERY_STRING": "",
            "SERVER_NAME": "127.0.0.1",
            "SERVER_PORT": "8000",
            "SERVER_PROTOCOL": "HTTP/1.1",
            "REMOTE_ADDR": "127.0.0.1",
            "HTTP_HOST": "127.0.0.1:8000",
            "HTTP_AUTHORIZATION": f"Bearer {token}",
            "CONTENT_TYPE": "application/json",
            "CONTENT_LENGTH": str(len(payload)),
            "wsgi.input": io.BytesIO(payload),
            "wsgi.errors": sys.stderr,
            "wsgi.url_scheme": "http",
            "wsgi.version": (1, 0),
            "wsgi.multithread": True,
            "wsgi.multiprocess": True,
            "wsgi.run_once": False,
        }
        status: list[str] = []
        result = application(environ, lambda s, headers, exc_info=None: status.append(s))
        try:
            for _ in result:
                pass
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
        if int(status[0].split()[0]) not in expected:
            raise SystemExit(f"{kind}: answered {status[0]}")

    for _ in range(WARM_UP):
        one()
    if under_callgrind:
        subprocess.run(
            ["callgrind_control", "-z", str(os.getpid())], check=True, capture_output=True
        )
    started = time.process_time()
    for _ in range(count):
        one()
    took = time.process_time() - started
    if under_callgrind:
        subprocess.run(
            ["callgrind_control", "-d", str(os.getpid())], check=True, capture_output=True
        )
    print(json.dumps({"cpu_s": took}))


# --- the parent ---------------------------------------------------------------------------


def set_up(database_url: str) -> str:
    """The database with a tenant, its quota, a member, their token and a node: returns the
    token."""
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "-v", "0"],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": database_url},
        check=True,
    )
    setup_django(database_url)
    import datetime as dt

    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from controlplane.cluster import actions as cluster_actions
    from controlplane.tenancy import actions as tenancy_actions
    from controlplane.tenancy.models import ApiToken

    admin = get_user_model().objects.create_superuser("bench-admin", "b@example.org", "x" * 16)
    tenant = tenancy_actions.create_tenant(actor=admin, slug="bench", name="Bench")
    tenancy_actions.create_quota(
        tenant, actor=admin, gpu_type="", guaranteed_gpus=10_000, limit_gpus=10_000
    )
    user = get_user_model().objects.create_user("bench", password="bench-password-1")
    tenancy_actions.add_member(tenant, user, "member", actor=admin)
    _, token = ApiToken.issue(user, "bench")
    # A node with GPUs, cordoned: a submit is checked against the cluster's shape, and no job
    # starts (this measures the API, not the scheduler).
    pool = cluster_actions.create_pool(actor=admin, name="bench")
    _, join_token = cluster_actions.create_join_token(
        pool, actor=admin, expires_at=timezone.now() + dt.timedelta(hours=1), max_uses=1
    )
    gpu = {"model": "H100-SXM-80GB", "memory_mib": 81559, "power_min_w": 200.0}
    node, _ = cluster_actions.register_node(
        join_token,
        {
            "name": "bench-node",
            "cpus": 64,
            "memory_mib": 512 * 1024,
            "runtime": "process",
            "labels": {},
            "agent_version": "bench",
            "gpus": [
                {
                    **gpu,
                    "index": i,
                    "uuid": f"GPU-bench-{i}",
                    "power_max_w": 700.0,
                    "power_default_w": 700.0,
                }
                for i in range(8)
            ],
        },
    )
    cluster_actions.set_node_state(node, "cordoned", actor=admin)
    return token


def child_env(database_url: str) -> dict[str, str]:
    return {
        **os.environ,
        "DATABASE_URL": database_url,
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "DEBUG": "0",
        "LOG_LEVEL": "WARNING",
        "WHITENOISE_AUTOREFRESH": "0",
        "API_THROTTLE_USER_RATE": "100000000/minute",
        "CELERY_QUEUE": os.environ.get("CELERY_QUEUE", "gpucp") + "_bench_ir",
    }


def measure(kind: str, count: int, token: str, env: dict, callgrind: bool) -> tuple[float, float]:
    """(instructions, CPU seconds) of `count` requests of `kind`; instructions 0 without
    callgrind."""
    command = [
        sys.executable,
        __file__,
        "--child",
        kind,
        "--requests",
        str(count),
        "--token",
        token,
    ]
    with tempfile.TemporaryDirectory() as out:
        if callgrind:
            command = [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={out}/cg.%p",
                *command,
                "--callgrind",
            ]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"{kind}: the requests failed:\n{done.stdout}\n{done.stderr[-4000:]}")
        cpu_s = json.loads(done.stdout.strip().splitlines()[-1])["cpu_s"]
        if not callgrind:
            return 0.0, cpu_s
        # The dump made by callgrind_control -d is the one numbered .1; the end-of-run dump
        # (start-up and warm-up) is the unnumbered one.
        dumps = [p for p in Path(out).iterdir() if p.name.endswith(".1")]
        if len(dumps) != 1:
            sys.exit(f"{kind}: expected one callgrind dump, found {sorted(Path(out).iterdir())}")
        found = re.search(r"^summary: (\d+)$", dumps[0].read_text(), re.MULTILINE)
        if found is None:
            sys.exit(f"{kind}: no summary in {dumps[0]}")
        return float(found[1]), cpu_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--kinds", nargs="*", choices=sorted(KINDS), default=list(KINDS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--token", help=argparse.SUPPRESS)
    parser.add_argument("--callgrind", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
        import django

        django.setup()
        run_requests(args.child, args.requests, args.token, args.callgrind)
        return

    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit("bench_request_instructions needs valgrind (callgrind) on the PATH")
    base_url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/gpucp")
    if not os.environ.get("REDIS_URL"):
        sys.exit("bench_request_instructions needs REDIS_URL (the rate counts and cycle requests)")
    database_url, name = bench_database_url(base_url, "_bench_ir")
    recreate_database(base_url, name)
    token = set_up(database_url)
    env = child_env(database_url)
    print(
        f"request instructions: the production WSGI application in one process, {args.requests} "
        f"requests of each kind after {WARM_UP} to warm up; PostgreSQL and Redis not counted",
        flush=True,
    )
    for kind in args.kinds:
        per = max(KINDS[kind][3], 1)
        instructions, _ = measure(kind, args.requests, token, env, callgrind=True)
        _, cpu_s = measure(kind, args.requests, token, env, callgrind=False)
        unit = "job" if KINDS[kind][3] > 1 else "request"
        print(
            f"{kind:36s} {instructions / args.requests / per / 1e6:8.3f} M instructions per "
            f"{unit}; {cpu_s * 1000 / args.requests / per:6.3f} ms CPU per {unit} outside "
            f"valgrind  (load {loadavg()})",
            flush=True,
        )


if __name__ == "__main__":
    main()
