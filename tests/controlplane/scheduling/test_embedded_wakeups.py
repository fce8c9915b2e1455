"""The embedded loop's wake-ups: at once when idle, one follow-up for requests during a cycle."""

import threading
import time

import pytest
from django.db import connection

from controlplane import wakeups
from controlplane.jobs.models import Job, JobState
from controlplane.scheduling import embedded
from controlplane.scheduling.cycle import run_scheduling_cycle
from controlplane.scheduling.embedded import SchedulingLoop
from tests.controlplane.scheduling.conftest import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def _admitted(job) -> bool:
    return Job.objects.filter(pk=job.pk, state=JobState.ADMITTED).exists()


def test_a_submit_on_a_quiet_loop_is_scheduled_without_waiting_for_the_debounce(
    settings, make_node, make_job, vision, alice
):
    settings.SCHEDULER_EMBEDDED = True
    make_node("n1", gpus=8)
    wakeups.embedded_wakeup_event().clear()
    # Neither the tick nor the debounce comes within the test: only a cycle run at once admits.
    loop = SchedulingLoop(interval_s=600, debounce_s=600, liveness_interval_s=600).start()
    try:
        job = make_job(vision, alice)
        assert wait_until(lambda: _admitted(job), timeout_s=30)
    finally:
        loop.stop()
        connection.close()
    assert loop.failures == 0


def test_requests_while_a_cycle_runs_share_one_follow_up_and_a_quiet_loop_runs_at_once(
    settings, monkeypatch, make_node, make_job, vision, alice
):
    settings.SCHEDULER_EMBEDDED = True
    make_node("n1", gpus=8)
    wakeups.embedded_wakeup_event().clear()
    running = threading.Event()
    release = threading.Event()

    def held_first_cycle(**kwargs):
        # The first cycle runs until the test has made its requests.
        if not running.is_set():
            running.set()
            release.wait(timeout=30)
        return run_scheduling_cycle(**kwargs)

    monkeypatch.setattr(embedded, "run_scheduling_cycle", held_first_cycle)
    loop = SchedulingLoop(interval_s=600, debounce_s=1.0, liveness_interval_s=600).start()
    try:
        make_job(vision, alice, name="first")
        assert running.wait(timeout=30)
        burst = [make_job(vision, alice, name=f"burst-{i}") for i in range(5)]
        for _ in range(50):
            wakeups.request_cycle("job_end")
        release.set()
        assert wait_until(lambda: all(_admitted(job) for job in burst), timeout_s=30)
        assert wait_until(lambda: loop.cycles == 2, timeout_s=30)
        # Nothing asked while the follow-up ran: it stays the only one, and the loop is quiet.
        time.sleep(1.5)
        assert loop.cycles == 2
        late = make_job(vision, alice, name="late")
        assert wait_until(lambda: _admitted(late), timeout_s=30)
        assert wait_until(lambda: loop.cycles == 3, timeout_s=30)
    finally:
        release.set()
        loop.stop()
        connection.close()
    assert loop.failures == 0
