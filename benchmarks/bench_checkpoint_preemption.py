"""Preemption victims by least lost work against youngest-first, on Philly at load 4.

    .venv/bin/python benchmarks/bench_checkpoint_preemption.py
    .venv/bin/python benchmarks/bench_checkpoint_preemption.py --limit 20000 --load 2
    .venv/bin/python benchmarks/bench_checkpoint_preemption.py --grace-s 30   # with a notice

Replays the Philly trace (../shared/data/philly, as benchmarks/bench_simulator.py reads it)
with its arrivals compressed by the load factor, under the ``ours`` preset, every job given a
checkpoint interval drawn uniformly from 15 to 60 minutes (seeded, the same in every replay).
A preempted job resumes from its last checkpoint and redoes Config.restart_cost_s. Three
variants of the victim rule:

  (a) lost-work     the victims that lose the least work in all, told every attempt's
                    checkpoint interval and last checkpoint (the default), waiting for a
                    victim's next checkpoint when that costs less than preempting now;
  (b) youngest      the most recently started first (the rule before checkpoints were known);
  (c) lost-work, no checkpoint knowledge: the same rule, told nothing about checkpoints (it
                    then counts the work since each attempt's start).

Prints GPU-hours lost to preemption, preemptions, mean JCT and mean queueing delay of each,
whether (a) meets the issue's goal (lost GPU-hours at most half of (b)'s, mean JCT no worse),
the load average before and after, and the command line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.model import VictimOrder  # noqa: E402
from scheduler.simulator.checkpoints import CheckpointIntervals  # noqa: E402
from scheduler.simulator.compare import run_preset  # noqa: E402
from scheduler.simulator.engine import Result, SimOptions  # noqa: E402
from scheduler.simulator.loaders import load_philly  # noqa: E402
from scheduler.simulator.metrics import Summary, summarize  # noqa: E402

# (label, victim order, whether the plan is told the checkpoints)
VARIANTS = (
    ("(a) lost-work", VictimOrder.LOST_WORK, True),
    ("(b) youngest-first", VictimOrder.YOUNGEST, True),
    ("(c) lost-work, no checkpoint knowledge", VictimOrder.LOST_WORK, False),
)


def _load_average() -> str:
    try:
        return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:
        return "n/a"


def table(rows: list[tuple[str, Summary, Result]]) -> str:
    lines = [
        "| victims | GPU-h lost to preemption | of which progress / restarts | preemptions | "
        "mean JCT (s) | mean queue (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, s, r in rows:
        progress_h = r.preempted_gpu_s_progress / 3600
        restarts_h = s.preempted_gpu_hours_lost - progress_h
        lines.append(
            f"| {label} | {s.preempted_gpu_hours_lost:,.1f} | {progress_h:,.1f} / "
            f"{restarts_h:,.1f} | {s.preemptions:,} | {s.mean_jct_s:,.1f} | {s.mean_queue_s:,.1f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", type=float, default=4.0, help="load factor (default 4)")
    parser.add_argument(
        "--checkpoint-interval",
        default="uniform:900-3600",
        help="per-job checkpoint intervals (default uniform:900-3600 seconds)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the interval draws")
    parser.add_argument(
        "--grace-s",
        type=float,
        default=0.0,
        help="notice before a preemption (a victim whose next checkpoint falls within it saves "
        "it, keeping its GPUs until then); default 0: GPUs are freed at once",
    )
    parser.add_argument("--limit", type=int, default=None, help="first N jobs only")
    args = parser.parse_args()
    checkpoints = CheckpointIntervals.parse(args.checkpoint_interval, args.seed)

    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(f"load average at start: {_load_average()} ({os.cpu_count()} CPUs)")
    t0 = time.perf_counter()
    trace = load_philly().limited(args.limit)
    print(f"loaded {len(trace.jobs):,} jobs in {time.perf_counter() - t0:.1f} s")
    rows: list[tuple[str, Summary, Result]] = []
    for label, order, knowledge in VARIANTS:
        before = _load_average()
        options = SimOptions(
            checkpoints=checkpoints, checkpoint_knowledge=knowledge, grace_s=args.grace_s
        )
        result = run_preset(
            trace,
            "ours",
            options,
            load_factor=args.load,
            config_changes={"victim_order": order},
        )
        rows.append((label, summarize(label, result), result))
        print(
            f"  {label}: wall {result.wall_s:.1f} s, CPU {result.cpu_s:.1f} s, "
            f"{result.plan_calls:,} plan calls, {len(result.unfinished_job_ids)} unfinished, "
            f"load {before} -> {_load_average()}",
            flush=True,
        )
    print(
        f"\n## Philly, load factor {args.load:g}, preset ours, checkpoints "
        f"{args.checkpoint_interval} (seed {args.seed}), notice {args.grace_s:g} s\n"
    )
    print(table(rows))
    lost, youngest = rows[0][1], rows[1][1]
    halved = lost.preempted_gpu_hours_lost <= youngest.preempted_gpu_hours_lost / 2
    no_worse = lost.mean_jct_s <= youngest.mean_jct_s
    print(
        f"\ngoal: GPU-h lost {lost.preempted_gpu_hours_lost:,.1f} <= half of youngest-first's "
        f"{youngest.preempted_gpu_hours_lost:,.1f}: {'met' if halved else 'MISSED'}; "
        f"mean JCT {lost.mean_jct_s:,.1f} s <= {youngest.mean_jct_s:,.1f} s: "
        f"{'met' if no_worse else 'MISSED'}"
    )
    print(f"load average at end: {_load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
