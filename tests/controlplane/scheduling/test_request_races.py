"""Cycle requests against the real Celery worker: no change is ever left to the periodic tick.

No beat runs here, so there is no tick at all: a change whose request was lost or wrongly
silenced is never scheduled, and the test waiting for it fails.
"""

import random
import threading
import time

import pytest
from django.db import connection

from controlplane import wakeups
from controlplane.jobs.models import Job, JobState
from controlplane.scheduling.lock import cycle_transaction
from controlplane.scheduling.models import SchedulingCycle
from tests.controlplane.scheduling.conftest import purge_queue, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _decided(job_id: int) -> bool:
    # A cycle that read the job either admitted it or wrote why it waits.
    job = Job.objects.get(pk=job_id)
    return job.state != JobState.PENDING or job.pending_reason != ""


class _LockHolder(threading.Thread):
    """Holds the cycle lock at random moments, as a tick in another worker would."""

    def __init__(self, rng: random.Random):
        super().__init__(daemon=True)
        self.rng = rng
        self.done = threading.Event()

    def run(self):
        try:
            while not self.done.wait(self.rng.uniform(0.0, 0.3)):
                with cycle_transaction() as held:
                    if held:
                        time.sleep(self.rng.uniform(0.0, 0.3))
        finally:
            connection.close()


def test_a_change_is_scheduled_whatever_moment_its_request_lands_at(
    celery_worker, redis_conn, settings, make_node, make_job, vision, alice, nlp, bob
):
    settings.SCHEDULER_DEBOUNCE_S = 0.2
    purge_queue(redis_conn)
    make_node("n1", gpus=8)
    # A backlog that never fits: cycles take long enough for changes to land in the middle of
    # one, after it read its snapshot.
    Job.objects.bulk_create(
        Job(tenant=nlp, submitted_by=bob, name=f"backlog-{i}", image="registry.local/b:1", gpus=64)
        for i in range(2000)
    )
    rng = random.Random(14)
    holder = _LockHolder(rng)
    holder.start()
    try:
        for i in range(25):
            # Other requests at random moments, then a random pause, so that the change's own
            # request lands while a requested cycle is queued, running, skipping on the held
            # lock, or just over.
            busy_until = time.monotonic() + rng.uniform(0.0, 0.4)
            while time.monotonic() < busy_until:
                wakeups.request_cycle("job_end")
                time.sleep(rng.uniform(0.0, 0.05))
            time.sleep(rng.uniform(0.0, 0.3))
            job = make_job(vision, alice, name=f"change-{i}")
            # Nothing asks for a cycle after this change but the change itself.
            assert wait_until(lambda job=job: _decided(job.pk), timeout_s=30), (
                f"change {i} was never scheduled",
                celery_worker.log_path.read_text()[-3000:],
            )
    finally:
        holder.done.set()
        holder.join(timeout=30)
    assert not SchedulingCycle.objects.filter(trigger="tick").exists()


def test_a_submit_on_a_quiet_queue_is_scheduled_without_waiting_for_the_debounce(
    celery_worker, redis_conn, settings, make_node, make_job, vision, alice
):
    # A debounce far longer than the test waits: only a cycle run at once admits the job.
    settings.SCHEDULER_DEBOUNCE_S = 600.0
    purge_queue(redis_conn)
    make_node("n1", gpus=8)
    job = make_job(vision, alice)
    assert wait_until(
        lambda: Job.objects.filter(pk=job.pk, state=JobState.ADMITTED).exists(), timeout_s=60
    ), celery_worker.log_path.read_text()[-3000:]
    purge_queue(redis_conn)
