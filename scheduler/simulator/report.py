"""The report of a comparison: Markdown tables and PNG plots in one folder.

matplotlib is imported here only, and only when plots are drawn, so the simulator itself runs
without it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

from scheduler.simulator.engine import Result
from scheduler.simulator.metrics import Summary, format_seconds, step_average, step_peak

# (column heading, how a policy's summary fills it)
Columns = tuple[tuple[str, Callable[[Summary], str]], ...]

SUMMARY_COLUMNS: Columns = (
    ("mean JCT (s)", lambda s: format_seconds(s.mean_jct_s)),
    ("median JCT (s)", lambda s: format_seconds(s.median_jct_s)),
    ("p99 JCT (s)", lambda s: format_seconds(s.p99_jct_s)),
    ("mean queue (s)", lambda s: format_seconds(s.mean_queue_s)),
    ("p99 queue (s)", lambda s: format_seconds(s.p99_queue_s)),
    ("waited", lambda s: _pct(s.waited_share)),
    ("makespan (d)", lambda s: f"{s.makespan_s / 86400:.2f}"),
    ("util", lambda s: _pct(s.utilization)),
    ("preempt", lambda s: f"{s.preemptions:,}"),
    ("GPU-h lost", lambda s: f"{s.preempted_gpu_hours_lost:,.1f}"),
    ("max rho", lambda s: _num(s.max_rho)),
    ("Jain(rho)", lambda s: _num(s.jain_rho)),
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


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{100 * x:.1f} %"


def _num(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3f}"


def summary_table(summaries: Sequence[Summary], *, power: bool = False) -> str:
    """Policies x metrics, as a Markdown table."""
    columns = SUMMARY_COLUMNS + (POWER_COLUMNS if power else ())
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


def write_report(
    out_dir: Path | str,
    summaries: Sequence[Summary],
    results: dict[str, Result],
    *,
    title: str,
    notes: Sequence[str] = (),
    command: str = "",
    plots: bool = True,
) -> Path:
    """Write report.md (and the plots it shows) into ``out_dir``; returns the report's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    power = any(s.power_budget_w is not None for s in summaries)
    images = _plots(out, summaries, results, power=power) if plots else []
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
        "(max over tenants; <= 1: nobody worse off). Energy from the power model over every GPU "
        "(idle ones included).",
        "",
        "## Per tenant (mean queue s / mean JCT s / rho)",
        "",
        tenant_table(summaries),
        "",
    ]
    if images:
        parts += ["## Plots", ""] + [f"![{caption}]({name})\n" for name, caption in images]
    path = out / "report.md"
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def _plots(
    out: Path, summaries: Sequence[Summary], results: dict[str, Result], *, power: bool
) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    images = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in summaries:
        jct = sorted(max(o.jct_s, 1.0) for o in results[s.policy].outcomes)
        if jct:
            ax.plot(jct, [(i + 1) / len(jct) for i in range(len(jct))], label=s.policy)
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (s)")
    ax.set_ylabel("share of jobs")
    ax.set_title("JCT CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "jct_cdf.png", dpi=110)
    plt.close(fig)
    images.append(("jct_cdf.png", "JCT CDF per policy"))

    tenants = []
    for s in summaries:
        for t in s.tenants:
            if t.tenant not in tenants:
                tenants.append(t.tenant)
    fig, ax = plt.subplots(figsize=(max(7, 0.8 * len(tenants)), 4.5))
    width = 0.8 / max(len(summaries), 1)
    for k, s in enumerate(summaries):
        by = {t.tenant: t.mean_queue_s for t in s.tenants}
        xs = [i + k * width for i in range(len(tenants))]
        # A log axis cannot show 0; 0.1 s stands for "never waited".
        ax.bar(xs, [max(by.get(t, 0.0), 0.1) for t in tenants], width, label=s.policy)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(tenants))], tenants, rotation=45)
    ax.set_yscale("log")
    ax.set_ylabel("mean queueing delay (s, 0.1 = none)")
    ax.set_title("Queueing delay per tenant")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "queue_per_tenant.png", dpi=110)
    plt.close(fig)
    images.append(("queue_per_tenant.png", "mean queueing delay per tenant and policy"))

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for s in summaries:
        r = results[s.policy]
        if not r.timeline_t_s:
            continue
        start, end = r.first_submit_s, r.first_submit_s + s.makespan_s
        bucket = max((end - start) / 400, 60.0)
        mids, busy = step_average(r.timeline_t_s, r.timeline_busy_gpus, start, end, bucket)
        ax.plot(
            [(m - start) / 86400 for m in mids],
            [100 * b / r.total_gpus for b in busy],
            label=s.policy,
            lw=1,
        )
    ax.set_xlabel("days since the first submit")
    ax.set_ylabel("GPUs busy (%)")
    ax.set_title("GPU utilization over time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "utilization.png", dpi=110)
    plt.close(fig)
    images.append(("utilization.png", "GPU utilization over time"))

    if power:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        budget = None
        for s in summaries:
            r = results[s.policy]
            if not r.timeline_t_s:
                continue
            budget = s.power_budget_w or budget
            start, end = r.first_submit_s, r.first_submit_s + s.makespan_s
            bucket = max((end - start) / 400, 60.0)
            mids, peaks = step_peak(r.timeline_t_s, r.timeline_power_w, start, end, bucket)
            ax.plot([(m - start) / 86400 for m in mids], [p / 1000 for p in peaks], label=s.policy)
        if budget:
            ax.axhline(budget / 1000, color="red", ls="--", label="budget")
        ax.set_xlabel("days since the first submit")
        ax.set_ylabel("pool draw, peak per interval (kW)")
        ax.set_title("Power against the budget")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "power.png", dpi=110)
        plt.close(fig)
        images.append(("power.png", "pool power draw against the budget"))
    return images
