"""A full scheduling cycle on PostgreSQL (load + plan + apply + commit) at cluster scale.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/gpucp .venv/bin/python benchmarks/bench_cycle.py

2,000 nodes x 8 GPUs, 1,000 tenants, 10,000 pending jobs, 5,000 finished jobs of history. Two
scenarios, each in its own throwaway database:

- steady: the cluster is 85 % busy (running attempts of 1-8 GPUs); between cycles ~2 % of the
  GPUs free up (real finish_attempt calls, not timed), so each cycle starts a few hundred jobs
  and moves the queue position of nearly every waiting job. This is the everyday cycle.
- cold: the cluster is empty, so one cycle starts thousands of jobs at once (the first cycle
  after an outage). Printed for the worst case; the goal is about the everyday cycle.

Goal (issue 3): a full cycle < 2 s.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _scheduling_db import bench_database, median, setup_django  # noqa: E402

GPU_MODEL = "H100-SXM-80GB"
GPU_SIZES = (1, 1, 1, 2, 2, 4, 8)  # requests, weighted towards small jobs as in real traces


def populate(
    *, nodes: int, tenants: int, pending: int, history: int, busy_fraction: float, seed: int
):
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from controlplane.cluster.models import GPU, Node, Pool
    from controlplane.jobs.models import Allocation, AttemptState, Job, JobAttempt, JobState
    from controlplane.tenancy.models import Quota, Tenant

    rng = random.Random(seed)
    now = timezone.now()
    pool = Pool.objects.create(name="default")
    node_rows = Node.objects.bulk_create(
        [
            Node(
                name=f"node-{i:05d}",
                pool=pool,
                cpus=128,
                memory_mib=1024 * 1024,
                last_heartbeat_at=now,
            )
            for i in range(nodes)
        ],
        batch_size=2000,
    )
    gpu_rows = GPU.objects.bulk_create(
        [
            GPU(
                node=node,
                index=g,
                uuid=f"GPU-{node.name}-{g}",
                model=GPU_MODEL,
                memory_mib=81559,
                power_min_w=200.0,
                power_max_w=700.0,
                power_default_w=700.0,
            )
            for node in node_rows
            for g in range(8)
        ],
        batch_size=4000,
    )
    total_gpus = len(gpu_rows)
    tenant_rows = Tenant.objects.bulk_create(
        [Tenant(slug=f"t{i:04d}", name=f"Tenant {i}") for i in range(tenants)], batch_size=2000
    )
    guaranteed = max(1, total_gpus // tenants)
    Quota.objects.bulk_create(
        [
            Quota(
                tenant=t, gpu_type=GPU_MODEL, guaranteed_gpus=guaranteed, limit_gpus=guaranteed * 4
            )
            for t in tenant_rows
        ],
        batch_size=2000,
    )
    User = get_user_model()
    users = User.objects.bulk_create(
        [User(username=f"u{i:04d}", password="!") for i in range(tenants)], batch_size=2000
    )

    def job(i: int, state: str, gpus: int, submitted_ago_s: float, **extra) -> Job:
        k = i % tenants
        return Job(
            tenant=tenant_rows[k],
            submitted_by=users[k],
            name=f"train-{rng.randrange(20)}",
            image="registry.local/bench:1",
            command=["python", "train.py"],
            gpus=gpus,
            gpu_type=GPU_MODEL if i % 2 else "",
            priority=rng.choice(("low", "normal", "normal", "high")),
            state=state,
            submitted_at=now - timedelta(seconds=submitted_ago_s),
            estimated_duration_s=rng.choice((None, 600, 3600)),
            **extra,
        )

    # History: finished jobs whose durations the predictor learns from.
    done = Job.objects.bulk_create(
        [
            job(i, JobState.SUCCEEDED, rng.choice(GPU_SIZES), 86400 + i, attempt_count=1)
            for i in range(history)
        ],
        batch_size=2000,
    )
    JobAttempt.objects.bulk_create(
        [
            JobAttempt(
                job=j,
                number=1,
                node=node_rows[i % nodes],
                state=AttemptState.SUCCEEDED,
                created_at=now - timedelta(days=1),
                started_at=now - timedelta(days=1),
                finished_at=now - timedelta(days=1) + timedelta(seconds=rng.uniform(60, 7200)),
            )
            for i, j in enumerate(done)
        ],
        batch_size=2000,
    )

    # Running work fills busy_fraction of the GPUs, packed node by node.
    by_node: dict[int, list] = {}
    for gpu in gpu_rows:
        by_node.setdefault(gpu.node_id, []).append(gpu)
    free = [by_node[node.pk] for node in node_rows]
    placements = []
    target = int(total_gpus * busy_fraction)
    used = 0
    node_i = 0
    while used < target and node_i < len(free):
        size = rng.choice(GPU_SIZES)
        if len(free[node_i]) < size:
            node_i += 1
            continue
        placements.append((node_rows[node_i], [free[node_i].pop() for _ in range(size)]))
        used += size
    running_jobs = Job.objects.bulk_create(
        [
            job(i, JobState.RUNNING, len(gpus), 3600 + i, attempt_count=1, started_at=now)
            for i, (_, gpus) in enumerate(placements)
        ],
        batch_size=2000,
    )
    attempts = JobAttempt.objects.bulk_create(
        [
            JobAttempt(
                job=j,
                number=1,
                node=node,
                state=AttemptState.RUNNING,
                borrowed=rng.random() < 0.3,
                created_at=now - timedelta(seconds=rng.uniform(120, 7200)),
                started_at=now - timedelta(seconds=rng.uniform(120, 7200)),
            )
            for j, (node, _) in zip(running_jobs, placements, strict=True)
        ],
        batch_size=2000,
    )
    Allocation.objects.bulk_create(
        [
            Allocation(attempt=a, gpu=g)
            for a, (_, gpus) in zip(attempts, placements, strict=True)
            for g in gpus
        ],
        batch_size=4000,
    )
    Job.objects.bulk_create(
        [
            job(i, JobState.PENDING, rng.choice(GPU_SIZES), rng.uniform(0, 3600))
            for i in range(pending)
        ],
        batch_size=2000,
    )
    return {"gpus": total_gpus, "busy_gpus": used, "running": len(attempts)}


def free_some(fraction_of_gpus: float, total_gpus: int, seed: int) -> int:
    """Finish random running attempts through the real action until that many GPUs are free."""
    from controlplane.jobs import actions
    from controlplane.jobs.models import JobAttempt

    rng = random.Random(seed)
    running = list(JobAttempt.objects.filter(state="RUNNING").select_related("node"))
    rng.shuffle(running)
    freed = 0
    goal = int(total_gpus * fraction_of_gpus)
    for attempt in running:
        if freed >= goal:
            break
        freed += attempt.allocations.filter(active=True).count()
        actions.finish_attempt(attempt, exit_code=0)
    return freed


def cycle(trigger: str = "bench") -> dict:
    """One real cycle, with this process's CPU seconds in it (PostgreSQL's are not counted)."""
    from controlplane.scheduling.cycle import run_scheduling_cycle

    cpu_s = time.process_time()
    summary = run_scheduling_cycle(trigger=trigger)
    summary["cpu_s"] = time.process_time() - cpu_s
    return summary


def show(label: str, summary: dict) -> None:
    steps = summary["step_ms"]
    core = ", ".join(f"{k[5:]} {v / 1000:.3f}" for k, v in steps.items() if k.startswith("plan."))
    print(
        f"{label:>8}: load {steps['load'] / 1000:.3f} s  plan {steps['plan'] / 1000:.3f} s  "
        f"apply {steps['apply'] / 1000:.3f} s  commit {steps['commit'] / 1000:.3f} s  "
        f"total {summary['duration_ms'] / 1000:.3f} s (CPU {summary['cpu_s']:.3f} s)  | "
        f"{summary['starts']} starts, {summary['preemptions']} preemptions, "
        f"{summary['pending']} pending, {summary['skipped_rows']} skipped, "
        f"{summary['pending_rows_written']} job rows rewritten  | core: {core}"
    )


def run(args) -> None:
    scenarios = ["steady", "cold"] if args.scenario == "both" else [args.scenario]
    for scenario in scenarios:
        with bench_database(f"bench_cycle_{scenario}"):
            t = time.perf_counter()
            sizes = populate(
                nodes=args.nodes,
                tenants=args.tenants,
                pending=args.pending,
                history=args.history,
                busy_fraction=0.85 if scenario == "steady" else 0.0,
                seed=args.seed,
            )
            print(
                f"[{scenario}] {args.nodes} nodes, {sizes['gpus']} GPUs ({sizes['busy_gpus']} busy, "
                f"{sizes['running']} running attempts), {args.tenants} tenants, {args.pending} pending, "
                f"{args.history} history; set up in {time.perf_counter() - t:.1f} s"
            )
            if scenario == "cold":
                show("cold", cycle())
                show("quiet", cycle())
                continue
            totals, cpus = [], []
            # The first cycle writes every job's reason for the first time; it is shown apart.
            show("first", cycle())
            for i in range(args.cycles):
                freed = free_some(0.02, sizes["gpus"], seed=args.seed + i)
                summary = cycle()
                show(f"steady{i + 1}", summary)
                print(f"{'':>10}({freed} GPUs had been freed before it)")
                totals.append(summary["duration_ms"] / 1000)
                cpus.append(summary["cpu_s"])
            show("quiet", cycle())
            print(
                f"[steady] median full cycle: {median(totals):.3f} s over {len(totals)} cycles "
                f"(goal < 2 s); median CPU of this process {median(cpus):.3f} s"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--pending", type=int, default=10000)
    parser.add_argument("--history", type=int, default=5000)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--scenario", choices=("steady", "cold", "both"), default="both")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    # On a shared machine the wall times say as much about the neighbours as about the cycle.
    print(f"machine: {os.cpu_count()} CPUs, load average {load}")
    setup_django()
    run(args)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"load average at the end: {load}")


if __name__ == "__main__":
    main()
