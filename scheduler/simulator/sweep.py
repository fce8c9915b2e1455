"""python -m scheduler.simulator.sweep: the same comparison at several loads, and the load-sweep
plot (a metric against the load factor L, a line per policy: the central figure of Gavel and
Pollux).

    python -m scheduler.simulator.sweep --trace philly --policy fifo-shared,ours --loads 4,6,8 \\
        --out sweep/

writes, under ``--out``: ``report.md`` (every replay's figures, one row per load and policy; the
per-class table at the highest load; the plot), ``sweep.png``, ``sweep.csv`` (the same figures,
unformatted) and a full report per load in ``L<load>/``. Every load runs FIFO on static
partitions too (for rho); it is shown only if asked for. Options are those of
``python -m scheduler.simulator`` (``--load-factor`` aside). ``--results DIR`` keeps every replay
there (``L<load>-<policy>[-n<limit>].pkl``, the names ``benchmarks/bench_saturation.py`` uses)
and reuses what it finds, so a report can be redrawn, or drawn from the benchmark's replays,
without replaying.
"""

from __future__ import annotations

import argparse
import csv
import math
import pickle
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from scheduler.simulator.__main__ import UsageError, build_parser, prepare
from scheduler.simulator.compare import Comparison, compare, progress_bar, run_preset
from scheduler.simulator.engine import Result, SimOptions
from scheduler.simulator.metrics import Summary, guarantee_cell, owed_cell, summarize
from scheduler.simulator.policies import REFERENCE_PRESET
from scheduler.simulator.report import (
    CLASS_EXPLANATION,
    class_table,
    command_line,
    guarantees,
    strip_paths,
    trace_label,
    write_report,
)
from scheduler.simulator.trace import Trace


@dataclass(frozen=True)
class Metric:
    """One panel of the sweep plot and one column of its table."""

    heading: str
    value: Callable[[Summary], float]
    digits: int  # decimals in the table
    log: bool = False  # a log axis (when the values span more than 20x)


METRICS: tuple[Metric, ...] = (
    Metric("mean JCT (s)", lambda s: s.mean_jct_s, 0),
    Metric("p99 JCT (s)", lambda s: s.p99_jct_s, 0),
    Metric("mean queue (s)", lambda s: s.mean_queue_s, 1, log=True),
    Metric("p99 queue (s)", lambda s: s.p99_queue_s, 0, log=True),
    Metric("max rho", lambda s: s.max_rho, 3),
    Metric("preempted jobs", lambda s: float(s.preempted_jobs), 0),
)
# Columns of the table beyond the plotted metrics: (heading, cell).
EXTRA_COLUMNS: tuple[tuple[str, Callable[[Summary], str]], ...] = (
    (
        "preempt / victim (mean / p99 / max)",
        lambda s: (
            "-"
            if not s.preempted_jobs
            else f"{s.preemptions_per_victim_mean:.1f} / {s.preemptions_per_victim_p99:.0f} / "
            f"{s.preemptions_per_victim_max}"
        ),
    ),
    ("GPU-h lost", lambda s: f"{s.preempted_gpu_hours_lost:,.1f}"),
    ("within guarantee: jobs / over bound (gangs) / max wait (s)", guarantee_cell),
    ("tenants owed: spells / past bound (gangs only) / longest (s)", owed_cell),
    ("util", lambda s: "-" if math.isnan(s.utilization) else f"{100 * s.utilization:.1f} %"),
    ("jobs", lambda s: f"{s.jobs:,}" + (f" (+{s.unfinished} unfinished)" if s.unfinished else "")),
    ("wall (s)", lambda s: f"{s.wall_s:.1f}"),
    ("CPU (s)", lambda s: f"{s.cpu_s:.1f}"),
)


def parse_loads(text: str) -> list[float]:
    try:
        loads = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("expected load factors, e.g. 4,6,8") from None
    if not loads or any(not (x > 0) or math.isinf(x) for x in loads):
        raise argparse.ArgumentTypeError("expected positive load factors, e.g. 4,6,8")
    return sorted(set(loads))


def build_sweep_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    parser.prog = "python -m scheduler.simulator.sweep"
    parser.description = (
        "Compare policies at several load factors and draw every metric against the load."
    )
    parser.add_argument(
        "--loads", type=parse_loads, required=True, help="comma-separated load factors: 4,6,8"
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        help="keep every replay in this folder (L<load>-<policy>[-n<limit>].pkl, as "
        "benchmarks/bench_saturation.py does) and reuse those found there; the name says only "
        "the load, policy and limit, so reuse them with the same options",
    )
    parser.add_argument(
        "--cached-only",
        action="store_true",
        help="with --results: replay nothing, and leave out of each load the policies it has no "
        "replay of (the report says which); for drawing what long replays have finished so far",
    )
    return parser


def cached_compare(
    trace: Trace,
    names: Sequence[str],
    options: SimOptions,
    *,
    load_factor: float,
    results: Path,
    limit: int | None,
    progress: bool = False,
    cached_only: bool = False,
) -> Comparison:
    """``compare`` with every replay (the reference too) kept in and reused from ``results``.

    ``cached_only``: replay nothing; a policy without a kept replay is left out (the reference
    must be there: rho is measured against it)."""
    found: dict[str, Result] = {}
    for name in dict.fromkeys([REFERENCE_PRESET, *names]):
        path = results / f"L{load_factor:g}-{name}{'' if limit is None else f'-n{limit}'}.pkl"
        if path.exists():
            with path.open("rb") as handle:
                found[name] = pickle.load(handle)  # our own replays, written below
            print(f"{name:>16}: reused {path.name}", file=sys.stderr)
            continue
        if cached_only:
            if name == REFERENCE_PRESET:
                raise UsageError(f"--cached-only: no replay of {name} (the reference) in {path}")
            print(f"{name:>16}: no {path.name}, left out", file=sys.stderr)
            continue
        opts = replace(options, progress=progress_bar(name)) if progress else options
        found[name] = run_preset(trace, name, opts, load_factor=load_factor)
        if progress:
            sys.stderr.write("\n")
        results.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as handle:
            pickle.dump(found[name], handle)
    reference = found[REFERENCE_PRESET]
    names = [n for n in names if n in found]
    return Comparison(
        [summarize(n, found[n], reference) for n in names], {n: found[n] for n in names}
    )


def _cell(value: float, digits: int) -> str:
    return "-" if math.isnan(value) else f"{value:,.{digits}f}"


def sweep_table(runs: Mapping[float, Sequence[Summary]]) -> str:
    """A row per load and policy: the plotted metrics, then the rest of what a replay shows."""
    headings = ["L", "policy", *(m.heading for m in METRICS), *(h for h, _ in EXTRA_COLUMNS)]
    lines = [
        "| " + " | ".join(headings) + " |",
        "|---:|---|" + "---:|" * (len(headings) - 2),
    ]
    for load, summaries in runs.items():
        for s in summaries:
            cells = [f"{load:g}", s.policy]
            cells += [_cell(m.value(s), m.digits) for m in METRICS]
            cells += [f(s) for _, f in EXTRA_COLUMNS]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# The comparison the issue of record asks for: every policy against FIFO on the shared pool, and
# the share of the mean-JCT gap between that and oracle SRTF on the shared pool it closes.
BASELINE = "fifo-shared"
ORACLE = "srtf-shared"


def _change(value: float, base: float) -> str:
    if math.isnan(value) or math.isnan(base) or base == 0:
        return "-"
    return f"{100 * (value - base) / base:+.1f} %"


def relative_table(
    runs: Mapping[float, Sequence[Summary]], baseline: str = BASELINE, oracle: str = ORACLE
) -> str:
    """Per load, every other policy's mean / p99 JCT and queue against ``baseline`` (+ = worse),
    and the share of the baseline's mean-JCT gap to ``oracle`` it closes; '' without the
    baseline."""
    lines = []
    for load, summaries in runs.items():
        by = {s.policy: s for s in summaries}
        base = by.get(baseline)
        if base is None:
            continue
        target = by.get(oracle)
        gap = base.mean_jct_s - target.mean_jct_s if target else math.nan
        for s in summaries:
            if s.policy == baseline:
                continue
            closed = (
                "-"
                if math.isnan(gap) or gap <= 0 or s.policy == oracle
                else f"{100 * (base.mean_jct_s - s.mean_jct_s) / gap:.0f} %"
            )
            lines.append(
                f"| {load:g} | {s.policy} | {_change(s.mean_jct_s, base.mean_jct_s)} | "
                f"{_change(s.p99_jct_s, base.p99_jct_s)} | "
                f"{_change(s.mean_queue_s, base.mean_queue_s)} | "
                f"{_change(s.p99_queue_s, base.p99_queue_s)} | {closed} |"
            )
    if not lines:
        return ""
    head = [
        f"| L | policy | mean JCT | p99 JCT | mean queue | p99 queue | {oracle} gap closed |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    if not any(oracle in (s.policy for s in summaries) for summaries in runs.values()):
        # Without the oracle there is no gap: the column goes.
        head = [h.rsplit("|", 2)[0] + "|" for h in head]
        lines = [line.rsplit("|", 2)[0] + "|" for line in lines]
    return "\n".join(head + lines)


def write_csv(path: Path, runs: Mapping[float, Sequence[Summary]]) -> None:
    fields = (
        "mean_jct_s",
        "median_jct_s",
        "p99_jct_s",
        "mean_queue_s",
        "p99_queue_s",
        "waited_share",
        "utilization",
        "max_rho",
        "preemptions",
        "preempted_jobs",
        "preemptions_per_victim_mean",
        "preemptions_per_victim_p50",
        "preemptions_per_victim_p99",
        "preemptions_per_victim_max",
        "preempted_gpu_hours_lost",
        "guaranteed_jobs",
        "guaranteed_over_bound",
        "guaranteed_over_bound_gangs",
        "guaranteed_wait_p99_s",
        "guaranteed_wait_max_s",
        "guarantee_wait_bound_s",
        "owed_spells",
        "owed_over_bound",
        "owed_over_bound_gangs",
        "owed_max_s",
        "jobs",
        "unfinished",
        "wall_s",
        "cpu_s",
    )
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(("load", "policy", *fields))
        for load, summaries in runs.items():
            for s in summaries:
                writer.writerow((f"{load:g}", s.policy, *(getattr(s, f) for f in fields)))


def sweep_plot(path: Path, runs: Mapping[float, Sequence[Summary]]) -> list[str]:
    """A panel per metric, the load on x, a line per policy (tied policies as one line);
    returns the ties, in words."""
    from scheduler.simulator import plots as pl

    loads = list(runs)
    names: list[str] = []
    for summaries in runs.values():
        names += [s.policy for s in summaries if s.policy not in names]
    fig, axes = pl.grid(len(METRICS), columns=3, size=(4.4, 3.4))
    ties = []
    for ax, metric in zip(axes, METRICS, strict=True):
        xs: dict[str, list[float]] = {}
        ys: dict[str, list[float]] = {}
        for name in names:
            points = [
                (load, metric.value(s))
                for load in loads
                for s in runs[load]
                if s.policy == name and not math.isnan(metric.value(s))
            ]
            if points:
                xs[name] = [x for x, _ in points]
                ys[name] = [y for _, y in points]
        # Tied as the table shows them: to its decimals.
        groups = pl.draw_lines(ax, xs, ys, marker="o", decimals=metric.digits)
        ties += [f"{pl.tie_label(g)} ({metric.heading})" for g in groups if len(g) > 1]
        values = [y for series in ys.values() for y in series if y > 0]
        if metric.log and values and max(values) > 20 * min(values):
            ax.set_yscale("log")
        if metric.heading == "max rho":
            ax.axhline(1.0, color="black", lw=0.8, ls=":")
        ax.set_title(metric.heading, fontsize=10)
        ax.set_xlabel("load factor L", fontsize=8)
        ax.set_xticks(loads, [f"{x:g}" for x in loads])
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if groups:
            ax.legend(fontsize=7)
    pl.save(fig, path)
    return ties


def write_sweep(
    out_dir: Path | str,
    runs: Mapping[float, Comparison],
    *,
    title: str,
    notes: Sequence[str] = (),
    command: str = "",
    tenant_guarantees: Mapping[str, int] | None = None,
    plots: bool = True,
) -> Path:
    """The sweep's report.md, sweep.csv and sweep.png, and a report per load in L<load>/.

    ``title`` names the trace (``philly-jobs.csv: 74,000 jobs``); the loads are added to it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summaries = {load: c.summaries for load, c in runs.items()}
    for load, c in runs.items():
        write_report(
            out / f"L{load:g}",
            c.summaries,
            c.results,
            title=f"{title}, load factor {load:g}",
            notes=notes,
            command=command,
            plots=plots,
            guarantees=tenant_guarantees,
        )
    write_csv(out / "sweep.csv", summaries)
    loads = ", ".join(f"{x:g}" for x in runs)
    parts = [f"# {title}, load factors {loads}", ""]
    if command:
        parts += ["```", command, "```", ""]
    if notes:
        parts += ["## Trace", ""] + [f"- {n}" for n in notes] + [""]
    parts += ["## Every replay", "", sweep_table(summaries), ""]
    parts += [
        "Queue = total time pending; rho = a tenant's mean JCT over its mean JCT under FIFO on "
        "its own static partition at the same load (max over tenants); preempted jobs = jobs "
        "preempted at least once; preempt / victim = preemptions per preempted job; within "
        "guarantee = jobs that arrived with their tenant's held and waiting GPUs plus their own "
        "within its guarantee, how many waited for their first start longer than the preemption "
        "rules allow (min run time + notice + a tick; in brackets those that are gangs, which wait "
        "also for a node with enough GPUs free or borrowed together), and the longest such "
        "wait; tenants owed = spells during which a tenant held less than its guarantee while a "
        "job of it that fits in the rest waited, how many lasted past that bound (in brackets: "
        "those only gangs waited through) and the longest, whichever of its jobs the policy "
        "served first; wall and "
        "CPU seconds of each replay. Unformatted figures: sweep.csv.",
        "",
    ]
    relative = relative_table(summaries)
    if relative:
        parts += [
            f"## Against {BASELINE}",
            "",
            relative,
            "",
            f"Change from {BASELINE} at the same load (+ = longer). Gap closed = how much of "
            f"the mean JCT between {BASELINE} and {ORACLE} (oracle SRTF on the shared pool) a "
            f"policy closes: 100 % = as good as {ORACLE}, 0 % = no better than {BASELINE}.",
            "",
        ]
    if plots:
        ties = sweep_plot(out / "sweep.png", summaries)
        parts += ["## Metrics against the load", ""]
        if ties:
            parts += ["Drawn as one line (equal in the table): " + "; ".join(ties), ""]
        parts += ["![every metric against the load factor, a line per policy](sweep.png)", ""]
    top = max(runs)
    parts += [
        f"## Per job class at L = {top:g}",
        "",
        class_table(runs[top].summaries, runs[top].results),
        "",
        CLASS_EXPLANATION,
        "",
        "## Per load",
        "",
    ]
    parts += [f"- [L = {load:g}](L{load:g}/report.md)" for load in runs]
    path = out / "report.md"
    path.write_text(strip_paths("\n".join(parts)) + "\n", encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    args = build_sweep_parser().parse_args(argv)
    try:
        names, trace, options = prepare(args)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    if not args.out:
        print("--out: a folder for the sweep's report is needed", file=sys.stderr)
        return 2
    if args.cached_only and not args.results:
        print("--cached-only: give the folder of the replays with --results", file=sys.stderr)
        return 2
    for note in trace.notes:
        print(f"trace: {note}", file=sys.stderr)
    runs: dict[float, Comparison] = {}
    notes = list(trace.notes)
    for load in args.loads:
        print(f"load factor {load:g}", file=sys.stderr)
        if args.results:
            try:
                runs[load] = cached_compare(
                    trace,
                    names,
                    options,
                    load_factor=load,
                    results=args.results,
                    limit=args.limit,
                    progress=not args.quiet,
                    cached_only=args.cached_only,
                )
            except UsageError as exc:
                print(exc, file=sys.stderr)
                return 2
            missing = [n for n in names if n not in runs[load].results]
            if missing:
                notes.append(f"L = {load:g}: no replay of {', '.join(missing)} (--cached-only)")
        else:
            runs[load] = compare(trace, names, options, load_factor=load, progress=not args.quiet)
    label = trace_label(args.trace, trace, seed=args.seed)
    argv = argv if argv is not None else sys.argv[1:]
    path = write_sweep(
        args.out,
        runs,
        title=f"{label}: {len(trace.jobs):,} jobs",
        notes=notes,
        command=command_line("python -m scheduler.simulator.sweep", argv),
        tenant_guarantees=guarantees(trace),
        plots=not args.no_plots,
    )
    print(sweep_table({load: c.summaries for load, c in runs.items()}))
    print(f"\nreport: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
