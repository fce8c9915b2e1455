"""The replays of a what-if: the period's history through the simulator, on today's cluster and
on the cluster as the request changes it, each run through the production ``plan``."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from django.conf import settings

from controlplane.scheduling.cycle import scheduler_config
from controlplane.scheduling.whatif.history import Cluster, load_cluster, load_history
from controlplane.scheduling.whatif.params import (
    PRODUCTION_PRESET,
    QuotaChange,
    WhatIfError,
    WhatIfParams,
)
from scheduler import model as m
from scheduler.simulator.engine import Progress, Result, SimOptions, replay
from scheduler.simulator.metrics import Summary, summarize
from scheduler.simulator.policies import REFERENCE_PRESET, Sharing, preset

# The rows of a what-if, in the order they are shown.
REAL_LABEL = "what really happened"
CURRENT_LABEL = "simulated: current config"
WHATIF_LABEL = "simulated: what-if"
# A replay reports its progress every this many events at the least (about 3 events a job).
_PROGRESS_EVERY_EVENTS = 100


@dataclass
class WhatIfOutcome:
    """What a what-if found: each row's figures, and what they were computed from."""

    params: WhatIfParams
    cluster: Cluster  # today's, before the request's changes
    history_notes: list[str]
    summaries: list[Summary]  # one per row, labelled with the row's label
    results: dict[str, Result]  # row label -> the run (its timelines draw the plots)


def changed_cluster(cluster: Cluster, params: WhatIfParams) -> Cluster:
    """The cluster with the request's weights, quotas and power budgets in place."""
    by_tenant: dict[str, list[QuotaChange]] = defaultdict(list)
    for q in params.quotas:
        by_tenant[q.tenant].append(q)
    tenants = []
    for t in cluster.tenants:
        quotas = {q.gpu_type: q for q in t.quotas}
        for q in by_tenant.get(t.name, ()):
            quotas[q.gpu_type] = m.Quota(q.gpu_type, q.guaranteed_gpus, q.limit_gpus)
        tenants.append(
            replace(
                t,
                weight=params.weights.get(t.name, t.weight),
                quotas=tuple(quotas[k] for k in sorted(quotas)),
            )
        )
    pools = tuple(
        replace(p, power_budget_w=params.power_budgets_w[p.name])
        if p.name in params.power_budgets_w
        else p
        for p in cluster.pools
    )
    return replace(cluster, tenants=tuple(tenants), pools=pools)


def _static(tenants: Sequence[m.Tenant]) -> tuple[m.Tenant, ...]:
    """Static partitions where the control plane has no node owners: a limit of the guarantee."""
    return tuple(
        replace(t, quotas=tuple(replace(q, limit_gpus=q.guaranteed_gpus) for q in t.quotas))
        for t in tenants
    )


def _config_for(policy: str) -> m.Config:
    return scheduler_config() if policy == PRODUCTION_PRESET else preset(policy).config


def run_whatif(
    params: WhatIfParams, *, progress: Callable[[float], None] | None = None
) -> WhatIfOutcome:
    """Replay the period's history under params; progress gets the fraction done (0..1)."""
    cluster = load_cluster()
    history = load_history(params.since, params.until, cluster)
    if not history.jobs:
        raise WhatIfError(
            "--since/--until",
            f"no finished job was submitted from {params.since.isoformat()} "
            f"to {params.until.isoformat()}",
        )
    changed = changed_cluster(cluster, params)
    options = SimOptions(
        cycle_s=params.cycle_s or settings.SCHEDULER_CYCLE_INTERVAL_S,
        debounce_s=settings.SCHEDULER_DEBOUNCE_S,
        progress_every_events=max(_PROGRESS_EVERY_EVENTS, 3 * len(history.jobs) // 50),
    )
    # (label, cluster, preset name); the reference comes first: every row's rho needs it.
    runs = [("reference", cluster, REFERENCE_PRESET), (CURRENT_LABEL, cluster, PRODUCTION_PRESET)]
    if params.changes_anything:
        runs.append((WHATIF_LABEL, changed, params.policy))
    results: dict[str, Result] = {}
    for i, (label, on, name) in enumerate(runs):
        p = preset(name)
        tenants = _static(on.tenants) if p.sharing is Sharing.STATIC else on.tenants
        stage = _stage_progress(progress, i, len(runs))
        results[label] = replay(
            history.jobs,
            on.nodes,
            tenants,
            _config_for(name),
            replace(options, oracle=p.oracle, progress=stage),
            pools=on.pools,
        )
    reference = results.pop("reference")
    results = {REAL_LABEL: history.real, **results}
    summaries = [summarize(label, r, reference) for label, r in results.items()]
    if progress is not None:
        progress(1.0)
    return WhatIfOutcome(params, cluster, history.notes, summaries, results)


def _stage_progress(
    progress: Callable[[float], None] | None, index: int, stages: int
) -> Callable[[Progress], None] | None:
    if progress is None:
        return None

    def report(p: Progress) -> None:
        done = p.jobs_done / p.jobs_total if p.jobs_total else 1.0
        progress(min(1.0, (index + done) / stages))

    return report
