"""A small real history (finished jobs with their attempts, written through jobs.actions), and a
real Celery worker on this session's queue for the what-if task."""

import datetime as dt
import time
from pathlib import Path

import pytest

from tests.celery_worker import running_worker

T0 = dt.datetime(2026, 11, 2, 9, 0, tzinfo=dt.UTC)
SINCE = "2026-11-01"
UNTIL = "2026-12-01"


@pytest.fixture
def finished_job(make_job):
    """finished_job(tenant, user, node, submit_s=..., wait_s=..., run_s=...) -> Job.

    Times are seconds after T0. The job is submitted, admitted wait_s later on the node's first
    free GPUs, starts startup_s after that, and exits with exit_code run_s later. preempted_after_s
    first runs an attempt that is preempted after that many seconds and requeued (resumed at once).
    """
    from controlplane.jobs import actions
    from controlplane.jobs.models import JobAttempt

    def at(seconds: float) -> dt.datetime:
        return T0 + dt.timedelta(seconds=seconds)

    def run_attempt(job, node, gpus, admitted_s, started_s, finished_s, *, exit_code, preempt):
        attempt = actions.admit_job(job, node=node, gpus=gpus, borrowed=False)
        JobAttempt.objects.filter(pk=attempt.pk).update(created_at=at(admitted_s))
        attempt.refresh_from_db()
        actions.mark_attempt_running(attempt, started_at=at(started_s))
        attempt.refresh_from_db()
        if preempt:
            actions.request_stop(attempt, reason="preempted", message="for a guaranteed job")
            attempt.refresh_from_db()
        actions.finish_attempt(
            attempt, exit_code=137 if preempt else exit_code, finished_at=at(finished_s)
        )
        job.refresh_from_db()

    def make(
        tenant,
        user,
        node,
        *,
        submit_s: float = 0.0,
        wait_s: float = 0.0,
        run_s: float = 600.0,
        gpus: int = 1,
        startup_s: float = 0.0,
        exit_code: int = 0,
        preempted_after_s: float | None = None,
        name: str = "train",
        gpu_type: str = "H100-SXM-80GB",
    ):
        job = make_job(
            tenant, user, name=name, gpus=gpus, gpu_type=gpu_type, submitted_at=at(submit_s)
        )
        free = list(node.gpus.exclude(allocations__active=True).order_by("index")[:gpus])
        admitted_s = submit_s + wait_s
        if preempted_after_s is not None:
            end_s = admitted_s + startup_s + preempted_after_s
            run_attempt(
                job,
                node,
                free,
                admitted_s,
                admitted_s + startup_s,
                end_s,
                exit_code=0,
                preempt=True,
            )
            admitted_s = end_s
        started_s = admitted_s + startup_s
        run_attempt(
            job,
            node,
            free,
            admitted_s,
            started_s,
            started_s + run_s,
            exit_code=exit_code,
            preempt=False,
        )
        return job

    return make


@pytest.fixture
def celery_worker(django_db_setup, django_db_blocker, tmp_path_factory):
    """A worker consuming this session's queue (CELERY_QUEUE), on the test database; killed after.

    Function-scoped, so a test asks for it after the fixtures that write its history: a worker
    already running would schedule those jobs itself (they are pending for a moment, on a free
    node) and the fixture's own admit_job would find them taken.
    """
    log_dir = Path(tmp_path_factory.mktemp("whatif-celery"))
    with running_worker(django_db_blocker, log_dir, "whatif") as worker:
        yield worker


def wait_until(predicate, timeout_s: float = 60.0, interval_s: float = 0.05):
    """Poll predicate until it returns something truthy; the last value otherwise."""
    deadline = time.monotonic() + timeout_s
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval_s)
        value = predicate()
    return value
