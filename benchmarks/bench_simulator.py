"""Replay the full Philly trace under every policy preset and print the figures issue 6 asks for.

    .venv/bin/python benchmarks/bench_simulator.py                  # L = 1, all presets
    .venv/bin/python benchmarks/bench_simulator.py --high-load      # L = 1, 2 and 4
    .venv/bin/python benchmarks/bench_simulator.py --loads 2 --policies fifo-static,srtf,ours
    .venv/bin/python benchmarks/bench_simulator.py --high-load --results DIR   # resumable

Prints, per load factor: the policies x metrics table, the per-tenant table, wall and CPU time
and events per second of every replay, how our baselines compare with the published simulators'
figures on the same file (../shared/data/philly/ANCHORS.md), and whether our default policy
meets its targets. Each replay's line is printed as soon as it ends, with the load average
before and after it; the machine may be shared, so CPU time is printed beside wall time.
With ``--results DIR`` every replay's result is kept there (``L<load>-<policy>.pkl``) and a
later run with the same DIR reuses it instead of replaying (delete a file to measure again).
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler.simulator.compare import progress_bar, run_preset  # noqa: E402
from scheduler.simulator.engine import Result, SimOptions  # noqa: E402
from scheduler.simulator.loaders import load_philly  # noqa: E402
from scheduler.simulator.metrics import Summary, summarize  # noqa: E402
from scheduler.simulator.policies import PRESETS, REFERENCE_PRESET, preset  # noqa: E402
from scheduler.simulator.report import summary_table, tenant_table, write_report  # noqa: E402

# ANCHORS.md: (mean JCT, mean queue, p99 JCT, p99 queue) of the Helios / Lucid simulators.
ANCHORS: dict[float, dict[str, tuple[float, float, float, float]]] = {
    1.0: {
        "fifo-static": (13207.2, 98.0, 257530, 341.5),
        "sjf": (13168.3, 59.1, 257131, 117.0),
        "srtf": (13159.2, 48.9, 257531, 0.0),
        "qssf": (13170.4, 61.1, 257204, 137.5),
        "tiresias": (13203.3, 92.9, 257085, 254.5),
    },
    2.0: {
        "fifo-static": (15012.6, 1903.4, 270470, 77543),
        "sjf": (13639.9, 530.7, 271155, 6559),
        "qssf": (13680.2, 570.9, 269561, 7967),
        "srtf": (13466.2, 355.2, 270209, 2794),
        "tiresias": (13748.8, 636.9, 269611, 11792),
    },
    4.0: {
        "fifo-static": (39315.7, 26206.5, 711759, 647705),
        "sjf": (17040.8, 3931.6, 343745, 38011),
        "srtf": (15764.2, 2650.6, 315201, 19523),
        "qssf": (18341.7, 5232.4, 371943, 61353),
        "tiresias": (22346.2, 9228.6, 618803, 307191),
    },
}
# Their FIFO and SJF block at the first job that does not fit: our "-strict" presets; the greedy
# presets (every job that fits starts) are shown against the same figures.
for _figures in ANCHORS.values():
    _figures["fifo-strict"] = _figures["fifo-static"]
    _figures["sjf-strict"] = _figures["sjf"]
ALL = ",".join(PRESETS)


def _diff(ours: float, theirs: float) -> str:
    if theirs == 0:
        return "n/a" if ours else "="
    return f"{100 * (ours - theirs) / theirs:+.1f} %"


def anchors_table(load: float, summaries: list[Summary]) -> str:
    published = ANCHORS.get(load, {})
    lines = [
        "| policy | mean JCT ours / published | mean queue ours / published | "
        "p99 JCT ours / published | p99 queue ours / published |",
        "|---|---:|---:|---:|---:|",
    ]
    for s in summaries:
        if s.policy not in published:
            continue
        jct, queue, p99_jct, p99_queue = published[s.policy]
        lines.append(
            f"| {s.policy} | {s.mean_jct_s:,.1f} / {jct:,.1f} ({_diff(s.mean_jct_s, jct)}) "
            f"| {s.mean_queue_s:,.1f} / {queue:,.1f} ({_diff(s.mean_queue_s, queue)}) "
            f"| {s.p99_jct_s:,.0f} / {p99_jct:,.0f} ({_diff(s.p99_jct_s, p99_jct)}) "
            f"| {s.p99_queue_s:,.1f} / {p99_queue:,.1f} ({_diff(s.p99_queue_s, p99_queue)}) |"
        )
    return "\n".join(lines)


def targets(load: float, summaries: list[Summary]) -> list[str]:
    """Issue 6's targets for our default policy, each with met / missed and by how much."""
    by = {s.policy: s for s in summaries}
    ours = by.get("ours")
    if ours is None:
        return []
    out = []
    srtf_published = ANCHORS.get(load, {}).get("srtf")
    srtf = by.get("srtf")
    if load == 1.0:
        goal = 0.5 * 48.9
        out.append(
            f"mean queue {ours.mean_queue_s:.1f} s <= half of published SRTF's 48.9 s "
            f"({goal:.2f} s): {'met' if ours.mean_queue_s <= goal else 'MISSED'}"
        )
        ref = (
            {t.tenant: t.mean_queue_s for t in by["fifo-static"].tenants}
            if ("fifo-static" in by)
            else None
        )
        if ref is not None:
            worse = [
                f"{t.tenant} {t.mean_queue_s:.1f} > {ref[t.tenant]:.1f}"
                for t in ours.tenants
                if t.mean_queue_s > ref.get(t.tenant, math.inf) + 1e-9
            ]
            out.append(
                "no tenant's mean queue worse than FIFO on its own partition: "
                + ("met" if not worse else "MISSED (" + ", ".join(worse) + ")")
            )
    else:
        for label, value in (
            ("our SRTF baseline", srtf.mean_jct_s if srtf else None),
            ("published SRTF", srtf_published[0] if srtf_published else None),
        ):
            if value is not None:
                verdict = "met" if ours.mean_jct_s < value else "MISSED"
                out.append(
                    f"mean JCT {ours.mean_jct_s:,.1f} s < {label} {value:,.1f} s: {verdict} "
                    f"({_diff(ours.mean_jct_s, value)})"
                )
        over = [f"{t.tenant} {t.rho:.3f}" for t in ours.tenants if t.rho > 1.0 + 1e-9]
        out.append(
            "rho <= 1 for every tenant: "
            + ("met" if not over else "MISSED (" + ", ".join(over) + ")")
        )
    return out


def profile_plan(rows: int = 30000, min_running: int = 300, repeats: int = 200) -> None:
    """Time plan() alone on one snapshot the simulator built (the replay's inner loop).

    Replays the first ``rows`` Philly jobs under our default policy until a cycle's snapshot
    holds ``min_running`` attempts, then calls plan() on it ``repeats`` times.
    """
    from scheduler.memo import PlanMemo
    from scheduler.policy import plan
    from scheduler.simulator.compare import run_preset

    class Found(Exception):
        pass

    caught = []

    def grab(snapshot, made):
        if len(snapshot.running) >= min_running:
            caught.append(snapshot)
            raise Found

    try:
        run_preset(load_philly(max_rows=rows), "ours", SimOptions(on_cycle=grab))
    except Found:
        pass
    if not caught:
        print(f"no cycle of the first {rows:,} jobs had {min_running} attempts running")
        return
    snapshot = caught[0]
    config = PRESETS["ours"].config
    steps: dict[str, float] = {}
    cpu0 = time.process_time()
    memo = PlanMemo()  # the replay's own, as in the engine
    for _ in range(repeats):
        made = plan(snapshot, config, memo)
        for step, seconds in made.step_seconds.items():
            steps[step] = steps.get(step, 0.0) + seconds
    per_call_ms = 1000 * (time.process_time() - cpu0) / repeats
    print(
        f"plan() on a Philly snapshot: {len(snapshot.nodes)} nodes, "
        f"{len(snapshot.running)} running, {len(snapshot.pending)} pending, "
        f"{len(snapshot.history)} history records: {per_call_ms:.2f} ms CPU per call"
    )
    for step, seconds in sorted(steps.items(), key=lambda kv: -kv[1]):
        print(f"  {step:10} {1000 * seconds / repeats:.3f} ms")


def _load_average() -> str:
    try:
        return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:
        return "n/a"


def replay_line(name: str, r: Result, note: str = "") -> str:
    return (
        f"  {name:12} wall {r.wall_s:7.1f} s  CPU {r.cpu_s:7.1f} s  "
        f"{r.events:,} events ({r.events / max(r.cpu_s, 1e-9):,.0f}/CPU-s, "
        f"{r.events / max(r.wall_s, 1e-9):,.0f}/wall-s)  "
        f"{r.plan_calls:,} plan calls, {r.plan_wall_s:.1f} s wall in plan(){note}"
    )


def replays(trace, names, options, load, results_dir, progress) -> dict[str, Result]:
    """Every preset of ``names`` (and the reference) at one load, one after the other."""
    out: dict[str, Result] = {}
    for name in [REFERENCE_PRESET, *[n for n in names if n != REFERENCE_PRESET]]:
        kept = Path(results_dir) / f"L{load:g}-{name}.pkl" if results_dir else None
        if kept is not None and kept.exists():
            with kept.open("rb") as f:
                out[name] = pickle.load(f)
            print(replay_line(name, out[name], "  (kept from an earlier run)"), flush=True)
            continue
        before = _load_average()
        opts = options
        if progress:
            opts = replace(options, progress=progress_bar(name))
        out[name] = run_preset(trace, name, opts, load_factor=load)
        if progress:
            sys.stderr.write("\n")
        print(replay_line(name, out[name], f"  load {before} -> {_load_average()}"), flush=True)
        if kept is not None:
            kept.parent.mkdir(parents=True, exist_ok=True)
            with kept.open("wb") as f:
                pickle.dump(out[name], f)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default=ALL, help=f"comma-separated (default {ALL})")
    parser.add_argument("--loads", default=None, help="comma-separated load factors (default 1)")
    parser.add_argument("--high-load", action="store_true", help="also L = 2 and 4")
    parser.add_argument("--cycle-s", type=float, default=60.0)
    parser.add_argument("--limit", type=int, default=None, help="first N jobs only")
    parser.add_argument("--out", default=None, help="write report.md and plots per load here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--results", default=None, help="keep (and reuse) every replay here")
    parser.add_argument(
        "--profile-plan", action="store_true", help="only time plan() on one replay snapshot"
    )
    args = parser.parse_args()
    if args.profile_plan:
        profile_plan()
        return 0

    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    for n in names:
        preset(n)  # an unknown name fails before any replay starts
    loads = [float(x) for x in args.loads.split(",")] if args.loads else [1.0]
    if args.high_load:
        loads = sorted(set(loads) | {1.0, 2.0, 4.0})

    t0 = time.perf_counter()
    trace = load_philly().limited(args.limit)
    print(f"loaded {len(trace.jobs):,} jobs in {time.perf_counter() - t0:.1f} s")
    for note in trace.notes:
        print(f"  {note}")
    options = SimOptions(cycle_s=args.cycle_s)
    results_dir = args.results if args.limit is None else None
    print(f"load average at start: {_load_average()} ({os.cpu_count()} CPUs)")
    for load in loads:
        print(f"\n## Philly, load factor L = {load:g}, cycle {args.cycle_s:g} s\n")
        print("replays (as they end):")
        results = replays(trace, names, options, load, results_dir, not args.quiet)
        reference = results[REFERENCE_PRESET]
        summaries = [summarize(n, results[n], reference) for n in dict.fromkeys(names)]
        print()
        print(summary_table(summaries))
        print()
        print(tenant_table(summaries))
        if args.limit is None:
            print("\nagainst ANCHORS.md (published simulators on the same file):\n")
            print(anchors_table(load, summaries))
            lines = targets(load, summaries)
            if lines:
                print("\ntargets of our default policy:")
                for line in lines:
                    print(f"  - {line}")
        if args.out:
            out = Path(args.out) / f"L{load:g}"
            write_report(
                out,
                summaries,
                {n: results[n] for n in dict.fromkeys(names)},
                title=f"Philly, {len(trace.jobs):,} jobs, load factor {load:g}",
                notes=trace.notes,
                command=" ".join(sys.argv),
            )
            print(f"\nreport: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
