"""Every change of a job's state goes through this module.

Each action is atomic, refuses what the state machine does not allow, guards against a
concurrent writer with a conditional UPDATE (the row count tells whether someone else got
there first), writes a JobEvent, and asks for a scheduling cycle once the transaction commits.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from django.db import IntegrityError, transaction
from django.db.models import F, OuterRef, Subquery
from django.utils import timezone

from controlplane import bulk, wakeups
from controlplane.cluster.models import GPU, Node
from controlplane.jobs.models import (
    ACTIVE_ATTEMPT_STATES,
    Allocation,
    AttemptState,
    Job,
    JobAttempt,
    JobEvent,
    JobState,
    SubmitKey,
)
from controlplane.jobs.transitions import fields_on_entering, is_allowed

log = logging.getLogger(__name__)


class IllegalTransition(Exception):
    """The state machine does not allow this transition from the job's current state."""

    def __init__(self, job: Job, from_state: str, to_state: str):
        self.job = job
        self.from_state = from_state
        self.to_state = to_state
        super().__init__(f"job {job.pk} cannot go from {from_state} to {to_state}")


class ConcurrentUpdate(Exception):
    """Another process changed the job between our read and our write."""


def request_cycle(reason: str) -> None:
    """Ask for an extra scheduling cycle after the current transaction commits."""
    transaction.on_commit(lambda: wakeups.request_cycle(reason))


def transition(
    job: Job,
    to_state: str,
    *,
    reason: str = "",
    actor=None,
    kind: str = "transition",
    data: dict | None = None,
    late_report: bool = False,
    **fields,
) -> Job:
    """Move job to to_state, or raise. The only code that writes Job.state.

    late_report: the move corrects the outcome of a job whose lost attempt turned out to have
    ended by itself (record_late_exit), which may take a few moves no other cause may.
    """
    from_state = job.state
    if not is_allowed(from_state, to_state, late_report=late_report):
        raise IllegalTransition(job, from_state, to_state)
    now = timezone.now()
    updates = {
        "state": to_state,
        "state_reason": reason,
        **fields_on_entering(to_state, now),
        **fields,
    }
    with transaction.atomic():
        changed = Job.objects.filter(pk=job.pk, state=from_state).update(**updates)
        if changed == 0:
            raise ConcurrentUpdate(f"job {job.pk} is no longer {from_state}")
        JobEvent.objects.create(
            job=job,
            at=now,
            kind=kind,
            from_state=from_state,
            to_state=to_state,
            message=reason,
            actor=actor,
            data=data or {},
        )
    for key, value in updates.items():
        setattr(job, key, value)
    return job


def record_event(
    job: Job, kind: str, message: str, *, actor=None, data: dict | None = None
) -> JobEvent:
    """A notable fact that is not a state change (a warning, a cap change, a log milestone)."""
    return JobEvent.objects.create(
        job=job, kind=kind, message=message, actor=actor, data=data or {}
    )


@transaction.atomic
def submit_job(*, tenant, user, **fields) -> Job:
    job = Job.objects.create(tenant=tenant, submitted_by=user, state=JobState.PENDING, **fields)
    JobEvent.objects.create(
        job=job,
        kind="submitted",
        to_state=JobState.PENDING,
        actor=user,
        message=f"Submitted by {user.username}",
    )
    request_cycle("submit")
    return job


def submit_job_once(
    *, tenant, user, key: str, request_sha256: str, **fields
) -> tuple[SubmitKey, bool]:
    """submit_job under the user's Idempotency-Key: the job and its key in one transaction.

    Returns the key's row and True; or, when another submit with this user's key committed
    first, that submit's row and False (the caller replays its job, or refuses a different
    body). Two requests racing with one key may both get past any look-up the caller made: the
    unique constraint on (user, key) makes the second insert wait for the first transaction,
    then fail, which rolls back its job with it. So a key only ever creates one job.
    """
    try:
        with transaction.atomic():
            # An expired key replays nothing: free it for this submit.
            SubmitKey.objects.expired().filter(user=user, key=key).delete()
            job = submit_job(tenant=tenant, user=user, **fields)
            row = SubmitKey.objects.create(
                user=user, key=key, request_sha256=request_sha256, job=job
            )
    except IntegrityError:
        earlier = SubmitKey.objects.filter(user=user, key=key).first()
        if earlier is None:
            raise  # not the key's constraint: a real error
        return earlier, False
    return row, True


def delete_expired_submit_keys(now=None) -> int:
    """Delete the Idempotency-Keys older than IDEMPOTENCY_KEY_TTL_S; returns how many."""
    deleted, _ = SubmitKey.objects.expired(now).delete()
    return deleted


def _notify_nodes_on_commit(attempts: list[JobAttempt]) -> None:
    """Wake the agents that run these attempts once the change is visible, so a stop is quick."""
    from controlplane.cluster.models import Node

    ids = [a.pk for a in attempts]
    names = set(
        Node.objects.filter(gpus__allocations__attempt_id__in=ids).values_list("name", flat=True)
    ) | set(Node.objects.filter(attempts__id__in=ids).values_list("name", flat=True))
    transaction.on_commit(lambda: wakeups.notify_nodes(names))


def _release_allocations(attempt: JobAttempt, now) -> None:
    Allocation.objects.filter(attempt=attempt, active=True).update(active=False, released_at=now)


@transaction.atomic
def cancel_job(job: Job, *, actor=None, reason: str = "") -> Job:
    """Cancel a job. A running attempt is told to stop; its GPUs free up when the agent confirms."""
    job = Job.objects.select_for_update().get(pk=job.pk)
    reason = reason or (f"Cancelled by {actor.username}" if actor else "Cancelled")
    now = timezone.now()
    stopping = list(
        job.attempts.filter(state__in=ACTIVE_ATTEMPT_STATES, stop_requested_at__isnull=True)
    )
    for attempt in stopping:
        JobAttempt.objects.filter(pk=attempt.pk).update(
            stop_requested_at=now, stop_reason="cancelled"
        )
    transition(job, JobState.CANCELLED, reason=reason, actor=actor, kind="cancelled")
    if stopping:
        _notify_nodes_on_commit(stopping)
    request_cycle("cancel")
    return job


@transaction.atomic
def admit_job(
    job: Job, *, node, gpus: Iterable, borrowed: bool, reason: str = ""
) -> JobAttempt | None:
    """Create the attempt and its allocations, and move the job to ADMITTED.

    Returns None (and logs) when the job is no longer pending: a cancel or another cycle won.
    A GPU already held raises IntegrityError from the partial unique index, which rolls back the
    savepoint, so nothing of a half-admitted job remains.
    """
    number = job.attempt_count + 1
    changed = Job.objects.filter(
        pk=job.pk, state=JobState.PENDING, attempt_count=job.attempt_count
    ).update(attempt_count=F("attempt_count") + 1)
    if changed == 0:
        log.info("job %s changed since the snapshot; not admitting it", job.pk)
        return None
    job.attempt_count = number
    attempt = JobAttempt.objects.create(job=job, number=number, node=node, borrowed=borrowed)
    Allocation.objects.bulk_create([Allocation(attempt=attempt, gpu=gpu) for gpu in gpus])
    transition(
        job,
        JobState.ADMITTED,
        reason=reason or f"Admitted to {node.name}",
        kind="admitted",
        data={
            "attempt": attempt.pk,
            "node": node.name,
            "gpus": [g.uuid for g in gpus],
            "borrowed": borrowed,
        },
    )
    return attempt


@dataclass(frozen=True, slots=True)
class Admission:
    """One start for admit_jobs: the job as the caller read it, and where it goes."""

    job: Job
    node: Node
    gpus: Sequence[GPU]
    borrowed: bool
    reason: str = ""


GPU_TAKEN = "one of its GPUs is already allocated"
JOB_CHANGED = "the job changed since it was read"


@transaction.atomic
def admit_jobs(admissions: Sequence[Admission]) -> dict[int, JobAttempt | str]:
    """admit_job for a scheduling cycle's starts, in a handful of statements instead of ~9 each.

    Writes for every admission exactly what admit_job writes (the attempt, its allocations, the
    job's move to ADMITTED and its JobEvent) under the same guards: the jobs are locked, and one
    that is no longer PENDING with the attempt_count the caller read is left alone; a GPU that is
    already held, or asked for twice, refuses that admission only. Returns, per job id, the new
    attempt or the reason it was refused. Should the unique index still refuse the batch (a writer
    that bypassed the pre-check), every admission is retried one by one through admit_job.
    """
    if not is_allowed(JobState.PENDING, JobState.ADMITTED):
        raise IllegalTransition(admissions[0].job, JobState.PENDING, JobState.ADMITTED)
    results: dict[int, JobAttempt | str] = {}
    if not admissions:
        return results
    current = {
        pk: (state, count)
        for pk, state, count in Job.objects.select_for_update()
        .filter(pk__in=[a.job.pk for a in admissions])
        .values_list("pk", "state", "attempt_count")
    }
    wanted = [g.pk for a in admissions for g in a.gpus]
    held = set(
        Allocation.objects.filter(active=True, gpu_id__in=wanted).values_list("gpu_id", flat=True)
    )
    accepted: list[Admission] = []
    for admission in admissions:
        job = admission.job
        gpu_ids = [g.pk for g in admission.gpus]
        if current.get(job.pk) != (JobState.PENDING, job.attempt_count):
            log.info("job %s changed since the snapshot; not admitting it", job.pk)
            results[job.pk] = JOB_CHANGED
        elif held.intersection(gpu_ids) or len(set(gpu_ids)) != len(gpu_ids):
            results[job.pk] = GPU_TAKEN
        else:
            held.update(gpu_ids)
            accepted.append(admission)
    if not accepted:
        return results
    try:
        with transaction.atomic():
            results.update(_admit_batch(accepted))
    except IntegrityError:
        log.warning("a GPU of the batch was taken meanwhile; admitting its jobs one by one")
        for admission in accepted:
            try:
                attempt = admit_job(
                    admission.job,
                    node=admission.node,
                    gpus=admission.gpus,
                    borrowed=admission.borrowed,
                    reason=admission.reason,
                )
            except IntegrityError:
                results[admission.job.pk] = GPU_TAKEN
            else:
                results[admission.job.pk] = attempt if attempt is not None else JOB_CHANGED
    return results


def _admit_batch(accepted: list[Admission]) -> dict[int, JobAttempt]:
    now = timezone.now()
    reasons = {a.job.pk: a.reason or f"Admitted to {a.node.name}" for a in accepted}
    # One INSERT per table with the per-row values as one array per column (controlplane.bulk): at a
    # cold start's thousands of admissions, bulk_create's instance per row costs seconds.
    attempt_ids = bulk.insert_rows(
        JobAttempt,
        [
            {
                "job_id": a.job.pk,
                "number": a.job.attempt_count + 1,
                "node_id": a.node.pk,
                "borrowed": a.borrowed,
            }
            for a in accepted
        ],
        common={"created_at": now},
        returning="job_id",
    )
    attempts = []
    for pk, a in zip(attempt_ids, accepted, strict=True):
        attempt = JobAttempt(
            pk=pk,
            job=a.job,
            number=a.job.attempt_count + 1,
            node=a.node,
            borrowed=a.borrowed,
            created_at=now,
        )
        attempt._state.adding = False
        attempt._state.db = JobAttempt.objects.db
        attempts.append(attempt)
    bulk.insert_rows(
        Allocation,
        [
            {"attempt_id": pk, "gpu_id": gpu.pk}
            for pk, a in zip(attempt_ids, accepted, strict=True)
            for gpu in a.gpus
        ],
        common={"created_at": now},
    )
    bulk.insert_rows(
        JobEvent,
        [
            {
                "job_id": a.job.pk,
                "message": reasons[a.job.pk],
                "data": {
                    "attempt": pk,
                    "node": a.node.name,
                    "gpus": [g.uuid for g in a.gpus],
                    "borrowed": a.borrowed,
                },
            }
            for pk, a in zip(attempt_ids, accepted, strict=True)
        ],
        common={
            "at": now,
            "kind": "admitted",
            "from_state": JobState.PENDING,
            "to_state": JobState.ADMITTED,
        },
    )
    cleared = fields_on_entering(JobState.ADMITTED, now)
    # Each job's state_reason is the message of the event just written for it: one statement
    # for the whole batch, where a CASE over thousands of rows costs seconds to build.
    own_reason = Subquery(
        JobEvent.objects.filter(job_id=OuterRef("pk"), kind="admitted")
        .order_by("-id")
        .values("message")[:1]
    )
    ids = [a.job.pk for a in accepted]
    for i in range(0, len(ids), 5000):
        # The rows are locked: no condition beyond the ids is needed, unlike admit_job's.
        Job.objects.filter(pk__in=ids[i : i + 5000]).update(
            state=JobState.ADMITTED,
            attempt_count=F("attempt_count") + 1,
            state_reason=own_reason,
            **cleared,
        )
    for a in accepted:
        a.job.attempt_count += 1
        a.job.state = JobState.ADMITTED
        a.job.state_reason = reasons[a.job.pk]
        for key, value in cleared.items():
            setattr(a.job, key, value)
    return {a.job.pk: attempt for attempt, a in zip(attempts, accepted, strict=True)}


@transaction.atomic
def request_stop(attempt: JobAttempt, *, reason: str, message: str) -> bool:
    """Tell the agent to stop an attempt (preemption, fencing). True if this call asked first."""
    changed = JobAttempt.objects.filter(
        pk=attempt.pk, state__in=ACTIVE_ATTEMPT_STATES, stop_requested_at__isnull=True
    ).update(stop_requested_at=timezone.now(), stop_reason=reason)
    if changed:
        record_event(
            attempt.job, "stop_requested", message, data={"attempt": attempt.pk, "reason": reason}
        )
    return bool(changed)


@transaction.atomic
def request_stops(stops: Sequence[tuple[JobAttempt, str]], *, reason: str) -> set[int]:
    """request_stop for many attempts, each with its message, in three statements.

    The same guard per attempt, under row locks: only one still active and not yet told to stop
    is asked (an attempt listed twice, once). Returns the ids of the attempts this call asked.
    """
    ids = list({attempt.pk: None for attempt, _ in stops})
    if not ids:
        return set()
    asked = set(
        JobAttempt.objects.select_for_update()
        .filter(pk__in=ids, state__in=ACTIVE_ATTEMPT_STATES, stop_requested_at__isnull=True)
        .values_list("pk", flat=True)
    )
    if not asked:
        return asked
    now = timezone.now()
    JobAttempt.objects.filter(pk__in=asked).update(stop_requested_at=now, stop_reason=reason)
    events, done = [], set()
    for attempt, message in stops:
        if attempt.pk in asked and attempt.pk not in done:
            done.add(attempt.pk)
            events.append(
                {
                    "job_id": attempt.job_id,
                    "message": message,
                    "data": {"attempt": attempt.pk, "reason": reason},
                }
            )
    bulk.insert_rows(JobEvent, events, common={"at": now, "kind": "stop_requested"})
    return asked


@transaction.atomic
def mark_attempt_running(
    attempt: JobAttempt, *, started_at=None, energy_start_j: dict | None = None
) -> None:
    started_at = started_at or timezone.now()
    changed = JobAttempt.objects.filter(pk=attempt.pk, state=AttemptState.ADMITTED).update(
        state=AttemptState.RUNNING, started_at=started_at, energy_start_j=energy_start_j or {}
    )
    if not changed:
        return
    job = Job.objects.select_for_update().get(pk=attempt.job_id)
    if job.state == JobState.ADMITTED:
        transition(
            job,
            JobState.RUNNING,
            reason=f"Running on {attempt.node.name}",
            kind="running",
            started_at=job.started_at or started_at,
            data={"attempt": attempt.pk},
        )


def _book_usage(
    attempt: JobAttempt, finished_at, energy_j: float | None, energy_estimated: bool
) -> dict:
    begun = attempt.started_at or attempt.created_at
    max_power_w = list(attempt.allocations.values_list("gpu__power_max_w", flat=True))
    seconds = max(0.0, (finished_at - begun).total_seconds())
    energy_j, energy_estimated = bounded_energy(
        attempt.pk,
        energy_j if energy_j is not None else attempt.energy_j,
        energy_estimated,
        sum(max_power_w),
        seconds,
    )
    return {
        "gpu_seconds": seconds * len(max_power_w),
        "energy_j": energy_j,
        "energy_estimated": energy_estimated,
    }


def bounded_energy(
    attempt_id: int, energy_j: float, estimated: bool, max_power_w: float, seconds: float
) -> tuple[float, bool]:
    """The energy booked for an attempt: never more than its GPUs can draw in its run time.

    A GPU cannot draw more than its maximum power limit, so a report implying more (a counter
    read late, after the run ended; a reset counter) is wrong by construction: it is booked at
    that bound and marked estimated, so that no tenant is charged for energy nobody drew.
    """
    bound_j = max_power_w * seconds
    if energy_j > bound_j:
        log.warning(
            "attempt %s reported %.0f J, more than its GPUs' %.0f W can draw in %.1f s: "
            "booked %.0f J, estimated",
            attempt_id,
            energy_j,
            max_power_w,
            seconds,
            bound_j,
        )
        return bound_j, True
    return energy_j, estimated


@transaction.atomic
def finish_attempt(
    attempt: JobAttempt,
    *,
    exit_code: int | None,
    finished_at=None,
    energy_j: float | None = None,
    energy_estimated: bool = False,
    lost: bool = False,
    never_started: bool = False,
    reported: bool = False,
    message: str = "",
) -> bool:
    """The agent says the attempt's container is gone (or the node is lost).

    exit_code None without lost means it never started (message says why): the job FAILS
    at once. message, when given, is the reason recorded for a lost or never-started attempt.
    lost with never_started: the node says the attempt never ran (its agent stopped it before
    it could start): the job is requeued, restartable or not, since nothing of it ran.
    reported: this comes from the node's own report (not from the liveness sweep), which a
    later report must not apply a second time.

    Books usage, frees the GPUs, and moves the job: to SUCCEEDED / FAILED when it ended by
    itself; PREEMPTED then PENDING when it was preempted; LOST then PENDING or FAILED when
    its node vanished. Idempotent: a repeated report changes nothing.
    """
    now = timezone.now()
    finished_at = finished_at or now
    stopped_on_purpose = attempt.stop_requested_at is not None
    if lost:
        new_state = AttemptState.LOST
    elif stopped_on_purpose:
        new_state = AttemptState.STOPPED
    else:
        new_state = AttemptState.SUCCEEDED if exit_code == 0 else AttemptState.FAILED
    usage = _book_usage(attempt, finished_at, energy_j, energy_estimated)
    changed = JobAttempt.objects.filter(pk=attempt.pk, state__in=ACTIVE_ATTEMPT_STATES).update(
        state=new_state,
        finished_at=finished_at,
        exit_code=exit_code,
        exit_reported_at=now if reported else None,
        **usage,
    )
    if not changed:
        return False
    _release_allocations(attempt, finished_at)
    job = Job.objects.select_for_update().get(pk=attempt.job_id)
    if job.state in (JobState.CANCELLED, JobState.SUCCEEDED, JobState.FAILED):
        record_event(
            job,
            "attempt_stopped",
            f"Attempt {attempt.number} stopped",
            data={"exit_code": exit_code},
        )
    elif lost:
        transition(
            job,
            JobState.LOST,
            reason=message or f"Node {attempt.node.name} stopped answering",
            kind="lost",
            data={"attempt": attempt.pk},
        )
        if job.restartable or never_started:
            why = "it never started" if never_started else "its node was lost"
            transition(job, JobState.PENDING, reason=f"Requeued: {why}", kind="requeued")
        else:
            transition(
                job,
                JobState.FAILED,
                reason=f"Not restartable, and its node was lost: {message}".rstrip(": "),
                kind="failed",
            )
    elif stopped_on_purpose and attempt.stop_reason in ("preempted", "drained"):
        if job.state == JobState.ADMITTED and not never_started:
            transition(
                job,
                JobState.RUNNING,
                reason="Started",
                kind="running",
                started_at=job.started_at or finished_at,
            )
        transition(job, JobState.PREEMPTED, reason="Preempted to give GPUs back", kind="preempted")
        transition(job, JobState.PENDING, reason="Requeued after preemption", kind="requeued")
    elif stopped_on_purpose:
        # Fenced (e.g. a stale attempt on a node that came back): the job was already moved on.
        record_event(
            job, "attempt_stopped", f"Attempt {attempt.number} stopped ({attempt.stop_reason})"
        )
    elif exit_code is None:
        transition(job, JobState.FAILED, reason=message or "Failed to start", kind="failed")
    else:
        if job.state == JobState.ADMITTED:
            transition(
                job,
                JobState.RUNNING,
                reason="Started",
                kind="running",
                started_at=attempt.started_at or finished_at,
            )
        if exit_code == 0:
            transition(
                job, JobState.SUCCEEDED, reason="Exited with code 0", kind="succeeded", exit_code=0
            )
        else:
            transition(
                job,
                JobState.FAILED,
                reason=f"Exited with code {exit_code}",
                kind="failed",
                exit_code=exit_code,
            )
    request_cycle("job_end")
    return True


@transaction.atomic
def record_late_exit(
    attempt: JobAttempt,
    *,
    exit_code: int | None,
    finished_at,
    energy_j: float | None,
    energy_estimated: bool,
    ended_by_itself: bool,
    message: str = "",
) -> bool:
    """A node back from silence says how an attempt declared lost really ended. Counted once.

    The attempt's real end, exit code and energy are recorded. When its process ended by
    itself (not stopped by its node's fence), that is the job's real outcome: a job requeued
    for the loss whose copy has not started is finished with it (the copy, if admitted, is
    withdrawn), and a job failed for the loss becomes what its process did. A copy that already
    runs is left to finish; the job then keeps its outcome and the report is kept as history.
    Returns False when the attempt is not a lost one awaiting its report.
    """
    now = timezone.now()
    locked = (
        JobAttempt.objects.select_for_update()
        .filter(pk=attempt.pk, state=AttemptState.LOST, exit_reported_at__isnull=True)
        .first()
    )
    if locked is None:
        return False
    ended_at = min(finished_at, locked.finished_at or finished_at)
    fields = {"exit_code": exit_code, "exit_reported_at": now, "finished_at": ended_at}
    fields.update(_book_usage(locked, ended_at, energy_j, energy_estimated))
    if ended_by_itself and exit_code is not None:
        fields["state"] = AttemptState.SUCCEEDED if exit_code == 0 else AttemptState.FAILED
    JobAttempt.objects.filter(pk=locked.pk).update(**fields)
    job = Job.objects.select_for_update().get(pk=locked.job_id)
    how = (
        f"exited with code {exit_code}"
        if ended_by_itself and exit_code is not None
        else (message or "was stopped by its node")
    )
    story = (
        f"Attempt {locked.number}, declared lost, really {how} at {ended_at:%H:%M:%S} UTC "
        "(reported when its node answered again)"
    )
    if not (ended_by_itself and exit_code is not None):
        record_event(job, "late_report", story, data={"attempt": locked.pk, "exit_code": exit_code})
        return True
    outcome = JobState.SUCCEEDED if exit_code == 0 else JobState.FAILED
    kind = "succeeded" if exit_code == 0 else "failed"
    latest = job.attempt_count == locked.number
    if job.state in (JobState.PENDING, JobState.ADMITTED):
        # Requeued for the loss, and no copy has started: the job is done. An admitted copy
        # is withdrawn (its agent may be starting it: it is told to stop, and its GPUs free
        # when the agent confirms, as for any stop).
        copies = list(
            JobAttempt.objects.filter(
                job=job, number__gt=locked.number, state__in=ACTIVE_ATTEMPT_STATES
            )
        )
        for copy in copies:
            request_stop(copy, reason="superseded", message=f"Withdrawn: {story}")
        transition(
            job,
            outcome,
            reason=story,
            kind=kind,
            exit_code=exit_code,
            late_report=True,
            finished_at=ended_at,
        )
        if copies:
            _notify_nodes_on_commit(copies)
    elif job.state == JobState.FAILED and latest and job.exit_code is None:
        # Failed for the loss alone (it is not restartable): what its process did decides.
        if outcome == JobState.SUCCEEDED:
            transition(
                job,
                outcome,
                reason=story,
                kind=kind,
                exit_code=0,
                late_report=True,
                finished_at=ended_at,
            )
        else:
            Job.objects.filter(pk=job.pk).update(exit_code=exit_code, state_reason=story)
            record_event(job, "late_report", story, data={"attempt": locked.pk})
    else:
        record_event(job, "late_report", story, data={"attempt": locked.pk, "exit_code": exit_code})
    request_cycle("late_report")
    return True
