"""A discrete-event simulation that drives the production ``plan`` with snapshots of a trace.

Events: job arrivals, attempt completions, and scheduling cycles. A cycle builds a
:class:`~scheduler.model.Snapshot` of the simulated cluster, calls ``plan`` exactly as the
Celery loop does, checks the plan against the contract (a start on a busy GPU, a job that is
not pending, a tenant past its limit: :class:`PlanError`, never a silent fix) and applies it.

When cycles run: like the control plane, an arrival or a completion requests a cycle (at once
when none ran in the last ``debounce_s``, else ``debounce_s`` after the last one), and a periodic tick every ``cycle_s`` serves what only time changes (a victim
passing its minimum run time, LAS ranks that move as running jobs attain service). ``plan`` is
not called when it has nothing to decide: no job pending (and no power budget to hold), or
nothing changed since its last call and nothing in the config depends on the passing of time.
So quiet periods cost nothing.

Preemption frees the GPUs at once, unless jobs get a notice (SimOptions.grace_s): then a
victim whose next checkpoint falls within it keeps its GPUs (stopping) until that checkpoint,
saves it, and leaves; any other leaves at once, as a job does on a stop signal it does not
handle. By default the job keeps
its progress (as if checkpointed continuously) and pays a restart cost when it starts again
(Helios: 7 s on 1 GPU, 30 s up to 8, 60 s beyond), during which it holds its GPUs without
progressing. With checkpoint intervals (SimOptions.checkpoints, scheduler.simulator.checkpoints)
a preempted job resumes from its last checkpoint instead, losing the work done since, and pays
Config.restart_cost_s; the snapshot then tells the plan each attempt's interval and last
checkpoint, unless SimOptions.checkpoint_knowledge hides them. Power caps from the plan stretch run time through
``scheduler.gpu_model.relative_throughput`` (a gang runs at the pace of its slowest GPU), and the
pool's draw is integrated with ``scheduler.gpu_model.power_draw_w`` into energy.

Snapshots are built incrementally: Node, Pending and Running objects are cached and rebuilt only
when what they say changes (a cap, a requeue, a start); only the orderings whose ranks move with
time (SRTF's remaining time, LAS's attained service) rebuild their Running objects, once per
instant.

Static partitions (``SimOptions.partitioned_tenants``) are planned apart, as the published
simulators run each VC on its own: an event plans only the partitions it touched, with only
their pending jobs, nodes and attempts in the snapshot, and the periodic tick plans every
partition with work pending. A partition no event touched would get the same answer again (its
jobs did not fit, and nothing of its changed). Under SRTF and LAS, attempts that no pending job
of their partition can beat are handed over as not preemptible, so the plan's victim searches
walk only the attempts that could lose. Both keep every decision of a whole-cluster snapshot
(a test replays both ways); a power budget turns them off, as the cap planner weighs the pool.
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

from scheduler import gpu_model, power
from scheduler.model import (
    ANY_GPU_TYPE,
    Config,
    HistoryRecord,
    Node,
    Ordering,
    Pending,
    Plan,
    Pool,
    PowerProfile,
    ReasonCode,
    Running,
    Snapshot,
    Start,
    Tenant,
)
from scheduler.predict import normalise_name
from scheduler.priority import LAS_QUEUE_THRESHOLDS_GPU_S, las_queue
from scheduler.quota import PreemptionBound
from scheduler.simulator.checkpoints import CheckpointIntervals
from scheduler.simulator.errors import PlanError as PlanError  # raised here; re-exported
from scheduler.simulator.policies import Oracle
from scheduler.simulator.results import JobOutcome as JobOutcome
from scheduler.simulator.results import Result as Result
from scheduler.simulator.trace import PARTITION_SEPARATOR, TraceJob

PlanFunction = Callable[[Snapshot, Config], Plan]
_DEFAULT_PROFILE = PowerProfile()
_INF = math.inf
# Changes of a class noted for its kept aging levels (_Engine._log_change) past which the
# levels are sorted anew instead.
_LEVEL_PATCH_MAX = 256
# Reasons that say the plan is waiting on time, not on an event.
# Cycles at one instant that may each preempt before the policy is taken to be thrashing.
_MAX_PREEMPTING_CYCLES_AT_ONCE = 1000
_TIME_BOUND_REASONS = frozenset({ReasonCode.RESERVED, ReasonCode.WAITING_FOR_PREEMPTION})


@dataclass(frozen=True, slots=True)
class RestartCost:
    """Seconds a preempted job spends restarting (holding its GPUs, not progressing)."""

    one_gpu_s: float = 7.0
    up_to_8_gpus_s: float = 30.0
    beyond_8_gpus_s: float = 60.0

    def for_gpus(self, gpus: int) -> float:
        """The restart cost of a job of ``gpus`` GPUs."""
        if gpus <= 1:
            return self.one_gpu_s
        return self.up_to_8_gpus_s if gpus <= 8 else self.beyond_8_gpus_s


@dataclass(frozen=True, slots=True)
class Progress:
    sim_time_s: float
    jobs_done: int
    jobs_total: int
    events: int
    plan_calls: int
    wall_s: float


@dataclass(frozen=True)
class SimOptions:
    """How the simulation runs, beyond the policy's Config."""

    cycle_s: float = 60.0  # periodic scheduling tick
    event_cycles: bool = True  # arrivals and completions request a cycle, as in the control plane
    debounce_s: float = 0.0  # the least time between a cycle and the next requested one
    restart_cost: RestartCost = field(default_factory=RestartCost)
    oracle: Oracle = Oracle.NONE
    power_budget_w: float | None = None  # of every pool that has none of its own
    # Finished jobs kept per tenant for duration prediction (what a history loader would keep).
    # A snapshot carries the history of the tenants (and users) that have jobs pending, which is
    # all the predictor reads: it matches a job against its own user's and tenant's runs.
    history_per_tenant: int = 200
    progress: Callable[[Progress], None] | None = None
    progress_every_events: int = 5000
    # Called with every snapshot and the plan made for it (tests, debugging).
    on_cycle: Callable[[Snapshot, Plan], None] | None = None
    # Every tenant runs on GPUs of its own type and borrows nothing (static node partitions):
    # no decision about one tenant can then depend on another tenant's attempts, so a snapshot
    # carries only the nodes and attempts of tenants with jobs pending, which keeps the plan's
    # work proportional to the partitions in play (ANCHORS' simulators run each VC on its own).
    # Ignored when power caps are planned: the cap planner weighs each pool as a whole.
    partitioned_tenants: bool = False
    # How often jobs checkpoint (scheduler.simulator.checkpoints); by default continuously.
    checkpoints: CheckpointIntervals = field(default_factory=CheckpointIntervals)
    # Whether the plan is told each attempt's checkpoint interval and last checkpoint.
    checkpoint_knowledge: bool = True
    # The notice every job gets before a preemption stops it (with checkpoint intervals only).
    grace_s: float = 0.0
    # Hand the plan only the head of each class of alike pending jobs (see _Engine._window),
    # and skip a cycle of a non-preemptive config with no GPU free: the same decisions as the
    # whole backlog, at a cost that does not grow with it. It relies on the rules of
    # scheduler.policy.plan (a job that gets nothing changes nothing): False for a policy of
    # other rules, or to see the plan at every cycle.
    window: bool = True


class _Job:
    __slots__ = (
        "trace",
        "work_left_s",
        "attained_gpu_s",
        "preemptions",
        "overhead_s",
        "held_s",
        "first_start_s",
        "pending",
        "attempt",
        "interval_s",
        "saved_work_left_s",
        "last_checkpoint_s",
        "queued_as",
    )

    def __init__(self, trace: TraceJob, interval_s: float | None):
        self.trace = trace
        self.work_left_s = trace.duration_s
        self.interval_s = interval_s  # how often it checkpoints (None: never, or continuously)
        self.saved_work_left_s = trace.duration_s  # the work left at its last checkpoint
        self.last_checkpoint_s: float | None = None
        self.attained_gpu_s = 0.0
        self.preemptions = 0
        self.overhead_s = 0.0
        self.held_s = 0.0
        self.first_start_s: float | None = None
        self.pending: Pending | None = None
        self.attempt: _Attempt | None = None
        # (its class, its entry in the class's queue) while pending and windowed
        self.queued_as: tuple[tuple[object, ...], tuple[float | int, ...]] | None = None


class _Attempt:
    __slots__ = (
        "attempt_id",
        "job",
        "gpus",
        "gpu_type",
        "start_s",
        "progress_from_s",
        "speed",
        "end_s",
        "version",
        "predicted_end_s",
        "running",
        "running_at_s",
        "shielded",
        "pool_index",
        "segments",
        "stop_s",
    )
    attempt_id: int
    job: _Job
    gpus: tuple[str, ...]
    gpu_type: str
    start_s: float
    progress_from_s: float  # when it starts making progress (after its restart cost)
    speed: float  # relative throughput of its slowest GPU at the caps in force
    end_s: float
    version: int  # bumped when its end moves, so a queued completion event can tell it is stale
    predicted_end_s: float | None
    running: Running  # the object the last plan saw
    running_at_s: float  # when ``running`` was made
    shielded: bool
    pool_index: int
    # (from, work left then, speed since) each time its speed was set: its progress over time,
    # to know what a checkpoint at an earlier moment saved.
    segments: list[tuple[float, float, float]]
    stop_s: float | None  # preempted with notice: when it leaves, at its checkpoint


class _Engine:
    def __init__(
        self,
        jobs: Sequence[TraceJob],
        nodes: Sequence[Node],
        tenants: Sequence[Tenant],
        config: Config,
        options: SimOptions,
        policy: PlanFunction,
        pools: Sequence[Pool] | None,
    ):
        self.config = config
        self.options = options
        self.policy = policy
        self.jobs = sorted(jobs, key=lambda j: (j.submit_s, j.job_id))
        ids = [j.job_id for j in self.jobs]
        if len(set(ids)) != len(ids):
            raise ValueError("job ids of a replay must be unique")
        self.tenants = tuple(tenants)
        self.bound = PreemptionBound(config.max_preemptions, self.tenants)
        known_tenants = {t.name for t in self.tenants}
        for j in self.jobs:
            if j.tenant not in known_tenants:
                raise ValueError(f"job {j.job_id} belongs to unknown tenant {j.tenant!r}")

        # Nodes, their GPUs, and the caps in force.
        self.node_list = list(nodes)
        self.node_index = {n.name: i for i, n in enumerate(self.node_list)}
        self.nodes_tuple = tuple(self.node_list)
        pool_names = sorted({n.pool for n in self.node_list})
        given = {p.name: p for p in (pools or ())}
        self.pools = tuple(
            given.get(name) or Pool(name, power_budget_w=options.power_budget_w)
            for name in pool_names
        )
        pool_pos = {p.name: i for i, p in enumerate(self.pools)}
        self.gpu_node: dict[str, int] = {}
        self.gpu_type: dict[str, str] = {}
        self.gpu_cap_w: dict[str, float] = {}
        self.gpu_max_w: dict[str, float] = {}
        self.gpu_idle_w: dict[str, float] = {}
        self.gpu_pool: dict[str, int] = {}
        for i, n in enumerate(self.node_list):
            for g in n.gpus:
                if g.uuid in self.gpu_node:
                    raise ValueError(f"GPU {g.uuid} appears twice")
                self.gpu_node[g.uuid] = i
                self.gpu_type[g.uuid] = g.gpu_type
                self.gpu_max_w[g.uuid] = g.power_max_w
                self.gpu_cap_w[g.uuid] = (
                    g.power_cap_w if g.power_cap_w is not None else g.power_default_w
                )
                board = replace(g, gpu_type=g.gpu_type.split(PARTITION_SEPARATOR, 1)[0])
                self.gpu_idle_w[g.uuid] = gpu_model.idle_power_w(board)
                self.gpu_pool[g.uuid] = pool_pos[n.pool]
        self.total_gpus = len(self.gpu_node)
        self.gpu_owner: dict[str, _Attempt] = {}
        self.busy_gpus = 0

        # Quota limits the plan must respect: (tenant, type) -> limit.
        self.limits: dict[tuple[str, str], int] = {}
        for t in self.tenants:
            for q in t.quotas:
                self.limits[(t.name, q.gpu_type)] = q.limit_gpus
        self.usage: dict[tuple[str, str], int] = {}

        # Queue state.
        self.state: dict[int, _Job] = {}
        self.pending: dict[int, _Job] = {}
        self.running: dict[int, _Attempt] = {}
        # The snapshot's objects, kept beside the state so a tuple of them is one C-level copy.
        self.pending_objs: dict[int, Pending] = {}
        self.running_objs: dict[int, Running] = {}
        self.pending_tuple: tuple[Pending, ...] | None = ()
        self.running_tuple: tuple[Running, ...] | None = ()
        self.tenant_running: dict[str, dict[int, _Attempt]] = {t.name: {} for t in self.tenants}
        # tenant -> priority -> how many of its running attempts are preemptible: which cut
        # class may claim GPUs of its own tenant's lower-priority work (_tail_may_claim), asked
        # at most plans, without a walk over every running attempt.
        self.preemptible_running: dict[str, dict[int, int]] = {}
        self.power_active = any(p.power_budget_w is not None for p in self.pools)
        # The cap planner weighs a pool's draw as a whole: it must see every node and attempt.
        self.partitioned = options.partitioned_tenants and not self._power_asked_for()
        # tenant -> indices of its partition's nodes; tenants in play -> their nodes, in order.
        self.partition_nodes: dict[str, list[int]] = {}
        self.nodes_in_play: dict[tuple[str, ...], tuple[Node, ...]] = {}
        # Per tenant, its pending jobs in queue order (partitioned replays plan tenants apart).
        self.tenant_pending: dict[str, dict[int, Pending]] = {t.name: {} for t in self.tenants}
        # Tenants whose partition changed since they were last planned, and those whose last
        # plan left a job waiting on time (a reservation, a preemption under way).
        self.dirty_tenants: set[str] = set()
        self.time_bound_tenants: set[str] = set()
        self.tick_at = _INF  # the next periodic tick that plans every tenant with work pending
        if self.partitioned:
            self._check_partitioned()
        self.next_attempt_id = 1
        self.completions: list[tuple[float, int, int, int]] = []  # (end, seq, attempt, version)
        self.seq = 0
        self.outcomes: list[JobOutcome] = []

        # History for prediction, per tenant.
        self.history: dict[str, deque[HistoryRecord]] = {}
        self.history_of: dict[str, tuple[HistoryRecord, ...]] = {}  # tenant -> cached tuple
        # Tenants -> their records as one tuple, kept until a job finishes: the predictor
        # indexes a history once per tuple it is given, so the same tuple must come back.
        self.history_joined: dict[tuple[str, ...], tuple[HistoryRecord, ...]] = {}
        self.user_tenants: dict[str, set[str]] = {}
        self.uses_history = options.oracle is Oracle.NONE
        # The durations of the history by what the predictor matches a job on, each list sorted
        # ((user, kind, GPUs), (tenant, kind, GPUs)): windowed replays predict each class here,
        # as scheduler.predict would from the same records, instead of handing the plan a
        # history whose index it would rebuild after every completion (see _window).
        self.durations_by_user: dict[tuple[str, str, int], list[float]] = {}
        self.durations_by_tenant: dict[tuple[str, str, int], list[float]] = {}
        self.predicted_objs: dict[int, Pending] = {}  # job id -> its Pending with the prediction

        # Cycle control.
        self.cycle_at = _INF
        self.last_cycle_s = -_INF
        self.preempting_at_s = -_INF
        self.preempting_cycles = 0
        # Set when the policy thrashed at one instant: no cycle before then (see _cycle).
        self.hold_cycles_until_s = -_INF
        self.thrash_stalls = 0
        self.dirty = False
        self.last_start_s = -_INF
        self.last_plan: Plan | None = None
        # When the last plan was made: what it could not take then (an attempt younger than
        # min_runtime_s) may be taken at a later tick with no event in between.
        self.last_plan_s = -_INF
        # LAS ranks running attempts by the service they attained, which moves with time: their
        # objects are made anew for each instant. SRTF's remaining time moves too, but the plan
        # works it out itself from predicted_end_s (the oracle's end) when remaining_s is None,
        # to the same value: the objects stay, and a cycle does not remake thousands of them.
        self.time_dependent_order = config.ordering is Ordering.LAS
        # On the shared pool (one plan for the whole cluster) an attempt's object states its
        # attained service as of its start and the plan adds the rest (Running.attained_as_of_s):
        # the same objects serve every cycle. Partitions keep remaking theirs (_shield_rank).
        self.attained_lazily = (
            self.time_dependent_order
            and not self.partitioned
            and options.oracle is not Oracle.REMAINING
        )
        self.las_preempts = config.ordering is Ordering.LAS and config.preemption
        # (when, attempt id, threshold): a running attempt's attained service crosses a LAS queue
        # threshold, the one change of LAS ranks that time alone makes (see _note_crossings).
        self.las_crossings: list[tuple[float, int, float]] = []

        # Power: per-GPU draw, per-pool sums, integrated energy.
        self._draw_memo: dict[tuple[float, float, float, bool], float] = {}
        self._speed_memo: dict[tuple[float, float], float] = {}
        self.gpu_draw_w: dict[str, float] = {}
        self.pool_draw_w = [0.0] * len(self.pools)
        for uuid in self.gpu_node:
            draw = self._idle_draw(uuid)
            self.gpu_draw_w[uuid] = draw
            self.pool_draw_w[self.gpu_pool[uuid]] += draw
        self.power_t = self.jobs[0].submit_s if self.jobs else 0.0
        self.energy_j = 0.0
        self.over_budget_s = 0.0
        self.peak_power_w = sum(self.pool_draw_w)
        self.timeline_t: list[float] = []
        self.timeline_busy: list[int] = []
        self.timeline_power: list[float] = []

        self.preemptions = 0
        self.lost_gpu_s = 0.0
        self.lost_progress_gpu_s = 0.0
        self.continuous = options.checkpoints.continuous
        self.grace_s = 0.0 if self.continuous else options.grace_s
        self.tell_checkpoints = options.checkpoint_knowledge and not self.continuous
        # (time, attempt id) of every attempt's next checkpoint, for the snapshot to show it
        self.checkpoint_due: list[tuple[float, int]] = []
        self.plan_calls = 0
        self.cycles_skipped = 0
        self.events = 0
        self.plan_wall_s = 0.0
        self.power_wall_s = 0.0

        # The window (see _window): pending jobs by class, each class in the plan's own order.
        self.windowed = options.window and not self.power_active
        # Under FAIR with oracle durations a class's order moves with aging (the aged priority
        # comes before the duration): each class is kept in submit order and cut, at each
        # cycle, into its aging levels, each in the plan's order (see _aged_levels).
        self.aged_levels = config.ordering is Ordering.FAIR and options.oracle is not Oracle.NONE
        # class -> the jobs that came (+1) and went (-1) since its levels in level_cache were
        # worked out, with their rows
        self.class_log: dict[tuple[object, ...], list[tuple[int, tuple[float | int, ...]]]] = {}
        # class -> each job's row in its aging level's order (predicted duration, then its
        # entry), in the order of the class's queue (self.classes).
        self.class_rows: dict[tuple[object, ...], list[tuple[float | int, ...]]] = {}
        # This cycle's aging levels of each class: (class, level) -> its entries in plan order.
        self.level_queues: dict[tuple[object, ...], list[tuple[float | int, ...]]] = {}
        # class -> (its version, the instant its levels stay good until, (level, rows) pairs,
        # the rows of each run of the queue by its first and last entry):
        # a class's levels change only when one of its jobs comes or goes (the version, bumped
        # by _queue_in_class and _unqueue_from_class) or waits into its next level.
        self.level_cache: dict[
            tuple[object, ...],
            tuple[
                int,
                float,
                list[tuple[int, list[tuple[float | int, ...]]]],
                dict[tuple[object, ...], list[tuple[float | int, ...]]],
            ],
        ] = {}
        self.class_version: dict[tuple[object, ...], int] = {}
        self.classes: dict[tuple[object, ...], list[tuple[float | int, ...]]] = {}
        self.by_duration = options.oracle is not Oracle.NONE and config.ordering in (
            Ordering.SJF,
            Ordering.SRTF,
            Ordering.QSSF,
        )
        self.free_of_type: dict[str, int] = {}
        for gpu_type in self.gpu_type.values():
            self.free_of_type[gpu_type] = self.free_of_type.get(gpu_type, 0) + 1
        self.guaranteed_gpus = {
            t.name: sum(q.guaranteed_gpus for q in t.quotas) for t in self.tenants
        }
        self.within_guarantee: set[int] = set()
        # How many of each tenant's waiting jobs ask for each number of GPUs (>= 1): the GPUs
        # it waits for and its smallest claim without walking the backlog. And each owed
        # tenant's spell: (since when, since when a one-GPU job waits or None, the longest such
        # stretch so far), see Result.owed_spells.
        self.pending_sizes: dict[str, Counter[int]] = {t.name: Counter() for t in self.tenants}
        self.owed_since: dict[str, tuple[float, float | None, float]] = {}
        self.owed_spells: list[tuple[float, float]] = []
        self.window_replans = 0

    # ----- power -------------------------------------------------------------------------------

    def _draw(self, uuid: str, busy: bool) -> float:
        cap = self.gpu_cap_w[uuid]
        key = (cap, self.gpu_max_w[uuid], self.gpu_idle_w[uuid], busy)
        draw = self._draw_memo.get(key)
        if draw is None:
            draw = gpu_model.power_draw_w(
                _DEFAULT_PROFILE, cap, key[1], key[2], utilization=1.0 if busy else 0.0
            )
            self._draw_memo[key] = draw
        return draw

    def _idle_draw(self, uuid: str) -> float:
        return self._draw(uuid, busy=False)

    def _speed(self, gpus: tuple[str, ...]) -> float:
        slowest = 1.0
        for uuid in gpus:
            key = (self.gpu_cap_w[uuid], self.gpu_max_w[uuid])
            speed = self._speed_memo.get(key)
            if speed is None:
                speed = gpu_model.relative_throughput(_DEFAULT_PROFILE, key[0], key[1])
                self._speed_memo[key] = speed
            slowest = min(slowest, speed)
        return max(slowest, 1e-6)

    def _advance_power(self, now_s: float) -> None:
        dt = now_s - self.power_t
        if dt > 0:
            self.energy_j += sum(self.pool_draw_w) * dt
            for i, pool in enumerate(self.pools):
                budget = pool.power_budget_w
                if budget is not None and self.pool_draw_w[i] > budget + 1e-6:
                    self.over_budget_s += dt
                    break
            self.power_t = now_s

    def _set_draw(self, uuid: str, draw: float) -> None:
        old = self.gpu_draw_w[uuid]
        if old != draw:
            self.gpu_draw_w[uuid] = draw
            self.pool_draw_w[self.gpu_pool[uuid]] += draw - old

    def _record(self, now_s: float) -> None:
        total_w = sum(self.pool_draw_w)
        if total_w > self.peak_power_w:
            self.peak_power_w = total_w
        if self.timeline_t and self.timeline_t[-1] == now_s:
            self.timeline_busy[-1] = self.busy_gpus
            self.timeline_power[-1] = total_w
        else:
            self.timeline_t.append(now_s)
            self.timeline_busy.append(self.busy_gpus)
            self.timeline_power.append(total_w)

    # ----- queue -------------------------------------------------------------------------------

    def _make_pending(self, job: _Job) -> Pending:
        t = job.trace
        oracle = self.options.oracle
        if oracle is Oracle.DURATION:
            predicted = t.duration_s
        elif oracle is Oracle.REMAINING:
            # What it will hold GPUs for once started, restart included, as a running attempt's
            # remaining_s counts it: were the restart left out, two jobs of nearly equal
            # remaining time would preempt each other at every cycle and neither progress.
            predicted = job.work_left_s
            if job.preemptions:
                predicted += self._restart_s(t.gpus)
        else:
            predicted = None
        return Pending(
            job_id=t.job_id,
            tenant=t.tenant,
            user=t.user,
            name=t.name,
            gpus=t.gpus,
            gpu_type=t.gpu_type,
            priority=t.priority,
            preemptible=t.preemptible,
            submitted_at_s=t.submit_s,
            predicted_duration_s=predicted,
            attained_service_s=job.attained_gpu_s,
            cpus=t.cpus,
            memory_mib=t.memory_mib,
            preemptions=job.preemptions,
        )

    def _enqueue(self, job: _Job) -> None:
        job.pending = self._make_pending(job)
        self.pending[job.trace.job_id] = job
        if job.trace.gpus > 0:
            self.pending_sizes[job.trace.tenant][job.trace.gpus] += 1
        self.pending_objs[job.trace.job_id] = job.pending
        self.tenant_pending[job.trace.tenant][job.trace.job_id] = job.pending
        self.pending_tuple = None
        if self.windowed:
            self.predicted_objs.pop(job.trace.job_id, None)  # its Pending was made anew
            self._queue_in_class(job, job.pending)

    def _queue_in_class(self, job: _Job, p: Pending) -> None:
        """File a pending job in its class, at its place in the plan's order of that class.

        A class is what every step of the plan looks at besides the job's place in the queue:
        tenant, size, type, priority, resources, and what its duration is predicted from (user,
        kind of name, GPUs: the same history, so the same prediction), whether it may still
        borrow, and its LAS queue. Within
        a class the plan's queue order is submit time under every ordering (FAIR's aged priority
        rises with waiting, so it too puts older first), or the oracle duration first.
        """
        t = job.trace
        klass: tuple[object, ...] = (
            t.tenant,
            t.gpus,
            t.gpu_type,
            t.priority,
            t.preemptible,
            t.cpus,
            t.memory_mib,
            t.user,
            normalise_name(t.name),
            # One at the preemption bound may only start within its guarantee.
            self.bound.reached(t.tenant, t.gpu_type, t.gpus, job.preemptions),
        )
        if self.config.ordering is Ordering.LAS:
            klass = (*klass, las_queue(p.attained_service_s))
        entry: tuple[float | int, ...]
        if self.by_duration and p.predicted_duration_s is not None:
            entry = (p.predicted_duration_s, t.submit_s, t.job_id)
        else:
            entry = (t.submit_s, t.job_id)
        queue = self.classes.get(klass)
        if queue is None:
            queue = self.classes[klass] = []
        at = len(queue) if not queue or entry > queue[-1] else bisect.bisect_left(queue, entry)
        queue.insert(at, entry)
        job.queued_as = (klass, entry)
        if self.aged_levels:
            self.class_version[klass] = self.class_version.get(klass, 0) + 1
            # The job's row in its aging level's order, made once: a level is a slice of these,
            # sorted (_aged_levels), not rows made anew for every job at every change.
            predicted = p.predicted_duration_s
            assert predicted is not None, "an oracle replay states every duration"
            if p.max_runtime_s is not None and predicted > p.max_runtime_s:
                predicted = p.max_runtime_s  # as scheduler.predict bounds it
            row = (max(predicted, 0.0), *entry)
            self.class_rows.setdefault(klass, []).insert(at, row)
            self._log_change(klass, 1, row)

    def _unqueue_from_class(self, job: _Job) -> None:
        if job.queued_as is None:
            return
        klass, entry = job.queued_as
        queue = self.classes[klass]
        i = bisect.bisect_left(queue, entry)
        del queue[i]
        job.queued_as = None
        if self.aged_levels:
            self._log_change(klass, -1, self.class_rows[klass].pop(i))
        if not queue:
            del self.classes[klass]
            self.class_version.pop(klass, None)
            self.level_cache.pop(klass, None)
            self.class_rows.pop(klass, None)
            self.class_log.pop(klass, None)
        elif self.aged_levels:
            self.class_version[klass] += 1

    def _log_change(
        self, klass: tuple[object, ...], sign: int, row: tuple[float | int, ...]
    ) -> None:
        """Note a job that came (+1) or went (-1) for the class's aging levels kept in
        level_cache, which _aged_levels patches with these instead of sorting them anew."""
        if klass not in self.level_cache:
            return
        changes = self.class_log.setdefault(klass, [])
        if len(changes) >= _LEVEL_PATCH_MAX:
            # A class not planned for a long while: sorting its levels anew costs less.
            del self.level_cache[klass]
            del self.class_log[klass]
            return
        changes.append((sign, row))

    def _running_now(self, a: _Attempt, now_s: float) -> Running:
        """The attempt as of ``now_s``, for orderings whose ranks move with time; several cycles
        at one instant (a preemption and the start it makes room for) share one object."""
        if a.running_at_s != now_s or a.shielded:
            a.running = self._make_running(a, now_s)
            a.running_at_s = now_s
            a.shielded = False
        return a.running

    def _restart_s(self, gpus: int) -> float:
        """Seconds a preempted job of this size spends restarting, not progressing."""
        if self.continuous:
            return self.options.restart_cost.for_gpus(gpus)
        return self.config.restart_cost_s

    def _last_checkpoint(self, a: _Attempt, now_s: float) -> float | None:
        """The job's latest checkpoint as of now_s: of this attempt, or else of an earlier one."""
        interval_s = a.job.interval_s
        if interval_s is not None and now_s - a.start_s >= interval_s:
            return a.start_s + math.floor((now_s - a.start_s) / interval_s) * interval_s
        return a.job.last_checkpoint_s

    def _make_running(self, a: _Attempt, now_s: float, shielded: bool = False) -> Running:
        job = a.job
        t = job.trace
        last_checkpoint_s = interval_s = None
        if self.tell_checkpoints:
            last_checkpoint_s = self._last_checkpoint(a, now_s)
            interval_s = job.interval_s
        attained = job.attained_gpu_s
        remaining = None
        as_of_s = None
        if self.attained_lazily:
            # The plan adds the service since the start itself (priority.attained_now), to the
            # same value as _attained: one object serves every cycle of the attempt.
            assert len(a.gpus) == t.gpus, "an attempt holds the GPUs its job asked for"
            as_of_s = a.start_s
        elif self.time_dependent_order:
            attained = self._attained(a, now_s)
            if self.options.oracle is Oracle.REMAINING:
                remaining = max(a.end_s - now_s, 0.0)
        return Running(
            attempt_id=a.attempt_id,
            job_id=t.job_id,
            tenant=t.tenant,
            user=t.user,
            priority=t.priority,
            preemptible=t.preemptible and not shielded,
            started_at_s=a.start_s,
            gpus=a.gpus,
            gpu_type=a.gpu_type,
            predicted_end_s=a.predicted_end_s,
            submitted_at_s=t.submit_s,
            attained_service_s=attained,
            attained_as_of_s=as_of_s,
            remaining_s=remaining,
            preemptions=job.preemptions,
            power_profile=_DEFAULT_PROFILE,
            cpus=t.cpus,
            memory_mib=t.memory_mib,
            last_checkpoint_s=last_checkpoint_s,
            checkpoint_interval_s=interval_s,
            grace_s=self.grace_s,
            stopping=a.stop_s is not None,
            stop_by_s=a.stop_s,
        )

    def _refresh_checkpoints(self, now_s: float) -> None:
        """Rebuild the snapshot objects of attempts that checkpointed since they were made."""
        due = self.checkpoint_due
        while due and due[0][0] <= now_s:
            _, attempt_id = heapq.heappop(due)
            a = self.running.get(attempt_id)
            if a is None:
                continue  # it ended since
            interval_s = a.job.interval_s
            assert interval_s is not None, "only attempts of jobs that checkpoint are due"
            last_s = self._last_checkpoint(a, now_s)
            heapq.heappush(due, ((last_s or a.start_s) + interval_s, attempt_id))
            a.running = self._make_running(a, now_s, a.shielded)
            a.running_at_s = now_s
            self.running_objs[attempt_id] = a.running
            self.running_tuple = None

    def _power_asked_for(self) -> bool:
        return self.config.power_planning and (
            self.power_active
            or self.config.eco_max_slowdown is not None
            or any(
                t.power_pace_w is not None or t.budget_action == "throttle" for t in self.tenants
            )
        )

    def _check_partitioned(self) -> None:
        if self.config.borrowing:
            raise ValueError("partitioned_tenants needs a config without borrowing")
        owner: dict[str, str] = {}
        for j in self.jobs:
            if j.gpu_type == ANY_GPU_TYPE or owner.setdefault(j.gpu_type, j.tenant) != j.tenant:
                raise ValueError(
                    f"partitioned_tenants needs a GPU type of its own for every tenant's jobs; "
                    f"job {j.job_id} of {j.tenant} asks for {j.gpu_type or 'any type'}"
                )
        # A node whose GPUs no tenant's jobs ask for never enters a snapshot: nothing can run there.
        for i, node in enumerate(self.node_list):
            tenants = {owner[g.gpu_type] for g in node.gpus if g.gpu_type in owner}
            for tenant in tenants:
                self.partition_nodes.setdefault(tenant, []).append(i)

    def _pending_tenants(self) -> tuple[str, ...]:
        return tuple(sorted({j.trace.tenant for j in self.pending.values()}))

    def _partition_nodes(self, tenants: tuple[str, ...]) -> tuple[Node, ...]:
        """The nodes of the partitions in play, in the cluster's order (ties break as in full)."""
        nodes = self.nodes_in_play.get(tenants)
        if nodes is None:
            if len(tenants) == 1:
                indices = self.partition_nodes.get(tenants[0], [])
            else:
                indices = sorted({i for t in tenants for i in self.partition_nodes.get(t, ())})
            nodes = self.nodes_in_play[tenants] = tuple(self.node_list[i] for i in indices)
        return nodes

    def _partition_running(self, now_s: float, tenants: tuple[str, ...]) -> tuple[Running, ...]:
        if not self.time_dependent_order:
            return tuple(a.running for t in tenants for a in self.tenant_running[t].values())
        if not self.config.preemption:
            return tuple(
                self._running_now(a, now_s)
                for t in tenants
                for a in self.tenant_running[t].values()
            )
        out = []
        for t in tenants:
            shield = self._shield_rank(t, now_s)
            for a in self.tenant_running[t].values():
                shielded = shield is not None and shield(a)
                # The plan reads an attempt's remaining time and attained service only to weigh
                # it as a victim: a shielded one keeps its object until it may lose again.
                if a.shielded is not shielded or (not shielded and a.running_at_s != now_s):
                    a.running = self._make_running(a, now_s, shielded)
                    a.running_at_s = now_s
                    a.shielded = shielded
                out.append(a.running)
        return tuple(out)

    def _shield_rank(self, tenant: str, now_s: float) -> Callable[[_Attempt], bool] | None:
        """Which of a partition's attempts no job pending there may preempt, or None.

        On a static partition the baselines preempt only for a job of the same partition with
        a shorter remaining time (SRTF) or an earlier LAS queue; an attempt no pending job beats
        is handed to the plan as not preemptible, so its victim searches walk only the attempts
        that could lose. Nothing else in the plan reads the flag for these configs (no
        borrowing; the own-tenant priority rule is FAIR's), so no decision changes.
        """
        pending = self.tenant_pending[tenant].values()
        if self.config.ordering is Ordering.SRTF:
            predicted = [d for p in pending if (d := p.predicted_duration_s) is not None]
            if not predicted or len(predicted) < len(pending):
                return None
            if self.options.oracle is not Oracle.REMAINING:
                return None
            shortest = min(predicted)
            return lambda a: a.end_s - now_s <= shortest
        if self.config.ordering is Ordering.LAS:
            earliest = min((las_queue(p.attained_service_s) for p in pending), default=None)
            if earliest is None:
                return None
            return lambda a: las_queue(self._attained(a, now_s)) <= earliest
        return None

    def _attained(self, a: _Attempt, now_s: float) -> float:
        return a.job.attained_gpu_s + a.job.trace.gpus * max(now_s - a.start_s, 0.0)

    def _snapshot(
        self,
        now_s: float,
        tenants: tuple[str, ...] | None = None,
        window: tuple[Pending, ...] | None = None,
    ) -> Snapshot:
        """The cluster as ``plan`` sees it; partitioned, only the partitions of ``tenants``;
        ``window``: the pending jobs to show (see _window), else every one in play."""
        if self.checkpoint_due:
            self._refresh_checkpoints(now_s)
        if self.partitioned:
            assert tenants is not None
            nodes = self._partition_nodes(tenants)
            running = self._partition_running(now_s, tenants)
            if window is not None:
                pending = window
            else:
                pending = tuple(p for t in tenants for p in self.tenant_pending[t].values())
        else:
            nodes = self.nodes_tuple
            if window is not None:
                pending = window
            else:
                if self.pending_tuple is None:
                    self.pending_tuple = tuple(self.pending_objs.values())
                pending = self.pending_tuple
            if self.time_dependent_order and not self.attained_lazily:
                running = tuple(self._running_now(a, now_s) for a in self.running.values())
            else:
                if self.running_tuple is None:
                    self.running_tuple = tuple(self.running_objs.values())
                running = self.running_tuple
        history: tuple[HistoryRecord, ...] = ()
        if self.uses_history and self.history and window is None:
            # A window carries its predictions (see _window): no history to index.
            history = self._history_for(pending)
        return Snapshot(
            now_s=now_s,
            nodes=nodes,
            running=running,
            pending=pending,
            tenants=self.tenants,
            pools=self.pools,
            history=history,
        )

    def _aged_levels(
        self, now_s: float, wanted: set[str] | None
    ) -> dict[tuple[object, ...], list[tuple[float | int, ...]]]:
        """Every class cut into its aging levels at ``now_s``, each level in the plan's order.

        FAIR ranks a tenant's jobs by aged priority (the priority plus a level per full aging
        period waited), then predicted duration, then submit time. Within a class the priority
        is one, so the plan meets a class's oldest level first, each level by duration: a job
        of a younger level may be shorter than one of an older level and get what it could
        not (room before a reservation). Within a level, later in the plan's order is no
        shorter, so the window's reasoning holds per (class, level): each is a class of its
        own for this cycle, keyed (*class, level).
        """
        period_s = self.config.aging_period_s
        class_rows = self.class_rows
        out: dict[tuple[object, ...], list[tuple[float | int, ...]]] = {}
        cache = self.level_cache
        # A job's level moves when its wait reaches the next multiple of the period; the
        # margin renews a class's levels a hair early rather than a rounding late.
        margin_s = 1e-9 * (abs(now_s) + period_s)

        def level_of(entry: tuple[float | int, ...]) -> int:
            # As priority.aged_priority computes it: the same arithmetic, so the same level.
            waited_s = now_s - float(entry[0])
            return math.floor(waited_s / period_s) if period_s > 0 and waited_s > 0 else 0

        def minus_level(entry: tuple[float | int, ...]) -> int:
            return -level_of(entry)

        for klass, queue in self.classes.items():
            if wanted is not None and klass[0] not in wanted:
                continue
            version = self.class_version[klass]
            kept = cache.get(klass)
            changes = self.class_log.pop(klass, None)
            patched: dict[int, list[tuple[float | int, ...]]] = {}
            sorted_runs: dict[tuple[object, ...], list[tuple[float | int, ...]]] = {}
            if kept is not None and kept[0] == version:
                if now_s < kept[1]:
                    for level, rows in kept[2]:
                        out[(*klass, level)] = rows
                    continue
                sorted_runs = kept[3]
            elif kept is not None and now_s < kept[1] and changes is not None:
                # Jobs came and went, and none of those kept waited into its next level: each
                # level is the one sorted before with them taken out or put in (the rows of
                # a level are unique, the job id last), not a slice sorted anew.
                before = dict(kept[2])
                for sign, row in changes:
                    level = level_of(row[1:])
                    level_rows = patched.get(level)
                    if level_rows is None:
                        level_rows = patched[level] = list(before.get(level, ()))
                    if sign > 0:
                        bisect.insort(level_rows, row)
                    else:
                        del level_rows[bisect.bisect_left(level_rows, row)]
                for level, kept_level in before.items():
                    patched.setdefault(level, kept_level)
            # The queue is in submit order and a level never rises with a later submit (the
            # arithmetic is monotone), so each level is a run of it, found by bisection; a run
            # whose ends are those of a run sorted before (the class unchanged) is reused.
            pairs = []
            runs: dict[tuple[object, ...], list[tuple[float | int, ...]]] = {}
            until_s = _INF
            hi = len(queue)
            while hi > 0:
                level = level_of(queue[hi - 1])
                lo = bisect.bisect_left(queue, -level, 0, hi - 1, key=minus_level)
                span = (queue[lo], queue[hi - 1])
                kept_rows = sorted_runs.get(span)
                if kept_rows is None:
                    kept_rows = patched.get(level)
                    if kept_rows is not None and len(kept_rows) != hi - lo:
                        raise AssertionError(f"level {level} of class {klass} patched wrong")
                rows = kept_rows if kept_rows is not None else sorted(class_rows[klass][lo:hi])
                runs[span] = rows
                out[(*klass, level)] = rows
                pairs.append((level, rows))
                if period_s > 0:
                    # The run's oldest job is the first to wait into the next level.
                    next_s = float(queue[lo][0]) + (level + 1) * period_s - margin_s
                    until_s = min(until_s, next_s)
                hi = lo
            cache[klass] = (version, until_s, pairs, runs)
        self.level_queues = out
        return out

    def _window(
        self,
        tenants: tuple[str, ...] | None,
        heads: dict[tuple[object, ...], int],
        now_s: float,
    ) -> tuple[tuple[Pending, ...], dict[tuple[object, ...], int]]:
        """The head of every class of pending jobs (of ``tenants``), and how many each showed
        where it showed fewer than it has.

        Why the plan decides alike with and without the tail of a class: the jobs of a class
        differ in nothing the plan looks at but their place in its queue, and it meets them in
        their class's order; whatever one of them can get (GPUs free now or set aside, victims,
        room beside a reservation) a later one of the class can only get less of, since a cycle
        only takes such things. So when the last job shown of a class got nothing, its tail
        gets nothing either, and a job that gets nothing changes nothing the plan decides after
        it (a reservation goes to the first job of its type that waits, which is shown). The
        first window shows as many jobs per class as the free GPUs could start, plus one; one
        whose last job got GPUs or victims is doubled and the plan asked again (_cycle).

        FAIR also walks each tenant's queue to mark the jobs within its guarantee, which raises
        them in the queue: a window's tail must hold none of those, so it shows at least as
        many jobs per class as the tenant's unused guarantee holds, plus one.
        """
        wanted = None if tenants is None else set(tenants)
        fair = self.config.ordering is Ordering.FAIR
        classes: Iterable[tuple[tuple[object, ...], list[tuple[float | int, ...]]]]
        if self.aged_levels:
            classes = self._aged_levels(now_s, wanted).items()
        else:
            classes = self.classes.items()
        free_all = self.total_gpus - self.busy_gpus
        room: dict[str, int] = {}
        if fair:
            for t in self.tenants:
                used = self.usage.get((t.name, ANY_GPU_TYPE), 0)
                room[t.name] = self.guaranteed_gpus[t.name] - (used if self.grace_s <= 0 else 0)
        pending_objs = self.pending_objs
        out: list[Pending] = []
        cut: dict[tuple[object, ...], int] = {}
        for klass, queue in classes:
            tenant = klass[0]
            if wanted is not None and tenant not in wanted:
                continue
            shown = heads.get(klass)
            if shown is None:
                gpus = klass[1]
                assert isinstance(gpus, int) and isinstance(tenant, str)
                size = max(gpus, 1)
                gpu_type = str(klass[2])
                free = self.free_of_type.get(gpu_type, 0) if gpu_type else free_all
                shown = free // size + 1
                if fair:
                    shown = max(shown, room[tenant] // size + 1)
            if shown < len(queue):
                cut[klass] = shown
            heads_of_queue = queue[:shown] if shown < len(queue) else queue
            if self.uses_history:
                guess = self._predicted(klass)
                objs = self.predicted_objs
                for e in heads_of_queue:
                    job_id = int(e[-1])
                    p = objs.get(job_id)
                    if p is None or p.predicted_duration_s != guess:
                        p = pending_objs[job_id]
                        if p.predicted_duration_s is None:
                            p = replace(p, predicted_duration_s=guess)
                        objs[job_id] = p
                    out.append(p)
            else:
                out.extend(pending_objs[int(e[-1])] for e in heads_of_queue)
        return tuple(out), cut

    def _window_holds(
        self, plan: Plan, cut: dict[tuple[object, ...], int]
    ) -> list[tuple[object, ...]] | None:
        """The classes whose last job shown got GPUs or victims: their tail might too. None:
        the tail of any class might get something (the plan is asked with the whole backlog),
        as when a class's last job shown was considered before a job that preempted.

        A cycle only takes resources, except one: an attempt preempted for a job may free more
        GPUs than the job needs, and the rest are there for any later job entitled to GPUs being
        freed (under SRTF and LAS every job; under FAIR one within its guarantee, which no tail
        holds, or one that may preempt its own tenant's lower-priority work).
        """
        if not cut:
            return []
        # GPUs a preemption frees beyond its job's need are there for the jobs considered after
        # it. A class whose last job shown (which got nothing) was considered after every job
        # that preempted saw them all: its tail gets nothing either. One considered before a
        # preempting job might not have, but only if some of those GPUs were still unclaimed
        # after that job was decided (Plan.soon_left_after): if none were, every later job
        # met no more than the class's last job shown met. Otherwise the plan is asked with
        # the whole backlog.
        # (place in the plan's order, type of its victims) of each job that preempted
        preempting: list[tuple[int, str]] = []
        if (plan.preemptions or self.grace_s > 0) and self._tail_may_claim(cut):
            if self.grace_s > 0:
                return None
            place = {d.job_id: d.queue_position for d in plan.pending}
            for p in plan.preemptions:
                if p.for_job_id is not None:
                    at = place.get(p.for_job_id)
                    if at is None:
                        return None  # a job that preempted and started at once: not seen here
                    victim = self.running.get(p.attempt_id)
                    if victim is None or not victim.gpus:
                        return None
                    preempting.append((at, self.gpu_type[victim.gpus[0]]))
        else:
            place = {}
        started = {s.job_id for s in plan.starts}
        waiting_for_victims = {
            d.job_id for d in plan.pending if d.reason_code is ReasonCode.WAITING_FOR_PREEMPTION
        }
        left_after = plan.soon_left_after
        short = []
        for klass, shown in cut.items():
            queue = self.level_queues[klass] if self.aged_levels else self.classes[klass]
            last = int(queue[shown - 1][-1])
            if last in started or last in waiting_for_victims:
                short.append(klass)
            elif preempting:
                at_last = place.get(last, 0)
                gpu_type = str(klass[2])
                after = [
                    at for at, t in preempting if at > at_last and (not gpu_type or t == gpu_type)
                ]
                if not after:
                    continue
                first = min(after)
                if any(
                    left_after.get(t, -1) >= first
                    for t in ((gpu_type,) if gpu_type else left_after)
                ):
                    # Showing such a class more until its last job comes after every
                    # preempting one was measured: asked again and again, it cost more than
                    # the whole backlog.
                    return None
        return short

    def _tail_may_claim(self, cut: dict[tuple[object, ...], int]) -> bool:
        """Whether a job of a cut class may take GPUs that are being freed (see _window_holds)."""
        if self.config.ordering in (Ordering.SRTF, Ordering.LAS):
            return True
        if self.config.ordering is not Ordering.FAIR:
            return False  # the other orderings do not preempt, beyond guarantees (no tail)
        for klass in cut:
            tenant, priority = klass[0], klass[3]
            assert isinstance(tenant, str) and isinstance(priority, int)
            counts = self.preemptible_running.get(tenant)
            if counts and min(counts) < priority:
                return True
        return False

    def _index_duration(self, rec: HistoryRecord, remove: bool = False) -> None:
        kind = normalise_name(rec.name)
        for index, key in (
            (self.durations_by_user, (rec.user, kind, rec.gpus)),
            (self.durations_by_tenant, (rec.tenant, kind, rec.gpus)),
        ):
            runs = index.get(key)
            if remove:
                assert runs is not None, "a record leaving the history was indexed"
                del runs[bisect.bisect_left(runs, rec.duration_s)]
                if not runs:
                    del index[key]
            elif runs is None:
                index[key] = [rec.duration_s]
            else:
                bisect.insort(runs, rec.duration_s)

    def _predicted(self, klass: tuple[object, ...]) -> float:
        """What scheduler.predict says of a job of this class, from the same history.

        The median of the runs of the same user, kind of name and GPUs, else of the tenant's,
        else the default (trace jobs give no estimate and no runtime limit).
        """
        tenant, gpus, user, kind = klass[0], klass[1], klass[7], klass[8]
        assert isinstance(tenant, str) and isinstance(gpus, int)
        assert isinstance(user, str) and isinstance(kind, str)
        runs = self.durations_by_user.get((user, kind, gpus)) or self.durations_by_tenant.get(
            (tenant, kind, gpus)
        )
        if not runs:
            return max(self.config.default_duration_s, 0.0)
        mid = len(runs) // 2
        if len(runs) % 2:
            return max(runs[mid], 0.0)
        return max((runs[mid - 1] + runs[mid]) / 2.0, 0.0)

    def _history_for(self, pending: tuple[Pending, ...]) -> tuple[HistoryRecord, ...]:
        tenants = set()
        for p in pending:
            tenants.add(p.tenant)
            tenants.update(self.user_tenants.get(p.user, ()))
        key = tuple(sorted(t for t in tenants if t in self.history))
        joined = self.history_joined.get(key)
        if joined is not None:
            return joined
        parts = []
        for tenant in key:
            cached = self.history_of.get(tenant)
            if cached is None:
                cached = self.history_of[tenant] = tuple(self.history[tenant])
            parts.append(cached)
        joined = parts[0] if len(parts) == 1 else tuple(r for part in parts for r in part)
        self.history_joined[key] = joined
        return joined

    # ----- events ------------------------------------------------------------------------------

    def _request_cycle(self, at_s: float) -> None:
        at_s = max(at_s, self.hold_cycles_until_s)
        if at_s < self.cycle_at:
            self.cycle_at = at_s

    def _next_tick(self, now_s: float, strictly_after: bool) -> float:
        c = self.options.cycle_s
        k = math.floor(now_s / c) + 1 if strictly_after else math.ceil(now_s / c - 1e-12)
        return max(k * c, now_s)

    def _changed(self, now_s: float, tenant: str | None = None) -> None:
        self.dirty = True
        if tenant is not None:
            self.dirty_tenants.add(tenant)
        if self.pending or self.power_active:
            if self.options.event_cycles:
                # The control plane's rule (controlplane/wakeups.py): leading edge when quiet,
                # one cycle per debounce when busy.
                self._request_cycle(max(now_s, self.last_cycle_s + self.options.debounce_s))
            else:
                self._request_cycle(self._next_tick(now_s, strictly_after=False))

    def _arrive(self, trace: TraceJob) -> None:
        tenant = trace.tenant
        held = self.usage.get((tenant, ANY_GPU_TYPE), 0)
        waiting = sum(gpus * count for gpus, count in self.pending_sizes[tenant].items())
        if held + waiting + trace.gpus <= self.guaranteed_gpus[tenant]:
            self.within_guarantee.add(trace.job_id)
        job = _Job(trace, self.options.checkpoints.interval_s(trace.job_id))
        self.state[trace.job_id] = job
        self._enqueue(job)
        self._owed(tenant, trace.submit_s)
        self._changed(trace.submit_s, trace.tenant)

    def _quota_keys(self, tenant: str, gpus: tuple[str, ...]) -> dict[tuple[str, str], int]:
        """GPUs counted against each (tenant, type) quota: all of them, and per type."""
        keys = {(tenant, ANY_GPU_TYPE): len(gpus)}
        for uuid in gpus:
            key = (tenant, self.gpu_type[uuid])
            keys[key] = keys.get(key, 0) + 1
        return keys

    def _release(self, a: _Attempt, now_s: float) -> None:
        """Free an attempt's GPUs and book what it received."""
        job = a.job
        del self.running[a.attempt_id]
        del self.running_objs[a.attempt_id]
        del self.tenant_running[job.trace.tenant][a.attempt_id]
        if job.trace.preemptible:
            counts = self.preemptible_running[job.trace.tenant]
            counts[job.trace.priority] -= 1
            if not counts[job.trace.priority]:
                del counts[job.trace.priority]
        self.running_tuple = None
        for uuid in a.gpus:
            del self.gpu_owner[uuid]
            self._set_draw(uuid, self._idle_draw(uuid))
        self.busy_gpus -= len(a.gpus)
        self.free_of_type[a.gpu_type] += len(a.gpus)
        for key, count in self._quota_keys(job.trace.tenant, a.gpus).items():
            self.usage[key] -= count
        held = now_s - a.start_s
        job.held_s += held
        job.attained_gpu_s += held * len(a.gpus)
        job.attempt = None
        self._owed(job.trace.tenant, now_s)

    def _owed(self, tenant: str, now_s: float) -> None:
        """Open or close the tenant's owed spell after what it holds or waits for changed."""
        room = self.guaranteed_gpus[tenant] - self.usage.get((tenant, ANY_GPU_TYPE), 0)
        sizes = self.pending_sizes[tenant]
        smallest = min(sizes) if sizes and room > 0 else 0
        spell = self.owed_since.get(tenant)
        if 0 < smallest <= room:
            single = now_s if smallest == 1 else None
            if spell is None:
                self.owed_since[tenant] = (now_s, single, 0.0)
                return
            since_s, single_since_s, single_max_s = spell
            if single_since_s is not None and single is None:
                single_max_s = max(single_max_s, now_s - single_since_s)
            elif single_since_s is not None:
                single = single_since_s  # a one-GPU job still waits: the stretch goes on
            self.owed_since[tenant] = (since_s, single, single_max_s)
        elif spell is not None:
            del self.owed_since[tenant]
            self._close_spell(spell, now_s)

    def _close_spell(self, spell: tuple[float, float | None, float], now_s: float) -> None:
        since_s, single_since_s, single_max_s = spell
        if single_since_s is not None:
            single_max_s = max(single_max_s, now_s - single_since_s)
        if now_s > since_s:
            self.owed_spells.append((now_s - since_s, single_max_s))

    def _complete(self, now_s: float, attempt_id: int, version: int) -> None:
        a = self.running.get(attempt_id)
        if a is None or a.version != version:
            return  # preempted or rescheduled since this event was queued
        if a.stop_s is not None and now_s < a.end_s:
            self._advance_power(now_s)
            self._stop(a, now_s)
            self._record(now_s)
            self._changed(now_s, a.job.trace.tenant)
            return
        self._advance_power(now_s)
        job = a.job
        job.work_left_s = 0.0
        self._release(a, now_s)
        self._record(now_s)
        t = job.trace
        assert job.first_start_s is not None, "a job that completes has started"
        self.outcomes.append(
            JobOutcome(
                job_id=t.job_id,
                tenant=t.tenant,
                gpus=t.gpus,
                submit_s=t.submit_s,
                first_start_s=job.first_start_s,
                finish_s=now_s,
                duration_s=t.duration_s,
                held_s=job.held_s,
                preemptions=job.preemptions,
                restart_overhead_s=job.overhead_s,
            )
        )
        if self.uses_history:
            history = self.history.get(t.tenant)
            if history is None:
                history = self.history[t.tenant] = deque(maxlen=self.options.history_per_tenant)
            if history.maxlen is not None and len(history) == history.maxlen and history:
                self._index_duration(history[0], remove=True)  # the deque drops it below
            self._index_duration(HistoryRecord(t.tenant, t.user, t.name, t.gpus, t.duration_s))
            history.append(HistoryRecord(t.tenant, t.user, t.name, t.gpus, t.duration_s))
            self.history_of.pop(t.tenant, None)
            self.history_joined.clear()
            self.user_tenants.setdefault(t.user, set()).add(t.tenant)
        del self.state[t.job_id]
        self._changed(now_s, t.tenant)

    def _schedule_completion(self, a: _Attempt) -> None:
        self.seq += 1
        at_s = a.end_s if a.stop_s is None else min(a.end_s, a.stop_s)
        heapq.heappush(self.completions, (at_s, self.seq, a.attempt_id, a.version))

    def _progress_to(self, a: _Attempt, now_s: float) -> None:
        """Book the work an attempt did up to ``now_s`` at its current speed."""
        if now_s > a.progress_from_s:
            a.job.work_left_s = max(a.job.work_left_s - (now_s - a.progress_from_s) * a.speed, 0.0)
            a.progress_from_s = now_s

    # ----- applying a plan ---------------------------------------------------------------------

    def _preempt(self, attempt_id: int, now_s: float) -> None:
        a = self.running.get(attempt_id)
        if a is None:
            raise PlanError(
                f"t={now_s:.0f}: preemption of attempt {attempt_id}, which is not running"
            )
        if a.stop_s is not None:
            raise PlanError(f"t={now_s:.0f}: preemption of attempt {attempt_id}, already stopping")
        job = a.job
        job.preemptions += 1
        self.preemptions += 1
        interval_s = job.interval_s
        if self.grace_s > 0 and interval_s is not None and now_s > a.start_s:
            next_s = a.start_s + math.ceil((now_s - a.start_s) / interval_s) * interval_s
            if now_s < next_s <= now_s + self.grace_s:
                # It saves its next checkpoint within its notice, then leaves: its GPUs stay
                # taken (stopping) until then.
                a.stop_s = next_s
                a.version += 1
                a.running = self._make_running(a, now_s)
                a.running_at_s = now_s
                self.running_objs[attempt_id] = a.running
                self.running_tuple = None
                self._schedule_completion(a)
                return
        self._stop(a, now_s)

    def _stop(self, a: _Attempt, now_s: float) -> None:
        """A preempted attempt leaves: the job resumes later from its last checkpoint."""
        self._progress_to(a, now_s)
        job = a.job
        if not self.continuous:
            # It resumes from its last checkpoint: what it did since is lost, and redone.
            last_s = a.stop_s if a.stop_s is not None else self._last_checkpoint(a, now_s)
            if last_s is not None and last_s >= a.start_s:
                job.saved_work_left_s = min(job.saved_work_left_s, self._work_left_at(a, last_s))
                job.last_checkpoint_s = last_s
            lost_s = max(job.saved_work_left_s - job.work_left_s, 0.0)
            self.lost_gpu_s += lost_s * len(a.gpus)
            self.lost_progress_gpu_s += lost_s * len(a.gpus)
            job.work_left_s = job.saved_work_left_s
        self._release(a, now_s)
        self._enqueue(job)
        self._owed(job.trace.tenant, now_s)

    def _work_left_at(self, a: _Attempt, at_s: float) -> float:
        """The job's work left at a moment of this attempt (before the moment's progress)."""
        for from_s, left_s, speed in reversed(a.segments):
            if from_s <= at_s:
                return max(left_s - (at_s - from_s) * speed, 0.0)
        return a.segments[0][1]

    def _start(self, start: Start, predicted: dict[int, float], now_s: float) -> None:
        job = self.pending.get(start.job_id)
        if job is None:
            raise PlanError(f"t={now_s:.0f}: start of job {start.job_id}, which is not pending")
        t = job.trace
        gpus = start.gpu_uuids
        if len(gpus) != t.gpus or len(set(gpus)) != len(gpus):
            raise PlanError(
                f"t={now_s:.0f}: job {t.job_id} asks for {t.gpus} GPUs, the plan gives {gpus}"
            )
        gpu_type = None
        for node_name, uuids in start.placements:
            node_i = self.node_index.get(node_name)
            for uuid in uuids:
                if self.gpu_node.get(uuid) != node_i or node_i is None:
                    raise PlanError(f"t={now_s:.0f}: job {t.job_id}: no GPU {uuid} on {node_name}")
                if uuid in self.gpu_owner:
                    other = self.gpu_owner[uuid].job.trace.job_id
                    raise PlanError(
                        f"t={now_s:.0f}: job {t.job_id} started on GPU {uuid}, held by job {other}"
                    )
                gpu_type = self.gpu_type[uuid] if gpu_type is None else gpu_type
                if t.gpu_type not in (ANY_GPU_TYPE, self.gpu_type[uuid]):
                    raise PlanError(
                        f"t={now_s:.0f}: job {t.job_id} asks for {t.gpu_type}, "
                        f"got {self.gpu_type[uuid]} GPU {uuid}"
                    )
        if gpu_type is None:
            raise PlanError(f"t={now_s:.0f}: job {t.job_id} started on no GPU")
        # Quota: the plan must keep every tenant within its limits, in all and per type.
        n = len(gpus)
        wanted = self._quota_keys(t.tenant, gpus)
        for key, count in wanted.items():
            used = self.usage.get(key, 0) + count
            limit = self.limits.get(key)
            if limit is not None and used > limit:
                raise PlanError(
                    f"t={now_s:.0f}: job {t.job_id} takes tenant {t.tenant} to {used} GPUs "
                    f"of {key[1] or 'any type'}, past its limit of {limit}"
                )
        for key, count in wanted.items():
            self.usage[key] = self.usage.get(key, 0) + count

        del self.pending[t.job_id]
        del self.pending_objs[t.job_id]
        del self.tenant_pending[t.tenant][t.job_id]
        if t.gpus > 0:
            sizes = self.pending_sizes[t.tenant]
            sizes[t.gpus] -= 1
            if not sizes[t.gpus]:
                del sizes[t.gpus]
        self.pending_tuple = None
        self._unqueue_from_class(job)
        self.predicted_objs.pop(t.job_id, None)
        self._owed(t.tenant, now_s)
        a = _Attempt()
        a.attempt_id = self.next_attempt_id
        self.next_attempt_id += 1
        a.job = job
        a.gpus = gpus
        a.gpu_type = gpu_type
        a.start_s = now_s
        overhead = self._restart_s(n) if job.preemptions else 0.0
        job.overhead_s += overhead
        self.lost_gpu_s += overhead * n
        a.progress_from_s = now_s + overhead
        a.speed = self._speed(gpus)
        a.end_s = a.progress_from_s + job.work_left_s / a.speed
        a.segments = [(a.progress_from_s, job.work_left_s, a.speed)]
        a.stop_s = None
        a.version = 0
        a.pool_index = self.gpu_pool[gpus[0]]
        if self.options.oracle is Oracle.NONE:
            guess = predicted.get(t.job_id)
            a.predicted_end_s = now_s + guess if guess is not None else None
        else:
            a.predicted_end_s = a.end_s
        job.attempt = a
        if job.first_start_s is None:
            job.first_start_s = now_s
        for uuid in gpus:
            self.gpu_owner[uuid] = a
            self._set_draw(uuid, self._draw(uuid, busy=True))
        self.busy_gpus += n
        self.free_of_type[gpu_type] -= n
        if self.las_preempts and n:
            for threshold in LAS_QUEUE_THRESHOLDS_GPU_S:
                if job.attained_gpu_s < threshold:
                    at_s = now_s + (threshold - job.attained_gpu_s) / n
                    heapq.heappush(self.las_crossings, (at_s, a.attempt_id, threshold))
        a.running = self._make_running(a, now_s)
        a.running_at_s = now_s
        a.shielded = False
        self.running[a.attempt_id] = a
        self.running_objs[a.attempt_id] = a.running
        self.tenant_running[t.tenant][a.attempt_id] = a
        if t.preemptible:
            counts = self.preemptible_running.setdefault(t.tenant, {})
            counts[t.priority] = counts.get(t.priority, 0) + 1
        self.running_tuple = None
        self.last_start_s = now_s
        if self.tell_checkpoints and job.interval_s is not None:
            heapq.heappush(self.checkpoint_due, (now_s + job.interval_s, a.attempt_id))
        self._schedule_completion(a)

    def _apply_caps(self, caps: dict[str, float], now_s: float) -> None:
        changed_nodes: set[int] = set()
        touched: dict[int, _Attempt] = {}
        for uuid, cap_w in caps.items():
            if uuid not in self.gpu_node:
                raise PlanError(f"t={now_s:.0f}: a power cap for unknown GPU {uuid}")
            if self.gpu_cap_w[uuid] == cap_w:
                continue
            owner = self.gpu_owner.get(uuid)
            if owner is not None:
                self._progress_to(owner, now_s)
                touched[owner.attempt_id] = owner
            self.gpu_cap_w[uuid] = cap_w
            self._set_draw(uuid, self._draw(uuid, busy=owner is not None))
            changed_nodes.add(self.gpu_node[uuid])
        for a in touched.values():
            speed = self._speed(a.gpus)
            if speed != a.speed:
                a.speed = speed
                a.segments.append((max(a.progress_from_s, now_s), a.job.work_left_s, speed))
                a.end_s = max(a.progress_from_s, now_s) + a.job.work_left_s / speed
                a.version += 1
                if self.options.oracle is not Oracle.NONE:
                    a.predicted_end_s = a.end_s
                    a.running = self._make_running(a, now_s)
                    a.running_at_s = now_s
                    a.shielded = False
                    self.running_objs[a.attempt_id] = a.running
                    self.running_tuple = None
                self._schedule_completion(a)
        for i in changed_nodes:
            node = self.node_list[i]
            gpus = tuple(replace(g, power_cap_w=self.gpu_cap_w[g.uuid]) for g in node.gpus)
            self.node_list[i] = replace(node, gpus=gpus)
        if changed_nodes:
            self.nodes_tuple = tuple(self.node_list)
            self.nodes_in_play.clear()

    def _time_dependent(self, as_of_s: float) -> bool:
        """Whether plan could decide differently later than at ``as_of_s`` with no event in
        between: at the last plan's instant when a tick asks whether to plan (an attempt too
        young to preempt then may have come of age by the tick), at its own instant when a
        plan asks whether a tick is needed."""
        if not self.pending or not self.running:
            return False
        if self.config.preemption and as_of_s - self.last_start_s < self.config.min_runtime_s:
            return True
        if self.partitioned:
            return bool(self.time_bound_tenants)
        plan = self.last_plan
        return plan is not None and any(d.reason_code in _TIME_BOUND_REASONS for d in plan.pending)

    def _cycle(self, now_s: float) -> None:
        if self.las_crossings:
            self._note_crossings(now_s)
        self._plan_cycle(now_s)
        if self.las_crossings and self.pending:
            self._request_crossing(now_s)

    def _note_crossings(self, now_s: float) -> None:
        """Mark dirty the tenants of attempts that crossed a LAS queue threshold by now.

        Under LAS with preemption, ranks move with time only when a running attempt's attained
        service crosses a queue threshold: only then may a job pending in an earlier queue take
        its GPUs. Between crossings (and events) a plan would decide what the last one did, so
        the engine plans at the first tick after each crossing instead of at every tick.
        """
        heap = self.las_crossings
        while heap and heap[0][0] <= now_s:
            _, attempt_id, threshold = heapq.heappop(heap)
            a = self.running.get(attempt_id)
            if a is None:
                continue  # it ended or was preempted since; a new attempt has its own
            if self._attained(a, now_s) < threshold:
                # Rounding put the crossing a hair past this instant: the next tick has it.
                heapq.heappush(heap, (math.nextafter(now_s, _INF), attempt_id, threshold))
                break
            self.dirty = True
            self.dirty_tenants.add(a.job.trace.tenant)

    def _request_crossing(self, now_s: float) -> None:
        """Ask for a cycle at the first tick after the next LAS crossing (see _note_crossings)."""
        heap = self.las_crossings
        while heap and heap[0][1] not in self.running:
            heapq.heappop(heap)
        if heap:
            at_s = self._next_tick(heap[0][0], strictly_after=False)
            if at_s <= now_s:
                at_s = self._next_tick(now_s, strictly_after=True)
            self._request_cycle(at_s)

    def _plan_cycle(self, now_s: float) -> None:
        self.cycle_at = _INF
        self.last_cycle_s = now_s
        plan_power = self.power_active and self.config.power_planning
        if not self.pending and not plan_power:
            self.dirty = False
            self.cycles_skipped += 1
            return
        if not self.dirty and not self._time_dependent(self.last_plan_s):
            self.cycles_skipped += 1
            return
        tenants = None
        if self.partitioned:
            # An event concerns its own partition only: the others' last plans still hold (no
            # change of theirs since, and a wait that time alone ends gets its tick). The tick
            # plans every tenant with work pending, as a whole-cluster plan would. Under LAS
            # with preemption, a partition whose attempt crossed a queue threshold is dirty.
            if now_s >= self.tick_at:
                self.tick_at = _INF
                tenants = self._pending_tenants()
            else:
                tenants = tuple(sorted(t for t in self.dirty_tenants if self.tenant_pending[t]))
            self.dirty_tenants.clear()
            if not tenants:
                self.dirty = False
                self.cycles_skipped += 1
                self._request_tick(now_s)
                return
        if self.windowed and not self.config.preemption and not self._any_free(tenants):
            # Nothing can start and nothing be preempted: the plan would change nothing.
            self.dirty = False
            self.cycles_skipped += 1
            return
        heads: dict[tuple[object, ...], int] = {}
        window, cut = self._window(tenants, heads, now_s) if self.windowed else (None, {})
        snapshot = self._snapshot(now_s, tenants, window)
        self.dirty = False
        self._advance_power(now_s)
        preempted = False
        if self.pending:
            t0 = time.perf_counter()
            plan = self.policy(snapshot, self.config)
            while short := self._window_holds(plan, cut) if cut else None:
                for klass in short:
                    heads[klass] = cut[klass] * 2
                for klass, shown in cut.items():
                    heads.setdefault(klass, shown)
                window, cut = self._window(tenants, heads, now_s)
                snapshot = self._snapshot(now_s, tenants, window)
                plan = self.policy(snapshot, self.config)
                self.window_replans += 1
            if cut and short is None:
                snapshot = self._snapshot(now_s, tenants)
                plan = self.policy(snapshot, self.config)
                self.window_replans += 1
            self.plan_wall_s += time.perf_counter() - t0
            self.plan_calls += 1
            self.last_plan = plan
            self.last_plan_s = now_s
            if tenants is not None:
                self._note_time_bound(tenants, plan)
            if self.options.on_cycle is not None:
                self.options.on_cycle(snapshot, plan)
            for p in plan.preemptions:
                self._preempt(p.attempt_id, now_s)
            if plan.power_caps_w:
                self._apply_caps(plan.power_caps_w, now_s)
            for s in plan.starts:
                self._start(s, plan.predicted_duration_s, now_s)
            preempted = bool(plan.preemptions)
        if plan_power:
            # As in the control plane: the cap planner runs on the plan's outcome.
            t0 = time.perf_counter()
            busy = {u: a.running for a in self.running.values() for u in a.gpus}
            caps = power.plan_power_caps(snapshot, self.config, busy)
            self.power_wall_s += time.perf_counter() - t0
            self._apply_caps(caps, now_s)
        self._record(now_s)
        if preempted:
            # The reclaimed GPUs are free now: the jobs waiting for them start in the next cycle.
            if now_s == self.preempting_at_s:
                self.preempting_cycles += 1
                if self.preempting_cycles > _MAX_PREEMPTING_CYCLES_AT_ONCE:
                    # The policy keeps undoing its own decisions. Stopping the replay would
                    # lose every figure of it; holding the cycles back to the next tick lets
                    # time move (the victims restart then), and the result says it happened.
                    self.thrash_stalls += 1
                    self.hold_cycles_until_s = self._next_tick(now_s, strictly_after=True)
                    self.preempting_cycles = 0
            else:
                self.preempting_at_s, self.preempting_cycles = now_s, 1
            self._changed(now_s)
            if tenants is not None:
                self.dirty_tenants.update(tenants)
        self._request_tick(now_s)

    def _any_free(self, tenants: tuple[str, ...] | None) -> bool:
        """Whether a GPU some pending job (of ``tenants``) could use is free."""
        if self.busy_gpus < self.total_gpus and not self.partitioned:
            return True
        for klass in self.classes:
            gpu_type = klass[2]
            if tenants is not None and klass[0] not in tenants:
                continue
            if not klass[1]:
                return True  # a job without GPUs needs none free
            if gpu_type:
                if self.free_of_type.get(str(gpu_type), 0) > 0:
                    return True
            elif self.busy_gpus < self.total_gpus:
                return True
        return False

    def _request_tick(self, now_s: float) -> None:
        if self._time_dependent(now_s):
            at_s = self._next_tick(now_s, strictly_after=True)
            self._request_cycle(at_s)
            self.tick_at = min(self.tick_at, at_s)

    def _note_time_bound(self, tenants: tuple[str, ...], plan: Plan) -> None:
        self.time_bound_tenants.difference_update(tenants)
        for d in plan.pending:
            if d.reason_code in _TIME_BOUND_REASONS:
                self.time_bound_tenants.add(self.state[d.job_id].trace.tenant)

    def run(self) -> Result:
        wall0 = time.perf_counter()
        cpu0 = time.process_time()
        jobs = self.jobs
        n_jobs = len(jobs)
        i = 0
        completions = self.completions
        progress = self.options.progress
        every = max(self.options.progress_every_events, 1)
        now_s = jobs[0].submit_s if jobs else 0.0
        while True:
            t_arrival = jobs[i].submit_s if i < n_jobs else _INF
            t_done = completions[0][0] if completions else _INF
            t_cycle = self.cycle_at
            if t_done <= t_arrival and t_done <= t_cycle:
                if t_done == _INF:
                    break
                end_s, _, attempt_id, version = heapq.heappop(completions)
                now_s = end_s
                self._complete(end_s, attempt_id, version)
            elif t_arrival <= t_cycle:
                now_s = t_arrival
                self._arrive(jobs[i])
                i += 1
            else:
                now_s = t_cycle
                self._cycle(t_cycle)
            self.events += 1
            if progress is not None and self.events % every == 0:
                progress(
                    Progress(
                        now_s,
                        len(self.outcomes),
                        n_jobs,
                        self.events,
                        self.plan_calls,
                        time.perf_counter() - wall0,
                    )
                )
        self._advance_power(now_s)
        # Spells still open at the end are counted to the last event (the replay stopped them).
        for spell in self.owed_since.values():
            self._close_spell(spell, now_s)
        if progress is not None:
            progress(
                Progress(
                    now_s,
                    len(self.outcomes),
                    n_jobs,
                    self.events,
                    self.plan_calls,
                    time.perf_counter() - wall0,
                )
            )
        unfinished = sorted(self.state)
        return Result(
            outcomes=self.outcomes,
            unfinished_job_ids=unfinished,
            tenants=tuple(t.name for t in self.tenants),
            total_gpus=self.total_gpus,
            timeline_t_s=self.timeline_t,
            timeline_busy_gpus=self.timeline_busy,
            timeline_power_w=self.timeline_power,
            energy_j=self.energy_j,
            peak_power_w=self.peak_power_w,
            power_budget_w=self._total_budget(),
            over_budget_s=self.over_budget_s,
            preemptions=self.preemptions,
            preempted_gpu_s_lost=self.lost_gpu_s,
            plan_calls=self.plan_calls,
            cycles_skipped=self.cycles_skipped,
            events=self.events,
            wall_s=time.perf_counter() - wall0,
            cpu_s=time.process_time() - cpu0,
            plan_wall_s=self.plan_wall_s,
            power_wall_s=self.power_wall_s,
            first_submit_s=jobs[0].submit_s if jobs else 0.0,
            preempted_gpu_s_progress=self.lost_progress_gpu_s,
            thrash_stalls=self.thrash_stalls,
            window_replans=self.window_replans,
            within_guarantee_job_ids=frozenset(self.within_guarantee),
            guarantee_wait_bound_s=self.config.min_runtime_s + self.grace_s + self.options.cycle_s,
            owed_spells=self.owed_spells,
        )

    def _total_budget(self) -> float | None:
        budgets = [p.power_budget_w for p in self.pools if p.power_budget_w is not None]
        return sum(budgets) if budgets else None


def planner_with_memo(sentences: bool = True) -> PlanFunction:
    """scheduler.policy.plan with a memo of this run's own: the engine hands it the same node
    and history tuples until they change, so their indexes are built once per change.
    ``sentences`` False: the plans' reasons are left empty (the engine reads only the codes;
    a caller that watches the cycles, SimOptions.on_cycle, gets them)."""
    from scheduler.memo import PlanMemo
    from scheduler.policy import plan

    return partial(plan, memo=PlanMemo(sentences))


def replay(
    jobs: Sequence[TraceJob],
    nodes: Sequence[Node],
    tenants: Sequence[Tenant],
    config: Config,
    options: SimOptions | None = None,
    *,
    policy: PlanFunction | None = None,
    pools: Sequence[Pool] | None = None,
) -> Result:
    """Replay ``jobs`` on ``nodes`` for ``tenants`` under ``config``, through ``plan``.

    Plain data in (trace jobs, and the core's own Node / Tenant / Pool types), a
    :class:`Result` out; the what-if command builds these from the control plane's history.
    ``policy`` defaults to ``scheduler.policy.plan``; a plan that breaks the contract raises
    :class:`PlanError`. Jobs that can never start (larger than anything they may use) are left
    in ``Result.unfinished_job_ids``.
    """
    options = options or SimOptions()
    if policy is None:
        policy = planner_with_memo(sentences=options.on_cycle is not None)
    engine = _Engine(jobs, nodes, tenants, config, options, policy, pools)
    return engine.run()
