"""The batch twins of the agent's actions write what the single actions write, under their guards."""

import threading
from datetime import timedelta

import pytest
from django.db import connection, connections, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from controlplane.jobs import actions
from controlplane.jobs.actions import ExitReport, StartReport
from controlplane.jobs.models import Allocation, AttemptState, Job, JobAttempt, JobEvent, JobState

pytestmark = pytest.mark.django_db


@pytest.fixture
def admitted(make_job, make_node, vision, alice):
    """n admitted attempts, one GPU each, on one node (made fresh per call)."""
    counter = iter(range(1000))

    def make(n: int, gpus: int = 1) -> list[JobAttempt]:
        node = make_node(f"n{next(counter)}", gpus=n * gpus)
        free = list(node.gpus.order_by("index"))
        attempts = []
        for i in range(n):
            job = make_job(vision, alice, gpus=gpus)
            attempt = actions.admit_job(
                job, node=node, gpus=free[i * gpus : (i + 1) * gpus], borrowed=False
            )
            attempts.append(JobAttempt.objects.select_related("node", "job").get(pk=attempt.pk))
        return attempts

    return make


def _trail(attempt: JobAttempt) -> dict:
    """What a person can see of an attempt and its job, without ids and clocks."""
    attempt.refresh_from_db()
    job = Job.objects.get(pk=attempt.job_id)
    events = JobEvent.objects.filter(job=job).order_by("id")
    node = attempt.node.name  # the two sides run on different nodes

    def words(text: str) -> str:
        return text.replace(node, "<node>")

    return {
        "job": (job.state, words(job.state_reason), job.exit_code, job.started_at is not None),
        "job_finished": job.finished_at is not None,
        "attempt": (attempt.state, attempt.exit_code, attempt.energy_j, attempt.energy_start_j),
        "held_gpus": Allocation.objects.filter(attempt=attempt, active=True).count(),
        "events": [
            (e.kind, e.from_state, e.to_state, words(e.message), sorted(e.data)) for e in events
        ],
    }


def test_a_batch_writes_exactly_what_the_single_actions_write(admitted):
    singles = admitted(3)
    batched = admitted(3)
    started = timezone.now() - timedelta(seconds=30)
    for a in singles:
        actions.mark_attempt_running(a, started_at=started, energy_start_j={"GPU-x": 5.0})
    moved = actions.mark_attempts_running(
        [StartReport(a.pk, started_at=started, energy_start_j={"GPU-x": 5.0}) for a in batched]
    ).done
    assert sorted(moved) == sorted(a.pk for a in batched)
    codes = [0, 3, 0]
    for a, code in zip(singles, codes, strict=True):
        a.refresh_from_db()
        actions.finish_attempt(a, exit_code=code, energy_j=7.0)
    finished = actions.finish_attempts(
        [ExitReport(a.pk, exit_code=c, energy_j=7.0) for a, c in zip(batched, codes, strict=True)]
    ).done
    assert sorted(finished) == sorted(a.pk for a in batched)
    for single, batch in zip(singles, batched, strict=True):
        assert _trail(batch) == _trail(single)
    for single, batch in zip(singles, batched, strict=True):
        assert batch.gpu_seconds == pytest.approx(single.gpu_seconds, abs=1.0)
        assert batch.started_at == started
        assert Job.objects.get(pk=batch.job_id).started_at == started


def test_the_states_a_person_sees_after_a_batch(admitted):
    attempts = admitted(2)
    actions.mark_attempts_running([StartReport(a.pk) for a in attempts])
    assert set(Job.objects.values_list("state", flat=True)) == {JobState.RUNNING}
    actions.finish_attempts(
        [ExitReport(attempts[0].pk, exit_code=0), ExitReport(attempts[1].pk, exit_code=1)]
    )
    first, second = (Job.objects.get(pk=a.job_id) for a in attempts)
    assert (first.state, first.exit_code) == (JobState.SUCCEEDED, 0)
    assert (second.state, second.state_reason) == (JobState.FAILED, "Exited with code 1")
    assert not Allocation.objects.filter(active=True).exists()


def test_an_attempt_no_longer_admitted_is_skipped_and_its_job_left_alone(admitted, alice):
    cancelled, ok = admitted(2)
    actions.cancel_job(cancelled.job, actor=alice)
    actions.mark_attempt_running(cancelled)  # the agent got there first
    events = JobEvent.objects.filter(job_id=cancelled.job_id).count()
    outcome = actions.mark_attempts_running([StartReport(cancelled.pk), StartReport(ok.pk)])
    assert (outcome.done, outcome.busy) == ([ok.pk], [])
    assert Job.objects.get(pk=cancelled.job_id).state == JobState.CANCELLED
    assert JobEvent.objects.filter(job_id=cancelled.job_id).count() == events


def test_a_cancelled_job_keeps_its_state_when_its_attempt_starts_late(admitted, alice):
    attempt, other = admitted(2)
    actions.cancel_job(attempt.job, actor=alice)
    moved = actions.mark_attempts_running([StartReport(attempt.pk), StartReport(other.pk)]).done
    assert sorted(moved) == sorted([attempt.pk, other.pk])
    attempt.refresh_from_db()
    assert attempt.state == AttemptState.RUNNING  # it runs until the agent stops it
    assert Job.objects.get(pk=attempt.job_id).state == JobState.CANCELLED
    assert Job.objects.get(pk=other.job_id).state == JobState.RUNNING


def test_a_repeated_exit_report_changes_nothing(admitted):
    attempts = admitted(2)
    actions.mark_attempts_running([StartReport(a.pk) for a in attempts])
    reports = [ExitReport(a.pk, exit_code=0) for a in attempts]
    assert len(actions.finish_attempts(reports).done) == 2
    events = JobEvent.objects.count()
    assert actions.finish_attempts(reports) == actions.Outcome([], [])
    assert actions.mark_attempts_running([StartReport(a.pk) for a in attempts]).done == []
    assert JobEvent.objects.count() == events


def test_a_preempted_and_a_lost_attempt_in_one_batch_go_back_to_pending(admitted):
    preempted, lost, ordinary = admitted(3)
    actions.mark_attempts_running([StartReport(a.pk) for a in (preempted, lost, ordinary)])
    # The agent's report was read before the cycle asked for the stop: the lock decides.
    actions.request_stop(preempted, reason="preempted", message="Reclaimed by nlp")
    done = actions.finish_attempts(
        [
            ExitReport(preempted.pk, exit_code=0),
            ExitReport(lost.pk, exit_code=None, lost=True, message="gone"),
            ExitReport(ordinary.pk, exit_code=0),
        ]
    ).done
    assert sorted(done) == sorted(a.pk for a in (preempted, lost, ordinary))
    states = {a.pk: Job.objects.get(pk=a.job_id).state for a in (preempted, lost, ordinary)}
    assert states == {
        preempted.pk: JobState.PENDING,
        lost.pk: JobState.PENDING,
        ordinary.pk: JobState.SUCCEEDED,
    }
    preempted.refresh_from_db()
    assert preempted.state == AttemptState.STOPPED
    kinds = list(JobEvent.objects.filter(job_id=preempted.job_id).values_list("kind", flat=True))
    assert kinds[-2:] == ["preempted", "requeued"]


def test_a_report_the_state_machine_refuses_does_not_sink_the_batch(admitted):
    refused, ordinary = admitted(2)
    actions.mark_attempts_running([StartReport(a.pk) for a in (refused, ordinary)])
    # A job already moved on while its attempt still runs (written as a racing sweep would).
    Job.objects.filter(pk=refused.job_id).update(state=JobState.LOST)
    outcome = actions.finish_attempts(
        [ExitReport(refused.pk, exit_code=0), ExitReport(ordinary.pk, exit_code=0)]
    )
    assert (outcome.done, outcome.busy) == ([ordinary.pk], [])
    refused.refresh_from_db()
    assert refused.state == AttemptState.RUNNING  # left for the next report, nothing half-done
    assert Allocation.objects.filter(attempt=refused, active=True).count() == 1
    assert Job.objects.get(pk=ordinary.job_id).state == JobState.SUCCEEDED


def test_a_batch_costs_the_same_statements_for_two_attempts_or_twenty(admitted):
    def statements(n: int) -> tuple[int, int]:
        attempts = admitted(n, gpus=2)
        with CaptureQueriesContext(connection) as started:
            actions.mark_attempts_running([StartReport(a.pk) for a in attempts])
        with CaptureQueriesContext(connection) as finished:
            actions.finish_attempts([ExitReport(a.pk, exit_code=0) for a in attempts])
        return len(started), len(finished)

    assert statements(2) == statements(20)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("held", ["attempt", "job"])
def test_a_row_another_transaction_holds_is_skipped_not_waited_for(admitted, held):
    """A cycle stopping an attempt (or a cancel) holds its rows: the batch must neither wait
    for it (the cycle may be waiting for the batch: a deadlock) nor lose the report."""
    locked, free = admitted(2)
    actions.mark_attempts_running([StartReport(a.pk) for a in (locked, free)])
    holding, release = threading.Event(), threading.Event()

    def hold():
        try:
            with transaction.atomic():
                if held == "attempt":
                    JobAttempt.objects.select_for_update().get(pk=locked.pk)
                else:
                    Job.objects.select_for_update().get(pk=locked.job_id)
                holding.set()
                release.wait(30)
        finally:
            connections.close_all()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(30)
        reports = [ExitReport(locked.pk, exit_code=0), ExitReport(free.pk, exit_code=0)]
        outcome = actions.finish_attempts(reports)
        assert (outcome.done, outcome.busy) == ([free.pk], [locked.pk])
        locked.refresh_from_db()
        assert locked.state == AttemptState.RUNNING
    finally:
        release.set()
        holder.join(30)
    # Sent again, as the next heartbeat would, the report goes through.
    outcome = actions.finish_attempts([ExitReport(locked.pk, exit_code=0)])
    assert (outcome.done, outcome.busy) == ([locked.pk], [])
    assert Job.objects.get(pk=locked.job_id).state == JobState.SUCCEEDED


def test_each_attempt_of_a_batch_keeps_its_own_reported_values(admitted):
    first, second = admitted(2)
    at = timezone.now() - timedelta(minutes=5)
    actions.mark_attempts_running(
        [
            StartReport(first.pk, started_at=at, energy_start_j={"GPU-a": 1.0}),
            StartReport(second.pk, started_at=at + timedelta(seconds=60), energy_start_j={}),
        ]
    )
    actions.finish_attempts(
        [
            ExitReport(
                first.pk, exit_code=0, finished_at=at + timedelta(seconds=100), energy_j=5.0
            ),
            ExitReport(second.pk, exit_code=2, finished_at=at + timedelta(seconds=100)),
        ]
    )
    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.energy_start_j, second.energy_start_j) == ({"GPU-a": 1.0}, {})
    assert (first.gpu_seconds, second.gpu_seconds) == (100.0, 40.0)
    assert (first.energy_j, first.exit_code, second.exit_code) == (5.0, 0, 2)
    assert (first.state, second.state) == (AttemptState.SUCCEEDED, AttemptState.FAILED)
    released = Allocation.objects.filter(attempt=first).values_list("released_at", flat=True)
    assert set(released) == {at + timedelta(seconds=100)}
