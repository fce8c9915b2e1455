"""An array's slots: which of its held tasks may go to the scheduler when others end.

Apart from controlplane.jobs.arrays (submit, cancel, reads) because every job end passes
through here from controlplane.jobs.actions, and arrays itself calls actions: this module
imports neither, so the two do not import each other.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from django.db import transaction
from django.db.models import Count, Q

from controlplane import wakeups
from controlplane.jobs.holds import Finished
from controlplane.jobs.models import Hold, Job, JobArray, JobState

# A task holds one of its array's slots from its release to its end: admitted, running,
# stopped and waiting to go again, or pending and seen by the scheduler.
IN_FLIGHT = Q(
    state__in=[JobState.ADMITTED, JobState.RUNNING, JobState.PREEMPTED, JobState.LOST]
) | Q(state=JobState.PENDING, hold=Hold.NONE)


def fill(array_ids: Iterable[int]) -> None:
    """Lift the array hold of the next tasks of these arrays, up to their max_parallel.

    Takes each array's row lock first: two transactions that each end a task of one array
    would otherwise both count the other's task as still in flight and give both slots to the
    same next task. Callers lock the ending jobs before (every job end does), and cancel_array
    too, so the order is always jobs, then arrays.
    """
    ids = sorted(set(array_ids))
    if not ids:
        return
    # NO KEY: a row that references the array (a job's dependency on it) may still be
    # inserted meanwhile; only fills of the same array wait for each other.
    limits = dict(
        JobArray.objects.select_for_update(no_key=True)
        .filter(pk__in=ids, max_parallel__isnull=False, cancelled_at__isnull=True)
        .order_by("pk")
        .values_list("pk", "max_parallel")
    )
    if not limits:
        return
    in_flight = dict(
        Job.objects.filter(array_id__in=limits)
        .filter(IN_FLIGHT)
        .values("array_id")
        .annotate(n=Count("pk"))
        .values_list("array_id", "n")
    )
    free = {a: (limit or 0) - in_flight.get(a, 0) for a, limit in limits.items()}
    free = {a: n for a, n in free.items() if n > 0}
    if not free:
        return
    lifted: list[int] = []
    held = (
        Job.objects.filter(array_id__in=free, state=JobState.PENDING, hold=Hold.ARRAY)
        .order_by("array_id", "array_index")
        .values_list("pk", "array_id")
    )
    if len(free) == 1:
        # The common case, one task ended: read only as many as there are slots.
        ((only, n),) = free.items()
        held = held[:n]
    taken: dict[int, int] = {}
    for pk, array_id in held:
        if taken.get(array_id, 0) < free[array_id]:
            taken[array_id] = taken.get(array_id, 0) + 1
            lifted.append(pk)
    if lifted:
        # The cycle writes their reasons from now on, as for any pending job.
        Job.objects.filter(pk__in=lifted, state=JobState.PENDING, hold=Hold.ARRAY).update(
            hold=Hold.NONE, pending_reason_code="", pending_reason=""
        )
        transaction.on_commit(lambda: wakeups.request_cycle("array_slot"))


def jobs_finished(finished: Sequence[Finished]) -> None:
    """Give the slots these array tasks held to their arrays' next held tasks."""
    fill(f.array_id for f in finished if f.array_id is not None)
