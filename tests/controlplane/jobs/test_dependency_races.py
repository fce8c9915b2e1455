"""A submit naming a job races that job's end, on two real PostgreSQL connections: whichever
commits first, the dependent never waits for an end that has already happened."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, transaction

from controlplane.jobs import actions
from controlplane.jobs.dependencies import DependencySpec
from controlplane.jobs.models import Job, JobState

pytestmark = pytest.mark.django_db(transaction=True)


class Open(threading.Thread):
    """Runs `work` in a transaction on its own connection, and commits only when released."""

    def __init__(self, work):
        super().__init__(daemon=True)
        self.work = work
        self.pid: int | None = None
        self.started_work = threading.Event()
        self.done = threading.Event()
        self.release = threading.Event()
        self.result = None
        self.error: BaseException | None = None

    def run(self):
        try:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute("SELECT pg_backend_pid()")
                    self.pid = cursor.fetchone()[0]
                self.started_work.set()
                self.result = self.work()
                self.done.set()
                self.release.wait(30)
        except BaseException as exc:  # the test reads it
            self.error = exc
        finally:
            self.started_work.set()
            self.done.set()
            connection.close()


def waits_for_a_lock(pid: int) -> bool:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_locks WHERE pid = %s AND NOT granted", [pid])
            if cursor.fetchone()[0]:
                return True
        time.sleep(0.005)
    return False


def submit_after(target: Job, vision, alice):
    return lambda: (
        actions.submit_one(
            tenant=vision,
            user=alice,
            name="evaluate",
            image="registry.local/team/train:1",
            command=["python", "eval.py"],
            gpus=1,
            depends_on=[DependencySpec("succeeded", job_id=target.pk)],
        ).job
    )


def finish(first: Open, second: Open) -> None:
    first.started_work.wait(30)
    first.done.wait(30)
    second.start()
    second.started_work.wait(30)
    assert second.pid is not None and waits_for_a_lock(second.pid), "the race was not run"
    first.release.set()
    second.done.wait(30)
    second.release.set()
    first.join(30)
    second.join(30)
    assert first.error is None and second.error is None, (first.error, second.error)


def test_a_submit_that_waits_for_an_end_in_progress_sees_it(make_job, vision, alice):
    target = make_job(vision, alice, name="prepare")
    ending = Open(lambda: actions.cancel_job(target))
    submitting = Open(submit_after(target, vision, alice))
    ending.start()
    finish(ending, submitting)
    dependent = Job.objects.get(pk=submitting.result.pk)
    assert dependent.state == JobState.CANCELLED
    assert dependent.state_reason == (
        f"Dependency never satisfied: job {target.pk} was cancelled; it was to succeed"
    )


def test_an_end_that_waits_for_a_submit_in_progress_resolves_it(make_job, vision, alice):
    target = make_job(vision, alice, name="prepare")
    submitting = Open(submit_after(target, vision, alice))
    ending = Open(lambda: actions.cancel_job(target))
    submitting.start()
    finish(submitting, ending)
    dependent = Job.objects.get(pk=submitting.result.pk)
    assert dependent.state == JobState.CANCELLED
    assert dependent.state_reason.endswith(f"job {target.pk} was cancelled; it was to succeed")
