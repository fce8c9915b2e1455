"""The hot reads of a heartbeat and of a cycle against a database with months of history.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/gpucp .venv/bin/python \
      benchmarks/bench_hot_reads.py [--history 20000,100000] [--nodes 4] [--calls 300]

For each history size (finished jobs, one attempt each, spread over --nodes nodes; each node
also runs two jobs), in a throwaway database: ANALYZE (as autovacuum would have), then each
read the production code runs often, called --calls times through Django's own connection as
the servers call it (psycopg prepares a statement after 5 runs on a connection, and
PostgreSQL then plans it once or anew at every call, as it judges):

- heartbeat work: desired_state.load_work, what a heartbeat reads after the node's desired
  state changed (every start and end of a job on it);
- the cycle's fixed reads: the waiting jobs, the service of earlier attempts, the running
  attempts (loader, fixed_rows);
- the duration history read from a minute ago (what a cycle reads between full reads).

Prints milliseconds per call (this process's wall time, the database's included), how often
PostgreSQL planned it anew (custom plans) or reused its one plan (generic), and the load
average. A read whose cost grows with the history, or that is planned anew at every call,
shows here.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _scheduling_db import bench_database, setup_django  # noqa: E402
from bench_heartbeat import add_history, job_row, register_in_bulk  # noqa: E402


def loadavg() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def populate(history: int, nodes: int) -> list[int]:
    """Nodes, two running jobs on each, `history` finished ones; returns the node ids."""
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from controlplane.cluster.models import GPU, Node, Pool
    from controlplane.jobs.models import Allocation, AttemptState, Job, JobAttempt, JobState
    from controlplane.tenancy.models import Tenant

    user = get_user_model().objects.create_user("bench", password="bench-password-1")
    tenant = Tenant.objects.create(slug="bench", name="Bench")
    pool = Pool.objects.create(name="bench")
    register_in_bulk(pool, [f"n{i}" for i in range(nodes)], 8)
    node_rows = list(Node.objects.order_by("pk"))
    add_history(history)  # spread over these nodes, then ANALYZE
    now = timezone.now()
    running = Job.objects.bulk_create(
        job_row(tenant, user, JobState.RUNNING, now) for _ in range(2 * nodes)
    )
    attempts = JobAttempt.objects.bulk_create(
        JobAttempt(
            job=j,
            number=1,
            node=node_rows[i // 2],
            state=AttemptState.RUNNING,
            started_at=now,
        )
        for i, j in enumerate(running)
    )
    first_gpus = {(g.node_id, g.index): g for g in GPU.objects.filter(index__in=(0, 1))}
    Allocation.objects.bulk_create(
        Allocation(attempt=a, gpu=first_gpus[(a.node_id, i % 2)]) for i, a in enumerate(attempts)
    )
    Job.objects.bulk_create(job_row(tenant, user, JobState.PENDING, now) for _ in range(50))
    return [n.pk for n in node_rows]


def plans(marker: str) -> tuple[int, int]:
    """(generic, custom) plans of this connection's prepared statements whose text has marker."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT coalesce(sum(generic_plans), 0), coalesce(sum(custom_plans), 0) "
            "FROM pg_prepared_statements WHERE statement LIKE %s",
            [f"%{marker}%"],
        )
        generic, custom = cursor.fetchone()
    return int(generic), int(custom)


def measure(label: str, call, marker: str, calls: int) -> None:
    before = plans(marker)
    started = time.perf_counter()
    for _ in range(calls):
        call()
    ms = (time.perf_counter() - started) / calls * 1000
    after = plans(marker)
    print(
        f"  {label:<34} {ms:7.3f} ms per call; PostgreSQL planned it anew {after[1] - before[1]}"
        f" times, reused one plan {after[0] - before[0]} times",
        flush=True,
    )


def run(history: int, nodes: int, calls: int) -> None:
    from django.db import connection

    from controlplane.cluster import desired_state
    from controlplane.scheduling import loader
    from controlplane.scheduling.rows import fixed_rows

    with bench_database("bench_hot_reads"):
        started = time.perf_counter()
        node_ids = populate(history, nodes)
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")  # the running and waiting jobs made after the history
        print(
            f"[{history} finished jobs, {nodes} nodes] set up in "
            f"{time.perf_counter() - started:.1f} s (load {loadavg()})",
            flush=True,
        )
        node = node_ids[0]
        measure(
            "heartbeat work (load_work)", lambda: desired_state.load_work(node), "here(aid)", calls
        )
        for label, build, marker in (
            ("cycle: waiting jobs", loader._pending_rows, '"queue_position"'),
            ("cycle: service of earlier attempts", loader._earlier_service_rows, '"service_s"'),
            ("cycle: running attempts", loader._running_rows, "checkpoint_interval_s"),
        ):
            measure(label, lambda build=build: fixed_rows(build), marker, calls)
        measure(
            "cycle: history of the last minute",
            lambda: loader._history_rows(time.time() - 60),
            "DESC LIMIT",
            calls,
        )
        print(f"  (load {loadavg()})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--history", default="20000,100000", help="comma-separated sizes")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs, load average {loadavg()}", flush=True)
    setup_django()
    for history in (int(h) for h in args.history.split(",")):
        run(history, args.nodes, args.calls)


if __name__ == "__main__":
    main()
