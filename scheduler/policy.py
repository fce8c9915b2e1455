"""plan(snapshot, config) -> Plan: the one entry point of the scheduling core.

A cycle is a fixed pipeline of named steps over one snapshot; each step is its own module and
is timed into Plan.step_seconds (a measurement only: it never changes a decision).

1. index      free GPUs per type and node (scheduler.placement)
2. quota      what every tenant uses of its guarantee and limit (scheduler.quota, .fairness)
3. predict    how long every pending job will run (scheduler.predict)
4. drain      borrowed attempts on draining nodes are preempted (scheduler.admit)
5. order      the queue (scheduler.priority)
6. admit      start, preempt for, reserve for, or hold each job (scheduler.admit, .backfill,
              .preemption)
7. reasons    a reason, queue position and estimated start for every job left pending
              (scheduler.reasons)
8. power      a power cap for every GPU, on the cluster as this plan leaves it
              (scheduler.power), when anything asks for caps: a pool power budget, a tenant's
              energy pace or throttle, or the eco setting. Otherwise Plan.power_caps_w stays
              empty, which means "uncapped": the control plane puts every GPU back to its
              default limit.

Same snapshot and config, same plan: every choice breaks ties on names and ids, never on
dictionary or set order, and the core reads no clock but the snapshot's.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from time import perf_counter

from scheduler import fairness, power, predict, priority, quota, reasons
from scheduler.admit import Admission
from scheduler.memo import PlanMemo
from scheduler.model import Config, Ordering, Plan, Running, Snapshot, Start
from scheduler.placement import ClusterIndex

_DEFAULT_CONFIG = Config()


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (unless it already was).

    A large cycle allocates hundreds of thousands of small objects next to a snapshot that is
    itself young: the collector then walks them all again and again (a third of the time at
    10,000 jobs) while finding next to nothing, since planning builds no cycles that outlive
    it. It runs again once the block is over. The control plane's cycle pauses it around load,
    plan and apply with the same context manager.
    """
    collecting = gc.isenabled()
    if collecting:
        gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def plan(
    snapshot: Snapshot, config: Config = _DEFAULT_CONFIG, memo: PlanMemo | None = None
) -> Plan:
    """Decide which pending jobs start where, what is preempted, and why the rest wait.

    `memo`: the caller's own (scheduler.memo), to reuse indexes of unchanged inputs from its
    previous calls; never one shared with another thread.
    """
    with cyclic_gc_paused():
        return _plan(snapshot, config, memo if memo is not None else PlanMemo())


def _plan(snapshot: Snapshot, config: Config, memo: PlanMemo) -> Plan:
    if not isinstance(config.ordering, Ordering):
        # Settings and JSON give the ordering as its name; the steps compare enum members.
        config = replace(config, ordering=Ordering(config.ordering))
    steps: dict[str, float] = {}
    t0 = perf_counter()
    bound = memo.preemption_bound(config.max_preemptions, snapshot.tenants)
    totals = memo.running_totals(snapshot.running, bound)
    topology = memo.topology(snapshot.nodes)
    index = ClusterIndex(
        snapshot.nodes,
        snapshot.running,
        topology,
        totals.held,
        memo.free_gpus(topology, snapshot.running),
    )
    # Kept in step with every update of the totals (cheap), so no plan rebuilds it.
    releases = (
        memo.releases(topology, config.default_duration_s, snapshot.running)
        if config.backfill
        else None
    )
    t1 = perf_counter()
    steps["index"] = t1 - t0

    books = quota.build_books(snapshot, config, totals)
    capacity = {t: ti.total_cap for t, ti in index.types.items()}
    for book in books.values():
        fairness.refresh(book, capacity)
    t2 = perf_counter()
    steps["quota"] = t2 - t1

    predicted_s = predict.predict_durations(
        snapshot.pending, snapshot.history, config, memo.history_index
    )
    t3 = perf_counter()
    steps["predict"] = t3 - t2

    candidates = memo.candidates(snapshot.now_s, config, topology) if config.preemption else None
    pool = memo.victim_pool(config, topology) if config.preemption else None
    admission = Admission(
        snapshot, config, index, books, predicted_s, releases, totals, candidates, pool
    )
    admission.drain()
    t4 = perf_counter()
    steps["drain"] = t4 - t3

    queue = priority.order(snapshot.pending, config, snapshot.now_s, books, predicted_s)
    t5 = perf_counter()
    steps["order"] = t5 - t4

    admission.run(queue)
    t6 = perf_counter()
    steps["admit"] = t6 - t5

    pending = reasons.decisions(
        admission.waiting, snapshot.now_s, snapshot.nodes, memo.fleet, memo.sentences
    )
    t7 = perf_counter()
    steps["reasons"] = t7 - t6

    caps_w: dict[str, float] = {}
    if config.power_planning and _power_is_asked_for(snapshot, config):
        busy = _busy_after(snapshot, admission.starts)
        caps_w = power.plan_power_caps(snapshot, config, busy)
        steps["power"] = perf_counter() - t7

    return Plan(
        starts=tuple(admission.starts),
        preemptions=tuple(admission.preemptions),
        pending=pending,
        power_caps_w=caps_w,
        predicted_duration_s=predicted_s,
        step_seconds=steps,
        soon_left_after=admission.soon_left_after,
    )


def _power_is_asked_for(snapshot: Snapshot, config: Config) -> bool:
    # Planning caps for every GPU costs time the trace simulator would pay on every cycle; with
    # no budget, pace, throttle or eco setting its answer would be "uncapped" anyway.
    return (
        config.eco_max_slowdown is not None
        or any(p.power_budget_w is not None for p in snapshot.pools)
        or any(
            t.power_pace_w is not None or t.budget_action == "throttle" for t in snapshot.tenants
        )
    )


def _busy_after(snapshot: Snapshot, starts: list[Start]) -> dict[str, Running]:
    """GPU uuid -> the attempt on it once this plan is applied.

    Preempted attempts still draw power until their agent has stopped them, so they count as
    busy this cycle; a new start is an attempt that has not run yet (no profile learned).
    """
    busy: dict[str, Running] = {}
    for attempt in snapshot.running:
        for uuid in attempt.gpus:
            busy[uuid] = attempt
    if not starts:
        return busy
    pending = {p.job_id: p for p in snapshot.pending}
    gpu_types = {g.uuid: g.gpu_type for n in snapshot.nodes for g in n.gpus}
    for start in starts:
        uuids = start.gpu_uuids
        if not uuids:
            continue  # a CPU-only job draws nothing the GPU caps govern
        job = pending[start.job_id]
        attempt = Running(
            attempt_id=-job.job_id,  # not created yet; negative ids never collide with real ones
            job_id=job.job_id,
            tenant=job.tenant,
            user=job.user,
            priority=job.priority,
            preemptible=job.preemptible,
            started_at_s=snapshot.now_s,
            gpus=uuids,
            gpu_type=gpu_types[uuids[0]],
            submitted_at_s=job.submitted_at_s,
        )
        for uuid in uuids:
            busy[uuid] = attempt
    return busy
