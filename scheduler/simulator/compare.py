"""Run several policy presets over one trace and summarize them side by side."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TextIO

from scheduler.model import config_with
from scheduler.simulator.engine import (
    PlanFunction,
    Progress,
    Result,
    SimOptions,
    planner_with_memo,
    replay,
)
from scheduler.simulator.metrics import Summary, summarize
from scheduler.simulator.policies import (
    REFERENCE_PRESET,
    cluster_for,
    head_of_line,
    independent,
    preset,
)
from scheduler.simulator.trace import Trace, compress_arrivals


@dataclass
class Comparison:
    summaries: list[Summary]
    results: dict[str, Result]


def run_preset(
    trace: Trace,
    name: str,
    options: SimOptions,
    *,
    load_factor: float = 1.0,
    policy: PlanFunction | None = None,
    config_changes: Mapping[str, Any] | None = None,
) -> Result:
    """Replay ``trace`` (arrivals compressed by ``load_factor``) under the preset ``name``.

    ``config_changes``: fields of the preset's Config to set otherwise (a variant of it).
    """
    p = preset(name)
    config = config_with(p.config, config_changes) if config_changes else p.config
    jobs, nodes, tenants = cluster_for(trace, p.sharing)
    jobs = compress_arrivals(jobs, load_factor)
    opts = replace(options, oracle=p.oracle, partitioned_tenants=independent(trace, p.sharing))
    if p.strict:
        if policy is None:
            policy = planner_with_memo(sentences=options.on_cycle is not None)
        policy = head_of_line(policy)
    return replay(jobs, nodes, tenants, config, opts, policy=policy)


def compare(
    trace: Trace,
    names: Sequence[str],
    options: SimOptions,
    *,
    load_factor: float = 1.0,
    policy: PlanFunction | None = None,
    reference: bool = True,
    progress: bool = False,
) -> Comparison:
    """Replay every preset in ``names``; with ``reference``, FIFO on static partitions is run too
    (first, and shown only if asked for) so that every policy gets its finish-time fairness."""
    for n in names:
        preset(n)  # an unknown name fails before any replay starts
    order = list(dict.fromkeys(names))
    runs = ([REFERENCE_PRESET] if reference and REFERENCE_PRESET not in order else []) + order
    results: dict[str, Result] = {}
    for name in runs:
        opts = replace(options, progress=progress_bar(name) if progress else options.progress)
        results[name] = run_preset(trace, name, opts, load_factor=load_factor, policy=policy)
        if progress:
            sys.stderr.write("\n")
    ref = results.get(REFERENCE_PRESET) if reference else None
    summaries = [summarize(n, results[n], ref) for n in order]
    return Comparison(summaries, {n: results[n] for n in order})


def progress_bar(
    label: str, width: int = 30, stream: TextIO | None = None
) -> Callable[[Progress], None]:
    """A plain-text progress bar on stderr, redrawn at most five times a second."""
    out = stream or sys.stderr
    last = [0.0]

    def show(p: Progress) -> None:
        now = time.monotonic()
        if now - last[0] < 0.2 and p.jobs_done < p.jobs_total:
            return
        last[0] = now
        share = p.jobs_done / p.jobs_total if p.jobs_total else 1.0
        filled = int(width * share)
        out.write(
            f"\r{label:>12} [{'#' * filled}{'.' * (width - filled)}] {100 * share:5.1f}% "
            f"{p.jobs_done:,}/{p.jobs_total:,} jobs, {p.plan_calls:,} plans, {p.wall_s:6.1f} s"
        )
        out.flush()

    return show
