"""A small real history (finished jobs with their attempts, written through jobs.actions), and a
real Celery worker on this session's queue for the what-if task."""

import datetime as dt
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

T0 = dt.datetime(2026, 11, 2, 9, 0, tzinfo=dt.UTC)
SINCE = "2026-11-01"
UNTIL = "2026-12-01"
WORKER_READY_TIMEOUT_S = 90.0


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


def _database_url() -> str:
    db = connection.settings_dict
    user = db.get("USER") or "postgres"
    host = db.get("HOST") or "127.0.0.1"
    port = db.get("PORT") or 5432
    return f"postgres://{user}@{host}:{port}/{db['NAME']}"


def purge_queue() -> None:
    from controlplane.redis_client import get_redis

    conn = get_redis()
    # kombu's Redis transport keeps a queue as lists named after it (one per priority step).
    for key in conn.scan_iter(match=f"{settings.CELERY_TASK_DEFAULT_QUEUE}*"):
        conn.delete(key)


@pytest.fixture(scope="module")
def celery_worker(django_db_setup, django_db_blocker, tmp_path_factory):
    """A worker consuming this session's queue (CELERY_QUEUE), on the test database; killed after."""
    if not settings.REDIS_URL:
        pytest.fail("REDIS_URL must point at a real Redis for the Celery worker test")
    with django_db_blocker.unblock():
        url = _database_url()
    queue = settings.CELERY_TASK_DEFAULT_QUEUE
    purge_queue()
    log_path = Path(tmp_path_factory.mktemp("whatif-celery")) / "worker.log"
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "REDIS_URL": settings.REDIS_URL,
        "CELERY_QUEUE": queue,
        "SCHEDULER_EMBEDDED": "0",
        "DB_CONN_MAX_AGE": "0",
    }
    cmd = [
        str(Path(sys.executable).with_name("celery")),
        "-A",
        "controlplane",
        "worker",
        "-Q",
        queue,
        "--pool=solo",
        "-n",
        f"{queue}-whatif@%h",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "-l",
        "INFO",
    ]
    with open(log_path, "wb") as log_file:
        worker = subprocess.Popen(
            cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, cwd=settings.BASE_DIR
        )
    try:
        deadline = time.monotonic() + WORKER_READY_TIMEOUT_S
        while b" ready." not in log_path.read_bytes():
            if worker.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the Celery worker did not start:\n{log_path.read_text()}")
            time.sleep(0.2)
        worker.log_path = log_path
        yield worker
    finally:
        worker.terminate()
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        purge_queue()


def wait_until(predicate, timeout_s: float = 60.0, interval_s: float = 0.05):
    """Poll predicate until it returns something truthy; the last value otherwise."""
    deadline = time.monotonic() + timeout_s
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval_s)
        value = predicate()
    return value
