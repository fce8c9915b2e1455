"""Does a crowd of waiting dependents cost the scheduling cycle anything? (issue 16)

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/gpucp .venv/bin/python benchmarks/bench_dependents.py

A cluster (bench_cycle's populate: nodes 85 % busy, a queue of schedulable pending jobs, a
history), then the real cycle (run_scheduling_cycle: load, plan, apply, commit) measured
before and after adding N dependent jobs, each held by a dependency on a running job (created
as the submit path creates them: jobs.dependencies.attach). Held jobs are PENDING rows the
scheduling loader never reads (the job_schedulable partial index), so the two medians should
be the same within the machine's noise. Also prints the plan PostgreSQL chooses for the
loader's query, which should use that index.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _scheduling_db import bench_database, median, setup_django  # noqa: E402


def add_dependents(count: int) -> float:
    """`count` held jobs, each waiting for a running job; returns the seconds it took."""
    from django.db import transaction

    from controlplane.jobs.models import Job, JobState

    started = time.perf_counter()
    running = list(Job.objects.filter(state=JobState.RUNNING).order_by("pk")[:100])
    template = Job.objects.filter(state=JobState.PENDING).first()
    assert template is not None and running
    per_target = count // len(running)
    for target in running:
        with transaction.atomic():  # a submit's transaction, as attach expects
            add_batch(target, template, per_target)
    return time.perf_counter() - started


def add_batch(target, template, size: int) -> None:
    """`size` held jobs waiting for `target`, as a batch submit makes them."""
    from controlplane.jobs import dependencies
    from controlplane.jobs.models import Job, JobState

    jobs = Job.objects.bulk_create(
        [
            Job(
                tenant_id=target.tenant_id,
                submitted_by_id=target.submitted_by_id,
                name="evaluate",
                image=template.image,
                command=template.command,
                gpus=1,
                state=JobState.PENDING,
            )
            for _ in range(size)
        ]
    )
    dependencies.attach(jobs, [dependencies.DependencySpec("succeeded", job_id=target.pk)])


def explain_loader() -> str:
    """PostgreSQL's plan for the loader's pending-jobs query (scheduling.loader._load_pending:
    its filter, order and joins; its other columns do not change the plan's shape): the scan
    of jobs_job it chooses and its execution time, then the same with sequential scans off,
    which shows the job_schedulable partial index serves the query whenever the planner finds
    it cheaper (on a table this small a scan of all rows may well be)."""
    from django.db import connection, transaction

    from controlplane.jobs.models import Job, JobState

    query = (
        Job.objects.filter(state=JobState.PENDING, hold="", tenant__active=True)
        .order_by("submitted_at", "id")
        .values_list("id", "tenant__slug", "submitted_by__username", "checkpoint_volume__name")
    )
    sql, params = query.query.sql_with_params()
    lines = []
    for label, seqscan in (("as planned", "on"), ("sequential scans off", "off")):
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute(f"SET LOCAL enable_seqscan = {seqscan}")
            cur.execute(f"EXPLAIN (ANALYZE, COSTS OFF) {sql}", params)
            plan = [row[0].strip() for row in cur.fetchall()]
        scan = " / ".join(
            line.lstrip("-> ").split(" (")[0]
            for line in plan
            if "Scan" in line and ("jobs_job" in line or "job_" in line)
        )
        took = next(line for line in plan if line.startswith("Execution Time"))
        lines.append(f"    {label}: {scan}; {took}")
    return "\n".join(lines)


def cycles(n: int) -> list[float]:
    from bench_cycle import cycle

    cycle()  # the first writes every pending job's reason: not the everyday cycle
    return [cycle()["duration_ms"] / 1000 for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=250)
    parser.add_argument("--tenants", type=int, default=100)
    parser.add_argument("--pending", type=int, default=2000)
    parser.add_argument("--dependents", type=int, default=10000)
    parser.add_argument("--cycles", type=int, default=5)
    args = parser.parse_args()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"machine: {os.cpu_count()} CPUs, load average {load}")
    setup_django()
    from bench_cycle import populate
    from django.db import connection

    from controlplane.jobs.models import Job

    with bench_database("bench_dependents"):
        sizes = populate(
            nodes=args.nodes,
            tenants=args.tenants,
            pending=args.pending,
            history=1000,
            busy_fraction=0.85,
            seed=7,
        )
        print(
            f"{args.nodes} nodes, {sizes['gpus']} GPUs ({sizes['running']} running jobs), "
            f"{args.pending} schedulable pending jobs"
        )
        with connection.cursor() as cur:
            cur.execute("ANALYZE")
        before = cycles(args.cycles)
        took = add_dependents(args.dependents)
        held = Job.objects.exclude(hold="").count()
        with connection.cursor() as cur:
            cur.execute("ANALYZE")
        print(f"added {held} held dependents in {took:.1f} s")
        after = cycles(args.cycles)
        print(f"{Job.objects.count()} job rows in all; the loader's query:")
        print(explain_loader())
        print(
            f"median full cycle: {median(before):.3f} s without dependents, "
            f"{median(after):.3f} s with {held} ({len(before)} cycles each; "
            f"all: {', '.join(f'{x:.3f}' for x in before)} | "
            f"{', '.join(f'{x:.3f}' for x in after)})"
        )
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"load average at the end: {load}")


if __name__ == "__main__":
    main()
