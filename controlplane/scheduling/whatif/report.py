"""What a what-if shows: the structured summary stored in WhatIfRun.summary, and the report read
from it.

The summary holds raw figures (JSON; NaN, which JSON lacks, stored as null). Everything shown is
formatted from it, once: ``report_of`` turns a stored summary into a Report, the title, lists and
tables (cells already formatted) that the web page renders with its templates and that
``Report.markdown`` writes for the command line and the download. So a page, a download and the
command's output show the same figures in the same words.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from controlplane.scheduling.whatif.history import Cluster
from controlplane.scheduling.whatif.params import PRODUCTION_PRESET, WhatIfParams
from controlplane.scheduling.whatif.replay import WhatIfOutcome
from scheduler.simulator.engine import Result
from scheduler.simulator.metrics import Summary, TenantMetrics
from scheduler.simulator.policies import preset
from scheduler.simulator.report import TABLE_COLUMNS, tenant_rows, write_report

EXPLANATION = (
    "JCT = finish - submit; queue = JCT - time holding GPUs (before the first start and after "
    "preemptions). The current-config row replays production's policy on today's quotas: its "
    "distance from what really happened is the simulator's error, to keep in mind when "
    "reading the what-if. rho = a tenant's mean JCT over its mean JCT under FIFO on static "
    "partitions of today's guarantees (max over tenants). Real energy counts the GPUs that "
    "ran jobs only; real peak power is not kept for past periods."
)

# The simulator's columns that mean something for what really happened too; the others
# (wall time, CPU time, events per second) measure a replay.
_SHARED_COLUMNS = (
    "mean JCT (s)",
    "median JCT (s)",
    "p99 JCT (s)",
    "mean queue (s)",
    "p99 queue (s)",
    "waited",
    "makespan (d)",
    "util",
    "preempt",
    "GPU-h lost",
    "max rho",
    "jobs",
)


def _fixed(value: float, scale: float = 1.0, digits: int = 1) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value / scale:,.{digits}f}"


COLUMNS = tuple(c for c in TABLE_COLUMNS if c[0] in _SHARED_COLUMNS) + (
    ("energy (kWh)", lambda s: _fixed(s.energy_j, 3.6e6)),
    ("peak (kW)", lambda s: _fixed(s.peak_power_w, 1000.0)),
    ("over budget (s)", lambda s: _fixed(s.over_budget_s, digits=0)),
)


# --- the structured summary ---------------------------------------------------------------------


def summary_json(outcome: WhatIfOutcome) -> dict:
    """What WhatIfRun.summary stores: every row's figures, what changes, and the notes."""
    return {
        "rows": [_summary_dict(s) for s in outcome.summaries],
        "changes": describe_changes(outcome.cluster, outcome.params),
        "notes": outcome.history_notes + _result_notes(outcome.results),
    }


def describe_changes(cluster: Cluster, params: WhatIfParams) -> list[str]:
    """What the what-if changes, in words, with the current values."""
    lines = []
    if params.policy != PRODUCTION_PRESET:
        lines.append(
            f"policy: {PRODUCTION_PRESET} -> {params.policy} ({preset(params.policy).description})"
        )
    tenants = {t.name: t for t in cluster.tenants}
    for name, weight in sorted(params.weights.items()):
        lines.append(f"{name}: weight {tenants[name].weight:g} -> {weight:g}")
    for q in params.quotas:
        old = next((x for x in tenants[q.tenant].quotas if x.gpu_type == q.gpu_type), None)
        was = f"{old.guaranteed_gpus}/{old.limit_gpus}" if old else "none"
        lines.append(
            f"{q.tenant}: quota {q.gpu_type or 'any type'} (guaranteed/limit GPUs) {was} -> "
            f"{q.guaranteed_gpus}/{q.limit_gpus}"
        )
    pools = {p.name: p for p in cluster.pools}
    for name, budget in sorted(params.power_budgets_w.items()):
        old_w = pools[name].power_budget_w
        lines.append(f"pool {name}: power budget {_watts(old_w)} -> {_watts(budget)}")
    return lines or ["nothing: the current config, replayed"]


def _watts(value: float | None) -> str:
    return "none" if value is None else f"{value:,.0f} W"


def _result_notes(results: dict[str, Result]) -> list[str]:
    notes = []
    for label, r in results.items():
        if r.unfinished_job_ids:
            notes.append(
                f"{label}: {len(r.unfinished_job_ids):,} jobs never started (larger than what "
                "their tenant may use, or of a GPU type the cluster no longer has)."
            )
    return notes


def _summary_dict(s: Summary) -> dict:
    def clean(value):
        if isinstance(value, float) and math.isnan(value):
            return None
        if isinstance(value, tuple):
            return [clean(v) for v in value]
        if dataclasses.is_dataclass(value):
            return {f.name: clean(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return value

    return clean(s)


def summaries_from_json(rows: Sequence[dict]) -> list[Summary]:
    """The stored rows as the simulator's Summaries again, NaN where null was stored."""
    return [
        _from_dict(
            Summary,
            {**row, "tenants": tuple(_from_dict(TenantMetrics, t) for t in row.get("tenants", ()))},
        )
        for row in rows
    ]


def _from_dict(cls, data: dict):
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in data and f.default is not dataclasses.MISSING:
            # A figure added after the row was stored: the field's own "not recorded".
            values[f.name] = f.default
            continue
        value = data.get(f.name)
        # Only a plain float field stores NaN as null; an optional one (a power budget) means it.
        if value is None and f.type in ("float", float):
            value = math.nan
        values[f.name] = value
    return cls(**values)


# --- the report read from it --------------------------------------------------------------------


@dataclass(frozen=True)
class Table:
    """A table as shown: a row's first cell names it, the other cells are right-aligned figures."""

    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]

    def markdown(self) -> str:
        lines = [
            "| " + " | ".join(self.columns) + " |",
            "|---|" + "---:|" * (len(self.columns) - 1),
        ]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines)


@dataclass(frozen=True)
class Report:
    title: str
    changes: list[str]
    notes: list[str]
    runs: Table  # the rows x metrics
    tenants: Table  # per tenant: mean queue s / mean JCT s / rho of every row
    explanation: str = EXPLANATION

    def markdown(self) -> str:
        parts = [
            f"# {self.title}",
            "",
            "## What changes",
            "",
            *[f"- {c}" for c in self.changes],
            "",
            "## History",
            "",
            *[f"- {n}" for n in self.notes],
            "",
            "## Simulated vs what really happened",
            "",
            self.runs.markdown(),
            "",
            self.explanation,
            "",
            "## Per tenant (mean queue s / mean JCT s / rho)",
            "",
            self.tenants.markdown(),
            "",
        ]
        return "\n".join(parts)


def title(params: WhatIfParams) -> str:
    return f"What-if on {params.since:%Y-%m-%d %H:%M} to {params.until:%Y-%m-%d %H:%M} UTC"


def report_of(params: WhatIfParams, summary: dict) -> Report:
    """The report of a stored summary (what summary_json wrote) for the run of params."""
    summaries = summaries_from_json(summary.get("rows", ()))
    return Report(
        title=title(params),
        changes=list(summary.get("changes", ())),
        notes=list(summary.get("notes", ())),
        runs=runs_table(summaries),
        tenants=tenant_table(summaries),
    )


def runs_table(summaries: Sequence[Summary]) -> Table:
    return Table(
        columns=("run", *(name for name, _ in COLUMNS)),
        rows=tuple((s.policy, *(f(s) for _, f in COLUMNS)) for s in summaries),
    )


def tenant_table(summaries: Sequence[Summary]) -> Table:
    """Per tenant: jobs, and for every row mean queue / mean JCT / rho."""
    columns, rows = tenant_rows(summaries)
    return Table(columns=columns, rows=tuple(rows))


def write_folder(outcome: WhatIfOutcome, out_dir: Path | str, *, plots: bool = True) -> Path:
    """report.md and its plots in out_dir; returns the report's path."""
    # The simulator's report draws the plots; its own tables are replaced by ours, which leave
    # out what the real row cannot have (wall time, CPU time, events per second).
    path = write_report(
        Path(out_dir),
        outcome.summaries,
        outcome.results,
        title=title(outcome.params),
        plots=plots,
    )
    images = re.findall(r"^!\[[^\]]*\]\([^)]*\)$", path.read_text(encoding="utf-8"), re.M)
    text = report_of(outcome.params, summary_json(outcome)).markdown()
    if images:
        text += "\n## Plots\n\n" + "\n\n".join(images) + "\n"
    path.write_text(text, encoding="utf-8")
    return path
