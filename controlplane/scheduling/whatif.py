"""What-if on real history: replay the cluster's own finished jobs under a changed config.

The jobs of a period (their submit times, sizes, GPU types, tenants, users, names, priorities,
and how long their final attempt really ran) become the simulator's trace; the cluster's current
nodes, tenants, quotas and pools become its cluster. The replay goes through the production
``plan`` (scheduler.simulator.engine.replay), and its figures are set next to the same figures
computed from what really happened, read from the Job and JobAttempt rows.

Definitions, so that the rows compare:

- A job's run time is its final attempt's started_at..finished_at (the successful attempt for a
  job that SUCCEEDED; the one that failed for a FAILED job, which held its GPUs all the same).
  Cancelled jobs, and jobs that never started, are left out (the notes count them): when a user
  would have cancelled is not something a replay can know.
- What really happened: JCT = the final attempt's finished_at - submitted_at; the time a job held
  GPUs is the sum over its attempts of created_at (admission: the allocation is made then) to
  finished_at; queue = JCT - held, as in scheduler.simulator.metrics. So container start-up time
  counts as held in the real row and is not simulated (the replay's run time starts at its
  container's start): the real JCT is longer by that much.
- Real preemptions are the attempts stopped by preemption or a drain; their GPU-hours (lost
  unless the job checkpoints) stand where the simulator puts its restart cost.
- Real energy is what the GPUs' NVML counters booked to the attempts, busy GPUs only; the
  simulator's counts every GPU, idle ones at idle draw. Real peak power and time over budget are
  not known for past periods (telemetry is kept for a day) and show as "-".
- Every current node is taken as schedulable with every GPU healthy: a what-if asks what the
  cluster could do, not what it can do while a node is cordoned today.
- Predictions start from an empty history (the simulator learns from the replayed jobs only).

The rows: what really happened; the simulated current config (production's policy, current
quotas, weights and budgets), which says how far the simulator is from reality; and the what-if.
Finish-time fairness rho is against FIFO on static partitions of the current quotas for all rows.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from django.conf import settings
from django.utils import timezone

from controlplane.cluster.models import Pool
from controlplane.jobs.models import PRIORITY_VALUE, AttemptState, Job, JobAttempt, JobState
from controlplane.scheduling.cycle import scheduler_config
from controlplane.scheduling.loader import load_nodes, load_tenants, raw_rows, unix_s
from scheduler import model as m
from scheduler.simulator.engine import JobOutcome, Progress, Result, SimOptions, replay
from scheduler.simulator.metrics import Summary, summarize
from scheduler.simulator.policies import PRESETS, REFERENCE_PRESET, Sharing, preset
from scheduler.simulator.report import SUMMARY_COLUMNS, tenant_table, write_report
from scheduler.simulator.trace import TraceJob

# The policy production runs: the preset "ours" is replayed with production's own config.
PRODUCTION_PRESET = "ours"
ANY_TYPE_WORDS = ("any", "*", "")
REAL_LABEL = "what really happened"
CURRENT_LABEL = "simulated: current config"
WHATIF_LABEL = "simulated: what-if"
# Attempts stopped so that their GPUs go to others.
_PREEMPTED_STOP_REASONS = ("preempted", "drained")
_FINISHED_RUN_STATES = (JobState.SUCCEEDED, JobState.FAILED)
# A replay reports its progress every this many events at the least (about 3 events a job).
_PROGRESS_EVERY_EVENTS = 100


class WhatIfError(ValueError):
    """A what-if request that cannot run, naming the argument at fault."""

    def __init__(self, argument: str, message: str):
        self.argument = argument
        self.message = message
        super().__init__(f"{argument}: {message}")


# --- the request --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QuotaChange:
    tenant: str
    gpu_type: str  # m.ANY_GPU_TYPE for the sum over all types
    guaranteed_gpus: int
    limit_gpus: int

    def describe(self) -> str:
        return f"{self.tenant}:{self.gpu_type or 'any'}={self.guaranteed_gpus}:{self.limit_gpus}"


@dataclass(frozen=True)
class WhatIfParams:
    since: dt.datetime
    until: dt.datetime
    policy: str = PRODUCTION_PRESET
    weights: dict[str, float] = field(default_factory=dict)
    quotas: tuple[QuotaChange, ...] = ()
    power_budgets_w: dict[str, float | None] = field(default_factory=dict)  # None: no budget
    cycle_s: float | None = None  # None: the production loop's interval

    @property
    def changes_anything(self) -> bool:
        return bool(
            self.policy != PRODUCTION_PRESET or self.weights or self.quotas or self.power_budgets_w
        )

    def to_json(self) -> dict:
        return {
            "since": self.since.isoformat(),
            "until": self.until.isoformat(),
            "policy": self.policy,
            "weights": dict(self.weights),
            "quotas": [dataclasses.asdict(q) for q in self.quotas],
            "power_budgets_w": dict(self.power_budgets_w),
            "cycle_s": self.cycle_s,
        }

    @classmethod
    def from_json(cls, data: dict) -> WhatIfParams:
        return cls(
            since=dt.datetime.fromisoformat(data["since"]),
            until=dt.datetime.fromisoformat(data["until"]),
            policy=data.get("policy", PRODUCTION_PRESET),
            weights={k: float(v) for k, v in (data.get("weights") or {}).items()},
            quotas=tuple(QuotaChange(**q) for q in data.get("quotas") or ()),
            power_budgets_w=dict(data.get("power_budgets_w") or {}),
            cycle_s=data.get("cycle_s"),
        )


def parse_time(text: str, argument: str) -> dt.datetime:
    """A date (midnight UTC) or an ISO 8601 time (UTC when it names no zone)."""
    try:
        value = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise WhatIfError(
            argument, f"{text!r} is not a date (YYYY-MM-DD) or an ISO 8601 time"
        ) from None
    return value.astimezone(dt.UTC) if timezone.is_aware(value) else value.replace(tzinfo=dt.UTC)


_WEIGHT = re.compile(r"^\s*([\w.-]+)\s*=\s*([0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)\s*$")
_QUOTA = re.compile(r"^\s*([\w.-]+)\s*:\s*([^=]*?)\s*=\s*(\d+)\s*:\s*(\d+)\s*$")
_BUDGET = re.compile(r"^\s*([\w.-]+)\s*=\s*(none|[0-9]*\.?[0-9]+)\s*$", re.IGNORECASE)


def parse_weight(text: str) -> tuple[str, float]:
    match = _WEIGHT.match(text)
    if not match:
        raise WhatIfError("--weight", f"{text!r} is not TENANT=WEIGHT (e.g. vision=2)")
    weight = float(match.group(2))
    if weight <= 0:
        raise WhatIfError("--weight", f"{text!r}: a weight must be above 0")
    return match.group(1), weight


def parse_quota(text: str) -> QuotaChange:
    match = _QUOTA.match(text)
    if not match:
        raise WhatIfError(
            "--quota",
            f"{text!r} is not TENANT:GPU_TYPE=GUARANTEED:LIMIT "
            "(e.g. vision:H100-SXM-80GB=8:16; GPU_TYPE 'any' for all types together)",
        )
    tenant, gpu_type, guaranteed, limit = match.groups()
    gpu_type = m.ANY_GPU_TYPE if gpu_type.lower() in ANY_TYPE_WORDS else gpu_type
    change = QuotaChange(tenant, gpu_type, int(guaranteed), int(limit))
    if change.limit_gpus < change.guaranteed_gpus:
        raise WhatIfError("--quota", f"{text!r}: the limit is below the guarantee")
    return change


def parse_power_budget(text: str) -> tuple[str, float | None]:
    match = _BUDGET.match(text)
    if not match:
        raise WhatIfError("--power-budget", f"{text!r} is not POOL=WATTS or POOL=none")
    value = match.group(2)
    if value.lower() == "none":
        return match.group(1), None
    watts = float(value)
    if watts <= 0:
        raise WhatIfError("--power-budget", f"{text!r}: a budget must be above 0 W")
    return match.group(1), watts


def build_params(
    *,
    since: str | dt.datetime | None,
    until: str | dt.datetime | None,
    policy: str = PRODUCTION_PRESET,
    weights: Iterable[str] = (),
    quotas: Iterable[str] = (),
    power_budgets: Iterable[str] = (),
    cycle_s: float | None = None,
) -> WhatIfParams:
    """Parse a request (command-line or form strings) and check it against the database.

    Until defaults to now, since to 30 days before until. Raises WhatIfError naming the argument.
    """
    if isinstance(until, str):
        until = parse_time(until, "--until")
    until = until or timezone.now()
    if isinstance(since, str):
        since = parse_time(since, "--since")
    since = since or until - dt.timedelta(days=30)
    if since >= until:
        raise WhatIfError(
            "--since", f"{since.isoformat()} is not before --until {until.isoformat()}"
        )
    if policy not in PRESETS:
        raise WhatIfError("--policy", f"unknown policy {policy!r}; known: {', '.join(PRESETS)}")
    if cycle_s is not None and cycle_s <= 0:
        raise WhatIfError("--cycle-s", "the cycle interval must be above 0 s")
    weight_map = dict(parse_weight(w) for w in weights)
    quota_changes: dict[tuple[str, str], QuotaChange] = {}
    for text in quotas:
        change = parse_quota(text)
        quota_changes[(change.tenant, change.gpu_type)] = change  # the last one given wins
    budgets = dict(parse_power_budget(b) for b in power_budgets)
    params = WhatIfParams(
        since=since,
        until=until,
        policy=policy,
        weights=weight_map,
        quotas=tuple(quota_changes.values()),
        power_budgets_w=budgets,
        cycle_s=cycle_s,
    )
    _check_against_cluster(params)
    return params


def _check_against_cluster(params: WhatIfParams) -> None:
    from controlplane.cluster.models import GPU
    from controlplane.tenancy.models import Tenant

    tenants = set(Tenant.objects.values_list("slug", flat=True))
    known_tenants = ", ".join(sorted(tenants)) or "none"
    for tenant in params.weights:
        if tenant not in tenants:
            raise WhatIfError("--weight", f"unknown tenant {tenant!r} (known: {known_tenants})")
    gpu_types = set(GPU.objects.values_list("model", flat=True).distinct())
    for q in params.quotas:
        if q.tenant not in tenants:
            raise WhatIfError("--quota", f"unknown tenant {q.tenant!r} (known: {known_tenants})")
        if q.gpu_type and q.gpu_type not in gpu_types:
            raise WhatIfError(
                "--quota",
                f"no GPU of type {q.gpu_type!r} in the cluster "
                f"(types: {', '.join(sorted(gpu_types)) or 'none'}; or 'any')",
            )
    pools = set(Pool.objects.values_list("name", flat=True))
    for pool in params.power_budgets_w:
        if pool not in pools:
            raise WhatIfError(
                "--power-budget",
                f"unknown pool {pool!r} (known: {', '.join(sorted(pools)) or 'none'})",
            )


# --- history and cluster as plain data ----------------------------------------------------------


@dataclass
class History:
    """The period's finished jobs as a trace, and what really happened to them."""

    jobs: tuple[TraceJob, ...]
    real: Result
    notes: list[str]


@dataclass(frozen=True)
class Cluster:
    nodes: tuple[m.Node, ...]
    tenants: tuple[m.Tenant, ...]
    pools: tuple[m.Pool, ...]

    @property
    def total_gpus(self) -> int:
        return sum(len(n.gpus) for n in self.nodes)


def load_cluster() -> Cluster:
    """The current nodes, tenants (weights, quotas) and pools, as the scheduler sees them."""
    pool_rows = list(Pool.objects.order_by("name").values_list("id", "name", "power_budget_w"))
    pools = tuple(m.Pool(name=name, power_budget_w=budget) for _, name, budget in pool_rows)
    loaded = load_nodes({pk: name for pk, name, _ in pool_rows}, {}, {})
    nodes = tuple(
        replace(
            node,
            schedulable=True,
            draining=False,
            gpus=tuple(replace(g, healthy=True, power_cap_w=None) for g in node.gpus),
        )
        for node in loaded
    )
    return Cluster(nodes=nodes, tenants=load_tenants(), pools=pools)


def load_history(since: dt.datetime, until: dt.datetime, cluster: Cluster) -> History:
    """Finished jobs submitted in [since, until), in two queries."""
    job_rows = raw_rows(
        Job.objects.filter(submitted_at__gte=since, submitted_at__lt=until)
        .order_by("submitted_at", "id")
        .values_list(
            "id",
            "state",
            "tenant__slug",
            "submitted_by__username",
            "name",
            "gpus",
            "gpu_type",
            "priority",
            "preemptible",
            "cpus",
            "memory_mib",
            unix_s("submitted_at"),
        )
    )
    attempts: dict[int, list[tuple]] = defaultdict(list)
    for row in raw_rows(
        JobAttempt.objects.filter(
            job__submitted_at__gte=since,
            job__submitted_at__lt=until,
            job__state__in=_FINISHED_RUN_STATES,
        )
        .order_by("job_id", "number")
        .values_list(
            "job_id",
            "state",
            "stop_reason",
            unix_s("created_at"),
            unix_s("started_at"),
            unix_s("finished_at"),
            "gpu_seconds",
            "energy_j",
        )
    ):
        attempts[row[0]].append(row[1:])

    jobs: list[TraceJob] = []
    outcomes: list[JobOutcome] = []
    intervals: list[tuple[float, float, int]] = []  # (from, to, GPUs) of held GPUs
    skipped: dict[str, int] = defaultdict(int)
    energy_j = 0.0
    preemptions = 0
    preempted_gpu_s = 0.0
    succeeded = failed = 0
    for (
        job_id,
        state,
        tenant,
        user,
        name,
        gpus,
        gpu_type,
        priority,
        preemptible,
        cpus,
        memory_mib,
        submit_s,
    ) in job_rows:
        if state not in _FINISHED_RUN_STATES:
            skipped["cancelled" if state == JobState.CANCELLED else "still active"] += 1
            continue
        rows = attempts.get(job_id, [])
        final = _final_attempt(state, rows)
        if final is None:
            skipped["never ran"] += 1
            continue
        _, _, _, run_start_s, run_end_s, _, _ = final
        held_s = 0.0
        job_preemptions = 0
        for a_state, stop_reason, created_s, started_s, finished_s, gpu_s, a_energy_j in rows:
            energy_j += a_energy_j or 0.0
            if finished_s is None:
                continue
            begun_s = created_s if created_s is not None else started_s
            held_s += max(0.0, finished_s - begun_s)
            intervals.append((begun_s, finished_s, gpus))
            if a_state == AttemptState.STOPPED and stop_reason in _PREEMPTED_STOP_REASONS:
                job_preemptions += 1
                preempted_gpu_s += gpu_s or 0.0
        preemptions += job_preemptions
        succeeded += state == JobState.SUCCEEDED
        failed += state == JobState.FAILED
        run_s = max(0.0, run_end_s - run_start_s)
        jobs.append(
            TraceJob(
                job_id=job_id,
                tenant=tenant,
                submit_s=submit_s,
                duration_s=run_s,
                gpus=gpus,
                user=user,
                name=name,
                gpu_type=gpu_type,
                priority=PRIORITY_VALUE.get(priority, PRIORITY_VALUE["normal"]),
                preemptible=bool(preemptible),
                cpus=float(cpus),
                memory_mib=int(memory_mib),
            )
        )
        first_created_s = rows[0][2] if rows[0][2] is not None else rows[0][3]
        outcomes.append(
            JobOutcome(
                job_id=job_id,
                tenant=tenant,
                gpus=gpus,
                submit_s=submit_s,
                first_start_s=first_created_s,
                finish_s=run_end_s,
                duration_s=run_s,
                held_s=held_s,
                preemptions=job_preemptions,
                restart_overhead_s=0.0,
            )
        )

    times, busy = _busy_timeline(intervals)
    first_submit_s = jobs[0].submit_s if jobs else 0.0
    real = _real_result(
        outcomes=outcomes,
        unfinished_job_ids=[],
        tenants=tuple(t.name for t in cluster.tenants),
        total_gpus=cluster.total_gpus,
        timeline_t_s=times,
        timeline_busy_gpus=busy,
        # Not known for the past; NaN draws nothing on the power plot.
        timeline_power_w=[math.nan] * len(times),
        energy_j=energy_j,
        peak_power_w=math.nan,
        power_budget_w=None,
        over_budget_s=math.nan,
        preemptions=preemptions,
        preempted_gpu_s_lost=preempted_gpu_s,
        first_submit_s=first_submit_s,
    )
    notes = [
        f"{len(jobs):,} finished jobs submitted from {since:%Y-%m-%d %H:%M} to {until:%Y-%m-%d %H:%M} UTC "
        f"({succeeded:,} succeeded, {failed:,} failed) on today's {len(cluster.nodes):,} node{'' if len(cluster.nodes) == 1 else 's'} "
        f"with {cluster.total_gpus:,} GPUs."
    ]
    if skipped:
        left_out = ", ".join(f"{n:,} {why}" for why, n in sorted(skipped.items()))
        notes.append(f"Left out: {left_out}.")
    return History(jobs=tuple(jobs), real=real, notes=notes)


def _real_result(**known) -> Result:
    """A Result for what really happened. The fields it leaves out measure a replay's own run
    (wall and CPU time, plan calls, events): nothing happened there, so they are zero."""
    for f in dataclasses.fields(Result):
        if f.name not in known:
            known[f.name] = [] if "list" in str(f.type) else 0
    return Result(**known)


def _final_attempt(state: str, rows: Sequence[tuple]) -> tuple | None:
    """The attempt whose run time the replay uses, or None when no attempt ran to its end."""
    wanted = AttemptState.SUCCEEDED if state == JobState.SUCCEEDED else None
    for row in reversed(rows):
        a_state, _, _, started_s, finished_s, _, _ = row
        if started_s is None or finished_s is None:
            continue
        if wanted is None or a_state == wanted:
            return row
    return None


def _busy_timeline(intervals: list[tuple[float, float, int]]) -> tuple[list[float], list[int]]:
    deltas: dict[float, int] = defaultdict(int)
    for start_s, end_s, gpus in intervals:
        deltas[start_s] += gpus
        deltas[end_s] -= gpus
    times, busy, level = [], [], 0
    for t in sorted(deltas):
        level += deltas[t]
        times.append(t)
        busy.append(level)
    return times, busy


# --- the changed config -------------------------------------------------------------------------


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
        old = pools[name].power_budget_w
        lines.append(f"pool {name}: power budget {_watts(old)} -> {_watts(budget)}")
    return lines or ["nothing: the current config, replayed"]


def _watts(value: float | None) -> str:
    return "none" if value is None else f"{value:,.0f} W"


# --- the run ------------------------------------------------------------------------------------


@dataclass
class WhatIfReport:
    params: WhatIfParams
    markdown: str
    summaries: list[Summary]
    results: dict[str, Result]
    changes: list[str]
    notes: list[str]

    def summary_json(self) -> dict:
        return {
            "rows": [_summary_dict(s) for s in self.summaries],
            "changes": self.changes,
            "notes": self.notes,
        }

    def write(self, out_dir: Path | str, *, plots: bool = True) -> Path:
        """report.md and its plots in out_dir; returns the report's path."""
        out = Path(out_dir)
        # The simulator's report draws the plots; its own tables are replaced by ours, which leave
        # out what the real row cannot have (wall time, CPU time, events per second).
        path = write_report(
            out, self.summaries, self.results, title=_title(self.params), plots=plots
        )
        images = re.findall(r"^!\[[^\]]*\]\([^)]*\)$", path.read_text(encoding="utf-8"), re.M)
        text = self.markdown
        if images:
            text += "\n## Plots\n\n" + "\n\n".join(images) + "\n"
        path.write_text(text, encoding="utf-8")
        return path


def run_whatif(
    params: WhatIfParams, *, progress: Callable[[float], None] | None = None
) -> WhatIfReport:
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
    changes = describe_changes(cluster, params)
    notes = history.notes + _result_notes(results)
    markdown = render_markdown(params, summaries, changes, notes)
    if progress is not None:
        progress(1.0)
    return WhatIfReport(params, markdown, summaries, results, changes, notes)


def _stage_progress(
    progress: Callable[[float], None] | None, index: int, stages: int
) -> Callable[[Progress], None] | None:
    if progress is None:
        return None

    def report(p: Progress) -> None:
        done = p.jobs_done / p.jobs_total if p.jobs_total else 1.0
        progress(min(1.0, (index + done) / stages))

    return report


def _result_notes(results: dict[str, Result]) -> list[str]:
    notes = []
    for label, r in results.items():
        if r.unfinished_job_ids:
            notes.append(
                f"{label}: {len(r.unfinished_job_ids):,} jobs never started (larger than what "
                "their tenant may use, or of a GPU type the cluster no longer has)."
            )
    return notes


def _title(params: WhatIfParams) -> str:
    return f"What-if on {params.since:%Y-%m-%d %H:%M} to {params.until:%Y-%m-%d %H:%M} UTC"


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
    "Jain(rho)",
    "jobs",
)


def _fixed(value: float, scale: float = 1.0, digits: int = 1) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value / scale:,.{digits}f}"


COLUMNS = tuple(c for c in SUMMARY_COLUMNS if c[0] in _SHARED_COLUMNS) + (
    ("energy (kWh)", lambda s: _fixed(s.energy_j, 3.6e6)),
    ("peak (kW)", lambda s: _fixed(s.peak_power_w, 1000.0)),
    ("over budget (s)", lambda s: _fixed(s.over_budget_s, digits=0)),
)


def summary_table(summaries: Sequence[Summary]) -> str:
    """The rows x metrics, as a Markdown table."""
    lines = [
        "| run | " + " | ".join(name for name, _ in COLUMNS) + " |",
        "|---|" + "---:|" * len(COLUMNS),
    ]
    for s in summaries:
        lines.append(f"| {s.policy} | " + " | ".join(f(s) for _, f in COLUMNS) + " |")
    return "\n".join(lines)


def render_markdown(
    params: WhatIfParams, summaries: Sequence[Summary], changes: Sequence[str], notes: Sequence[str]
) -> str:
    parts = [
        f"# {_title(params)}",
        "",
        "## What changes",
        "",
        *[f"- {c}" for c in changes],
        "",
        "## History",
        "",
        *[f"- {n}" for n in notes],
        "",
        "## Simulated vs what really happened",
        "",
        summary_table(summaries),
        "",
        "JCT = finish - submit; queue = JCT - time holding GPUs (before the first start and after "
        "preemptions). The current-config row replays production's policy on today's quotas: its "
        "distance from what really happened is the simulator's error, to keep in mind when "
        "reading the what-if. rho = a tenant's mean JCT over its mean JCT under FIFO on static "
        "partitions of today's guarantees (max over tenants). Real energy counts the GPUs that "
        "ran jobs only; real peak power is not kept for past periods.",
        "",
        "## Per tenant (mean queue s / mean JCT s / rho)",
        "",
        tenant_table(summaries),
        "",
    ]
    return "\n".join(parts)


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
