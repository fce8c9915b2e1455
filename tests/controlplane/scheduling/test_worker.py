"""The loop as production runs it: a submit asks Redis for a cycle, a Celery worker runs it."""

import math
import time

import pytest

from controlplane import wakeups
from controlplane.jobs.models import Job, JobState
from controlplane.scheduling.models import SchedulingCycle
from tests.controlplane.scheduling.conftest import purge_queue, read, submit, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def test_a_job_submitted_through_the_api_is_admitted_by_the_celery_worker_without_waiting_for_a_tick(
    celery_worker, redis_conn, client, alice_token, make_node
):
    purge_queue(redis_conn)
    make_node("n1", gpus=8)
    job_id = submit(client, alice_token, gpus=2)
    admitted = wait_until(
        lambda: read(client, alice_token, job_id)["state"] == JobState.ADMITTED, timeout_s=60
    )
    assert admitted, celery_worker.log_path.read_text()[-3000:]
    job = Job.objects.get(pk=job_id)
    assert job.attempts.get().allocations.filter(active=True).count() == 2
    # The cycle records itself just after its commit.
    assert wait_until(lambda: SchedulingCycle.objects.exists(), timeout_s=30)
    cycle = SchedulingCycle.objects.get()
    assert (cycle.trigger, cycle.starts) == ("submit", 1)


def test_a_burst_of_a_thousand_submits_runs_far_fewer_cycles_than_submits(
    celery_worker, redis_conn, settings, make_node, make_job, vision, alice
):
    purge_queue(redis_conn)
    make_node("n1", gpus=8)
    began = time.monotonic()
    for i in range(1000):
        make_job(vision, alice, name=f"burst-{i}")
    elapsed_s = time.monotonic() - began

    def settled():
        # The last request's cycle has run once every job has a decision: a place or a reason.
        return not Job.objects.filter(state=JobState.PENDING, pending_reason="").exists()

    assert wait_until(settled, timeout_s=120), celery_worker.log_path.read_text()[-3000:]
    cycles = SchedulingCycle.objects.count()
    # Requests that land while a cycle runs share one follow-up, spaced by what cycles take
    # (controlplane/wakeups.py): never more than one per MIN_SPACING_S, and far fewer cycles
    # than submits.
    windows = math.ceil(elapsed_s / wakeups.MIN_SPACING_S)
    assert 1 <= cycles <= windows + 2
    assert cycles < 100
    assert Job.objects.filter(state=JobState.ADMITTED).count() == 8
