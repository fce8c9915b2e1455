"""Heartbeat throughput and latency: many simulated agents against gunicorn + PostgreSQL.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/gpucp REDIS_URL=redis://127.0.0.1:6379/15 \
      .venv/bin/python benchmarks/bench_heartbeat.py [--nodes 1000] [--rate 1000] [--duration-s 30]
      [--history 0]

It creates its own database (the DATABASE_URL's name + "_bench_hb", dropped and re-created),
registers --nodes nodes with 8 GPUs each through the real register endpoint, admits one job
per node onto one of its GPUs, starts gunicorn (gthread workers) on 127.0.0.1, and then has
client processes send real heartbeat JSON (8 GPUs of telemetry, the running attempt with its
energy) at --rate heartbeats per second in total, spread evenly over the nodes (open loop:
a send is due at its time whether or not the previous answer came back). --rate 0 sends as
fast as the server answers (closed loop), which measures the ceiling.

Prints: heartbeats per second sustained, latency p50 / p99 / max, errors. The goal (issue 4):
>= 1,000 per second with p99 < 200 ms, i.e. 10,000 nodes at a 10 s interval.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def bench_database_url(base_url: str, suffix: str) -> tuple[str, str]:
    parsed = urlparse(base_url)
    if parsed.scheme not in ("postgres", "postgresql", "pgsql"):
        sys.exit("bench_heartbeat needs DATABASE_URL=postgres://... (it measures PostgreSQL)")
    name = (parsed.path.lstrip("/") or "gpucp") + suffix
    return parsed._replace(path="/" + name).geturl(), name


def recreate_database(base_url: str, name: str) -> None:
    import psycopg

    parsed = urlparse(base_url)
    admin = parsed._replace(path="/postgres").geturl()
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')


def setup_django(database_url: str) -> None:
    os.environ["DATABASE_URL"] = database_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django

    django.setup()


def ensure_free(port: int) -> None:
    """Refuse to measure somebody else's server: the port must be free before we start ours."""
    import socket

    with socket.socket() as s:
        # SO_REUSEADDR, as gunicorn binds: a previous run's closing connections do not count.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            sys.exit(f"port {port} is in use; pick another with --port")


def start_gunicorn(port: int, workers: int, threads: int, env: dict) -> subprocess.Popen:
    ensure_free(port)
    cmd = [
        str(ROOT / ".venv" / "bin" / "gunicorn"),
        "controlplane.wsgi:application",
        "--bind",
        f"127.0.0.1:{port}",
        "--worker-class",
        "gthread",
        "--workers",
        str(workers),
        "--threads",
        str(threads),
        "--keep-alive",
        "75",
        "--backlog",
        "4096",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("POST", "/api/agent/v1/heartbeat", body="{}")
            conn.getresponse().read()
            return proc
        except OSError:
            time.sleep(0.3)
        if proc.poll() is not None:
            sys.exit("gunicorn exited during start-up")
    stop(proc)
    sys.exit("gunicorn did not answer within 60 s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def inventory(name: str, gpus: int) -> dict:
    return {
        "name": name,
        "cpus": 128,
        "memory_mib": 2 * 1024 * 1024,
        "labels": {"rack": name[-2:]},
        "agent_version": "bench",
        "runtime": "docker",
        "gpus": [
            {
                "index": i,
                "uuid": f"GPU-{name}-{i}",
                "model": "H100-SXM-80GB",
                "memory_mib": 81559,
                "power_min_w": 200.0,
                "power_max_w": 700.0,
                "power_default_w": 700.0,
            }
            for i in range(gpus)
        ],
    }


def register_nodes(port: int, join_token: str, count: int, gpus: int) -> list[tuple[str, str]]:
    from concurrent.futures import ThreadPoolExecutor

    def some(names: list[str]) -> list[tuple[str, str]]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        done = []
        for name in names:
            conn.request(
                "POST",
                "/api/agent/v1/register",
                body=json.dumps(inventory(name, gpus)),
                headers={
                    "Authorization": f"Bearer {join_token}",
                    "Content-Type": "application/json",
                },
            )
            response = conn.getresponse()
            body = response.read()
            if response.status != 201:
                sys.exit(f"register {name}: {response.status} {body[:200]!r}")
            done.append((name, json.loads(body)["node_token"]))
        return done

    names = [f"bench-{i:05d}" for i in range(count)]
    with ThreadPoolExecutor(4) as pool:
        batches = pool.map(some, [names[i::4] for i in range(4)])
    return sorted(node for batch in batches for node in batch)


# Registered through the real endpoint; the rest are written in bulk with the same fields, since
# registration is not what is measured and 10,000 of them would take minutes here.
REGISTERED_BY_HTTP = 50
PRIMED_BY_HTTP = 200


def register_in_bulk(pool, names: list[str], gpus: int) -> list[tuple[str, str]]:
    from django.conf import settings
    from django.db import transaction
    from django.utils import timezone

    from controlplane.cluster.models import GPU, Node
    from controlplane.tenancy.models import hash_token, new_raw_token

    now = timezone.now()
    tokens = {name: new_raw_token("gcpn") for name in names}
    with transaction.atomic():
        created = Node.objects.bulk_create(
            [
                Node(
                    name=name,
                    pool=pool,
                    cpus=128,
                    memory_mib=2 * 1024 * 1024,
                    labels={"rack": name[-2:]},
                    agent_version="bench",
                    runtime="docker",
                    heartbeat_interval_s=settings.AGENT_HEARTBEAT_INTERVAL_S,
                    last_heartbeat_at=now,
                    ready=True,
                    token_hash=hash_token(tokens[name]),
                    token_prefix=tokens[name][:12],
                )
                for name in names
            ],
            batch_size=1000,
        )
        GPU.objects.bulk_create(
            [
                GPU(node=node, uuid=g["uuid"], healthy=True, **{k: g[k] for k in g if k != "uuid"})
                for node in created
                for g in inventory(node.name, gpus)["gpus"]
            ],
            batch_size=2000,
        )
    return [(name, tokens[name]) for name in names]


def mark_running_in_bulk(attempt_ids: list[int]) -> None:
    """What each node's first heartbeat would do to its attempt, for the nodes not primed."""
    from django.utils import timezone

    from controlplane.jobs.models import AttemptState, Job, JobAttempt, JobState

    now = timezone.now()
    JobAttempt.objects.filter(pk__in=attempt_ids).update(state=AttemptState.RUNNING, started_at=now)
    Job.objects.filter(attempts__pk__in=attempt_ids).update(state=JobState.RUNNING, started_at=now)


def job_row(tenant, user, state: str, submitted_at, name: str = "bench"):
    """A one-GPU `true` job of the tenant and user in `state`, not saved (for bulk_create)."""
    from controlplane.jobs.models import Job

    return Job(
        tenant=tenant,
        submitted_by=user,
        name=name,
        image="bench:1",
        command=["true"],
        gpus=1,
        state=state,
        attempt_count=1,
        submitted_at=submitted_at,
    )


def add_history(count: int, tenant_slug: str = "bench", username: str = "bench") -> None:
    """`count` jobs of the tenant and user that ran and ended, spread over the nodes, as a
    cluster in use for months keeps: what the hot reads must not go through. Then ANALYZE,
    as autovacuum would have by then."""
    from datetime import timedelta

    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.utils import timezone

    from controlplane.cluster.models import Node
    from controlplane.jobs.models import AttemptState, Job, JobAttempt, JobState
    from controlplane.tenancy.models import Tenant

    user = get_user_model().objects.get(username=username)
    tenant = Tenant.objects.get(slug=tenant_slug)
    nodes = list(Node.objects.order_by("pk"))
    now = timezone.now()
    for start in range(0, count, 5000):
        n = min(5000, count - start)
        jobs = Job.objects.bulk_create(
            job_row(
                tenant,
                user,
                JobState.SUCCEEDED,
                now - timedelta(seconds=count - start - i),
                name="history",
            )
            for i in range(n)
        )
        JobAttempt.objects.bulk_create(
            JobAttempt(
                job=job,
                number=1,
                node=nodes[(start + i) % len(nodes)],
                state=AttemptState.SUCCEEDED,
                started_at=job.submitted_at,
                finished_at=job.submitted_at + timedelta(seconds=1),
            )
            for i, job in enumerate(jobs)
        )
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")


def admit_one_job_per_node() -> dict[str, int]:
    """One running job per node, so heartbeats carry an attempt report like real ones do."""
    from django.contrib.auth import get_user_model

    from controlplane.cluster.models import GPU
    from controlplane.jobs import actions
    from controlplane.tenancy.models import Tenant

    user = get_user_model().objects.create_user("bench", password="bench-password-1")
    tenant = Tenant.objects.create(slug="bench", name="Bench")
    gpus = list(GPU.objects.filter(index=0).select_related("node"))
    jobs = [
        actions.submit_job(
            tenant=tenant, user=user, name="bench", image="bench:1", command=["true"], gpus=1
        )
        for _ in gpus
    ]
    attempts = {}
    # In batches, the way the scheduler admits: 10,000 nodes are set up in seconds.
    for i in range(0, len(gpus), 500):
        admissions = [
            actions.Admission(job=job, node=gpu.node, gpus=[gpu], borrowed=False)
            for job, gpu in zip(jobs[i : i + 500], gpus[i : i + 500], strict=True)
        ]
        admitted = actions.admit_jobs(admissions)
        for a in admissions:
            attempts[a.node.name] = admitted[a.job.pk].pk
    return attempts


def heartbeat_body(name: str, gpus: int, seq: int, attempt_id: int | None, t0: float) -> bytes:
    now = time.time()
    readings = []
    for i in range(gpus):
        busy = i == 0 and attempt_id is not None
        readings.append(
            {
                "uuid": f"GPU-{name}-{i}",
                "healthy": True,
                "utilization_pct": 97.0 if busy else 0.0,
                "memory_used_mib": 40000.0 if busy else 0.0,
                "power_draw_w": (510.0 if busy else 70.0) + random.random(),
                "power_cap_w": 700.0,
                "energy_j": 1e8 + (now - t0) * (510.0 if busy else 70.0),
                "temperature_c": 61.0 if busy else 35.0,
                "sm_clock_mhz": 1755.0 if busy else 210.0,
                "throttle_reasons": ["sw_power_cap"] if busy else [],
                "ecc_errors": 0,
            }
        )
    attempts = []
    if attempt_id is not None:
        attempts.append(
            {
                "attempt_id": attempt_id,
                "state": "running",
                "started_at": t0,
                "exit_code": None,
                "finished_at": None,
                "energy_j": (now - t0) * 510.0,
                "energy_estimated": False,
            }
        )
    return json.dumps(
        {"seq": seq, "sent_at": now, "gpus": readings, "attempts": attempts, "conditions": []}
    ).encode()


def client_process(
    port: int,
    nodes: list[tuple[str, str, int | None]],
    gpus: int,
    rate_per_s: float,
    duration_s: float,
    connections: int,
    start_at: float,
    out: mp.Queue,
) -> None:
    """One load-generating process: `connections` keep-alive connections on one asyncio loop.

    A bare HTTP/1.1 exchange over asyncio streams (the request written in one piece, the answer
    read by its Content-Length) rather than http.client in threads, whose header parsing and
    thread switches cost the client more CPU than the server spends on a steady heartbeat; on
    a machine shared with the server, the client's CPU is the server's loss. Reports its own
    CPU time with the latencies.
    """
    import asyncio

    latencies: list[float] = []
    errors = [0]
    t0 = time.time()

    async def connect():
        return await asyncio.open_connection("127.0.0.1", port)

    async def exchange(reader, writer, request: bytes) -> int:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        if length:
            await reader.readexactly(length)
        return status

    async def connection(mine: list[tuple[str, str, int | None]], conn_rate: float) -> None:
        reader, writer = await connect()
        seq = 0
        await asyncio.sleep(max(0.0, start_at - time.time()))
        began = time.perf_counter()
        end = began + duration_s
        sent = 0
        local: list[float] = []
        failed = 0
        while True:
            if conn_rate > 0:
                due = began + sent / conn_rate
                now = time.perf_counter()
                if due > now:
                    await asyncio.sleep(due - now)
            if time.perf_counter() >= end:
                break
            name, token, attempt_id = mine[sent % len(mine)]
            seq += 1
            body = heartbeat_body(name, gpus, seq, attempt_id, t0)
            request = (
                f"POST /api/agent/v1/heartbeat HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode() + body
            sent_at = time.perf_counter()
            try:
                status = await exchange(reader, writer, request)
                if status == 200:
                    local.append(time.perf_counter() - sent_at)
                else:
                    failed += 1
            except (OSError, asyncio.IncompleteReadError, ValueError):
                failed += 1
                writer.close()
                reader, writer = await connect()
            sent += 1
        writer.close()
        latencies.extend(local)
        errors[0] += failed

    async def main() -> None:
        share = [nodes[i::connections] for i in range(connections)]
        await asyncio.gather(*(connection(m, rate_per_s / connections) for m in share if m))

    cpu_before = time.process_time()
    asyncio.run(main())
    out.put((latencies, errors[0], time.process_time() - cpu_before))


def prime(port: int, nodes: list[tuple[str, str, int | None]], gpus: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.time()

    def one(batch):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        for name, token, attempt_id in batch:
            conn.request(
                "POST",
                "/api/agent/v1/heartbeat",
                body=heartbeat_body(name, gpus, 1, attempt_id, t0),
                headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            )
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                sys.exit(f"first heartbeat of {name}: {response.status}")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, [nodes[i::8] for i in range(8)]))


def cpu_s(pids: list[int]) -> float:
    """utime + stime of these processes, in seconds (processes gone since count as 0)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def process_group(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                pids.append(int(entry.name))
    return pids


def database_backends(name: str) -> list[int]:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            [name],
        )
        return [pid for (pid,) in cursor.fetchall()]


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[k]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--rate", type=float, default=1000.0, help="heartbeats/s; 0 = closed loop")
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument(
        "--warmup-s",
        type=float,
        default=None,
        help="not measured; default: long enough for every node to heartbeat once (each web "
        "process then holds its nodes' answers, as in a running system), at least 5 s",
    )
    parser.add_argument(
        "--history",
        type=int,
        default=0,
        help="finished jobs (one attempt each, spread over the nodes) in the database first",
    )
    parser.add_argument("--port", type=int, default=18450)
    parser.add_argument("--workers", type=int, default=max(2, (os.cpu_count() or 2)))
    parser.add_argument("--threads", type=int, default=4, help="gunicorn threads per worker")
    parser.add_argument("--client-processes", type=int, default=2)
    parser.add_argument(
        "--client-threads",
        "--client-connections",
        dest="client_connections",
        type=int,
        default=16,
        help="keep-alive connections per client process (asyncio, not threads; the old name "
        "is kept for the commands in the issues)",
    )
    args = parser.parse_args()
    if args.warmup_s is None:
        # Twice round: the first heartbeat of a node in a web process costs a read more.
        args.warmup_s = max(5.0, 2 * args.nodes / args.rate + 5.0) if args.rate > 0 else 5.0

    base_url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/gpucp")
    database_url, name = bench_database_url(base_url, "_bench_hb")
    recreate_database(base_url, name)
    env = {**os.environ, "DATABASE_URL": database_url, "DEBUG": "0", "LOG_LEVEL": "WARNING"}
    # Database connections live through the run, so that PostgreSQL's CPU is counted on the
    # same backends before and after (one reconnect a minute costs nothing worth measuring).
    env.setdefault("DB_CONN_MAX_AGE", "3600")
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True
    )
    setup_django(database_url)
    import datetime as dt

    from django.utils import timezone

    from controlplane.cluster.agent_auth import issue_join_token
    from controlplane.cluster.models import Pool

    pool = Pool.objects.create(name="bench")
    _, join_token = issue_join_token(
        pool, expires_at=timezone.now() + dt.timedelta(hours=2), max_uses=args.nodes
    )
    server = start_gunicorn(args.port, args.workers, args.threads, env)
    # A timeout's or Ctrl-C's signal unwinds through the finally below, which stops gunicorn
    # (it runs in its own session, so it would outlive this script).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped by SIGTERM"))
    try:
        print(f"registering {args.nodes} nodes with {args.gpus} GPUs each ...", flush=True)
        by_http = min(args.nodes, REGISTERED_BY_HTTP)
        registered = register_nodes(args.port, join_token, by_http, args.gpus)
        registered += register_in_bulk(
            pool, [f"bench-{i:05d}" for i in range(by_http, args.nodes)], args.gpus
        )
        attempts = admit_one_job_per_node()
        if args.history:
            print(f"adding {args.history} finished jobs of history ...", flush=True)
            add_history(args.history)
        nodes = [(n, tok, attempts.get(n)) for n, tok in registered]
        # Each node's first heartbeat moves its attempt to RUNNING (a state change, with its
        # events); the figures are about the steady state, so that happens before measuring,
        # through the endpoint for the first nodes and in bulk for the rest.
        print("first heartbeat of the first nodes (not measured) ...", flush=True)
        prime(args.port, nodes[:PRIMED_BY_HTTP], args.gpus)
        mark_running_in_bulk([a for _, _, a in nodes[PRIMED_BY_HTTP:] if a is not None])

        # What autovacuum would have done by now on a running system: the planner's statistics.
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")

        def run(duration_s: float, rate: float) -> tuple[list[float], int, float]:
            out: mp.Queue = mp.Queue()
            start_at = time.time() + 1.0
            procs = [
                mp.Process(
                    target=client_process,
                    args=(
                        args.port,
                        nodes[i :: args.client_processes],
                        args.gpus,
                        rate / args.client_processes,
                        duration_s,
                        args.client_connections,
                        start_at,
                        out,
                    ),
                )
                for i in range(args.client_processes)
            ]
            for p in procs:
                p.start()
            latencies: list[float] = []
            errors = 0
            client_cpu_s[0] = 0.0
            for _ in procs:
                lat, err, cpu = out.get()
                latencies.extend(lat)
                errors += err
                client_cpu_s[0] += cpu
            for p in procs:
                p.join()
            return sorted(latencies), errors, duration_s

        client_cpu_s = [0.0]

        if args.warmup_s > 0:
            run(args.warmup_s, args.rate)
        server_pids = process_group(server.pid)
        backends = database_backends(name)
        cpu_before = (cpu_s(server_pids), {pid: cpu_s([pid]) for pid in backends})
        latencies, errors, duration_s = run(args.duration_s, args.rate)
        backends_after = {pid: cpu_s([pid]) for pid in database_backends(name)}
        # Backends opened during the run count from their start; any closed during it are
        # missed (hence the long DB_CONN_MAX_AGE above).
        pg_cpu_s = sum(cpu - cpu_before[1].get(pid, 0.0) for pid, cpu in backends_after.items())
        cpu_after = (cpu_s(server_pids), pg_cpu_s)
    finally:
        stop(server)

    achieved = len(latencies) / duration_s
    mode = "closed loop (as fast as answered)" if args.rate == 0 else f"target {args.rate:.0f}/s"
    print()
    print(
        f"heartbeat benchmark: {args.nodes} nodes x {args.gpus} GPUs, {args.history} finished "
        f"jobs of history, {mode}, "
        f"gunicorn gthread {args.workers}x{args.threads}, {os.cpu_count()} CPUs shared with the clients"
    )
    print(f"  heartbeats answered : {len(latencies)} in {duration_s:.0f} s, errors: {errors}")
    print(f"  sustained           : {achieved:.0f} heartbeats/s")
    if latencies:
        print(
            f"  latency             : p50 {percentile(latencies, 0.5) * 1000:.1f} ms, "
            f"p99 {percentile(latencies, 0.99) * 1000:.1f} ms, "
            f"max {latencies[-1] * 1000:.1f} ms, mean {statistics.fmean(latencies) * 1000:.1f} ms"
        )
    if latencies:
        web_ms = (cpu_after[0] - cpu_before[0]) / len(latencies) * 1000
        pg_ms = cpu_after[1] / len(latencies) * 1000
        client_ms = client_cpu_s[0] / len(latencies) * 1000
        print(
            f"  server CPU per hb   : {web_ms:.2f} ms gunicorn + {pg_ms:.2f} ms PostgreSQL "
            f"-> {1000 / (web_ms + pg_ms):.0f} heartbeats per CPU-second"
        )
        print(
            f"  client CPU per hb   : {client_ms:.2f} ms ({args.client_processes} asyncio "
            f"processes x {args.client_connections} connections, building each body included)"
        )
    load_1m, load_5m, load_15m = os.getloadavg()
    print(f"  load average        : {load_1m:.2f} {load_5m:.2f} {load_15m:.2f} (at the end)")
    print(
        f"  goal                : >= 1000/s with p99 < 200 ms -> "
        f"{'met' if achieved >= 1000 * 0.98 and percentile(latencies, 0.99) < 0.2 else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
