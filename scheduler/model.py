"""Plain, frozen data: a snapshot of the cluster going in, a plan coming out.

Times are seconds on one clock chosen by the caller (Unix time in production, simulated time in
the simulator); the core never reads a clock of its own. Tenants, users, nodes and GPUs are
referred to by stable string keys, jobs and attempts by integer ids.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

ANY_GPU_TYPE = ""


class VictimOrder(enum.StrEnum):
    """Which borrowed attempts a preemption takes first."""

    LOST_WORK = "lost_work"  # the least work lost: GPU-seconds since the last checkpoint + restart
    YOUNGEST = "youngest"  # the most recently started (the rule before checkpoints were known)


class Ordering(enum.StrEnum):
    """How the queue is ordered; the baselines of the simulator are orderings plus switches."""

    FAIR = "fair"  # ours: guarantee first, priority, weighted share, predicted duration, aging
    FIFO = "fifo"
    SJF = "sjf"  # shortest (predicted or oracle) duration first
    SRTF = "srtf"  # shortest remaining time first, preemptive
    LAS = "las"  # Tiresias 2D-LAS: least attained GPU-service first, no duration knowledge
    QSSF = "qssf"  # Helios: shortest predicted GPU-service first


class ReasonCode(enum.StrEnum):
    """Why a job is still pending, in a form a program can switch on."""

    QUOTA_LIMIT = "quota_limit"  # the tenant is at its limit for this GPU type
    MAX_RUNNING_JOBS = "max_running_jobs"
    NO_CAPACITY = "no_capacity"  # not enough free GPUs of the type anywhere
    RESERVED = "reserved"  # free GPUs are held for the head of the queue
    GANG_FRAGMENTED = "gang_fragmented"  # enough GPUs in total, but not placeable together
    NO_MATCHING_GPUS = "no_matching_gpus"  # no registered node could ever hold it
    # Registered nodes could hold it, but they are down, cordoned or draining (or the GPUs it
    # needs are unhealthy) now: it waits for them to come back.
    NODES_UNAVAILABLE = "nodes_unavailable"
    BUDGET_HOLD = "budget_hold"  # the tenant's energy or GPU-hour budget is spent (hold)
    BUDGET_NO_BORROWING = "budget_no_borrowing"
    WAITING_FOR_PREEMPTION = "waiting_for_preemption"  # GPUs are being reclaimed for it
    MISSING_VOLUME = "missing_volume"  # no node it could use has every volume it asks for
    STATIC_PARTITION = "static_partition"  # baselines without borrowing


@dataclass(frozen=True, slots=True)
class Gpu:
    uuid: str
    index: int
    gpu_type: str
    power_min_w: float
    power_max_w: float
    power_default_w: float
    power_cap_w: float | None = None  # the cap enforced now (None: unknown, assume default)
    healthy: bool = True


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    pool: str
    gpus: tuple[Gpu, ...]
    schedulable: bool = True  # False when cordoned, draining or not ready
    draining: bool = False
    cpus: float = 0.0  # 0 means "not tracked"
    memory_mib: int = 0
    volumes: frozenset[str] = frozenset()  # names of the storage volumes the node has


@dataclass(frozen=True, slots=True)
class PowerProfile:
    """How a job's throughput and draw depend on its GPUs' power cap (see scheduler.gpu_model).

    The defaults are a typical training job: the median of the profiles fitted to the zeus
    workloads that draw at least 60 % of the maximum cap uncapped.
    """

    # Watts one GPU of the job draws with no cap at all, as a fraction of that GPU's maximum cap.
    uncapped_fraction: float = 0.82
    # Share of the draw that does not scale with clocks (memory, fans, leakage).
    static_fraction: float = 0.27
    # Share of a step's time that follows the SM clock; 0 = not at all (memory- or input-bound).
    sensitivity: float = 0.88
    # Dynamic power follows the clock as clock ** clock_exponent (voltage falls with the clock) ...
    clock_exponent: float = 3.5
    # ... down to this share of the full clock; below it the voltage is at its floor (power ~ clock).
    floor_clock: float = 0.66
    # How many telemetry samples refined this profile (0 = the default profile).
    samples: int = 0


@dataclass(frozen=True, slots=True)
class Running:
    """An attempt that holds GPUs now."""

    attempt_id: int
    job_id: int
    tenant: str
    user: str
    priority: int
    preemptible: bool
    started_at_s: float
    gpus: tuple[str, ...]  # GPU uuids, possibly on several nodes (a gang)
    gpu_type: str  # the type of the GPUs it holds
    predicted_end_s: float | None = None
    stopping: bool = False  # already told to stop; its GPUs free up soon
    submitted_at_s: float = 0.0
    attained_service_s: float = 0.0  # GPU-seconds received so far, over all attempts (for LAS)
    # None: attained_service_s is as of the snapshot. Else the time it was counted up to, and
    # the attempt has received len(gpus) GPU-seconds per second since (scheduler.priority.
    # attained_now): a caller that hands the same objects to many cycles (the simulator) need
    # not remake every one as its service grows.
    attained_as_of_s: float | None = None
    remaining_s: float | None = None  # oracle remaining time (simulator only, for SRTF)
    # Times the job was preempted before this attempt (Config.max_preemptions).
    preemptions: int = 0
    power_profile: PowerProfile = field(default_factory=PowerProfile)
    # What it holds besides GPUs, so a node's tracked CPUs and memory are not promised twice.
    cpus: float = 0.0
    memory_mib: int = 0
    # Its notice before a stop: a preempted attempt holds its GPUs up to this long.
    grace_s: float = 0.0
    # For an attempt already stopping: when its grace ends (its GPUs are free by then at latest).
    stop_by_s: float | None = None
    # When the job last reported a checkpoint (over all its attempts; None: never), and how often
    # it says it checkpoints (None: not said). A preemption loses the work since the last one.
    last_checkpoint_s: float | None = None
    checkpoint_interval_s: float | None = None


@dataclass(frozen=True, slots=True)
class Pending:
    """A job waiting for GPUs."""

    job_id: int
    tenant: str
    user: str
    name: str
    gpus: int
    gpu_type: str = ANY_GPU_TYPE
    priority: int = 100
    preemptible: bool = True
    submitted_at_s: float = 0.0
    predicted_duration_s: float | None = None  # from history or, in the simulator, the oracle
    estimated_duration_s: float | None = None  # what the user said
    max_runtime_s: float | None = None
    attained_service_s: float = 0.0  # GPU-seconds received in earlier attempts (for LAS)
    cpus: float = 0.0
    memory_mib: int = 0
    volumes: tuple[str, ...] = ()  # storage volumes it mounts: only nodes with all of them
    grace_s: float = 0.0  # its notice before a stop, once it runs
    # Jobs submitted together as one sweep (a job array's id): their finished siblings predict
    # their duration best. None: a job of its own.
    group: int | None = None
    # Times it was preempted so far: at Config.max_preemptions it may no longer borrow.
    preemptions: int = 0


@dataclass(frozen=True, slots=True)
class Quota:
    gpu_type: str  # ANY_GPU_TYPE caps the sum over all types
    guaranteed_gpus: int
    limit_gpus: int


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    weight: float = 1.0
    quotas: tuple[Quota, ...] = ()
    max_running_jobs: int | None = None
    # Energy / GPU-hour budgets, already turned into what the core needs this cycle.
    budget_action: str | None = None  # "throttle" | "no_borrowing" | "hold" when a budget is spent
    power_pace_w: float | None = None  # watts it may draw on average for the rest of its period


@dataclass(frozen=True, slots=True)
class HistoryRecord:
    """A finished job, for duration prediction."""

    tenant: str
    user: str
    name: str
    gpus: int
    duration_s: float
    group: int | None = None  # as Pending.group


@dataclass(frozen=True, slots=True)
class Pool:
    name: str
    power_budget_w: float | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    now_s: float
    nodes: tuple[Node, ...]
    running: tuple[Running, ...] = ()
    pending: tuple[Pending, ...] = ()
    tenants: tuple[Tenant, ...] = ()
    pools: tuple[Pool, ...] = ()
    history: tuple[HistoryRecord, ...] = ()


@dataclass(frozen=True, slots=True)
class Config:
    ordering: Ordering = Ordering.FAIR
    borrowing: bool = True  # lend idle capacity beyond guarantees
    preemption: bool = True  # reclaim borrowed GPUs for work within a guarantee
    backfill: bool = True
    min_runtime_s: float = 60.0  # never preempt an attempt younger than this (no thrashing)
    # An attempt of a job preempted this many times already is not preempted again (None: no
    # bound), so no job restarts over and over; draining a node still stops it. Such a job may
    # then start only within its tenant's guarantee, as a job that cannot be preempted: GPUs it
    # borrowed could not be given back to the tenant they belong to (scheduler.quota.check).
    # A job its tenant's guarantee cannot hold (quota.PreemptionBound) is not bounded: it could
    # never start again. 5 keeps every promise of the saturated replays at L = 6 and 8 and
    # costs them under 3 % (docs/simulator-saturation.md, thirteenth pass).
    max_preemptions: int | None = 5
    victim_order: VictimOrder = VictimOrder.LOST_WORK
    # What restarting a victim costs besides the work it loses (image, data, checkpoint load).
    restart_cost_s: float = 60.0
    # Waiting raises a job's rank: every aging_period_s of waiting counts like one priority step.
    aging_period_s: float = 3600.0
    # Default when neither history nor the user gives a duration and there is no max runtime.
    default_duration_s: float = 3600.0
    power_planning: bool = True
    power_step_w: float = 25.0
    # Caps move only when the new one differs by more than this (hysteresis against flapping).
    power_hysteresis_w: float = 10.0
    # "Eco" mode: with no binding budget, run each job at the least-energy cap that makes it at
    # most this much slower (0.05 = 5 %); None runs unconstrained jobs uncapped.
    eco_max_slowdown: float | None = None


def config_with(base: Config, changes: Mapping[str, object]) -> Config:
    """``base`` with ``changes`` (an operator's settings, a benchmark's variant) applied, checked
    here: an unknown field is an error naming it, and a choice given by name (``"sjf"``) becomes
    its member, so that a compiled core (scheduler.native), which checks every field's type,
    takes the same settings as the source."""
    known = {f.name: getattr(base, f.name) for f in fields(Config)}
    unknown = sorted(set(changes) - set(known))
    if unknown:
        raise ValueError(f"unknown Config fields: {', '.join(unknown)}")
    typed: dict[str, Any] = {}
    for name, value in changes.items():
        current = known[name]
        if isinstance(current, enum.Enum) and isinstance(value, str):
            try:
                value = type(current)(value)
            except ValueError:
                choices = ", ".join(m.value for m in type(current))
                raise ValueError(f"{name}={value!r}: expected one of {choices}") from None
        typed[name] = value
    return replace(base, **typed)


@dataclass(frozen=True, slots=True)
class Start:
    job_id: int
    # One entry per node the job lands on: (node name, GPU uuids on it).
    placements: tuple[tuple[str, tuple[str, ...]], ...]
    borrowed: bool

    @property
    def gpu_uuids(self) -> tuple[str, ...]:
        return tuple(u for _, uuids in self.placements for u in uuids)

    @property
    def node(self) -> str:
        return self.placements[0][0]


@dataclass(frozen=True, slots=True)
class Preemption:
    attempt_id: int
    job_id: int
    reason: str
    for_job_id: int | None = None


@dataclass(frozen=True, slots=True)
class PendingDecision:
    job_id: int
    reason_code: ReasonCode
    reason: str  # a sentence a person understands
    queue_position: int  # 1 = next in line
    estimated_start_s: float | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    starts: tuple[Start, ...] = ()
    preemptions: tuple[Preemption, ...] = ()
    pending: tuple[PendingDecision, ...] = ()
    power_caps_w: dict[str, float] = field(default_factory=dict)  # GPU uuid -> cap
    predicted_duration_s: dict[int, float] = field(default_factory=dict)  # job id -> prediction
    # Wall seconds per named step; measurement only, so equal plans compare equal without it.
    step_seconds: dict[str, float] = field(default_factory=dict, compare=False)
    # GPU type -> how many jobs had been left waiting (queue positions given out) when GPUs of
    # the type being freed (by a preemption or a stop under way) were last seen unclaimed after
    # a job was decided: a job considered after that point might have taken them. The trace
    # simulator's window reads it to tell whether a job it did not show could have got
    # anything; nothing decides on it, so equal plans compare equal without it.
    soon_left_after: dict[str, int] = field(default_factory=dict, compare=False)
