import pytest
from django.db import IntegrityError, transaction

from controlplane.jobs import actions
from controlplane.jobs.models import Allocation, JobEvent, JobState
from controlplane.jobs.transitions import ALLOWED_TRANSITIONS

pytestmark = pytest.mark.django_db

ALL_STATES = list(JobState.values)
LEGAL = [(a, b) for a in ALL_STATES for b in ALL_STATES if b in ALLOWED_TRANSITIONS[a]]
ILLEGAL = [(a, b) for a in ALL_STATES for b in ALL_STATES if b not in ALLOWED_TRANSITIONS[a]]


def _job_in(state, make_job, vision, alice):
    from controlplane.jobs.models import Job

    job = make_job(vision, alice)
    Job.objects.filter(pk=job.pk).update(state=state)
    job.refresh_from_db()
    return job


@pytest.mark.parametrize(("from_state", "to_state"), LEGAL)
def test_every_legal_transition_writes_one_event(from_state, to_state, make_job, vision, alice):
    job = _job_in(from_state, make_job, vision, alice)
    before = JobEvent.objects.filter(job=job).count()
    actions.transition(job, to_state, reason="because")
    job.refresh_from_db()
    assert job.state == to_state
    events = JobEvent.objects.filter(job=job).order_by("id")
    assert events.count() == before + 1
    last = events.last()
    assert (last.from_state, last.to_state, last.message) == (from_state, to_state, "because")


@pytest.mark.parametrize(("from_state", "to_state"), ILLEGAL)
def test_every_illegal_transition_is_refused_and_leaves_no_trace(
    from_state, to_state, make_job, vision, alice
):
    job = _job_in(from_state, make_job, vision, alice)
    before = JobEvent.objects.filter(job=job).count()
    with pytest.raises(actions.IllegalTransition):
        actions.transition(job, to_state)
    job.refresh_from_db()
    assert job.state == from_state
    assert JobEvent.objects.filter(job=job).count() == before


def test_a_stale_copy_of_a_job_cannot_overwrite_a_newer_state(make_job, vision, alice):
    job = make_job(vision, alice)
    stale = type(job).objects.get(pk=job.pk)
    actions.cancel_job(job)
    with pytest.raises(actions.ConcurrentUpdate):
        actions.transition(stale, JobState.ADMITTED)


def test_the_database_rejects_a_second_active_allocation_of_a_gpu(
    make_job, make_node, vision, alice
):
    node = make_node("n1", gpus=1)
    gpu = node.gpus.get()
    first = make_job(vision, alice)
    second = make_job(vision, alice)
    actions.admit_job(first, node=node, gpus=[gpu], borrowed=False)
    with pytest.raises(IntegrityError), transaction.atomic():
        actions.admit_job(second, node=node, gpus=[gpu], borrowed=False)
    second.refresh_from_db()
    assert second.state == JobState.PENDING
    assert second.attempts.count() == 0
    assert Allocation.objects.filter(gpu=gpu, active=True).count() == 1


def test_a_finished_attempt_frees_its_gpu_for_the_next_job(make_job, make_node, vision, alice):
    node = make_node("n1", gpus=1)
    gpu = node.gpus.get()
    first = make_job(vision, alice)
    attempt = actions.admit_job(first, node=node, gpus=[gpu], borrowed=False)
    actions.mark_attempt_running(attempt)
    actions.finish_attempt(attempt, exit_code=0)
    first.refresh_from_db()
    assert first.state == JobState.SUCCEEDED
    second = make_job(vision, alice)
    assert actions.admit_job(second, node=node, gpus=[gpu], borrowed=False) is not None


def test_a_repeated_exit_report_changes_nothing(make_job, make_node, vision, alice):
    node = make_node("n1", gpus=1)
    job = make_job(vision, alice)
    attempt = actions.admit_job(job, node=node, gpus=list(node.gpus.all()), borrowed=False)
    actions.mark_attempt_running(attempt)
    assert actions.finish_attempt(attempt, exit_code=3) is True
    events = JobEvent.objects.filter(job=job).count()
    assert actions.finish_attempt(attempt, exit_code=3) is False
    job.refresh_from_db()
    assert (job.state, job.exit_code) == (JobState.FAILED, 3)
    assert JobEvent.objects.filter(job=job).count() == events


def test_a_preempted_job_goes_back_to_pending_when_its_node_confirms(
    make_job, make_node, vision, alice
):
    node = make_node("n1", gpus=1)
    job = make_job(vision, alice)
    attempt = actions.admit_job(job, node=node, gpus=list(node.gpus.all()), borrowed=True)
    actions.mark_attempt_running(attempt)
    actions.request_stop(attempt, reason="preempted", message="Reclaimed by nlp")
    job.refresh_from_db()
    assert job.state == JobState.RUNNING  # GPUs are held until the container is really gone
    attempt.refresh_from_db()
    actions.finish_attempt(attempt, exit_code=137)
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    kinds = list(JobEvent.objects.filter(job=job).values_list("to_state", flat=True))
    assert kinds[-2:] == [JobState.PREEMPTED, JobState.PENDING]
