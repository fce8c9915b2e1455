"""Read-side queries shared by the web UI and the API: who may see what, and the figures pages show.

Nothing here writes. Tenant isolation follows controlplane.permissions (the API's rules): every
page that lists or fetches a tenant's objects starts from `visible_jobs` or
`permissions.visible_tenants`, so a user of another tenant gets "not found", never a hint that the
object exists.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from dataclasses import dataclass, field

from django.conf import settings
from django.db.models import Avg, Count, Max, Q, QuerySet, Sum
from django.db.models.functions import TruncMinute
from django.utils import timezone

from controlplane.accounting.budgets import (
    J_PER_KWH,
    BudgetState,
    Usage,
    budget_states,
    period_bounds,
    usage_by_tenant,
)
from controlplane.audit.models import AuditEvent
from controlplane.cluster.models import GPU, GpuTelemetry, Node, Pool
from controlplane.cluster.telemetry import TELEMETRY_BUCKET_S, TELEMETRY_RETENTION_S, bucket_start
from controlplane.jobs.models import (
    ACTIVE_ATTEMPT_STATES,
    ACTIVE_JOB_STATES,
    Allocation,
    AttemptState,
    Job,
    JobAttempt,
    JobDependency,
    JobEvent,
    JobState,
)
from controlplane.permissions import (
    TenantScope,
    is_cluster_admin,
    role_at_least,
    tenant_roles,
)
from controlplane.scheduling.models import SchedulingCycle
from controlplane.tenancy.models import Quota, Role, Tenant

ANY_GPU_TYPE_LABEL = "any type"


# --- who may see what -------------------------------------------------------------------------
# The rules themselves live in controlplane.permissions (shared with the API); these narrow
# querysets with them.


def role_in(user, tenant) -> str | None:
    """The user's role in tenant, or None. Cluster admins act as tenant admins everywhere."""
    if is_cluster_admin(user):
        return Role.ADMIN
    if not user.is_authenticated:
        return None
    return tenant_roles(user).get(tenant.pk)


def has_role(user, tenant, at_least: str) -> bool:
    return role_at_least(role_in(user, tenant), at_least)


def tenants_with_role(user, at_least: str) -> QuerySet[Tenant]:
    """Active tenants in which the user holds at least the given role (may submit: member)."""
    if not user.is_authenticated:
        return Tenant.objects.none()
    if is_cluster_admin(user):
        return Tenant.objects.filter(active=True)
    ids = [t for t, role in tenant_roles(user).items() if role_at_least(role, at_least)]
    return Tenant.objects.filter(active=True, pk__in=ids)


def visible_jobs(user) -> QuerySet[Job]:
    """Every job the user may read: their tenants' jobs (all jobs for cluster admins)."""
    if not user.is_authenticated:
        return Job.objects.none()
    return TenantScope("tenant").filter(Job.objects.select_related("tenant", "submitted_by"), user)


def may_cancel(user, job: Job) -> bool:
    """A member cancels their own jobs; a tenant admin (or cluster admin) anyone's in the tenant."""
    if job.is_finished:
        return False
    role = role_in(user, job.tenant)
    if role_at_least(role, Role.ADMIN):
        return True
    return role_at_least(role, Role.MEMBER) and job.submitted_by_id == user.pk


# --- jobs -------------------------------------------------------------------------------------

# What a person can sort the job list by, mapped to the ORM ordering (ties: newest first).
JOB_SORTS = {
    "-submitted": ("-submitted_at", "-id"),
    "submitted": ("submitted_at", "id"),
    "name": ("name", "-id"),
    "-name": ("-name", "-id"),
    "state": ("state", "-submitted_at"),
    "-state": ("-state", "-submitted_at"),
    "gpus": ("gpus", "-submitted_at"),
    "-gpus": ("-gpus", "-submitted_at"),
    "user": ("submitted_by__username", "-submitted_at"),
    "-user": ("-submitted_by__username", "-submitted_at"),
}
DEFAULT_JOB_SORT = "-submitted"


@dataclass(frozen=True)
class JobFilter:
    state: str = ""  # a JobState, "active", "finished" or "" (all)
    user: str = ""  # username, exact
    name: str = ""  # substring, case-insensitive
    tenant: str = ""  # slug
    sort: str = DEFAULT_JOB_SORT


def filter_jobs(jobs: QuerySet[Job], f: JobFilter) -> QuerySet[Job]:
    if f.state == "active":
        jobs = jobs.filter(state__in=ACTIVE_JOB_STATES)
    elif f.state == "finished":
        jobs = jobs.exclude(state__in=ACTIVE_JOB_STATES)
    elif f.state:
        jobs = jobs.filter(state=f.state)
    if f.user:
        jobs = jobs.filter(submitted_by__username=f.user)
    if f.name:
        jobs = jobs.filter(name__icontains=f.name)
    if f.tenant:
        jobs = jobs.filter(tenant__slug=f.tenant)
    return jobs.order_by(*JOB_SORTS.get(f.sort, JOB_SORTS[DEFAULT_JOB_SORT]))


def current_attempt(job: Job) -> JobAttempt | None:
    """The attempt that holds (or last held) the job's GPUs."""
    return job.attempts.select_related("node").order_by("-number").first()


# The job page lists at most this many of the jobs that wait for a job (a sweep's evaluation
# may wait for thousands); the count says how many there are in all.
DEPENDENTS_SHOWN = 50


def job_dependencies(job: Job) -> list[JobDependency]:
    """What the job waits (or waited) for, with the named jobs' names and states."""
    return list(
        JobDependency.objects.filter(job=job).select_related("on_job", "on_array").order_by("id")
    )


def job_dependents(job: Job) -> tuple[list[JobDependency], int]:
    """The first DEPENDENTS_SHOWN dependencies on this job (with their jobs), and how many
    there are in all. Only jobs of the job's own tenant can depend on it."""
    if not job.has_dependents:
        return [], 0
    rows = JobDependency.objects.filter(on_job=job).select_related("job").order_by("job_id")
    shown = list(rows[:DEPENDENTS_SHOWN])
    total = len(shown) if len(shown) < DEPENDENTS_SHOWN else rows.count()
    return shown, total


@dataclass(frozen=True)
class JobUsage:
    gpu_seconds: float
    energy_j: float
    energy_estimated: bool

    @property
    def gpu_hours(self) -> float:
        return self.gpu_seconds / 3600.0

    @property
    def energy_kwh(self) -> float:
        return self.energy_j / J_PER_KWH


def job_usage(job: Job, now: dt.datetime | None = None) -> JobUsage:
    """GPU-time and energy over all attempts so far.

    A running attempt's figures are refreshed by its heartbeats; between two heartbeats its
    GPU-seconds are at least the time it has run times its GPUs, so the page never goes backwards.
    """
    now = now or timezone.now()
    gpu_s = 0.0
    energy_j = 0.0
    estimated = False
    attempts = job.attempts.annotate(
        gpu_count=Count("allocations", filter=Q(allocations__active=True))
    )
    for a in attempts:
        seconds = a.gpu_seconds
        if a.state == AttemptState.RUNNING and a.started_at:
            seconds = max(seconds, (now - a.started_at).total_seconds() * a.gpu_count)
        gpu_s += seconds
        energy_j += a.energy_j
        estimated = estimated or a.energy_estimated
    return JobUsage(gpu_s, energy_j, estimated)


@dataclass
class GpuSeries:
    """One GPU's telemetry over time: (time, value) points, None where not reported."""

    uuid: str
    label: str
    utilization_pct: list[tuple[dt.datetime, float | None]] = field(default_factory=list)
    power_draw_w: list[tuple[dt.datetime, float | None]] = field(default_factory=list)
    power_cap_w: list[tuple[dt.datetime, float | None]] = field(default_factory=list)


def attempt_gpus(attempt: JobAttempt) -> list[GPU]:
    return list(
        GPU.objects.filter(allocations__attempt=attempt).select_related("node").order_by("index")
    )


def attempt_telemetry(attempt: JobAttempt, max_points: int = 720) -> list[GpuSeries]:
    """Telemetry of the attempt's GPUs while the attempt held them, oldest first."""
    gpus = attempt_gpus(attempt)
    # A bucket is stamped with its start, so the one the attempt began in starts before it.
    begin = bucket_start(attempt.started_at or attempt.created_at)
    rows = GpuTelemetry.objects.filter(gpu__in=gpus, bucket_at__gte=begin)
    if attempt.finished_at:
        rows = rows.filter(bucket_at__lte=attempt.finished_at)
    series = {g.pk: GpuSeries(uuid=g.uuid, label=f"GPU {g.index}") for g in gpus}
    # Newest first, limited, then reversed: a long job's chart shows its recent hours.
    recent = rows.order_by("-bucket_at").values_list(
        "gpu_id", "bucket_at", "utilization_pct", "power_draw_w", "power_cap_w"
    )[: max_points * max(1, len(gpus))]
    # A bucket's average holds over the part of the bucket the attempt had the GPU: drawn at its
    # stamp (its start), a job shorter than a bucket would be one dot before it even started.
    started = attempt.started_at or attempt.created_at
    ended = attempt.finished_at or timezone.now()
    bucket = dt.timedelta(seconds=TELEMETRY_BUCKET_S)
    for gpu_id, at, util, draw, cap in reversed(list(recent)):
        s = series[gpu_id]
        left, right = max(at, started), min(at + bucket, ended)
        for t in (left, right) if right > left else (left,):
            s.utilization_pct.append((t, util))
            s.power_draw_w.append((t, draw))
            s.power_cap_w.append((t, cap))
    return list(series.values())


def pending_jobs_ahead(job: Job) -> int | None:
    """How many jobs the scheduler placed before this one in its last cycle (None: not known)."""
    if job.state != JobState.PENDING or job.queue_position is None:
        return None
    return max(0, job.queue_position - 1)


# --- tenant dashboard -------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuTypeUsage:
    gpu_type: str  # "" = any type
    in_use: int
    borrowed: int
    guaranteed: int
    limit: int
    pending_gpus: int
    max_running_jobs: int | None = None

    @property
    def label(self) -> str:
        return self.gpu_type or ANY_GPU_TYPE_LABEL

    @property
    def within_guarantee(self) -> int:
        return self.in_use - self.borrowed


def tenant_gpu_usage(tenant: Tenant) -> list[GpuTypeUsage]:
    """GPUs in use against the tenant's guarantee and limit, per quota row (GPU type)."""
    in_use: dict[str, int] = defaultdict(int)
    borrowed: dict[str, int] = defaultdict(int)
    for row in (
        Allocation.objects.filter(active=True, attempt__job__tenant=tenant)
        .values("gpu__model", "attempt__borrowed")
        .annotate(n=Count("id"))
    ):
        in_use[row["gpu__model"]] += row["n"]
        if row["attempt__borrowed"]:
            borrowed[row["gpu__model"]] += row["n"]
    pending: dict[str, int] = defaultdict(int)
    for queued in (
        Job.objects.filter(tenant=tenant, state=JobState.PENDING)
        .values("gpu_type")
        .annotate(n=Sum("gpus"))
    ):
        pending[queued["gpu_type"]] += queued["n"] or 0

    rows = []
    seen = set()
    for q in Quota.objects.filter(tenant=tenant).order_by("gpu_type"):
        seen.add(q.gpu_type)
        if q.gpu_type:
            used, lent, waiting = in_use[q.gpu_type], borrowed[q.gpu_type], pending[q.gpu_type]
        else:
            used, lent, waiting = (
                sum(in_use.values()),
                sum(borrowed.values()),
                sum(pending.values()),
            )
        rows.append(
            GpuTypeUsage(
                gpu_type=q.gpu_type,
                in_use=used,
                borrowed=lent,
                guaranteed=q.guaranteed_gpus,
                limit=q.limit_gpus,
                pending_gpus=waiting,
                max_running_jobs=q.max_running_jobs,
            )
        )
    # GPUs held on a type without a quota row (a quota removed while jobs ran) still show.
    for gpu_type in sorted(set(in_use) - seen):
        rows.append(
            GpuTypeUsage(
                gpu_type=gpu_type,
                in_use=in_use[gpu_type],
                borrowed=borrowed[gpu_type],
                guaranteed=0,
                limit=0,
                pending_gpus=pending[gpu_type],
            )
        )
    return rows


@dataclass(frozen=True)
class TimelineItem:
    at: dt.datetime
    message: str
    kind: str
    job: Job | None = None


def recent_tenant_events(tenant: Tenant, limit: int = 15) -> list[TimelineItem]:
    """Job transitions and the tenant's audit trail (members, quotas, budget warnings), newest
    first: this tenant's rows only."""
    job_events = (
        JobEvent.objects.filter(job__tenant=tenant)
        .select_related("job")
        .order_by("-at", "-id")[:limit]
    )
    items = [
        TimelineItem(
            at=e.at, message=e.message or f"{e.from_state} → {e.to_state}", kind=e.kind, job=e.job
        )
        for e in job_events
    ]
    items += [
        TimelineItem(at=e.at, message=e.message, kind=e.action)
        for e in AuditEvent.objects.filter(tenant=tenant).order_by("-at", "-id")[:limit]
    ]
    items.sort(key=lambda i: i.at, reverse=True)
    return items[:limit]


def tenant_budgets(tenant: Tenant, now: dt.datetime | None = None) -> list[BudgetState]:
    return [s for s in budget_states(now) if s.tenant_id == tenant.pk]


def tenant_usage(tenant: Tenant, period: str = "month", now: dt.datetime | None = None) -> Usage:
    """GPU-seconds and joules the tenant used this period, budget or not (booked as budgets are)."""
    start, end = period_bounds(period, now or timezone.now())
    return usage_by_tenant(start, end, tenant_ids=[tenant.pk]).get(tenant.pk, Usage())


def tenant_job_counts(tenant: Tenant) -> dict[str, int]:
    counts = dict(
        Job.objects.filter(tenant=tenant, state__in=ACTIVE_JOB_STATES)
        .values_list("state")
        .annotate(n=Count("id"))
    )
    return {state: counts.get(state, 0) for state in ACTIVE_JOB_STATES}


# --- cluster ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TenantAllocation:
    tenant: Tenant
    guaranteed_in_use: int
    borrowed_in_use: int
    guaranteed_quota: int
    limit_quota: int
    pending_jobs: int
    pending_gpus: int

    @property
    def in_use(self) -> int:
        return self.guaranteed_in_use + self.borrowed_in_use


def allocation_by_tenant() -> list[TenantAllocation]:
    """Per tenant: GPUs held within the guarantee and borrowed, and what is still waiting."""
    held: dict[int, dict[bool, int]] = defaultdict(lambda: {True: 0, False: 0})
    for row in (
        Allocation.objects.filter(active=True)
        .values("attempt__job__tenant_id", "attempt__borrowed")
        .annotate(n=Count("id"))
    ):
        held[row["attempt__job__tenant_id"]][row["attempt__borrowed"]] += row["n"]
    waiting = {
        row["tenant_id"]: (row["jobs"], row["gpus"] or 0)
        for row in Job.objects.filter(state=JobState.PENDING)
        .values("tenant_id")
        .annotate(jobs=Count("id"), gpus=Sum("gpus"))
    }
    typed = Quota.objects.exclude(gpu_type="").values_list("tenant_id")
    guaranteed = dict(typed.annotate(total=Sum("guaranteed_gpus")))
    limits = dict(typed.annotate(total=Sum("limit_gpus")))
    result = []
    for tenant in Tenant.objects.order_by("slug"):
        jobs, gpus = waiting.get(tenant.pk, (0, 0))
        result.append(
            TenantAllocation(
                tenant=tenant,
                guaranteed_in_use=held[tenant.pk][False],
                borrowed_in_use=held[tenant.pk][True],
                guaranteed_quota=guaranteed.get(tenant.pk, 0),
                limit_quota=limits.get(tenant.pk, 0),
                pending_jobs=jobs,
                pending_gpus=gpus,
            )
        )
    return result


@dataclass
class PoolPower:
    pool: Pool
    gpus: int
    draw_now_w: float | None
    cap_now_w: float | None
    # What the pool could draw at most right now, as the cap planner holds it under the budget:
    # busy GPUs at their caps, idle ones at what they draw (an idle GPU's cap, its minimum, is
    # not a draw: summing every cap overstates the pool, by 200 W per idle H100).
    worst_case_w: float | None = None
    # Sum over the pool's GPUs per telemetry bucket, oldest first.
    draw_w: list[tuple[dt.datetime, float | None]] = field(default_factory=list)
    cap_w: list[tuple[dt.datetime, float | None]] = field(default_factory=list)


def pool_power(window: dt.timedelta = dt.timedelta(hours=1), now=None) -> list[PoolPower]:
    """Each pool's draw against its budget: now (latest GPU readings) and over the window."""
    now = now or timezone.now()
    result = []
    for pool in Pool.objects.order_by("name"):
        latest = GPU.objects.filter(node__pool=pool).aggregate(
            n=Count("id"), draw=Sum("power_draw_w"), cap=Sum("power_cap_w")
        )
        busy = Q(allocations__active=True)
        split = (
            GPU.objects.filter(node__pool=pool)
            .annotate(busy=Count("allocations", filter=busy))
            .values_list("busy", "power_cap_w", "power_draw_w")
        )
        worst_case_w = None
        for held, cap_w, draw_w in split:
            figure = cap_w if held else draw_w
            if figure is not None:
                worst_case_w = (worst_case_w or 0.0) + figure
        pp = PoolPower(
            pool=pool,
            gpus=latest["n"],
            draw_now_w=latest["draw"],
            cap_now_w=latest["cap"],
            worst_case_w=worst_case_w,
        )
        for row in (
            GpuTelemetry.objects.filter(gpu__node__pool=pool, bucket_at__gte=now - window)
            .values("bucket_at")
            .annotate(draw=Sum("power_draw_w"), cap=Sum("power_cap_w"))
            .order_by("bucket_at")
        ):
            pp.draw_w.append((row["bucket_at"], row["draw"]))
            pp.cap_w.append((row["bucket_at"], row["cap"]))
        result.append(pp)
    return result


def recent_cycles(limit: int = 20) -> QuerySet[SchedulingCycle]:
    return SchedulingCycle.objects.order_by("-started_at", "-id")[:limit]


@dataclass(frozen=True)
class GpuRow:
    gpu: GPU
    job: Job | None
    attempt: JobAttempt | None


def nodes_with_gpus(nodes: QuerySet[Node] | None = None) -> list[tuple[Node, list[GpuRow]]]:
    """Nodes, each with its GPUs and the job that holds each GPU now, in three queries."""
    listed = list((nodes if nodes is not None else Node.objects.all()).select_related("pool"))
    gpus = GPU.objects.filter(node__in=listed).order_by("node__name", "index")
    held = {
        a.gpu_id: a.attempt
        for a in Allocation.objects.filter(active=True, gpu__node__in=listed).select_related(
            "attempt__job__tenant"
        )
    }
    by_node: dict[int, list[GpuRow]] = defaultdict(list)
    for g in gpus:
        attempt = held.get(g.pk)
        by_node[g.node_id].append(GpuRow(g, attempt.job if attempt else None, attempt))
    return [(n, by_node[n.pk]) for n in listed]


def node_active_attempts(node: Node) -> QuerySet[JobAttempt]:
    return node.attempts.filter(state__in=ACTIVE_ATTEMPT_STATES).select_related("job__tenant")


def node_runtimes() -> set[str]:
    """How the cluster's nodes run jobs ("docker", "process"), as their agents report it."""
    return set(Node.objects.exclude(runtime="").values_list("runtime", flat=True).distinct())


def known_gpu_types() -> list[str]:
    """GPU models present in the cluster or named in a quota, for pickers."""
    types = set(GPU.objects.values_list("model", flat=True).distinct())
    types |= set(Quota.objects.exclude(gpu_type="").values_list("gpu_type", flat=True))
    return sorted(types)


# --- the cluster over time (the overview's charts) ----------------------------------------------

Point = tuple[dt.datetime, float | None]


@dataclass(frozen=True)
class HistoryWindow:
    key: str  # what the page's ?window= says
    label: str  # "the last 24 hours"
    span: dt.timedelta
    # Wide enough for 60-100 points a chart: one per scheduling cycle would be 17,280 a day.
    bucket: dt.timedelta


HISTORY_WINDOWS = {
    w.key: w
    for w in (
        HistoryWindow("1h", "the last hour", dt.timedelta(hours=1), dt.timedelta(minutes=1)),
        HistoryWindow("6h", "the last 6 hours", dt.timedelta(hours=6), dt.timedelta(minutes=5)),
        HistoryWindow("24h", "the last 24 hours", dt.timedelta(days=1), dt.timedelta(minutes=15)),
        HistoryWindow("7d", "the last 7 days", dt.timedelta(days=7), dt.timedelta(hours=2)),
    )
}
DEFAULT_HISTORY_WINDOW = "24h"


@dataclass
class ClusterHistory:
    """The cluster over a window, one point per bucket (stamped at the bucket's start); None
    where nothing was recorded, so a chart shows a gap rather than a zero."""

    window: HistoryWindow
    start: dt.datetime
    end: dt.datetime
    gpus_now: int
    allocated_pct: list[Point] = field(default_factory=list)  # time-weighted, of gpus_now
    utilization_pct: list[Point] = field(default_factory=list)  # mean of the GPUs reporting
    pending_max: list[Point] = field(default_factory=list)  # the longest queue a cycle saw
    starts: list[Point] = field(default_factory=list)  # jobs started in the bucket
    preemptions: list[Point] = field(default_factory=list)
    # The first bucket of the window with a cycle record / a GPU reading (None: none at all).
    cycles_from: dt.datetime | None = None
    telemetry_from: dt.datetime | None = None
    cycle_retention: dt.timedelta = field(
        default_factory=lambda: dt.timedelta(days=settings.SCHEDULER_CYCLE_RETENTION_DAYS)
    )
    telemetry_retention: dt.timedelta = dt.timedelta(seconds=TELEMETRY_RETENTION_S)


def _bucket_of(at: dt.datetime, start: dt.datetime, bucket: dt.timedelta) -> int:
    return int((at - start) / bucket)


def cluster_history(window: HistoryWindow, now: dt.datetime | None = None) -> ClusterHistory:
    """The queue (from the scheduling cycle records), GPU allocation (from allocations) and GPU
    utilization (from telemetry) over the window, in three grouped queries and one of the
    allocations that overlap it."""
    now = now or timezone.now()
    step_s = window.bucket.total_seconds()
    # Buckets on round clock times (every 15 minutes from midnight), the last one holding now.
    start = bucket_start(now - window.span, step_s) + window.bucket
    n = _bucket_of(now, start, window.bucket) + 1
    stamps = [start + i * window.bucket for i in range(n)]
    gpus_now = GPU.objects.filter(node__deregistered_at__isnull=True).count()
    history = ClusterHistory(window=window, start=start, end=now, gpus_now=gpus_now)

    pending: list[float | None] = [None] * n
    starts: list[float | None] = [None] * n
    preemptions: list[float | None] = [None] * n
    for cycles in (
        SchedulingCycle.objects.filter(started_at__gte=start, started_at__lte=now)
        .annotate(minute=TruncMinute("started_at"))
        .values("minute")
        .annotate(pending=Max("pending"), starts=Sum("starts"), preemptions=Sum("preemptions"))
        .order_by()
    ):
        i = _bucket_of(cycles["minute"], start, window.bucket)
        if not 0 <= i < n:
            continue
        pending[i] = max(pending[i] or 0, cycles["pending"])
        starts[i] = (starts[i] or 0) + cycles["starts"]
        preemptions[i] = (preemptions[i] or 0) + cycles["preemptions"]
    first = next((i for i, v in enumerate(pending) if v is not None), None)
    history.cycles_from = None if first is None else stamps[first]

    # A bucket's mean of per-minute means, weighted by how many GPUs reported in each minute.
    util_sum = [0.0] * n
    util_count = [0] * n
    for readings in (
        GpuTelemetry.objects.filter(bucket_at__gte=start, bucket_at__lte=now)
        .values("bucket_at")
        .annotate(mean=Avg("utilization_pct"), reporting=Count("utilization_pct"))
        .order_by()
    ):
        i = _bucket_of(readings["bucket_at"], start, window.bucket)
        if 0 <= i < n and readings["reporting"]:
            util_sum[i] += readings["mean"] * readings["reporting"]
            util_count[i] += readings["reporting"]
    utilization = [s / c if c else None for s, c in zip(util_sum, util_count, strict=True)]
    first = next((i for i, v in enumerate(utilization) if v is not None), None)
    history.telemetry_from = None if first is None else stamps[first]

    # GPU-seconds allocated in each bucket, over the seconds the bucket has had so far.
    held_s = [0.0] * n
    for began, released in (
        Allocation.objects.filter(created_at__lt=now)
        .filter(Q(released_at__isnull=True) | Q(released_at__gt=start))
        .values_list("created_at", "released_at")
    ):
        left, right = max(began, start), min(released or now, now)
        i = _bucket_of(left, start, window.bucket)
        while i < n and stamps[i] < right:
            edge = stamps[i] + window.bucket
            held_s[i] += (min(edge, right) - max(stamps[i], left)).total_seconds()
            i += 1
    allocated: list[float | None] = []
    for i, at in enumerate(stamps):
        seconds = (min(at + window.bucket, now) - at).total_seconds()
        allocated.append(
            100.0 * held_s[i] / seconds / gpus_now if gpus_now and seconds > 0 else None
        )

    history.pending_max = list(zip(stamps, pending, strict=True))
    history.starts = list(zip(stamps, starts, strict=True))
    history.preemptions = list(zip(stamps, preemptions, strict=True))
    history.utilization_pct = list(zip(stamps, utilization, strict=True))
    history.allocated_pct = list(zip(stamps, allocated, strict=True))
    return history
