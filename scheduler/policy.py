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

The power step (scheduler.power) runs after this one on the plan; it is not part of plan().

Same snapshot and config, same plan: every choice breaks ties on names and ids, never on
dictionary or set order, and the core reads no clock but the snapshot's.
"""

from __future__ import annotations

from dataclasses import replace
from time import perf_counter

from scheduler import fairness, predict, priority, quota, reasons
from scheduler.admit import Admission
from scheduler.model import Config, Ordering, Plan, Snapshot
from scheduler.placement import ClusterIndex

_DEFAULT_CONFIG = Config()


def plan(snapshot: Snapshot, config: Config = _DEFAULT_CONFIG) -> Plan:
    """Decide which pending jobs start where, what is preempted, and why the rest wait."""
    if not isinstance(config.ordering, Ordering):
        # Settings and JSON give the ordering as its name; the steps compare enum members.
        config = replace(config, ordering=Ordering(config.ordering))
    steps: dict[str, float] = {}
    t0 = perf_counter()
    index = ClusterIndex(snapshot.nodes, snapshot.running)
    t1 = perf_counter()
    steps["index"] = t1 - t0

    books = quota.build_books(snapshot, config)
    capacity = {t: ti.total_cap for t, ti in index.types.items()}
    for book in books.values():
        fairness.refresh(book, capacity)
    t2 = perf_counter()
    steps["quota"] = t2 - t1

    predicted_s = predict.predict_durations(snapshot.pending, snapshot.history, config)
    t3 = perf_counter()
    steps["predict"] = t3 - t2

    admission = Admission(snapshot, config, index, books, predicted_s)
    admission.drain()
    t4 = perf_counter()
    steps["drain"] = t4 - t3

    queue = priority.order(snapshot.pending, config, snapshot.now_s, books, predicted_s)
    t5 = perf_counter()
    steps["order"] = t5 - t4

    admission.run(queue)
    t6 = perf_counter()
    steps["admit"] = t6 - t5

    pending = reasons.decisions(admission.waiting, snapshot.now_s)
    t7 = perf_counter()
    steps["reasons"] = t7 - t6

    return Plan(
        starts=tuple(admission.starts),
        preemptions=tuple(admission.preemptions),
        pending=pending,
        predicted_duration_s=predicted_s,
        step_seconds=steps,
    )
