"""How long plan() takes, and how much memory it needs, at production size and simulator size.

    .venv/bin/python benchmarks/bench_plan.py [--runs N]

Large: 10,000 pending jobs, 2,000 nodes x 8 GPUs (two GPU types), 1,000 tenants, about 85 % of
the GPUs busy, 5,000 history records: what a big cluster's scheduling cycle sees. Every run
gets fresh tuples, as the control plane's loader gives every cycle, so the caches keyed on
them (topology, history index) do not flatter the figure. Goal: median < 0.5 s, peak < 1 GiB.

Small: 350 nodes, 20 pending, 300 running, the trace simulator's typical cycle, with the same
nodes and history tuples every time, as the simulator passes them. Goal: about 2 ms.

Prints the median wall time over the runs (and the median CPU time, which a busy shared
machine inflates less), the median of each named step, and the peak memory traced during one
more run (tracemalloc slows Python down, so that run is not timed) beside the process's RSS.
The first line gives the load average and a yardstick (CPU nanoseconds per iteration of a fixed
loop), because on a shared machine the wall time says as much about the neighbours as the code.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import time
import tracemalloc

from scheduler.memo import PlanMemo
from scheduler.model import (
    ANY_GPU_TYPE,
    Config,
    Gpu,
    HistoryRecord,
    Node,
    Pending,
    Quota,
    Running,
    Snapshot,
    Tenant,
)
from scheduler.policy import plan

H100, A100 = "H100-SXM-80GB", "A100-SXM4-80GB"
NOW = 1_800_000_000.0
NAMES = [
    f"{base}-{i}" for base in ("resnet", "bert", "llama-ft", "vit", "whisper") for i in range(40)
]


def build(
    n_nodes: int, n_tenants: int, n_pending: int, busy_fraction: float, seed: int, n_running=None
) -> Snapshot:
    rng = random.Random(seed)
    nodes = []
    for i in range(n_nodes):
        gpu_type = H100 if i % 4 else A100
        nodes.append(
            Node(
                name=f"node-{i:05d}",
                pool="main",
                gpus=tuple(
                    Gpu(f"gpu-{i:05d}-{j}", j, gpu_type, 200.0, 700.0, 700.0) for j in range(8)
                ),
                cpus=128.0,
                memory_mib=1_024_000,
            )
        )
    tenants = []
    for t in range(n_tenants):
        quotas = [Quota(ANY_GPU_TYPE, 12, 48)]
        if t % 10 == 0:
            quotas.append(Quota(A100, 4, 16))
        tenants.append(
            Tenant(f"team-{t:04d}", weight=rng.choice([1.0, 1.0, 2.0, 3.0]), quotas=tuple(quotas))
        )
    running = []
    attempt = 1
    busy_target = busy_fraction * n_nodes * 8
    busy = 0
    for node in nodes:
        free = list(node.gpus)
        while free and busy < busy_target and (n_running is None or len(running) < n_running):
            size = min(rng.choice([1, 1, 2, 4, 8]), len(free))
            held, free = free[:size], free[size:]
            started = NOW - rng.uniform(0, 86_400)
            tenant = tenants[rng.randrange(n_tenants)]
            running.append(
                Running(
                    attempt_id=attempt,
                    job_id=attempt,
                    tenant=tenant.name,
                    user=f"{tenant.name}-u{rng.randrange(5)}",
                    priority=rng.choice([50, 100, 100, 200]),
                    preemptible=rng.random() < 0.9,
                    started_at_s=started,
                    gpus=tuple(g.uuid for g in held),
                    gpu_type=held[0].gpu_type,
                    predicted_end_s=started + rng.uniform(600, 172_800),
                    stopping=rng.random() < 0.01,
                    cpus=8.0 * size,
                    memory_mib=64_000 * size,
                )
            )
            attempt += 1
            busy += size
        if busy >= busy_target or (n_running is not None and len(running) >= n_running):
            break
    pending = []
    for j in range(n_pending):
        tenant = tenants[rng.randrange(n_tenants)]
        gpus = rng.choice([1, 1, 1, 2, 2, 4, 8, 16])
        pending.append(
            Pending(
                job_id=1_000_000 + j,
                tenant=tenant.name,
                user=f"{tenant.name}-u{rng.randrange(5)}",
                name=f"{rng.choice(NAMES)}-seed{rng.randrange(10)}",
                gpus=gpus,
                gpu_type=rng.choice([ANY_GPU_TYPE, ANY_GPU_TYPE, H100, H100, A100]),
                priority=rng.choice([50, 100, 100, 200]),
                preemptible=rng.random() < 0.9,
                submitted_at_s=NOW - rng.uniform(0, 172_800),
                estimated_duration_s=rng.choice([None, rng.uniform(600, 86_400)]),
                max_runtime_s=86_400.0,
                cpus=8.0 * gpus,
                memory_mib=32_000 * gpus,
            )
        )
    history = tuple(
        HistoryRecord(
            (t := tenants[rng.randrange(n_tenants)]).name,
            f"{t.name}-u{rng.randrange(5)}",
            f"{rng.choice(NAMES)}-seed{rng.randrange(10)}",
            rng.choice([1, 2, 4, 8]),
            rng.uniform(300, 86_400),
        )
        for _ in range(5000)
    )
    return Snapshot(
        now_s=NOW,
        nodes=tuple(nodes),
        running=tuple(running),
        pending=tuple(pending),
        tenants=tuple(tenants),
        history=history,
    )


def measure(label: str, snap: Snapshot, runs: int, fresh: bool, config: Config) -> None:
    walls, cpus, steps = [], [], {}
    result = None
    # As a scheduling loop owns one: indexes of tuples passed again are reused (not when fresh).
    memo = PlanMemo()
    for _ in range(runs):
        s = _fresh(snap) if fresh else snap
        t0, c0 = time.perf_counter(), time.process_time()
        result = plan(s, config, memo)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        for name, seconds in result.step_seconds.items():
            steps.setdefault(name, []).append(seconds)
    tracemalloc.start()
    plan(_fresh(snap) if fresh else snap, config, memo)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    busy = sum(len(r.gpus) for r in snap.running)
    total = sum(len(n.gpus) for n in snap.nodes)
    print(f"== {label} ({config.ordering}, {runs} runs)")
    print(
        f"   {len(snap.nodes)} nodes, {total} GPUs ({busy} busy), {len(snap.tenants)} tenants, "
        f"{len(snap.running)} running, {len(snap.pending)} pending"
    )
    print(
        f"   plan(): median {statistics.median(walls) * 1000:.1f} ms, "
        f"min {min(walls) * 1000:.1f} ms, max {max(walls) * 1000:.1f} ms; "
        f"CPU time median {statistics.median(cpus) * 1000:.1f} ms; "
        f"peak memory traced in plan() {peak / 2**20:.1f} MiB, process max RSS "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"
    )
    print(
        "   steps (median ms): "
        + ", ".join(f"{k} {statistics.median(v) * 1000:.2f}" for k, v in steps.items())
    )
    print(
        f"   outcome: {len(result.starts)} starts, {len(result.preemptions)} preemptions, "
        f"{len(result.pending)} pending"
    )


def _fresh(snap: Snapshot) -> Snapshot:
    """The same snapshot in new tuples, as a loader builds every cycle: no cache can hit."""
    return Snapshot(
        now_s=snap.now_s,
        nodes=tuple(list(snap.nodes)),
        running=tuple(list(snap.running)),
        pending=tuple(list(snap.pending)),
        tenants=tuple(list(snap.tenants)),
        history=tuple(list(snap.history)),
    )


def machine_speed_ns() -> float:
    """CPU nanoseconds per iteration of a fixed loop of dictionary reads: a yardstick for how
    fast this machine runs Python right now (a quiet modern core does it in about 40-60 ns)."""
    table = {i: i for i in range(1024)}
    start = time.process_time()
    total = 0
    for i in range(500_000):
        total += table.get(i & 1023, 0)
    return (time.process_time() - start) / 500_000 * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="timed runs of the large case")
    args = parser.parse_args()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"machine: {os.cpu_count()} CPUs, load average {load}; yardstick loop "
        f"{machine_speed_ns():.0f} ns per iteration"
    )
    large = build(2000, 1000, 10_000, busy_fraction=0.85, seed=1)
    measure("large", large, args.runs, fresh=True, config=Config())
    small = build(350, 20, 20, busy_fraction=0.95, seed=2, n_running=300)
    measure("small", small, max(50, args.runs * 30), fresh=False, config=Config())


if __name__ == "__main__":
    main()
