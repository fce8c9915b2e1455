"""Power-cap planning on 64 simulated GPUs: pool budgets and eco mode, against simple baselines.

    .venv/bin/python benchmarks/bench_power.py [--hours 6] [--seed 1] [--budgets 0.5,0.7,0.9]

Each job's ground truth is the power model fitted to one zeus workload (../shared/data/zeus) on
its GPU type, 16 GPUs each of V100, A40, P100 and RTX6000; 60 % of the jobs are compute-bound
workloads (drawing at least 70 % of the maximum cap uncapped), 40 % the others (small batches,
NCF). The planner never sees those curves: every job starts on the default profile and is refit
from its own telemetry (draw and utilization, what the control plane's telemetry history keeps;
1 % noise; summarised per cap by scheduler.power_fit.CapSummary, as the control plane does) as it
runs under the caps the planner gives it. Time steps are heartbeats (10 s); the planner runs every
third one (30 s) and jobs start only then, as in the control plane. Every policy runs the same
per-GPU job sequences to completion.

Policies: no caps; one uniform cap (budget / GPUs on every GPU); the planner
(scheduler.power.plan_power_caps), also with eco mode on (Config.eco_max_slowdown = 0.05); and
the planner on the default profile alone, learning nothing (what the control plane did before
it fitted profiles to telemetry: every job budgeted at its board's maximum). Figures: energy (kWh, all GPUs until the last job ends),
mean and p95 slowdown (a job's run time over its uncapped run time), and seconds in which the
pool's true draw exceeded its budget. Eco: no binding budget, every job at most 5 % slower.
"""

from __future__ import annotations

import argparse
import csv
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.gpu_model import (  # noqa: E402
    GPU_TYPES,
    ZEUS_GPU_TYPES,
    energy_per_work,
    gpu_utilization,
    power_draw_w,
    relative_throughput,
)
from scheduler.model import Config, Gpu, Node, Pool, PowerProfile, Running, Snapshot, Tenant  # noqa: E402
from scheduler.power import best_cap_within_slowdown, plan_power_caps  # noqa: E402
from scheduler.power_fit import CapSummary, fit_profile, zeus_curves, zeus_samples  # noqa: E402

ZEUS = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "zeus"
HEARTBEAT_S = 10.0
CYCLE_EVERY = 3  # heartbeats per scheduling cycle
GPUS_PER_TYPE = 16
GPUS_PER_NODE = 8
TELEMETRY_NOISE = 0.01
COMPUTE_SHARE = 0.75  # of jobs, compute-bound zeus workloads; the rest the lighter ones
MEAN_GAP_S = 300.0  # mean idle time of a GPU between two jobs
# Per-workload optimum on the measured curves, from the data README (share of uncapped energy).
README_ECO_OPTIMUM = {"v100": 0.913, "a40": 0.881, "p100": 0.928, "rtx6000": 0.910}


@dataclass(frozen=True)
class Workload:
    gpu: str  # zeus key: v100, a40, p100, rtx6000
    name: str
    truth: PowerProfile
    measured_eco_energy: float  # best cap within 5 % on the measured curve, over uncapped energy
    compute_bound: bool


@dataclass
class JobRun:
    job_id: int
    workload: Workload
    work_s: float  # run time uncapped
    gap_s: float  # idle time on its GPU before it may start
    start_s: float | None = None
    end_s: float | None = None
    done_s: float = 0.0  # uncapped-equivalent seconds of work done
    energy_j: float = 0.0
    telemetry: CapSummary = field(default_factory=lambda: CapSummary(10.0))
    profile: PowerProfile = field(default_factory=PowerProfile)
    fitted_bins: int = 0
    fits: int = 0


def load_workloads() -> list[Workload]:
    workloads = []
    for gpu, type_name in ZEUS_GPU_TYPES.items():
        gpu_type = GPU_TYPES[type_name]
        with open(ZEUS / f"summary_power_{gpu}.csv", newline="") as f:
            curves = zeus_curves(csv.DictReader(f))
        for key, curve in curves.items():
            truth = fit_profile(zeus_samples(curve), gpu_type.max_w)
            time_max, power_max = curve[-1][1], curve[-1][2]
            eco = min(t * p for _, t, p in curve if t <= 1.05 * time_max) / (time_max * power_max)
            workloads.append(
                Workload(gpu, "/".join(key), truth, eco, power_max >= 0.7 * gpu_type.max_w)
            )
    return workloads


def make_jobs(workloads: list[Workload], hours: float, seed: int) -> dict[str, list[JobRun]]:
    """Per GPU uuid, its sequence of jobs (the same for every policy)."""
    rng = random.Random(seed)
    by_gpu: dict[str, list[Workload]] = {}
    for w in workloads:
        by_gpu.setdefault(w.gpu, []).append(w)
    jobs: dict[str, list[JobRun]] = {}
    job_id = 0
    for gpu in ZEUS_GPU_TYPES:
        compute = [w for w in by_gpu[gpu] if w.compute_bound]
        other = [w for w in by_gpu[gpu] if not w.compute_bound]
        for i in range(GPUS_PER_TYPE):
            uuid = f"{gpu}-{i}"
            planned_s, sequence = 0.0, []
            while planned_s < hours * 3600.0:
                job_id += 1
                workload = rng.choice(compute if rng.random() < COMPUTE_SHARE else other)
                work_s = min(max(rng.lognormvariate(math.log(2400.0), 0.8), 600.0), 4 * 3600.0)
                gap_s = rng.expovariate(1.0 / MEAN_GAP_S)
                sequence.append(JobRun(job_id, workload, work_s, gap_s))
                planned_s += work_s + gap_s
            jobs[uuid] = sequence
    return jobs


def inventory() -> tuple[list[Node], dict[str, Gpu]]:
    gpus: dict[str, Gpu] = {}
    for gpu, type_name in ZEUS_GPU_TYPES.items():
        t = GPU_TYPES[type_name]
        for i in range(GPUS_PER_TYPE):
            uuid = f"{gpu}-{i}"
            gpus[uuid] = Gpu(uuid, i % GPUS_PER_NODE, t.name, t.min_w, t.max_w, t.max_w)
    uuids = sorted(gpus)
    nodes = [
        Node(f"node-{n}", "pool", tuple(gpus[u] for u in uuids[n : n + GPUS_PER_NODE]))
        for n in range(0, len(uuids), GPUS_PER_NODE)
    ]
    return nodes, gpus


def learn(job: JobRun, max_w: float) -> None:
    """Refit the job's profile from its telemetry once a cap bin it had not been fitted on has
    three heartbeats (bins of 10 W; each bin becomes one averaged sample, weighted by its
    heartbeats, as the control plane summarises telemetry), at most 6 times."""
    samples = job.telemetry.samples(min_readings=3)
    if len(samples) <= job.fitted_bins or job.fits >= 6:
        return
    job.profile = fit_profile(samples, max_w, iterations=60)
    job.fitted_bins = len(samples)
    job.fits += 1


@dataclass
class Result:
    energy_kwh: float
    busy_energy_kwh: float
    slowdowns: list[float]
    jobs: list[JobRun]
    pool_draw_w: list[float]  # true pool draw at each heartbeat

    def over_budget_s(self, budget_w: float) -> float:
        return HEARTBEAT_S * sum(1 for w in self.pool_draw_w if w > budget_w + 1e-6)


def simulate(
    policy: str,
    budget_w: float | None,
    eco: float | None,
    jobs_by_gpu,
    seed: int,
    learning: bool = True,
) -> Result:
    rng = random.Random(seed)
    nodes, gpus = inventory()
    types = {u: GPU_TYPES[g.gpu_type] for u, g in gpus.items()}
    queues = {
        u: [JobRun(j.job_id, j.workload, j.work_s, j.gap_s) for j in seq]
        for u, seq in jobs_by_gpu.items()
    }
    running: dict[str, JobRun | None] = {u: None for u in gpus}
    free_since = {u: 0.0 for u in gpus}
    caps = {u: g.power_max_w for u, g in gpus.items()}
    finished: list[JobRun] = []
    tenants = (Tenant("vision"), Tenant("nlp"))
    config = Config(eco_max_slowdown=eco)
    now, step, energy_j, trace = 0.0, 0, 0.0, []
    while any(queues.values()) or any(running.values()):
        if step % CYCLE_EVERY == 0:
            for u in gpus:
                queue = queues[u]
                if running[u] is None and queue and now - free_since[u] >= queue[0].gap_s:
                    job = queue.pop(0)
                    job.start_s = now
                    running[u] = job
            if policy == "none":
                caps = {u: g.power_max_w for u, g in gpus.items()}
            elif policy == "uniform":
                assert budget_w is not None
                caps = {
                    u: min(max(budget_w / len(gpus), g.power_min_w), g.power_max_w)
                    for u, g in gpus.items()
                }
            else:
                busy = {
                    u: Running(
                        attempt_id=j.job_id,
                        job_id=j.job_id,
                        tenant=tenants[j.job_id % 2].name,
                        user="u",
                        priority=100,
                        preemptible=True,
                        started_at_s=j.start_s or 0.0,
                        gpus=(u,),
                        gpu_type=gpus[u].gpu_type,
                        power_profile=j.profile,
                    )
                    for u, j in running.items()
                    if j is not None
                }
                snap = Snapshot(
                    now_s=now,
                    nodes=tuple(
                        Node(
                            n.name,
                            n.pool,
                            tuple(
                                Gpu(
                                    g.uuid,
                                    g.index,
                                    g.gpu_type,
                                    g.power_min_w,
                                    g.power_max_w,
                                    g.power_default_w,
                                    power_cap_w=caps[g.uuid],
                                )
                                for g in n.gpus
                            ),
                        )
                        for n in nodes
                    ),
                    tenants=tenants,
                    pools=(Pool("pool", budget_w),),
                )
                caps = plan_power_caps(snap, config, busy)
        pool_draw_w = 0.0
        for u, g in gpus.items():
            job = running[u]
            t = types[u]
            cap = caps[u]
            if job is None:
                draw = min(t.idle_w, cap)
                pool_draw_w += draw
                energy_j += draw * HEARTBEAT_S
                continue
            truth = job.workload.truth
            draw = power_draw_w(truth, cap, g.power_max_w, t.idle_w)
            rel = relative_throughput(truth, cap, g.power_max_w)
            pool_draw_w += draw
            remaining = job.work_s - job.done_s
            dt = min(HEARTBEAT_S, remaining / rel)
            job.done_s += rel * dt
            job.energy_j += draw * dt
            energy_j += draw * dt + min(t.idle_w, cap) * (HEARTBEAT_S - dt)
            if policy == "planner" and learning:

                def noisy(x: float) -> float:
                    return x * (1.0 + rng.gauss(0.0, TELEMETRY_NOISE))

                job.telemetry.add(
                    cap,
                    noisy(draw),
                    min(noisy(gpu_utilization(truth, cap, g.power_max_w)), 1.0),
                )
                learn(job, g.power_max_w)
            if job.done_s >= job.work_s - 1e-9:
                job.end_s = now + dt
                finished.append(job)
                running[u] = None
                free_since[u] = now + dt
        trace.append(pool_draw_w)
        now += HEARTBEAT_S
        step += 1
    slowdowns = [(j.end_s - j.start_s) / j.work_s for j in finished]
    busy_j = sum(j.energy_j for j in finished)
    return Result(energy_j / 3.6e6, busy_j / 3.6e6, slowdowns, finished, trace)


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=6.0, help="work per GPU, hours")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--budgets",
        default="0.5,0.7,0.9",
        help="pool budgets as shares of the summed maximum caps, comma-separated",
    )
    args = parser.parse_args()
    shares = [float(x) for x in args.budgets.split(",") if x.strip()]
    if not (ZEUS / "summary_power_v100.csv").exists():
        sys.exit(
            f"the zeus power sweeps are not at {ZEUS} (optional: README.md, section Data, says where to get it)"
        )
    started = time.monotonic()
    workloads = load_workloads()
    jobs = make_jobs(workloads, args.hours, args.seed)
    _, gpus = inventory()
    max_total_w = sum(g.power_max_w for g in gpus.values())
    count = sum(len(s) for s in jobs.values())
    print(
        f"{len(gpus)} GPUs (summed max caps {max_total_w:.0f} W), {count} jobs, "
        f"{len(workloads)} zeus workloads as ground truth\n"
    )

    print("| budget | policy | energy kWh | mean slowdown | p95 slowdown | s over budget |")
    print("|---|---|---|---|---|---|")
    baseline = simulate("none", None, None, jobs, args.seed)
    goals = []
    for share in shares:
        budget_w = share * max_total_w
        rows = {
            "no caps": baseline,
            "uniform cap": simulate("uniform", budget_w, None, jobs, args.seed),
            "planner, default profile": simulate(
                "planner", budget_w, None, jobs, args.seed, learning=False
            ),
            "planner": simulate("planner", budget_w, None, jobs, args.seed),
            "planner + eco 5 %": simulate("planner", budget_w, 0.05, jobs, args.seed),
        }
        for policy, result in rows.items():
            print(
                f"| {share:.0%} ({budget_w:.0f} W) | {policy} | {result.energy_kwh:.1f} | "
                f"{statistics.fmean(result.slowdowns):.3f} | {p95(result.slowdowns):.3f} | "
                f"{result.over_budget_s(budget_w):.0f} |"
            )
        planner, uniform = rows["planner"], rows["uniform cap"]
        unlearned = rows["planner, default profile"]
        goals.append(
            (
                share,
                planner.over_budget_s(budget_w) == 0,
                statistics.fmean(planner.slowdowns) < statistics.fmean(uniform.slowdowns),
                planner.energy_kwh <= uniform.energy_kwh,
                statistics.fmean(planner.slowdowns) <= statistics.fmean(unlearned.slowdowns),
            )
        )

    eco = simulate("planner", None, 0.05, jobs, args.seed)
    eco_unlearned = simulate("planner", None, 0.05, jobs, args.seed, learning=False)
    # The per-job optimum on the same (ground-truth) curves: each job at its best cap within 5 %.
    optimum_j = 0.0
    for job in baseline.jobs:
        t = GPU_TYPES[ZEUS_GPU_TYPES[job.workload.gpu]]
        cap = best_cap_within_slowdown(job.workload.truth, t.min_w, t.max_w, 0.05)
        optimum_j += job.energy_j * energy_per_work(job.workload.truth, cap, t.max_w)
    optimum_kwh = optimum_j / 3.6e6
    saved = 1.0 - eco.busy_energy_kwh / baseline.busy_energy_kwh
    best = 1.0 - optimum_kwh / baseline.busy_energy_kwh
    print(
        "\n| eco (each job at most 5 % slower) | job energy kWh | saved vs no caps | mean slowdown | max slowdown |"
    )
    print("|---|---|---|---|---|")
    print(
        f"| no caps | {baseline.busy_energy_kwh:.1f} | - | {statistics.fmean(baseline.slowdowns):.3f} | {max(baseline.slowdowns):.3f} |"
    )
    print(f"| per-job optimum (true curves) | {optimum_kwh:.1f} | {best:.1%} | - | - |")
    print(
        f"| planner, learned from telemetry | {eco.busy_energy_kwh:.1f} | {saved:.1%} | {statistics.fmean(eco.slowdowns):.3f} | {max(eco.slowdowns):.3f} |"
    )
    saved_unlearned = 1.0 - eco_unlearned.busy_energy_kwh / baseline.busy_energy_kwh
    print(
        f"| planner, default profile only | {eco_unlearned.busy_energy_kwh:.1f} | {saved_unlearned:.1%} | {statistics.fmean(eco_unlearned.slowdowns):.3f} | {max(eco_unlearned.slowdowns):.3f} |"
    )
    print(f"\neco: {saved / best:.0%} of the per-job optimum's saving (goal >= 90 %)")
    measured = {
        gpu: statistics.median(w.measured_eco_energy for w in workloads if w.gpu == gpu)
        for gpu in ZEUS_GPU_TYPES
    }
    modelled = {}
    for gpu, type_name in ZEUS_GPU_TYPES.items():
        t = GPU_TYPES[type_name]
        modelled[gpu] = statistics.median(
            energy_per_work(
                w.truth, best_cap_within_slowdown(w.truth, t.min_w, t.max_w, 0.05), t.max_w
            )
            for w in workloads
            if w.gpu == gpu
        )
    print(
        "per-workload optimum within 5 %, median share of uncapped energy "
        "(measured curves / fitted model / data README):"
    )
    for gpu in ZEUS_GPU_TYPES:
        print(f"  {gpu}: {measured[gpu]:.3f} / {modelled[gpu]:.3f} / {README_ECO_OPTIMUM[gpu]:.3f}")
    for share, no_overrun, faster, cheaper, learned_faster in goals:
        print(
            f"budget {share:.0%}: 0 s over budget {'yes' if no_overrun else 'NO'}; "
            f"lower mean slowdown than uniform {'yes' if faster else 'NO'}; "
            f"no more energy than uniform {'yes' if cheaper else 'NO'}; "
            f"learned profiles: mean slowdown no higher than the default profile's "
            f"{'yes' if learned_faster else 'NO'}"
        )
    print(f"({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
