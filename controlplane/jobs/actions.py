"""Every change of a job's state goes through this module.

Each action is atomic, refuses what the state machine does not allow, guards against a
concurrent writer with a conditional UPDATE (the row count tells whether someone else got
there first), writes a JobEvent, and asks for a scheduling cycle once the transaction commits.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from django.db import IntegrityError, transaction
from django.db.models import F, Q, Subquery
from django.utils import timezone

from controlplane import bulk, event_metrics, modelrows, wakeups
from controlplane.cluster.models import GPU, Node
from controlplane.jobs import array_slots, dependencies, holds
from controlplane.jobs.models import (
    ACTIVE_ATTEMPT_STATES,
    FINISHED_JOB_STATES,
    Allocation,
    AttemptMember,
    AttemptState,
    Job,
    JobAttempt,
    JobEvent,
    JobState,
    SubmitKey,
)
from controlplane.jobs.transitions import fields_on_entering, is_allowed
from controlplane.prepared import Prepared
from controlplane.storage.models import Volume
from controlplane.tenancy.models import Tenant

if TYPE_CHECKING:
    from django.contrib.auth.models import User

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
        if to_state in FINISHED_JOB_STATES:
            jobs_finished(
                [holds.Finished(job.pk, to_state, job.array_id, job.has_dependents)],
                tenant_ids={job.pk: job.tenant_id},
                # A late report that turns FAILED into SUCCEEDED corrects an end counted already.
                count=from_state not in FINISHED_JOB_STATES,
            )
    for key, value in updates.items():
        setattr(job, key, value)
    return job


def jobs_finished(
    finished: Sequence[holds.Finished],
    *,
    tenant_ids: Mapping[int, int] | None = None,
    count: bool = True,
) -> None:
    """Release what these jobs' ends release (controlplane.jobs.holds), and count them for
    /metrics once they commit. Called inside the transaction that ended them, by every move to
    a finished state, once per real end: the row's update changed it under its lock.

    tenant_ids: each job's tenant, where the caller has it (else one query finds them).
    Free for the common job, with no array and no dependents: no statement at all.
    """
    if count:
        _count_finished(finished, tenant_ids or {})
    relevant = [f for f in finished if f.has_dependents or f.array_id is not None]
    if not relevant:
        return
    # Dependencies first: a task whose dependency hold is lifted joins its array's queue, and
    # the array then fills its free slots in index order.
    left = dependencies.jobs_finished(relevant)
    if left.fill:
        array_slots.fill(left.fill)
    tasks = [f for f in relevant if f.array_id is not None] + left.ended
    if tasks:
        array_slots.jobs_finished(tasks)


def _count_finished(finished: Sequence[holds.Finished], tenant_ids: Mapping[int, int]) -> None:
    if not finished or not event_metrics.enabled():
        return
    missing = [f.job_id for f in finished if f.job_id not in tenant_ids]
    if missing:
        tenant_ids = {
            **tenant_ids,
            **dict(Job.objects.filter(pk__in=missing).values_list("pk", "tenant_id")),
        }
    outcomes = [(tenant_ids[f.job_id], f.state) for f in finished]
    transaction.on_commit(lambda: event_metrics.record_jobs_finished(outcomes))


def _count_queue_waits(waits: list[tuple[int, float]]) -> None:
    """(tenant id, seconds from submit to first admission) of jobs admitted in this transaction."""
    if waits and event_metrics.enabled():
        transaction.on_commit(lambda: event_metrics.record_queue_waits(waits))


def record_event(
    job: Job, kind: str, message: str, *, actor=None, data: dict | None = None
) -> JobEvent:
    """A notable fact that is not a state change (a warning, a cap change, a log milestone)."""
    return JobEvent.objects.create(
        job=job, kind=kind, message=message, actor=actor, data=data or {}
    )


@dataclass(frozen=True)
class Submitted:
    """A job just submitted and its 'submitted' event, as written: all there is of a new job
    (it has no attempt yet), so the API answers from them instead of reading the job back."""

    job: Job
    event: JobEvent


def submit_job(*, tenant, user, **fields) -> Job:
    return submit_one(tenant=tenant, user=user, **fields).job


def _insertable(fields: dict) -> dict:
    """The fields with the checkpoint volume as a subquery that is null if it is gone.

    Validation names it from a per-process cache of the volumes (jobs.validation), which may
    still hold a volume another process deleted a moment ago: the job then gets no checkpoint
    directory, where the id itself would break the foreign key and the submit.
    """
    volume_id = fields.get("checkpoint_volume_id")
    if volume_id is None:
        return fields
    guarded = Subquery(Volume.objects.filter(pk=volume_id, checkpoints=True).values("pk"))
    return {**fields, "checkpoint_volume_id": guarded}


def submit_one(*, tenant, user, depends_on: Sequence = (), **fields) -> Submitted:
    """Submit one job; `depends_on` (validated DependencySpecs) holds it until they are met."""
    job = Job(tenant=tenant, submitted_by=user, state=JobState.PENDING, **_insertable(fields))
    event = JobEvent(
        kind="submitted",
        to_state=JobState.PENDING,
        actor=user,
        message=f"Submitted by {user.username}",
    )
    single = modelrows.one_statement_pair(job, event, "job_id")  # the event gets the job's id
    if single is not None and not depends_on and not transaction.get_connection().in_atomic_block:
        # The job and its event in one statement, which commits on its own (autocommit): a
        # transaction around it would only add BEGIN and COMMIT, two more round trips. Nothing
        # else is written: no dependencies, and the cycle request comes after.
        single()
        return _submitted(job, event, fields, ())
    with transaction.atomic():
        if single is not None:
            single()
        else:
            modelrows.insert_pair(job, event, "job_id")
        return _submitted(job, event, fields, depends_on)


def _submitted(job: Job, event: JobEvent, fields: dict, depends_on: Sequence) -> Submitted:
    """The rest of submit_one once the job and its event are in, in its transaction if any."""
    event.job = job
    job.checkpoint_volume_id = fields.get("checkpoint_volume_id")
    dependencies.attach([job], depends_on)
    request_cycle("submit")  # on commit; at once outside a transaction (the job is in)
    return Submitted(job, event)


@transaction.atomic
def submit_jobs(*, user, submissions: Sequence[tuple]) -> list[Submitted]:
    """Submit many jobs at once, all or none: [(tenant, fields)] -> the jobs, in that order.

    Two bulk INSERTs (the jobs, then their 'submitted' events) and one cycle request, whatever
    the number. The jobs share one submitted_at, and each event's data says where the job was
    in its batch ({"batch": {"first_job", "index", "size"}}), which is how a replayed
    Idempotency-Key finds the batch again (batch_jobs).
    """
    now = timezone.now()
    waits = [tuple(f.get("depends_on", ())) for _, f in submissions]
    submissions = [(t, {k: v for k, v in f.items() if k != "depends_on"}) for t, f in submissions]
    jobs = Job.objects.bulk_create(
        [
            Job(
                tenant=tenant,
                submitted_by=user,
                state=JobState.PENDING,
                submitted_at=now,
                **_insertable(f),
            )
            for tenant, f in submissions
        ]
    )
    for job, (_, f) in zip(jobs, submissions, strict=True):
        job.checkpoint_volume_id = f.get("checkpoint_volume_id")
    first, size = jobs[0].pk, len(jobs)
    events = JobEvent.objects.bulk_create(
        [
            JobEvent(
                job=job,
                at=now,
                kind="submitted",
                to_state=JobState.PENDING,
                actor=user,
                message=f"Submitted by {user.username}",
                data={"batch": {"first_job": first, "index": i, "size": size}},
            )
            for i, job in enumerate(jobs)
        ]
    )
    # One attach per distinct set of dependencies: a batch that all waits for one job is one.
    alike: dict[tuple, list[Job]] = {}
    for job, wait in zip(jobs, waits, strict=True):
        alike.setdefault(wait, []).append(job)
    for wait, waiting in alike.items():
        dependencies.attach(waiting, wait)
    request_cycle("submit")
    return [Submitted(job, event) for job, event in zip(jobs, events, strict=True)]


def batch_jobs(first: Job, size: int) -> list[Job] | None:
    """The jobs submit_jobs created together with `first` (their first), in their order; None
    when those are not `size` jobs (it was not a batch of that size)."""
    candidates = Job.objects.filter(
        submitted_by_id=first.submitted_by_id, submitted_at=first.submitted_at, pk__gte=first.pk
    ).prefetch_related("events")
    found: dict[int, Job] = {}
    for job in candidates:
        for event in job.events.all():
            batch = event.data.get("batch") if event.kind == "submitted" else None
            if isinstance(batch, dict) and batch.get("first_job") == first.pk:
                found[batch["index"]] = job
    if sorted(found) != list(range(size)):
        return None
    return [found[i] for i in range(size)]


def submit_job_once(
    *, tenant, user, key: str, request_sha256: str, **fields
) -> tuple[SubmitKey, Submitted | None]:
    """submit_one under the user's Idempotency-Key: the job and its key in one transaction.

    Returns the key's row and the job submitted; or, when another submit with this user's key
    committed first, that submit's row and None (the caller replays its job, or refuses a
    different body). Two requests racing with one key may both get past any look-up the caller
    made: the unique constraint on (user, key) makes the second insert wait for the first
    transaction, then fail, which rolls back its job with it. So a key only ever creates one
    job.
    """
    done: list[Submitted] = []

    def submit() -> Job:
        done.append(submit_one(tenant=tenant, user=user, **fields))
        return done[0].job

    row, created = _once(user, key, request_sha256, submit)
    return row, (done[0] if created else None)


def submit_jobs_once(
    *, user, key: str, request_sha256: str, submissions: Sequence[tuple]
) -> tuple[SubmitKey, list[Submitted]]:
    """submit_jobs under the user's Idempotency-Key, as submit_job_once: the key's row points
    at the batch's first job (batch_jobs finds the rest). Returns the row and the jobs
    submitted, none when another submit with the key committed first."""
    done: list[Submitted] = []

    def submit() -> Job:
        done.extend(submit_jobs(user=user, submissions=submissions))
        return done[0].job

    row, created = _once(user, key, request_sha256, submit)
    return row, (done if created else [])


def _once(user, key: str, request_sha256: str, submit) -> tuple[SubmitKey, bool]:
    """(the row of `key` for the job submit() returns, True), or (the row another submit with
    the key committed first, False), in which case what submit() wrote is rolled back."""
    try:
        with transaction.atomic():
            # An expired key replays nothing: free it for this submit.
            SubmitKey.objects.expired().filter(user=user, key=key).delete()
            job = submit()
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
    # Its active attempts first, then the job: the order in which a heartbeat's report locks
    # them (its attempt, then the job it moves), so a cancel racing the start of a gang's
    # members (or any report) waits instead of deadlocking. An attempt admitted in between is
    # found again below, under the job's lock.
    list(
        JobAttempt.objects.select_for_update()
        .filter(job_id=job.pk, state__in=ACTIVE_ATTEMPT_STATES)
        .order_by("pk")
        .values_list("pk", flat=True)
    )
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
    gpus = list(gpus)
    (plan,) = plan_rendezvous([(node, gpus)])
    attempt = JobAttempt.objects.create(
        job=job,
        number=number,
        node=node,
        borrowed=borrowed,
        master_port=plan.master_port,
        node_addrs=plan.node_addrs,
    )
    Allocation.objects.bulk_create([Allocation(attempt=attempt, gpu=gpu) for gpu in gpus])
    AttemptMember.objects.bulk_create(
        [AttemptMember(attempt=attempt, **member) for member in plan.members]
    )
    if number == 1:
        _count_queue_waits(
            [(job.tenant_id, (attempt.created_at - job.submitted_at).total_seconds())]
        )
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
class Rendezvous:
    """Where an attempt's members meet (docs/job-contract.md): its members as AttemptMember
    fields (node_id, rank, address, gpus), their addresses in rank order, and the master port."""

    members: list[dict]
    node_addrs: list[str]
    master_port: int | None


def plan_rendezvous(placements: Sequence[tuple[Node, Sequence[GPU]]]) -> list[Rendezvous]:
    """The members and master port of each attempt about to be admitted, in two reads whatever
    their number.

    A member per node holding the attempt's GPUs (the attempt's own node when it holds none).
    Rank 0 is the node with the most of them (ties: the attempt's own node, then name order),
    so the master runs where most of the job's processes do. The master port is the lowest of
    the rank-0 node's job port range that no other active member of rank 0 at its address holds
    (nor one planned before it in this batch): nodes that share an address share a host's ports
    (simulated nodes, or several agents on one host), and two of their jobs given one port
    would meet each other, or fail each other's start. A range all taken gives its lowest port,
    whose bind the agent checks before it starts: a port taken fails the start and the job is
    requeued.
    """
    node_ids = {node.pk for node, _ in placements} | {
        g.node_id for _, gpus in placements for g in gpus
    }
    nodes = {
        row[0]: row
        for row in Node.objects.filter(pk__in=node_ids).values_list(
            "pk", "name", "advertise_address", "job_port_min", "job_port_max"
        )
    }
    # Each node's host: its address, or itself when it has none. The other nodes at those
    # addresses are read apart, so that the members' read below goes by node through its
    # (node, state) index, whatever the number of members kept from finished attempts.
    host_of: dict[int, str | int] = {pk: row[2] or pk for pk, row in nodes.items()}
    addresses = {row[2] for row in nodes.values() if row[2]}
    if addresses:
        host_of.update(
            Node.objects.filter(advertise_address__in=addresses).values_list(
                "pk", "advertise_address"
            )
        )
    used: dict[str | int, set[int]] = {}
    for node_id, port in AttemptMember.objects.filter(
        node_id__in=list(host_of),
        rank=0,
        state__in=ACTIVE_ATTEMPT_STATES,
        attempt__master_port__isnull=False,
    ).values_list("node_id", "attempt__master_port"):
        if port is not None:
            used.setdefault(host_of[node_id], set()).add(port)
    plans = []
    for node, gpus in placements:
        counts: dict[int, int] = {}
        for gpu in gpus:
            counts[gpu.node_id] = counts.get(gpu.node_id, 0) + 1
        if not counts:
            counts[node.pk] = 0
        ranked = sorted(
            counts, key=lambda n: (-counts[n], n != node.pk, nodes[n][1] if n in nodes else "")
        )
        members: list[dict] = []
        addrs: list[str] = []
        for rank, node_id in enumerate(ranked):
            _, name, address, _, _ = nodes.get(node_id, (node_id, "", "", 0, 0))
            addrs.append(address or name)
            members.append(
                {
                    "node_id": node_id,
                    "rank": rank,
                    "address": address or name,
                    "gpus": counts[node_id],
                }
            )
        master = ranked[0]
        _, _, _, low, high = nodes.get(master, (master, "", "", 29500, 29999))
        taken = used.setdefault(host_of.get(master, master), set())
        port = next((p for p in range(low, high + 1) if p not in taken), low)
        taken.add(port)
        plans.append(Rendezvous(members, addrs, port))
    return plans


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
    current: dict[int, tuple[str, int]] = {}
    # Read with the lock, for the queue wait of each first admission (the caller's rows may
    # not have them: the scheduling applier reads only the columns it checks).
    submitted: dict[int, tuple[int, dt.datetime]] = {}
    for pk, state, count, tenant_id, submitted_at in (
        Job.objects.select_for_update()
        .filter(pk__in=[a.job.pk for a in admissions])
        .values_list("pk", "state", "attempt_count", "tenant_id", "submitted_at")
    ):
        current[pk] = (state, count)
        submitted[pk] = (tenant_id, submitted_at)
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
            batch = _admit_batch(accepted)
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
    else:
        results.update(batch)
        _count_queue_waits(
            [
                (submitted[pk][0], (attempt.created_at - submitted[pk][1]).total_seconds())
                for pk, attempt in batch.items()
                if attempt.number == 1
            ]
        )
    return results


def _admit_batch(accepted: list[Admission]) -> dict[int, JobAttempt]:
    now = timezone.now()
    reasons = {a.job.pk: a.reason or f"Admitted to {a.node.name}" for a in accepted}
    plans = plan_rendezvous([(a.node, a.gpus) for a in accepted])
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
                "master_port": plan.master_port,
                "node_addrs": plan.node_addrs,
            }
            for a, plan in zip(accepted, plans, strict=True)
        ],
        common={"created_at": now},
        returning="job_id",
    )
    attempts: list[JobAttempt] = []
    for pk, a in zip(attempt_ids, accepted, strict=True):
        attempt = JobAttempt(
            pk=pk,
            job=a.job,
            number=a.job.attempt_count + 1,
            node=a.node,
            borrowed=a.borrowed,
            created_at=now,
            master_port=plans[len(attempts)].master_port,
            node_addrs=plans[len(attempts)].node_addrs,
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
        AttemptMember,
        [
            {"attempt_id": pk, **member}
            for pk, plan in zip(attempt_ids, plans, strict=True)
            for member in plan.members
        ],
        common={"state": AttemptState.ADMITTED, "message": ""},
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
    # The rows are locked, and their attempt counts were checked under the lock (admit_jobs): no
    # condition beyond the ids is needed, unlike admit_job's, and the new counts are known. Each
    # job's state_reason is the message of its event: one statement for the whole batch.
    bulk.update_rows(
        Job,
        ["state", "attempt_count", "state_reason", *cleared],
        [
            (
                a.job.pk,
                JobState.ADMITTED,
                a.job.attempt_count + 1,
                reasons[a.job.pk],
                *cleared.values(),
            )
            for a in accepted
        ],
    )
    for a in accepted:
        a.job.attempt_count += 1
        a.job.state = JobState.ADMITTED
        a.job.state_reason = reasons[a.job.pk]
        for key, value in cleared.items():
            setattr(a.job, key, value)
    return {a.job.pk: attempt for attempt, a in zip(attempts, accepted, strict=True)}


CHECKPOINT_READ_ONLY_EVENT = "checkpoint_read_only"


@transaction.atomic
def make_checkpoints_read_only(attempts: Sequence[tuple[JobAttempt, str]]) -> int:
    """Give these new attempts a read-only checkpoint directory, each event saying why.

    For attempts admitted while their tenant is at or past its checkpoint storage limit: the job
    still reads what earlier attempts wrote, but adds nothing. Only an attempt still active is
    changed (one that ended meanwhile keeps what it had). Returns how many were changed.
    """
    ids = [attempt.pk for attempt, _ in attempts]
    changed = set(
        JobAttempt.objects.select_for_update()
        .filter(pk__in=ids, state__in=ACTIVE_ATTEMPT_STATES, checkpoint_read_only=False)
        .values_list("pk", flat=True)
    )
    if not changed:
        return 0
    JobAttempt.objects.filter(pk__in=changed).update(checkpoint_read_only=True)
    bulk.insert_rows(
        JobEvent,
        [
            {"job_id": attempt.job_id, "message": why, "data": {"attempt": attempt.pk}}
            for attempt, why in attempts
            if attempt.pk in changed
        ],
        common={"at": timezone.now(), "kind": CHECKPOINT_READ_ONLY_EVENT},
    )
    return len(changed)


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
    # A one-node attempt's member runs with it (a gang's members each said so first).
    AttemptMember.objects.filter(attempt_id=attempt.pk, state=AttemptState.ADMITTED).update(
        state=AttemptState.RUNNING, started_at=started_at
    )
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
    max_power_w = list(attempt.allocations.values_list("gpu__power_max_w", flat=True))
    seconds, held_s = run_and_held_s(attempt.started_at, attempt.created_at, finished_at)
    energy_j, energy_estimated = bounded_energy(
        attempt.pk,
        energy_j if energy_j is not None else attempt.energy_j,
        energy_estimated,
        sum(max_power_w),
        held_s,
    )
    return {
        "gpu_seconds": seconds * len(max_power_w),
        "energy_j": energy_j,
        "energy_estimated": energy_estimated,
    }


def run_and_held_s(started_at, created_at, finished_at) -> tuple[float, float]:
    """How long an attempt ran (its GPU seconds), and how long its GPUs were its own.

    The GPUs are the attempt's from its admission, and the agent reads their energy counters
    from when it sets the attempt up, before the job's process starts: its energy is bounded
    over that longer span. Bounded over the run alone, nearly every job of a second or less
    was "more than its GPUs can draw" (the setup's tens of milliseconds at idle draw): a
    warning per job, and its energy marked estimated.
    """
    begun = started_at or created_at
    run_s = max(0.0, (finished_at - begun).total_seconds())
    return run_s, max(run_s, (finished_at - min(begun, created_at)).total_seconds())


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
    notice: StopNotice | None = None,
) -> bool:
    """The agent says the attempt's container is gone (or the node is lost).

    exit_code None without lost means it never started (message says why): the job FAILS
    at once. message, when given, is the reason recorded for a lost or never-started attempt.
    lost with never_started: the node says the attempt never ran (its agent stopped it before
    it could start): the job is requeued, restartable or not, since nothing of it ran.
    reported: this comes from the node's own report (not from the liveness sweep), which a
    later report must not apply a second time.

    notice: how the node says the stop went (its signal's time, whether it had to kill):
    stored on the attempt, and told on the job's timeline (stop_story).

    Books usage, frees the GPUs, and moves the job: to SUCCEEDED / FAILED when it ended by
    itself; PREEMPTED then PENDING when it was preempted; LOST then PENDING or FAILED when
    its node vanished. Idempotent: a repeated report changes nothing.
    """
    now = timezone.now()
    finished_at = finished_at or now
    # A gang told to stop because one of its members failed ends as that member did.
    stopped_on_purpose = (
        attempt.stop_requested_at is not None and attempt.stop_reason != MEMBER_FAILED
    )
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
        **(
            {"stop_signal_at": notice.signal_at, "killed_after_grace": notice.killed}
            if notice is not None
            else {}
        ),
    )
    if not changed:
        return False
    _release_allocations(attempt, finished_at)
    # A one-node attempt's member ends with it; a gang's have each ended already (but for the
    # liveness sweep's or a withdrawal's members, which end here, as the attempt did).
    AttemptMember.objects.filter(attempt=attempt, state__in=ACTIVE_ATTEMPT_STATES).update(
        state=new_state, finished_at=finished_at, exit_code=exit_code, message=message
    )
    job = Job.objects.select_for_update().get(pk=attempt.job_id)
    if notice is not None:
        story, data = stop_story(
            attempt.number,
            attempt.pk,
            attempt.stop_reason if stopped_on_purpose else "",
            notice,
            finished_at,
            job.stop_signal,
            job.preemption_grace_s,
        )
        record_event(job, STOP_NOTICE_EVENT, story, data=data)
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
        # A gang's member that failed (finish_gang) says its own reason: a kill, a loss, a fence.
        gang = attempt.stop_reason == MEMBER_FAILED
        if job.restartable or never_started:
            why = "it never started" if never_started else "its node was lost"
            if gang:
                why = f"{why}: {message}" if never_started else message
            transition(job, JobState.PENDING, reason=f"Requeued: {why}", kind="requeued")
        else:
            lost_how = "Not restartable" if gang else "Not restartable, and its node was lost"
            transition(
                job,
                JobState.FAILED,
                reason=f"{lost_how}: {message}".rstrip(": "),
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
        transition(
            job,
            JobState.PREEMPTED,
            reason="Preempted to give GPUs back",
            kind="preempted",
            preemptions=job.preemptions + 1,
        )
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
                job,
                JobState.SUCCEEDED,
                reason=message or "Exited with code 0",
                kind="succeeded",
                exit_code=0,
            )
        else:
            transition(
                job,
                JobState.FAILED,
                reason=message or f"Exited with code {exit_code}",
                kind="failed",
                exit_code=exit_code,
            )
    request_cycle("job_end")
    return True


# The stop_reason of a gang told to stop because one of its members failed: its other members
# get their stop signal and grace, and the attempt ends as the failed member says (finish_gang).
MEMBER_FAILED = "member_failed"


@dataclass(frozen=True, slots=True)
class MemberReport:
    """What one node says of its member of a gang (an attempt over several nodes).

    started_at: it runs since then (None: no news of its start). ended: its process is gone,
    with exit_code when it exited by itself; lost: the node lost or stopped it on its own (its
    fence, an answer that no longer listed it, a master port it could not bind, the liveness
    sweep); never_started: it never ran."""

    attempt_id: int
    node_id: int
    started_at: dt.datetime | None = None
    ended: bool = False
    exit_code: int | None = None
    finished_at: dt.datetime | None = None
    lost: bool = False
    never_started: bool = False
    message: str = ""
    energy_j: float | None = None
    energy_estimated: bool = False
    notice: StopNotice | None = None


def member_failure_requeues(state: str, exit_code: int | None) -> bool:
    """The rule for a gang member that failed (docs/job-contract.md): a member lost (its node
    lost it, fenced it, could not bind its port) or killed by a signal (an exit code past 128,
    or negative) is not the job's doing, and the job is requeued when restartable; a member
    that exited with 1..127 failed by itself, and the job fails. (A member that failed to start
    for the job's own reasons, an image that cannot be pulled, fails the job as a one-node
    job's would.)"""
    if state == AttemptState.LOST:
        return True
    return exit_code is not None and (exit_code < 0 or exit_code > 128)


@transaction.atomic
def record_member_report(report: MemberReport) -> bool:
    """Move one member of a gang as its node reports; False when there was nothing to move.

    A member that runs: the attempt (and its job) is RUNNING once every member runs. A member
    that ended frees its own GPUs, and only those: the other members' GPUs stay held until their
    own nodes say their processes are gone, so no GPU ever holds two jobs. A member that failed
    has the attempt told to stop (MEMBER_FAILED), so every other member gets its stop signal and
    grace; a member that exited 0 leaves the others running. Once no member is left, the attempt
    ends (finish_gang). Locks the attempt, then the member, then the job, as the other actions.
    """
    attempt = (
        JobAttempt.objects.select_for_update(of=("self",))
        .select_related("node", "job")
        .filter(pk=report.attempt_id, state__in=ACTIVE_ATTEMPT_STATES)
        .first()
    )
    if attempt is None:
        return False
    member = (
        AttemptMember.objects.select_for_update(of=("self",))
        .select_related("node")
        .filter(attempt=attempt, node_id=report.node_id, state__in=ACTIVE_ATTEMPT_STATES)
        .first()
    )
    if member is None:
        return False
    now = timezone.now()
    starting = member.state == AttemptState.ADMITTED and report.started_at is not None
    if not report.ended:
        if not starting:
            return False
        AttemptMember.objects.filter(pk=member.pk).update(
            state=AttemptState.RUNNING, started_at=report.started_at
        )
        # Every member has started (one may have ended already: exited 0 before the others;
        # one that never started, failed to, keeps the attempt from running).
        waiting = (
            AttemptMember.objects.filter(attempt=attempt, started_at__isnull=True)
            .exclude(pk=member.pk)
            .exists()
        )
        if not waiting:
            mark_attempt_running(attempt, started_at=report.started_at)
        return True
    finished_at = report.finished_at or now
    if report.lost:
        state = AttemptState.LOST
    elif attempt.stop_requested_at is not None:
        state = AttemptState.STOPPED
    elif report.exit_code == 0:
        state = AttemptState.SUCCEEDED
    else:
        state = AttemptState.FAILED
    how = report.message or (
        f"exited with code {report.exit_code}"
        if report.exit_code is not None
        else "ended, exit code unknown"
    )
    AttemptMember.objects.filter(pk=member.pk).update(
        state=state,
        started_at=member.started_at or report.started_at,
        finished_at=finished_at,
        exit_code=report.exit_code,
        message=how,
    )
    Allocation.objects.filter(attempt=attempt, active=True, gpu__node_id=member.node_id).update(
        active=False, released_at=finished_at
    )
    what = f"Rank {member.rank} on {member.node.name}"
    failed = state in (AttemptState.FAILED, AttemptState.LOST)
    if failed and attempt.stop_requested_at is None:
        JobAttempt.objects.filter(pk=attempt.pk).update(
            stop_requested_at=now, stop_reason=MEMBER_FAILED
        )
        attempt.stop_requested_at, attempt.stop_reason = now, MEMBER_FAILED
        record_event(
            attempt.job,
            "member_failed",
            f"{what}: {how}; stopping the other members of attempt {attempt.number}",
            data={
                "attempt": attempt.pk,
                "rank": member.rank,
                "node": member.node.name,
                "exit_code": report.exit_code,
                "lost": report.lost,
            },
        )
        _notify_nodes_on_commit([attempt])
    else:
        record_event(
            attempt.job,
            "member_ended",
            f"{what}: {how}",
            data={"attempt": attempt.pk, "rank": member.rank, "node": member.node.name},
        )
    if AttemptMember.objects.filter(attempt=attempt, state__in=ACTIVE_ATTEMPT_STATES).exists():
        request_cycle("member_end")  # its GPUs are free
        return True
    finish_gang(attempt, report)
    return True


def finish_gang(attempt: JobAttempt, last: MemberReport) -> None:
    """End a gang whose members have all ended, as its members say (member_failure_requeues).

    Stopped on purpose (a preemption, a cancel): as any stopped attempt. Every member exited 0:
    the job succeeded. Else the first member that failed decides, named in the job's reason.
    """
    members = list(attempt.members.select_related("node").order_by("finished_at", "rank"))
    culprit = next(
        (m for m in members if m.state in (AttemptState.FAILED, AttemptState.LOST)), None
    )
    # The job never ran as a whole until every member ran (its attempt was RUNNING): a gang
    # that fell apart before is requeued as one that never started, restartable or not.
    never_started = attempt.started_at is None
    ended_at = max(m.finished_at for m in members if m.finished_at is not None)

    def end(exit_code: int | None, *, lost: bool = False, message: str = "") -> None:
        finish_attempt(
            attempt,
            exit_code=exit_code,
            finished_at=ended_at,
            energy_j=last.energy_j,
            energy_estimated=last.energy_estimated,
            lost=lost,
            never_started=never_started,
            reported=True,
            message=message,
            notice=last.notice,
        )

    if attempt.stop_reason and attempt.stop_reason != MEMBER_FAILED:
        end(last.exit_code)
    elif culprit is None:
        end(0, message="Every member exited with code 0")
    else:
        what = f"Rank {culprit.rank} on {culprit.node.name}: {culprit.message}"
        if member_failure_requeues(culprit.state, culprit.exit_code):
            end(None, lost=True, message=what)
        else:
            end(culprit.exit_code, message=what)


@dataclass(frozen=True, slots=True)
class StopNotice:
    """How a stopped attempt left, as its node reports it."""

    signal_at: dt.datetime | None  # when the node sent the job its stop signal
    killed: bool | None  # True: SIGKILLed at the end of its grace; False: it left by itself
    # The node's own reason, when it stopped the attempt unasked: "fenced" (its lease was
    # running out) or "unwanted" (no longer in its answer); "": asked, or over its max runtime.
    cause: str = ""


STOP_NOTICE_EVENT = "stop_notice"
# An attempt's stop_reason as the timeline says it.
_STOPS = {
    "preempted": "preempted",
    "drained": "drained",
    "cancelled": "cancelled",
    "superseded": "withdrawn",
    "fenced": "fenced",
}
_NODE_STOPS = {"fenced": "fenced by its node", "unwanted": "stopped by its agent"}


def stop_story(
    number: int,
    attempt_id: int,
    stop_reason: str,
    notice: StopNotice,
    finished_at: dt.datetime,
    signal: str,
    grace_s: int,
) -> tuple[str, dict]:
    """The timeline's words for how a stop went, and the event's data.

    Which stop: the reason the control plane asked it for; else the node's own (its fence);
    else the agent stopped it for running past its max runtime, the one stop it makes alone.
    """
    if stop_reason:
        stop, key = _STOPS.get(stop_reason, stop_reason), stop_reason
    elif notice.cause:
        stop, key = _NODE_STOPS.get(notice.cause, notice.cause), notice.cause
    else:
        stop, key = "over its max runtime", "max_runtime"
    left_after_s = (
        max(0.0, (finished_at - notice.signal_at).total_seconds())
        if notice.signal_at is not None
        else None
    )
    if notice.killed:
        how = f"did not leave within its {grace_s} s grace after {signal}: killed"
    elif left_after_s is not None:
        how = f"left {left_after_s:.1f} s after {signal} (grace {grace_s} s)"
    else:
        how = f"left within its grace after {signal} (grace {grace_s} s)"
    data = {
        "attempt": attempt_id,
        "stop": key,
        "signal": signal,
        "grace_s": grace_s,
        "left_after_s": None if left_after_s is None else round(left_after_s, 3),
        "killed": notice.killed,
    }
    return f"Attempt {number} {stop}: {how}", data


@dataclass(frozen=True, slots=True)
class CheckpointReport:
    """What a node says of an attempt's checkpoints (None: nothing new)."""

    attempt_id: int
    job_id: int
    last_checkpoint_at: dt.datetime | None
    checkpoint_bytes: int | None


@transaction.atomic
def record_checkpoints(reports: Sequence[CheckpointReport]) -> None:
    """Store the attempts' latest checkpoint times and their jobs' checkpoint sizes.

    A checkpoint time never moves backwards (a late or reordered heartbeat cannot undo a newer
    one); a size is what was measured last. Attempts are written before jobs, each in id order,
    as the other actions lock them. Moves no job's state and asks for no cycle: the scheduler
    reads these for its next decision, which nothing here makes urgent.
    """
    for r in sorted(reports, key=lambda r: r.attempt_id):
        if r.last_checkpoint_at is not None:
            JobAttempt.objects.filter(pk=r.attempt_id).filter(
                Q(last_checkpoint_at__isnull=True) | Q(last_checkpoint_at__lt=r.last_checkpoint_at)
            ).update(last_checkpoint_at=r.last_checkpoint_at)
    sizes = {r.job_id: r.checkpoint_bytes for r in reports if r.checkpoint_bytes is not None}
    for job_id in sorted(sizes):
        Job.objects.filter(pk=job_id).exclude(checkpoint_bytes=sizes[job_id]).update(
            checkpoint_bytes=sizes[job_id]
        )


@dataclass(frozen=True, slots=True)
class Report:
    """What a node says of one attempt, for record_reports: it started at started_at (None: no
    news of its start), and, with exit_code, its process then ended by itself at finished_at."""

    attempt_id: int
    started_at: dt.datetime | None = None
    energy_start_j: dict | None = None
    exit_code: int | None = None
    finished_at: dt.datetime | None = None
    energy_j: float | None = None
    energy_estimated: bool = False
    # How the agent stopped it, if it did (over its max runtime: the one stop that reaches here).
    notice: StopNotice | None = None

    @property
    def exited(self) -> bool:
        return self.exit_code is not None


# What record_reports writes of a job, read under its lock and written back whole.
_JOB_COLUMNS = ("state", "state_reason", "started_at", "finished_at", "exit_code")

# record_reports' reads, compiled once (controlplane.prepared): the reported attempts still
# active and not told to stop, and their jobs, each locked.
_REPORTED_ATTEMPTS = Prepared(
    lambda ids: (
        JobAttempt.objects.select_for_update(of=("self",))
        .filter(pk__in=ids, state__in=ACTIVE_ATTEMPT_STATES, stop_requested_at__isnull=True)
        .order_by("pk")
        .values(
            "pk",
            "job_id",
            "number",
            "state",
            "started_at",
            "created_at",
            "energy_j",
            "node__name",
            "node_addrs",
        )
    )
)
_REPORTED_JOBS = Prepared(
    # NO KEY: the job's key is not written, and events inserted for it meanwhile (their
    # foreign key takes a KEY SHARE lock) need not wait for this transaction.
    lambda ids: (
        Job.objects.select_for_update(no_key=True)
        .filter(pk__in=ids)
        .order_by("pk")
        .values(
            "pk",
            "stop_signal",
            "preemption_grace_s",
            "array_id",
            "has_dependents",
            "tenant_id",
            *_JOB_COLUMNS,
        )
    )
)

# record_reports' statements as fixed text (bulk.execute_for_ids): the GPUs' power limits of
# the attempts that ended (for the bound on their energy), then, following the attempts' rows it
# just wrote, their GPUs released at their end, and a one-node attempt's member taking its
# state, start, end and exit code.
_ALLOCATIONS = f'"{Allocation._meta.db_table}"'
_MEMBERS = f'"{AttemptMember._meta.db_table}"'
_ATTEMPTS = f'"{JobAttempt._meta.db_table}"'
_MAX_POWER_SQL = (
    f'SELECT al."attempt_id", g."power_max_w" FROM {_ALLOCATIONS} al '
    f'JOIN "{GPU._meta.db_table}" g ON g."id" = al."gpu_id" WHERE al."attempt_id" {{among}}'
)
_RELEASE_ENDED_SQL = (
    f'UPDATE {_ALLOCATIONS} SET "active" = false, "released_at" = '
    f'(SELECT a."finished_at" FROM {_ATTEMPTS} a WHERE a."id" = {_ALLOCATIONS}."attempt_id") '
    f'WHERE {_ALLOCATIONS}."active" AND {_ALLOCATIONS}."attempt_id" {{among}}'
)
_MEMBER_FOLLOWS_SQL = (
    f"UPDATE {_MEMBERS} SET "
    + ", ".join(
        f'"{c}" = (SELECT a."{c}" FROM {_ATTEMPTS} a WHERE a."id" = {_MEMBERS}."attempt_id")'
        for c in ("state", "started_at", "finished_at", "exit_code")
    )
    + f' WHERE {_MEMBERS}."attempt_id" {{among}}'
)


@transaction.atomic
def record_reports(reports: Sequence[Report]) -> set[int]:
    """mark_attempt_running and finish_attempt for the common reports of a heartbeat, set-based.

    A flood of short jobs makes every heartbeat carry many starts and exits; one by one, each
    costs a dozen statements and a transaction. Here a whole heartbeat's costs nine, whatever
    their number. Only the common case is taken, and written exactly as the one-attempt actions
    write it (states, reasons, events, usage, released GPUs): an attempt still active that was
    not told to stop, of a job that is ADMITTED or RUNNING, which started, or whose process
    ended by itself with an exit code after it started. Everything else (a stop requested
    meanwhile, a job moved on by a cancel or a sweep, an exit without a known start, a gang's
    member: record_member_report) is left alone for the caller to pass to those actions.
    Returns the ids of the attempts recorded.

    The attempts are locked before their jobs, in id order, as the one-attempt actions lock
    them, and every decision is made on what is read under those locks, so a report applied
    here is applied once.
    """
    by_id = {r.attempt_id: r for r in reports if r.started_at is not None or r.exited}
    if not by_id:
        return set()
    attempts = {row["pk"]: row for row in _REPORTED_ATTEMPTS.values(sorted(by_id))}
    jobs = {
        row["pk"]: row
        for row in _REPORTED_JOBS.values(sorted({a["job_id"] for a in attempts.values()}))
    }
    max_power_w: dict[int, list[float]] = {}
    for attempt_id, gpu_max_w in bulk.rows_for_ids(
        _MAX_POWER_SQL, [a for a in attempts if by_id[a].exited]
    ):
        max_power_w.setdefault(attempt_id, []).append(gpu_max_w)
    now = timezone.now()
    started_rows, ended_rows, events = [], [], []
    released: list[int] = []
    job_writes: dict[int, dict] = {}
    applied: set[int] = set()
    for attempt_id, attempt in attempts.items():
        r = by_id[attempt_id]
        if len(attempt["node_addrs"] or ()) > 1:
            continue  # a gang: each member moves alone (record_member_report)
        job = job_writes.get(attempt["job_id"]) or dict(jobs[attempt["job_id"]])
        if job["state"] not in (JobState.ADMITTED, JobState.RUNNING):
            continue  # moved on meanwhile: the one-attempt actions say what that means
        admitted = attempt["state"] == AttemptState.ADMITTED
        if r.exited and admitted and r.started_at is None:
            continue  # an exit with no start: finish_attempt's own rules apply
        started_at = attempt["started_at"]
        if admitted and r.started_at is not None:
            started_at = r.started_at
            started_rows.append(
                (attempt_id, AttemptState.RUNNING, started_at, r.energy_start_j or {})
            )
            if job["state"] == JobState.ADMITTED:
                events.append(
                    _event(
                        job,
                        JobState.RUNNING,
                        f"Running on {attempt['node__name']}",
                        "running",
                        now,
                        data={"attempt": attempt_id},
                    )
                )
                job.update(state=JobState.RUNNING, started_at=job["started_at"] or started_at)
        if r.exited:
            finished_at = r.finished_at or now
            power_w = max_power_w.get(attempt_id, [])
            seconds, held_s = run_and_held_s(started_at, attempt["created_at"], finished_at)
            energy_j, estimated = bounded_energy(
                attempt_id,
                r.energy_j if r.energy_j is not None else attempt["energy_j"],
                r.energy_estimated,
                sum(power_w),
                held_s,
            )
            ended_rows.append(
                (
                    attempt_id,
                    AttemptState.SUCCEEDED if r.exit_code == 0 else AttemptState.FAILED,
                    finished_at,
                    r.exit_code,
                    now,
                    seconds * len(power_w),
                    energy_j,
                    estimated,
                    r.notice.signal_at if r.notice else None,
                    r.notice.killed if r.notice else None,
                )
            )
            released.append(attempt_id)
            if r.notice is not None:
                story, data = stop_story(
                    attempt["number"],
                    attempt_id,
                    "",
                    r.notice,
                    finished_at,
                    job["stop_signal"],
                    job["preemption_grace_s"],
                )
                events.append(
                    {
                        "job_id": job["pk"],
                        "kind": STOP_NOTICE_EVENT,
                        "from_state": "",
                        "to_state": "",
                        "message": story,
                        "data": data,
                    }
                )
            if job["state"] == JobState.ADMITTED:
                # Started by an earlier report, of a job another of its attempts left ADMITTED.
                events.append(_event(job, JobState.RUNNING, "Started", "running", now))
                job.update(started_at=started_at or finished_at)
            if r.exit_code == 0:
                events.append(
                    _event(job, JobState.SUCCEEDED, "Exited with code 0", "succeeded", now)
                )
            else:
                events.append(
                    _event(job, JobState.FAILED, f"Exited with code {r.exit_code}", "failed", now)
                )
            job.update(finished_at=now, exit_code=r.exit_code)
        job_writes[attempt["job_id"]] = job
        applied.add(attempt_id)
    if not applied:
        return applied
    bulk.update_rows(JobAttempt, ("state", "started_at", "energy_start_j"), started_rows)
    bulk.update_rows(
        JobAttempt,
        (
            "state",
            "finished_at",
            "exit_code",
            "exit_reported_at",
            "gpu_seconds",
            "energy_j",
            "energy_estimated",
            "stop_signal_at",
            "killed_after_grace",
        ),
        ended_rows,
    )
    # Each attempt's GPUs are released when it ended, which its row now says: by attempt id,
    # through its index (a join with the rows' array had PostgreSQL hash every active one).
    bulk.execute_for_ids(_RELEASE_ENDED_SQL, released)
    # Each one-node attempt's member moves with it: one statement, from the rows just written.
    bulk.execute_for_ids(_MEMBER_FOLLOWS_SQL, sorted(applied))
    cleared = fields_on_entering(JobState.RUNNING, now)
    bulk.update_rows(
        Job,
        (*_JOB_COLUMNS, *cleared),
        [
            (pk, *(job[c] for c in _JOB_COLUMNS), *cleared.values())
            for pk, job in job_writes.items()
        ],
    )
    bulk.insert_rows(JobEvent, events, common={"at": now})
    jobs_finished(
        [
            holds.Finished(pk, job["state"], job["array_id"], job["has_dependents"])
            for pk, job in job_writes.items()
            if job["state"] in FINISHED_JOB_STATES
        ],
        tenant_ids={pk: job["tenant_id"] for pk, job in job_writes.items()},
    )
    if ended_rows:
        request_cycle("job_end")
    return applied


def _event(job: dict, to_state: str, reason: str, kind: str, now, *, data=None) -> dict:
    """The JobEvent of a move record_reports makes, and the move itself on its row `job`."""
    event = {
        "job_id": job["pk"],
        "kind": kind,
        "from_state": job["state"],
        "to_state": to_state,
        "message": reason,
        "data": data or {},
    }
    if not is_allowed(job["state"], to_state):
        raise AssertionError(f"record_reports took a report it may not: {event}")
    job.update(state=to_state, state_reason=reason)
    return event


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
    notice: StopNotice | None = None,
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
    if notice is not None:
        # How its fence's stop went (the timeline's story of it is the late report's own).
        fields.update(stop_signal_at=notice.signal_at, killed_after_grace=notice.killed)
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


# --- history -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FinishedJob:
    """A job that ran and ended before it reached this control plane (import_finished_jobs).

    outcome is the job's final state: SUCCEEDED, FAILED (exit_code says how) or CANCELLED (by
    its submitter while it ran: its attempt was stopped).
    """

    tenant: Tenant
    user: User
    fields: dict
    submitted_at: dt.datetime
    node: Node
    gpus: Sequence[GPU]
    admitted_at: dt.datetime
    started_at: dt.datetime
    finished_at: dt.datetime
    outcome: str
    exit_code: int | None
    energy_j: float


FINISHED_OUTCOMES = (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


@transaction.atomic
def import_finished_jobs(records: Sequence[FinishedJob], *, actor_label: str) -> list[Job]:
    """Write finished jobs with their one attempt, members, released allocations and timeline.

    For a past that happened elsewhere (the demo's generated week, a migration from another
    scheduler): every row says what the live path would have written had the job run here, at
    the times given, in a handful of bulk statements. Nothing is active, so no GPU is held and
    the scheduler has nothing to do; one audit row says who imported how many.
    """
    from controlplane.audit import trail

    for record in records:
        if record.outcome not in FINISHED_OUTCOMES:
            raise ValueError(f"not a final state: {record.outcome!r}")
        if not record.submitted_at <= record.admitted_at <= record.started_at:
            raise ValueError("a job is admitted after its submission and starts after that")
        if record.finished_at < record.started_at:
            raise ValueError("a job ends after it starts")
    jobs = Job.objects.bulk_create(
        [
            Job(
                tenant=r.tenant,
                submitted_by=r.user,
                state=r.outcome,
                state_reason=_final_reason(r),
                submitted_at=r.submitted_at,
                started_at=r.started_at,
                finished_at=r.finished_at,
                exit_code=r.exit_code,
                attempt_count=1,
                **r.fields,
            )
            for r in records
        ]
    )
    attempts = JobAttempt.objects.bulk_create(
        [
            JobAttempt(
                job=job,
                number=1,
                node=r.node,
                state=_attempt_state(r),
                stop_requested_at=r.finished_at if r.outcome == JobState.CANCELLED else None,
                stop_reason="cancelled" if r.outcome == JobState.CANCELLED else "",
                created_at=r.admitted_at,
                started_at=r.started_at,
                finished_at=r.finished_at,
                exit_code=r.exit_code,
                exit_reported_at=r.finished_at,
                gpu_seconds=(r.finished_at - r.started_at).total_seconds() * len(r.gpus),
                energy_j=r.energy_j,
                node_addrs=[r.node.advertise_address] if r.node.advertise_address else [],
            )
            for job, r in zip(jobs, records, strict=True)
        ]
    )
    AttemptMember.objects.bulk_create(
        [
            AttemptMember(
                attempt=attempt,
                node=r.node,
                rank=0,
                address=r.node.advertise_address,
                gpus=len(r.gpus),
                state=attempt.state,
                started_at=r.started_at,
                finished_at=r.finished_at,
                exit_code=r.exit_code,
            )
            for attempt, r in zip(attempts, records, strict=True)
        ]
    )
    Allocation.objects.bulk_create(
        [
            Allocation(
                attempt=attempt,
                gpu=gpu,
                active=False,
                created_at=r.admitted_at,
                released_at=r.finished_at,
            )
            for attempt, r in zip(attempts, records, strict=True)
            for gpu in r.gpus
        ]
    )
    events: list[JobEvent] = []
    for job, attempt, r in zip(jobs, attempts, records, strict=True):
        events += [
            JobEvent(
                job=job,
                at=r.submitted_at,
                kind="submitted",
                to_state=JobState.PENDING,
                actor=r.user,
                message=f"Submitted by {r.user.username}",
            ),
            JobEvent(
                job=job,
                at=r.admitted_at,
                kind="admitted",
                from_state=JobState.PENDING,
                to_state=JobState.ADMITTED,
                message=f"Admitted to {r.node.name}",
                data={
                    "attempt": attempt.pk,
                    "node": r.node.name,
                    "gpus": [g.uuid for g in r.gpus],
                    "borrowed": False,
                },
            ),
            JobEvent(
                job=job,
                at=r.started_at,
                kind="running",
                from_state=JobState.ADMITTED,
                to_state=JobState.RUNNING,
                message=f"Running on {r.node.name}",
                data={"attempt": attempt.pk},
            ),
            JobEvent(
                job=job,
                at=r.finished_at,
                kind=r.outcome.lower(),
                from_state=JobState.RUNNING,
                to_state=r.outcome,
                actor=r.user if r.outcome == JobState.CANCELLED else None,
                message=_final_reason(r),
            ),
        ]
    JobEvent.objects.bulk_create(events)
    trail.record(
        "jobs.history_imported",
        actor_label=actor_label,
        object_type="job",
        message=f"Imported {len(jobs)} finished jobs",
        after={"jobs": len(jobs)},
    )
    return jobs


def _attempt_state(record: FinishedJob) -> str:
    if record.outcome == JobState.CANCELLED:
        return AttemptState.STOPPED
    return AttemptState.SUCCEEDED if record.outcome == JobState.SUCCEEDED else AttemptState.FAILED


def _final_reason(record: FinishedJob) -> str:
    if record.outcome == JobState.CANCELLED:
        return f"Cancelled by {record.user.username}"
    return f"Exited with code {record.exit_code}"
