"""Figures of a replay: JCT, queueing, utilization, preemption, fairness, power.

Definitions (what the tables mean):

- JCT = finish - submit. Queue = total time pending (before the first start and after every
  preemption) = JCT - time holding GPUs. A job "waited" when its queue is longer than
  WAITED_AFTER_S: a real cluster admits even a job that finds free GPUs a moment after its
  submit (a scheduling cycle), which must not count as waiting, or every job of a real history
  would have "waited" against a simulation's instant starts.
- Percentiles interpolate linearly between order statistics (numpy's default).
- Utilization = GPU-seconds held / (GPUs x makespan), makespan = last finish - first submit.
- GPU-hours lost to preemption = (restart cost + run time since the job's last checkpoint) x
  GPUs, summed over preemptions. With the default continuous checkpoints nothing is lost but
  the restart (see scheduler.simulator.checkpoints).
- Finish-time fairness rho of a tenant = its mean JCT under the policy / its mean JCT under
  FIFO on its own static partition (the reference run), over the jobs finished in both;
  rho <= 1: the tenant is no worse off than alone on its partition. ``rho_job_mean`` is the
  mean over its jobs of the per-job ratio, which weighs short jobs as much as long ones.
- The reports show max rho (the worst-off tenant), not Jain's index over rho: Jain's index
  counts a tenant that gains (rho well below 1) as unfairness. ``jain_rho`` is still computed
  (the what-if's stored summaries carry it).
- Preempted jobs = jobs preempted at least once (the victims); preemptions per victim is the
  distribution of their preemption counts (mean, median, p99, max), over finished jobs.
- Job classes (``job_class``): GPUs requested x the trace's run time (not the JCT, so a job is
  in the same class under every policy). GPU bins 1, 2-4, 5-8, > 8 (a node of Philly has 8
  GPUs: > 8 spans nodes); run-time bins < 10 min, 10 min - 1 h, 1 - 8 h, >= 8 h, after the
  short / long split of Tiresias and the duration bins of Helios' characterization, with the
  many minute-long Philly jobs (mostly failures) in a bin of their own.
- Per-tenant series over time (``tenant_series``) are rebuilt from the job outcomes: a job is
  queued from its submit to its first start; from there to its finish it holds its GPUs for
  ``held_s`` of that span, and since the outcome does not say when a preempted job waited, its
  GPUs and its requeued time are spread evenly over the span (exact for jobs never preempted).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.simulator.engine import JobOutcome, Result

WAITED_AFTER_S = 10.0


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def jain_index(values: Sequence[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n sum x^2); NaN for no values."""
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return math.nan
    squares = sum(v * v for v in vals)
    return (sum(vals) ** 2) / (len(vals) * squares) if squares else 1.0


@dataclass(frozen=True, slots=True)
class TenantMetrics:
    tenant: str
    jobs: int
    mean_jct_s: float
    mean_queue_s: float
    waited_share: float
    rho: float  # NaN without a reference run
    rho_job_mean: float


@dataclass(frozen=True, slots=True)
class Summary:
    policy: str
    jobs: int
    unfinished: int
    mean_jct_s: float
    median_jct_s: float
    p99_jct_s: float
    mean_queue_s: float
    p99_queue_s: float
    makespan_s: float
    waited_share: float
    utilization: float
    preemptions: int
    preempted_gpu_hours_lost: float
    max_rho: float
    jain_rho: float
    energy_j: float
    peak_power_w: float
    power_budget_w: float | None
    over_budget_s: float
    wall_s: float
    cpu_s: float
    events: int
    plan_calls: int
    plan_wall_s: float
    tenants: tuple[TenantMetrics, ...]
    # Jobs preempted at least once, and the distribution of their preemption counts.
    preempted_jobs: int = 0
    preemptions_per_victim_mean: float = math.nan
    preemptions_per_victim_p50: float = math.nan
    preemptions_per_victim_p99: float = math.nan
    preemptions_per_victim_max: int = 0
    # Jobs that arrived within their tenant's guarantee (Result.within_guarantee_job_ids) and
    # finished: how long they waited for their first start, and how many waited longer than
    # the preemption rules allow (Result.guarantee_wait_bound_s). NaN / -1: not recorded.
    guaranteed_jobs: int = -1
    guaranteed_wait_p99_s: float = math.nan
    guaranteed_wait_max_s: float = math.nan
    guaranteed_over_bound: int = -1
    # Of those, gangs (more than one GPU): the preemption rules take only borrowed GPUs, so a
    # gang waits also until some node holds enough GPUs free or borrowed together.
    guaranteed_over_bound_gangs: int = -1
    guarantee_wait_bound_s: float = math.nan
    # The promise per tenant (Result.owed_spells): spells during which a tenant held less than
    # its guarantee while a job of it that fits in the rest waited; how many lasted longer than
    # the bound, how many of those only gangs waited through, and the longest. -1 / NaN: not
    # recorded.
    owed_spells: int = -1
    owed_over_bound: int = -1
    owed_over_bound_gangs: int = -1
    owed_max_s: float = math.nan

    @property
    def events_per_s(self) -> float:
        return self.events / self.wall_s if self.wall_s > 0 else math.nan


def summarize(policy: str, result: Result, reference: Result | None = None) -> Summary:
    """The figures of one replay; ``reference`` (FIFO on static partitions) gives rho."""
    outcomes = result.outcomes
    jct = [o.jct_s for o in outcomes]
    queue = [o.queue_s for o in outcomes]
    waited = sum(1 for q in queue if q > WAITED_AFTER_S)
    last_finish = max((o.finish_s for o in outcomes), default=result.first_submit_s)
    makespan = last_finish - result.first_submit_s
    held_gpu_s = sum(o.held_s * o.gpus for o in outcomes)
    # Unfinished jobs may still hold GPUs at the end; utilization counts what finished jobs held.
    utilization = held_gpu_s / (result.total_gpus * makespan) if makespan > 0 else math.nan

    ref_jct = {o.job_id: o.jct_s for o in reference.outcomes} if reference else {}
    tenant_rows = []
    by_tenant: dict[str, list[JobOutcome]] = {t: [] for t in result.tenants}
    for o in outcomes:
        by_tenant.setdefault(o.tenant, []).append(o)
    for tenant, rows in by_tenant.items():
        if not rows:
            continue
        t_queue = [o.queue_s for o in rows]
        both = [o for o in rows if o.job_id in ref_jct]
        if both:
            rho = _mean([o.jct_s for o in both]) / _mean([ref_jct[o.job_id] for o in both])
            rho_job = _mean([o.jct_s / ref_jct[o.job_id] for o in both if ref_jct[o.job_id] > 0])
        else:
            rho = rho_job = math.nan
        tenant_rows.append(
            TenantMetrics(
                tenant=tenant,
                jobs=len(rows),
                mean_jct_s=_mean([o.jct_s for o in rows]),
                mean_queue_s=_mean(t_queue),
                waited_share=sum(1 for q in t_queue if q > WAITED_AFTER_S) / len(rows),
                rho=rho,
                rho_job_mean=rho_job,
            )
        )
    rhos = [t.rho for t in tenant_rows if not math.isnan(t.rho)]
    victims = [float(o.preemptions) for o in outcomes if o.preemptions > 0]
    # None (the class default a Result pickled before these fields existed reads): not recorded.
    within = result.within_guarantee_job_ids
    bound_s = result.guarantee_wait_bound_s
    recorded = within is not None and bound_s is not None
    claims = [
        (o.first_start_s - o.submit_s, o.gpus) for o in outcomes if o.job_id in (within or ())
    ]
    waits = [w for w, _ in claims]
    over = [gpus for w, gpus in claims if w > (bound_s or 0.0)]
    spells = result.owed_spells
    owed = spells is not None and bound_s is not None
    # A spell past the bound that no one-GPU job waited through longer than the bound: only
    # gangs waited past it (a node with enough GPUs free or borrowed together).
    long_spells = [single_s for s, single_s in spells or () if s > (bound_s or 0.0)]
    return Summary(
        policy=policy,
        jobs=len(outcomes),
        unfinished=len(result.unfinished_job_ids),
        mean_jct_s=_mean(jct),
        median_jct_s=percentile(jct, 50),
        p99_jct_s=percentile(jct, 99),
        mean_queue_s=_mean(queue),
        p99_queue_s=percentile(queue, 99),
        makespan_s=makespan,
        waited_share=waited / len(outcomes) if outcomes else math.nan,
        utilization=utilization,
        preemptions=result.preemptions,
        preempted_gpu_hours_lost=result.preempted_gpu_s_lost / 3600.0,
        max_rho=max(rhos) if rhos else math.nan,
        jain_rho=jain_index(rhos),
        energy_j=result.energy_j,
        peak_power_w=result.peak_power_w,
        power_budget_w=result.power_budget_w,
        over_budget_s=result.over_budget_s,
        wall_s=result.wall_s,
        cpu_s=result.cpu_s,
        events=result.events,
        plan_calls=result.plan_calls,
        plan_wall_s=result.plan_wall_s,
        tenants=tuple(tenant_rows),
        preempted_jobs=len(victims),
        preemptions_per_victim_mean=_mean(victims),
        preemptions_per_victim_p50=percentile(victims, 50),
        preemptions_per_victim_p99=percentile(victims, 99),
        preemptions_per_victim_max=int(max(victims, default=0)),
        guaranteed_jobs=len(waits) if recorded else -1,
        guaranteed_wait_p99_s=percentile(waits, 99) if recorded else math.nan,
        guaranteed_wait_max_s=max(waits, default=math.nan) if recorded else math.nan,
        guaranteed_over_bound=len(over) if recorded else -1,
        guaranteed_over_bound_gangs=sum(1 for g in over if g > 1) if recorded else -1,
        guarantee_wait_bound_s=bound_s if bound_s is not None else math.nan,
        owed_spells=len(spells or ()) if owed else -1,
        owed_over_bound=len(long_spells) if owed else -1,
        owed_over_bound_gangs=(
            sum(1 for single_s in long_spells if single_s <= (bound_s or 0.0)) if owed else -1
        ),
        owed_max_s=max((s for s, _ in spells or ()), default=0.0) if owed else math.nan,
    )


# (label, lowest, highest) GPUs requested; (label, from, below) seconds of run time.
GPU_BINS: tuple[tuple[str, int, float], ...] = (
    ("1 GPU", 1, 1),
    ("2-4 GPUs", 2, 4),
    ("5-8 GPUs", 5, 8),
    ("> 8 GPUs", 9, math.inf),
)
DURATION_BINS: tuple[tuple[str, float, float], ...] = (
    ("< 10 min", 0.0, 600.0),
    ("10 min - 1 h", 600.0, 3600.0),
    ("1 - 8 h", 3600.0, 8 * 3600.0),
    (">= 8 h", 8 * 3600.0, math.inf),
)


def job_class(gpus: int, duration_s: float) -> tuple[str, str]:
    """The (GPU bin, run-time bin) labels of a job; a job of 0 GPUs counts as 1."""
    gpu_label = next((b[0] for b in GPU_BINS if gpus <= b[2]), GPU_BINS[-1][0])
    duration_label = next((b[0] for b in DURATION_BINS if duration_s < b[2]), DURATION_BINS[-1][0])
    return gpu_label, duration_label


@dataclass(frozen=True, slots=True)
class ClassMetrics:
    gpu_bin: str
    duration_bin: str
    jobs: int
    mean_jct_s: float
    p99_jct_s: float
    mean_queue_s: float
    p99_queue_s: float
    preempted_jobs: int


def class_metrics(outcomes: Sequence[JobOutcome]) -> tuple[ClassMetrics, ...]:
    """Figures per job class, in bin order, the classes without jobs left out; the counts add
    up to ``len(outcomes)``."""
    groups: dict[tuple[str, str], list[JobOutcome]] = {}
    for o in outcomes:
        groups.setdefault(job_class(o.gpus, o.duration_s), []).append(o)
    rows = []
    for gpu_label, _, _ in GPU_BINS:
        for duration_label, _, _ in DURATION_BINS:
            members = groups.get((gpu_label, duration_label))
            if not members:
                continue
            jct = [o.jct_s for o in members]
            queue = [o.queue_s for o in members]
            rows.append(
                ClassMetrics(
                    gpu_bin=gpu_label,
                    duration_bin=duration_label,
                    jobs=len(members),
                    mean_jct_s=_mean(jct),
                    p99_jct_s=percentile(jct, 99),
                    mean_queue_s=_mean(queue),
                    p99_queue_s=percentile(queue, 99),
                    preempted_jobs=sum(1 for o in members if o.preemptions > 0),
                )
            )
    return tuple(rows)


@dataclass(frozen=True, slots=True)
class TenantSeries:
    """Bucket averages over time of one tenant: jobs queued and GPUs held."""

    tenant: str
    mids_s: list[float]
    queued_jobs: list[float]
    held_gpus: list[float]


def tenant_series(
    result: Result, start_s: float, end_s: float, bucket_s: float
) -> dict[str, TenantSeries]:
    """Per tenant, its queue length and the GPUs it holds, averaged per bucket (see the module's
    docstring for how a preempted job's time is spread)."""
    events: dict[str, list[tuple[float, float, float]]] = {t: [] for t in result.tenants}
    for o in result.outcomes:
        rows = events.setdefault(o.tenant, [])
        if o.first_start_s > o.submit_s:
            rows.append((o.submit_s, 1.0, 0.0))
            rows.append((o.first_start_s, -1.0, 0.0))
        span = o.finish_s - o.first_start_s
        if span > 0:
            held = min(o.held_s / span, 1.0)
            rows.append((o.first_start_s, 1.0 - held, o.gpus * held))
            rows.append((o.finish_s, held - 1.0, -o.gpus * held))
    out = {}
    for tenant, rows in events.items():
        rows.sort()
        times: list[float] = []
        queued: list[float] = []
        gpus: list[float] = []
        q = g = 0.0
        for t, dq, dg in rows:
            q += dq
            g += dg
            if times and times[-1] == t:
                queued[-1], gpus[-1] = q, g
            else:
                times.append(t)
                queued.append(q)
                gpus.append(g)
        mids, queue_avg = step_average(times, queued, start_s, end_s, bucket_s)
        _, gpu_avg = step_average(times, gpus, start_s, end_s, bucket_s)
        out[tenant] = TenantSeries(tenant, mids, queue_avg, gpu_avg)
    return out


def step_average(
    times_s: Sequence[float], values: Sequence[float], start_s: float, end_s: float, bucket_s: float
) -> tuple[list[float], list[float]]:
    """Bucket averages of a piecewise-constant series (value i holds from times i to i+1)."""
    if bucket_s <= 0 or end_s <= start_s:
        return [], []
    buckets = max(1, math.ceil((end_s - start_s) / bucket_s))
    sums = [0.0] * buckets
    for k, t in enumerate(times_s):
        seg_end = times_s[k + 1] if k + 1 < len(times_s) else end_s
        a, b = max(t, start_s), min(seg_end, end_s)
        if a >= b:
            continue
        v = values[k]
        first = min(int((a - start_s) // bucket_s), buckets - 1)
        last = min(int((b - start_s) // bucket_s), buckets - 1)
        # Walk bucket indices, not times, so rounding at an edge cannot stall the walk.
        for i in range(first, last + 1):
            lo = start_s + i * bucket_s
            hi = end_s if i == buckets - 1 else lo + bucket_s
            overlap = min(b, hi) - max(a, lo)
            if overlap > 0:
                sums[i] += v * overlap
    mids = [start_s + (i + 0.5) * bucket_s for i in range(buckets)]
    widths = [min(bucket_s, end_s - (start_s + i * bucket_s)) for i in range(buckets)]
    return mids, [s / w if w > 0 else 0.0 for s, w in zip(sums, widths, strict=True)]


def step_peak(
    times_s: Sequence[float], values: Sequence[float], start_s: float, end_s: float, bucket_s: float
) -> tuple[list[float], list[float]]:
    """Bucket maxima of a piecewise-constant series."""
    if bucket_s <= 0 or end_s <= start_s or not times_s:
        return [], []
    buckets = max(1, math.ceil((end_s - start_s) / bucket_s))
    peaks = [-math.inf] * buckets
    current = values[0]
    k = 0
    # The value in force at the start of every bucket counts, as do all changes inside it.
    for i in range(buckets):
        lo = start_s + i * bucket_s
        hi = lo + bucket_s
        while k < len(times_s) and times_s[k] <= lo:
            current = values[k]
            k += 1
        peak = current
        j = k
        while j < len(times_s) and times_s[j] < hi:
            peak = max(peak, values[j])
            current = values[j]
            j += 1
        k = j
        peaks[i] = peak
    return [start_s + (i + 0.5) * bucket_s for i in range(buckets)], peaks


def format_seconds(value: float) -> str:
    """1,234.5 style; '-' for NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.1f}"


def guarantee_cell(s: Summary) -> str:
    """The per-job guarantee figures as the tables show them: jobs / over the bound (gangs) /
    longest wait; "-" for a replay that did not record them."""
    if s.guaranteed_jobs < 0:
        return "-"
    wait = "-" if math.isnan(s.guaranteed_wait_max_s) else f"{s.guaranteed_wait_max_s:,.0f}"
    return (
        f"{s.guaranteed_jobs:,} / {s.guaranteed_over_bound:,} "
        f"({s.guaranteed_over_bound_gangs:,}) / {wait}"
    )


def owed_cell(s: Summary) -> str:
    """The per-tenant guarantee figures as the tables show them: spells / past the bound
    (gangs only) / longest; "-" for a replay that did not record them."""
    if s.owed_spells < 0:
        return "-"
    return (
        f"{s.owed_spells:,} / {s.owed_over_bound:,} ({s.owed_over_bound_gangs:,}) / "
        f"{s.owed_max_s:,.0f}"
    )
