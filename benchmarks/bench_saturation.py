"""The dev file where the shared pool saturates: every preset at L = 4, 6, 8 (and 12), timed.

    .venv/bin/python benchmarks/bench_saturation.py                          # L = 6, 8, 12, all
    .venv/bin/python benchmarks/bench_saturation.py --loads 4,6,8 \\
        --policies fifo-shared,tiresias-shared,srtf-shared,ours-oracle,ours --results DIR

Issue 19 asks the dev file (../shared/data/philly/philly-jobs.csv: 74k jobs, 2,816 GPUs) to
replay in under 2 minutes per policy at L = 6, 8 and 12, and `ours` to beat `fifo-shared` at
L = 6 and 8. Printed per replay as soon as it ends: wall and CPU seconds, plan calls, plans
asked again with a larger window, thrash stalls (must be 0), the load average of the machine
(it is shared: CPU seconds are the figure to compare) and the hash of every job's outcome
(outcome_hash); then per load factor the table of mean / p99 JCT, mean / p99 queue, max rho
(against FIFO on each tenant's own partition), preemptions per victim (mean / max), the jobs
that arrived within their tenant's guarantee with how many of them waited longer than the
preemption rules allow (min run time + notice + a tick) and the longest such wait, the same
promise per tenant whichever of its jobs the policy serves first (spells during which a tenant
held less than its guarantee while a job of it that fits in the rest waited: how many, how
many lasted past the bound, and the longest), and
where `ours` stands between fifo-shared and srtf-shared. ``--results DIR`` keeps every replay
(``L<load>-<policy>.pkl``) and reuses it. ``--core python`` runs the scheduling core from
source instead of its mypyc build (the default, built first where missing; scheduler/native.py):
the decisions are the same, the CPU seconds are not.

A policy may be a preset with fields of its Config set otherwise, ``PRESET+FIELD=VALUE[+...]``
(``ours+max_preemptions=3``): a variant measured beside the presets. Under the table: the
distribution of preemptions per victim (how many preempted jobs were preempted 1, 2, 3-5,
6-10, 11-20 and more than 20 times) of every policy that preempts.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _core(argv: list[str]) -> str:
    """``--core`` from the command line, read before the core is imported: which one it is is
    settled at its import (scheduler.native)."""
    for i, arg in enumerate(argv):
        if arg == "--core" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--core="):
            return arg.partition("=")[2]
    return "compiled"


CORE = _core(sys.argv)
if CORE == "compiled":
    # Built once per version of the sources (about 75 s), kept in var/build/core.
    subprocess.run([sys.executable, str(REPO / "scripts" / "build_core.py")], check=True)
if CORE in ("compiled", "python"):
    os.environ["GPUCP_CORE"] = CORE

from scheduler import native  # noqa: E402
from scheduler.simulator.compare import run_preset  # noqa: E402
from scheduler.simulator.engine import Result, SimOptions  # noqa: E402
from scheduler.simulator.loaders import load_trace  # noqa: E402
from scheduler.simulator.metrics import (  # noqa: E402
    Summary,
    guarantee_cell,
    owed_cell,
    summarize,
)
from scheduler.simulator.policies import PRESETS, REFERENCE_PRESET  # noqa: E402


def _load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def variant(name: str) -> tuple[str, dict[str, object]]:
    """(preset, Config fields to set) of ``PRESET+FIELD=VALUE+...``."""
    preset_name, *sets = name.split("+")
    changes: dict[str, object] = {}
    for item in sets:
        field, _, text = item.partition("=")
        value: object = text
        if text in ("None", "none"):
            value = None
        elif text in ("True", "False"):
            value = text == "True"
        else:
            try:
                value = int(text)
            except ValueError:
                try:
                    value = float(text)
                except ValueError:
                    pass
        changes[field] = value
    return preset_name, changes


def outcome_hash(result: Result) -> str:
    """What every job got, as 16 hex digits: every field of each JobOutcome, sorted by job id,
    and the sorted unfinished ids (sha256 of their repr). Two replays that decided alike have
    the same; a change meant to be faster only must keep it."""
    rows = [dataclasses.astuple(o) for o in sorted(result.outcomes, key=lambda o: o.job_id)]
    text = repr((rows, sorted(result.unfinished_job_ids)))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


BINS = ((1, 1), (2, 2), (3, 5), (6, 10), (11, 20), (21, None))


def per_victim(result: Result) -> str:
    """How many preempted jobs were preempted 1, 2, 3-5, 6-10, 11-20, > 20 times."""
    counts = [o.preemptions for o in result.outcomes if o.preemptions]
    cells = []
    for low, high in BINS:
        n = sum(1 for c in counts if c >= low and (high is None or c <= high))
        label = f"{low}" if low == high else (f"{low}-{high}" if high else f">{low - 1}")
        cells.append(f"{label}: {n:,}")
    return ", ".join(cells)


def replay(
    trace_spec: str, name: str, load: float, limit: int | None, results: Path | None
) -> Result:
    path = (
        results / f"L{load:g}-{name}{'' if limit is None else f'-n{limit}'}.pkl"
        if results
        else None
    )
    if path is not None and path.exists():
        with path.open("rb") as handle:
            cached: Result = pickle.load(handle)
        return cached
    trace = load_trace(trace_spec).limited(limit)
    before = _load()
    preset_name, changes = variant(name)
    result = run_preset(
        trace, preset_name, SimOptions(), load_factor=load, config_changes=changes or None
    )
    print(
        f"  L={load:<4g} {name:<16} wall {result.wall_s:7.1f} s  cpu {result.cpu_s:7.1f} s  "
        f"plans {result.plan_calls:>7,}  re-asked {result.window_replans:>6,}  "
        f"thrash stalls {result.thrash_stalls}  unfinished {len(result.unfinished_job_ids)}  "
        f"load {before} -> {_load()}  outcomes {outcome_hash(result)}",
        flush=True,
    )
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as handle:
            pickle.dump(result, handle)
    return result


def change(value: float, base: float) -> str:
    return f"{value / base - 1:+.1%}" if base else "n/a"


def table(rows: list[Summary]) -> str:
    head = (
        "| policy | mean JCT s | p99 JCT s | mean queue s | p99 queue s | max rho | "
        "preempted jobs | preemptions per victim mean / max | within guarantee: jobs / "
        "over the bound (gangs) / max wait s | tenants owed: spells / past the bound (gangs "
        "only) / longest s | wall s | CPU s |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for s in rows:
        per_victim = (
            f"{s.preemptions_per_victim_mean:.2f} / {s.preemptions_per_victim_max}"
            if s.preempted_jobs
            else "-"
        )
        lines.append(
            f"| {s.policy} | {s.mean_jct_s:,.0f} | {s.p99_jct_s:,.0f} | {s.mean_queue_s:,.0f} | "
            f"{s.p99_queue_s:,.0f} | {s.max_rho:.3f} | {s.preempted_jobs:,} | {per_victim} | "
            f"{guarantee_cell(s)} | {owed_cell(s)} | {s.wall_s:.1f} | {s.cpu_s:.1f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default="philly")
    parser.add_argument("--loads", default="6,8,12")
    parser.add_argument("--policies", default=",".join(PRESETS))
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--results", type=Path, default=None)
    parser.add_argument(
        "--core",
        choices=("compiled", "python"),
        default="compiled",
        help="run the scheduling core compiled with mypyc (built first if this version of the "
        "sources has no build yet) or from source; both decide alike (scheduler/native.py)",
    )
    args = parser.parse_args()
    print(f"core: {native.active()}  (load {_load()})", flush=True)
    loads = [float(x) for x in args.loads.split(",")]
    names = [n for n in args.policies.split(",") if n]
    for load in loads:
        print(f"\nL = {load:g}", flush=True)
        t0 = time.perf_counter()
        runs = {
            n: replay(args.trace, n, load, args.limit, args.results)
            for n in dict.fromkeys([REFERENCE_PRESET, *names])
        }
        reference = runs[REFERENCE_PRESET]
        rows = [summarize(n, runs[n], reference) for n in names]
        print(table(rows))
        for n in names:
            if runs[n].preemptions:
                print(f"  {n}: preemptions per victim {per_victim(runs[n])}")
        by = {s.policy: s for s in rows}
        if "fifo-shared" in by:
            fifo = by["fifo-shared"]
            srtf = by.get("srtf-shared")
            for ours in rows:
                if ours.policy in ("fifo-shared", "srtf-shared"):
                    continue
                line = (
                    f"{ours.policy} vs fifo-shared: mean JCT "
                    f"{change(ours.mean_jct_s, fifo.mean_jct_s)}, p99 JCT "
                    f"{change(ours.p99_jct_s, fifo.p99_jct_s)}, mean queue "
                    f"{change(ours.mean_queue_s, fifo.mean_queue_s)}, p99 queue "
                    f"{change(ours.p99_queue_s, fifo.p99_queue_s)}"
                )
                if srtf is not None:
                    gap = fifo.mean_jct_s - srtf.mean_jct_s
                    closed = (fifo.mean_jct_s - ours.mean_jct_s) / gap if gap > 0 else math.nan
                    line += f"; closes {closed:.0%} of the mean-JCT gap to srtf-shared"
                print(line)
        print(f"({time.perf_counter() - t0:.0f} s for L = {load:g})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
