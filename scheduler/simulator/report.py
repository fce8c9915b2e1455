"""The report of a comparison: Markdown tables and PNG plots in one folder.

What it shows (see ``metrics`` for the definitions): policies x metrics (mean / p99 JCT and
queue, max rho, preempted jobs beside preemptions per victim and GPU-hours lost, wall and CPU
seconds of each replay), the figures per job class and per tenant, CDFs of JCT, queueing delay
and per-tenant rho, and per tenant its queue length and the GPUs it holds against its guarantee
over time. Colours and ties follow ``plots``. The title names the trace file; every text written
has its absolute paths cut to the file's name (``strip_paths``), so a report says nothing of the
machine it was made on.

matplotlib is imported only when plots are drawn, so the simulator itself runs without it.
"""

from __future__ import annotations

import math
import os
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from scheduler.simulator.engine import Result
from scheduler.simulator.metrics import (
    DURATION_BINS,
    GPU_BINS,
    ClassMetrics,
    Summary,
    class_metrics,
    format_seconds,
    step_average,
    step_peak,
    tenant_series,
)
from scheduler.simulator.trace import Trace

# (column heading, how a policy's summary fills it)
Columns = tuple[tuple[str, Callable[[Summary], str]], ...]


def _victims(s: Summary) -> str:
    if not s.preempted_jobs:
        return "-"
    return (
        f"{s.preemptions_per_victim_mean:.1f} / {s.preemptions_per_victim_p99:.0f} / "
        f"{s.preemptions_per_victim_max}"
    )


# The simulator's table of policies x metrics.
TABLE_COLUMNS: Columns = (
    ("mean JCT (s)", lambda s: format_seconds(s.mean_jct_s)),
    ("median JCT (s)", lambda s: format_seconds(s.median_jct_s)),
    ("p99 JCT (s)", lambda s: format_seconds(s.p99_jct_s)),
    ("mean queue (s)", lambda s: format_seconds(s.mean_queue_s)),
    ("p99 queue (s)", lambda s: format_seconds(s.p99_queue_s)),
    ("waited", lambda s: _pct(s.waited_share)),
    ("makespan (d)", lambda s: f"{s.makespan_s / 86400:.2f}"),
    ("util", lambda s: _pct(s.utilization)),
    ("max rho", lambda s: _num(s.max_rho)),
    ("preempt", lambda s: f"{s.preemptions:,}"),
    ("preempted jobs", lambda s: f"{s.preempted_jobs:,}"),
    ("preempt / victim (mean / p99 / max)", _victims),
    ("GPU-h lost", lambda s: f"{s.preempted_gpu_hours_lost:,.1f}"),
    ("jobs", lambda s: f"{s.jobs:,}" + (f" (+{s.unfinished} unfinished)" if s.unfinished else "")),
    ("wall (s)", lambda s: f"{s.wall_s:.1f}"),
    ("CPU (s)", lambda s: f"{s.cpu_s:.1f}"),
    ("events/s", lambda s: f"{s.events_per_s:,.0f}"),
)
POWER_COLUMNS: Columns = (
    ("energy (MWh)", lambda s: f"{s.energy_j / 3.6e9:,.2f}"),
    ("peak (kW)", lambda s: f"{s.peak_power_w / 1000:,.1f}"),
    ("over budget (s)", lambda s: f"{s.over_budget_s:,.0f}"),
)
# At most this many tenants get a panel of their own over time (the busiest ones).
MAX_TENANT_PANELS = 24


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{100 * x:.1f} %"


def _num(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3f}"


def summary_table(summaries: Sequence[Summary], *, power: bool = False) -> str:
    """Policies x metrics, as a Markdown table."""
    columns = TABLE_COLUMNS + (POWER_COLUMNS if power else ())
    lines = [
        "| policy | " + " | ".join(name for name, _ in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for s in summaries:
        lines.append(f"| {s.policy} | " + " | ".join(f(s) for _, f in columns) + " |")
    return "\n".join(lines)


def tenant_rows(
    summaries: Sequence[Summary],
) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """Per tenant: jobs, and for every run mean queue / mean JCT / rho; (columns, rows) of
    formatted cells, for the Markdown below and for what-if's page alike."""
    tenants: list[str] = []
    for s in summaries:
        for t in s.tenants:
            if t.tenant not in tenants:
                tenants.append(t.tenant)
    columns = ("tenant", "jobs", *(f"{s.policy} queue / JCT / rho" for s in summaries))
    rows = []
    for name in tenants:
        cells = []
        jobs = ""
        for s in summaries:
            row = next((t for t in s.tenants if t.tenant == name), None)
            if row is None:
                cells.append("-")
                continue
            jobs = jobs or f"{row.jobs:,}"
            cells.append(
                f"{format_seconds(row.mean_queue_s)} / {row.mean_jct_s:,.0f} / {_num(row.rho)}"
            )
        rows.append((name, jobs, *cells))
    return columns, rows


def tenant_table(summaries: Sequence[Summary]) -> str:
    """Per tenant: jobs, and for every policy mean queue / mean JCT / rho."""
    columns, rows = tenant_rows(summaries)
    lines = ["| " + " | ".join(columns) + " |", "|---|---:|" + "---:|" * len(summaries)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def class_rows(
    summaries: Sequence[Summary], results: Mapping[str, Result]
) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """Per job class (GPUs x run time): jobs, and for every policy mean JCT / mean queue / p99
    queue; (columns, rows), the last row all jobs."""
    per_policy: dict[str, dict[tuple[str, str], ClassMetrics]] = {}
    order: list[tuple[str, str]] = []
    for s in summaries:
        rows = class_metrics(results[s.policy].outcomes)
        per_policy[s.policy] = {(r.gpu_bin, r.duration_bin): r for r in rows}
        order += [
            (r.gpu_bin, r.duration_bin) for r in rows if (r.gpu_bin, r.duration_bin) not in order
        ]
    # Keep the bins' order whatever policy first had a class.
    rank = {
        (g[0], d[0]): i * len(DURATION_BINS) + k
        for i, g in enumerate(GPU_BINS)
        for k, d in enumerate(DURATION_BINS)
    }
    order.sort(key=rank.__getitem__)
    columns = (
        "GPUs",
        "run time",
        "jobs",
        *(f"{s.policy} JCT / queue / p99 queue" for s in summaries),
    )
    out = []
    for key in order:
        cells = []
        jobs = ""
        for s in summaries:
            row = per_policy[s.policy].get(key)
            if row is None:
                cells.append("-")
                continue
            jobs = jobs or f"{row.jobs:,}"
            cells.append(
                f"{row.mean_jct_s:,.0f} / {format_seconds(row.mean_queue_s)} / "
                f"{format_seconds(row.p99_queue_s)}"
            )
        out.append((key[0], key[1], jobs, *cells))
    total = [
        f"{s.mean_jct_s:,.0f} / {format_seconds(s.mean_queue_s)} / {format_seconds(s.p99_queue_s)}"
        for s in summaries
    ]
    out.append(("all", "all", f"{summaries[0].jobs:,}" if summaries else "0", *total))
    return columns, out


def class_table(summaries: Sequence[Summary], results: Mapping[str, Result]) -> str:
    """Per job class: jobs, and for every policy mean JCT / mean queue / p99 queue (seconds)."""
    columns, rows = class_rows(summaries, results)
    lines = ["| " + " | ".join(columns) + " |", "|---|---|---:|" + "---:|" * len(summaries)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


CLASS_EXPLANATION = (
    "Job class = GPUs requested x the trace's run time (the same class under every policy): "
    "GPUs 1, 2-4, 5-8, > 8; run time < 10 min, 10 min - 1 h, 1 - 8 h, >= 8 h. Cells: mean JCT / "
    "mean queue / p99 queue, seconds; jobs = finished jobs of the class (under the first policy)."
)


# --- no machine's paths in what a report says ---------------------------------------------------

_ABSOLUTE_PATH = re.compile(r"(?<![\w.:/~-])(?:~|[A-Za-z]:)?(?:/[^\s/`'\"|()\[\]<>,;]+)+/?")


def strip_paths(text: str) -> str:
    """``text`` with every absolute path (``/a/b/c.csv``, ``~/x``) cut to its last part."""

    def name(match: re.Match[str]) -> str:
        path = match.group(0).rstrip("/")
        return path.rsplit("/", 1)[-1] or path

    return _ABSOLUTE_PATH.sub(name, text)


def trace_label(spec: str, trace: Trace | None = None, *, seed: int = 0) -> str:
    """The trace file a run read, by name only (``philly-jobs.csv``): what a report's title
    names; ``synthetic`` is named with its seed."""
    if spec == "synthetic":
        return f"synthetic (seed {seed})"
    if spec == "philly":
        return "philly-jobs.csv"
    if spec in ("alibaba", "alibaba-openb"):
        return "openb_pod_list_default.csv"
    path = Path(spec)
    if path.is_dir():
        for name in ("philly-jobs.csv", "openb_pod_list_default.csv"):
            if (path / name).exists():
                return name
    return path.name or (trace.name if trace else spec)


def command_line(program: str, argv: Sequence[str]) -> str:
    """The command as typed, its absolute paths made relative to the working folder where they
    lie under it, cut to their file's name otherwise."""
    cwd = os.getcwd()
    words = []
    for arg in argv:
        if os.path.isabs(arg):
            rel = os.path.relpath(arg, cwd)
            arg = rel if not rel.startswith("..") else os.path.basename(arg.rstrip("/"))
        words.append(shlex.quote(arg))
    return " ".join([program, *words])


def guarantees(trace: Trace) -> dict[str, int]:
    """Each tenant's guaranteed GPUs, for the per-tenant plots' guarantee line."""
    return {t.name: t.guaranteed_gpus for t in trace.tenants}


def write_report(
    out_dir: Path | str,
    summaries: Sequence[Summary],
    results: Mapping[str, Result],
    *,
    title: str,
    notes: Sequence[str] = (),
    command: str = "",
    plots: bool = True,
    guarantees: Mapping[str, int] | None = None,
) -> Path:
    """Write report.md (and the plots it shows) into ``out_dir``; returns the report's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    power = any(s.power_budget_w is not None for s in summaries)
    images: list[tuple[str, str]] = []
    ties: list[str] = []
    if plots:
        images, ties = _plots(out, summaries, results, power=power, guarantees=guarantees or {})
    parts = [f"# {title}", ""]
    if command:
        parts += ["```", command, "```", ""]
    if notes:
        parts += ["## Trace", ""] + [f"- {n}" for n in notes] + [""]
    budgets = {s.power_budget_w for s in summaries if s.power_budget_w is not None}
    if budgets:
        parts += [f"Pool power budget: {', '.join(f'{b:,.0f} W' for b in sorted(budgets))}.", ""]
    parts += [
        "## Policies x metrics",
        "",
        summary_table(summaries, power=True),
        "",
        "Queue = total time pending (start - submit, plus time requeued after preemptions). "
        "rho = a tenant's mean JCT over its mean JCT under FIFO on its own static partition "
        "(max over tenants; <= 1: nobody worse off). Preempted jobs = jobs preempted at least "
        "once; preempt / victim = preemptions per preempted job. Wall and CPU seconds are the "
        "replay's own. Energy from the power model over every GPU (idle ones included).",
        "",
        "## Per job class",
        "",
        class_table(summaries, results),
        "",
        CLASS_EXPLANATION,
        "",
        "## Per tenant (mean queue s / mean JCT s / rho)",
        "",
        tenant_table(summaries),
        "",
    ]
    if images:
        parts += ["## Plots", ""]
        if ties:
            parts += ["Drawn as one line (equal to 3 significant digits): " + "; ".join(ties), ""]
        parts += [f"![{caption}]({name})\n" for name, caption in images]
    path = out / "report.md"
    path.write_text(strip_paths("\n".join(parts)), encoding="utf-8")
    return path


def _plots(
    out: Path,
    summaries: Sequence[Summary],
    results: Mapping[str, Result],
    *,
    power: bool,
    guarantees: Mapping[str, int],
) -> tuple[list[tuple[str, str]], list[str]]:
    """Draw every figure; returns (file, caption) per figure and the ties, in words."""
    from scheduler.simulator import plots as pl

    images: list[tuple[str, str]] = []
    ties: list[str] = []

    def tied(figure: str, groups: Sequence[tuple[str, ...]]) -> None:
        for names in groups:
            if len(names) > 1:
                ties.append(f"{pl.tie_label(names)} ({figure})")

    names = [s.policy for s in summaries]
    groups = pl.cdf_figure(
        out / "jct_cdf.png",
        {n: [max(o.jct_s, 1.0) for o in results[n].outcomes] for n in names},
        xlabel="job completion time (s)",
        title="JCT CDF",
        xscale="log",
    )
    tied("JCT CDF", groups)
    images.append(("jct_cdf.png", "JCT CDF per policy"))

    groups = pl.cdf_figure(
        out / "queue_cdf.png",
        {n: [o.queue_s for o in results[n].outcomes] for n in names},
        xlabel="queueing delay (s, linear below 1 s)",
        title="Queueing delay CDF",
        xscale="symlog",
    )
    tied("queueing CDF", groups)
    images.append(("queue_cdf.png", "queueing delay CDF per policy"))

    rhos = {s.policy: [t.rho for t in s.tenants if not math.isnan(t.rho)] for s in summaries}
    if any(rhos.values()):
        groups = pl.cdf_figure(
            out / "rho_cdf.png",
            rhos,
            xlabel="rho of a tenant (mean JCT / its mean JCT alone on its partition)",
            title="Finish-time fairness: CDF of per-tenant rho (1 = as alone)",
            vline=1.0,
            step=True,
        )
        tied("rho CDF", groups)
        images.append(("rho_cdf.png", "CDF over tenants of rho per policy"))

    tenants: list[str] = []
    for s in summaries:
        for t in sorted(s.tenants, key=lambda t: -t.jobs):
            if t.tenant not in tenants:
                tenants.append(t.tenant)
    plt = pl.pyplot()
    fig, ax = plt.subplots(figsize=(max(7, 0.8 * len(tenants)), 4.5))
    by_policy = {s.policy: {t.tenant: t.mean_queue_s for t in s.tenants} for s in summaries}
    bar_groups = pl.tie_groups({n: [by_policy[n].get(t, 0.0) for t in tenants] for n in names})
    tied("queue per tenant", bar_groups)
    width = 0.8 / max(len(bar_groups), 1)
    for k, group in enumerate(bar_groups):
        by = by_policy[group[0]]
        # A log axis cannot show 0; 0.1 s stands for "never waited".
        ax.bar(
            [i + k * width for i in range(len(tenants))],
            [max(by.get(t, 0.0), 0.1) for t in tenants],
            width,
            label=pl.tie_label(group),
            color=pl.policy_color(group[0]),
        )
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(tenants))], tenants, rotation=45)
    ax.set_yscale("log")
    ax.set_ylabel("mean queueing delay (s, 0.1 = none)")
    ax.set_title("Queueing delay per tenant")
    ax.legend(fontsize=8)
    pl.save(fig, out / "queue_per_tenant.png")
    images.append(("queue_per_tenant.png", "mean queueing delay per tenant and policy"))

    timed = [s for s in summaries if results[s.policy].outcomes]
    if timed:
        start = min(results[s.policy].first_submit_s for s in timed)
        end = max(results[s.policy].first_submit_s + s.makespan_s for s in timed)
        if end > start:
            images += _tenant_figures(out, timed, results, tenants, start, end, guarantees, tied)

    xs: dict[str, list[float]] = {}
    ys: dict[str, list[float]] = {}
    for s in summaries:
        r = results[s.policy]
        if not r.timeline_t_s:
            continue
        start, end = r.first_submit_s, r.first_submit_s + s.makespan_s
        bucket = max((end - start) / 400, 60.0)
        mids, busy = step_average(r.timeline_t_s, r.timeline_busy_gpus, start, end, bucket)
        xs[s.policy] = [(m - start) / 86400 for m in mids]
        ys[s.policy] = [100 * b / r.total_gpus for b in busy]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    tied("utilization", pl.draw_lines(ax, xs, ys, lw=1))
    ax.set_xlabel("days since the first submit")
    ax.set_ylabel("GPUs busy (%)")
    ax.set_title("GPU utilization over time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    pl.save(fig, out / "utilization.png")
    images.append(("utilization.png", "GPU utilization over time"))

    if power:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        budget = None
        xs, ys = {}, {}
        for s in summaries:
            r = results[s.policy]
            if not r.timeline_t_s:
                continue
            budget = s.power_budget_w or budget
            start, end = r.first_submit_s, r.first_submit_s + s.makespan_s
            bucket = max((end - start) / 400, 60.0)
            mids, peaks = step_peak(r.timeline_t_s, r.timeline_power_w, start, end, bucket)
            xs[s.policy] = [(m - start) / 86400 for m in mids]
            ys[s.policy] = [p / 1000 for p in peaks]
        tied("power", pl.draw_lines(ax, xs, ys))
        if budget:
            ax.axhline(budget / 1000, color="red", ls="--", label="budget")
        ax.set_xlabel("days since the first submit")
        ax.set_ylabel("pool draw, peak per interval (kW)")
        ax.set_title("Power against the budget")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        pl.save(fig, out / "power.png")
        images.append(("power.png", "pool power draw against the budget"))
    return images, ties


def _tenant_figures(
    out: Path,
    summaries: Sequence[Summary],
    results: Mapping[str, Result],
    tenants: Sequence[str],
    start: float,
    end: float,
    guarantees: Mapping[str, int],
    tied: Callable[[str, Sequence[tuple[str, ...]]], None],
) -> list[tuple[str, str]]:
    """Per tenant (a panel each, the busiest first): jobs queued, and GPUs held against the
    guarantee, over time, a line per policy."""
    from scheduler.simulator import plots as pl

    shown = list(tenants[:MAX_TENANT_PANELS])
    bucket = max((end - start) / 200, 60.0)
    series = {s.policy: tenant_series(results[s.policy], start, end, bucket) for s in summaries}
    images = []
    for attr, file, ylabel, caption in (
        ("queued_jobs", "tenant_queue.png", "jobs queued", "queue length per tenant over time"),
        (
            "held_gpus",
            "tenant_gpus.png",
            "GPUs held",
            "GPUs held per tenant over time, against its guarantee (dashed)",
        ),
    ):
        fig, axes = pl.grid(len(shown))
        legend: dict[str, object] = {}
        for ax, tenant in zip(axes, shown, strict=True):
            xs: dict[str, list[float]] = {}
            ys: dict[str, list[float]] = {}
            for name, per_tenant in series.items():
                row = per_tenant.get(tenant)
                if row is None:
                    continue
                xs[name] = [(m - start) / 86400 for m in row.mids_s]
                ys[name] = list(getattr(row, attr))
            tied(f"{tenant} {ylabel}", pl.draw_lines(ax, xs, ys, lw=1))
            if attr == "held_gpus" and tenant in guarantees:
                ax.axhline(guarantees[tenant], color="black", ls="--", lw=0.8)
            ax.set_title(tenant, fontsize=9)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
        if axes:
            axes[0].set_ylabel(ylabel, fontsize=8)
            axes[-1].set_xlabel("days since the first submit", fontsize=8)
            # Every label of every panel: policies tied in one panel may differ in another.
            for ax in axes:
                for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
                    legend.setdefault(label, handle)
            ncol = min(len(legend), 4)
            fig.legend(
                list(legend.values()), list(legend), loc="upper center", ncol=ncol, fontsize=8
            )
            fig.suptitle(caption, y=0.0, va="bottom", fontsize=9)
        # Fixed margins (tight_layout measures every panel's text: seconds for a big grid).
        height = fig.get_figheight()
        legend_rows = math.ceil(len(legend) / 4)
        fig.subplots_adjust(
            left=0.06,
            right=0.98,
            top=1 - (0.35 + 0.22 * legend_rows) / height,
            bottom=0.75 / height,
            hspace=0.45,
            wspace=0.22,
        )
        fig.savefig(out / file, dpi=100)
        pl.pyplot().close(fig)
        note = "" if len(shown) == len(tenants) else f" (the {len(shown)} busiest tenants)"
        images.append((file, caption + note))
    return images
