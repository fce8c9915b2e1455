"""What a replay measured: a module of its own, left uncompiled (scheduler.native), because
replays are kept as pickles (the sweep's and the benchmark's --results) and a frozen dataclass
compiled by mypyc cannot be unpickled."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class JobOutcome:
    job_id: int
    tenant: str
    gpus: int
    submit_s: float
    first_start_s: float
    finish_s: float
    duration_s: float  # the trace's run time
    held_s: float  # seconds it held GPUs, over all attempts (restarts and capping included)
    preemptions: int
    restart_overhead_s: float

    @property
    def jct_s(self) -> float:
        return self.finish_s - self.submit_s

    @property
    def queue_s(self) -> float:
        """Total time pending: before the first start and after every preemption."""
        return max(self.jct_s - self.held_s, 0.0)


@dataclass
class Result:
    """Everything a replay measured; ``metrics.summarize`` turns it into figures."""

    outcomes: list[JobOutcome]
    unfinished_job_ids: list[int]
    tenants: tuple[str, ...]
    total_gpus: int
    # Piecewise-constant series, one point per change: time, busy GPUs, pool draw (W, all pools).
    timeline_t_s: list[float]
    timeline_busy_gpus: list[int]
    timeline_power_w: list[float]
    energy_j: float
    peak_power_w: float
    power_budget_w: float | None
    over_budget_s: float
    preemptions: int
    # (restart overhead + progress since the last checkpoint thrown away) x GPUs
    preempted_gpu_s_lost: float
    plan_calls: int
    cycles_skipped: int
    events: int
    wall_s: float
    cpu_s: float  # process CPU time of the replay (the machine may be shared; wall time lies)
    plan_wall_s: float
    power_wall_s: float
    first_submit_s: float
    # The part of preempted_gpu_s_lost that is progress since the last checkpoint (the rest is
    # restarts).
    preempted_gpu_s_progress: float = 0.0
    # Instants at which more than _MAX_PREEMPTING_CYCLES_AT_ONCE cycles in a row preempted work
    # (the policy undoing its own decisions): the cycles were held back to the next tick there.
    # 0 for a policy that does not thrash; anything else is a defect of the policy.
    thrash_stalls: int = 0
    # Plans asked again with a larger window of the backlog (see _Engine._window).
    window_replans: int = 0
    # Jobs that arrived within their tenant's guarantee: the GPUs the tenant held, plus those
    # of its jobs already waiting, plus the job's own, were within the GPUs guaranteed to it
    # (None: a replay made before this was recorded).
    within_guarantee_job_ids: frozenset[int] | None = None
    # How long such a job may wait under the preemption rules: a borrower becomes a candidate
    # once it has run min_runtime_s, then has the notice (grace_s) to leave, and the cycle that
    # sees it may be one tick later.
    guarantee_wait_bound_s: float | None = None
    # The promise per tenant, whichever of its jobs a policy serves first: each spell during
    # which a tenant held fewer GPUs than guaranteed while a job of it that fits in the rest
    # waited, as (seconds, the longest stretch of it during which a one-GPU job waited: the
    # rest only gangs waited through); spells of no length left out. None: a replay made
    # before this was recorded.
    owed_spells: list[tuple[float, float]] | None = None
