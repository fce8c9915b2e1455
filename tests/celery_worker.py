"""A real Celery worker process on the test database, for the suites that need one.

The scheduling-loop and what-if suites each start one per module (`celery_worker` fixtures in
their conftests); both consume this session's queue (CELERY_QUEUE) from the real Redis.
"""

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

WORKER_READY_TIMEOUT_S = 90.0


def session_database_url() -> str:
    """The URL of the database this test session uses, for processes started by the tests."""
    db = connection.settings_dict
    user = db.get("USER") or "postgres"
    host = db.get("HOST") or "127.0.0.1"
    port = db.get("PORT") or 5432
    return f"postgres://{user}@{host}:{port}/{db['NAME']}"


def purge_queue(*extra_keys: str) -> None:
    """Empty this session's queue (and the given Redis keys) so no earlier message is consumed."""
    from controlplane.redis_client import get_redis

    conn = get_redis()
    # kombu's Redis transport keeps a queue as a list per priority step, named after the queue.
    for key in conn.scan_iter(match=f"{settings.CELERY_TASK_DEFAULT_QUEUE}*"):
        conn.delete(key)
    conn.delete("unacked", "unacked_index", *extra_keys)


@contextmanager
def running_worker(
    django_db_blocker, log_dir: Path, name: str, *, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    """Start a solo-pool worker named `name`, wait until it is ready, and stop it afterwards.

    The process is yielded with `log_path` set, so a failing test can show its log.
    """
    if not settings.REDIS_URL:
        pytest.fail("REDIS_URL must point at a real Redis for the Celery worker tests")
    with django_db_blocker.unblock():
        url = session_database_url()
    queue = settings.CELERY_TASK_DEFAULT_QUEUE
    purge_queue()
    log_path = log_dir / "worker.log"
    worker_env = {
        **os.environ,
        "DATABASE_URL": url,
        "REDIS_URL": settings.REDIS_URL,
        "CELERY_QUEUE": queue,
        "SCHEDULER_EMBEDDED": "0",
        "DB_CONN_MAX_AGE": "0",
        **(env or {}),
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
        f"{queue}-{name}@%h",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "-l",
        "INFO",
    ]
    with open(log_path, "wb") as log_file:
        worker = subprocess.Popen(
            cmd, env=worker_env, stdout=log_file, stderr=subprocess.STDOUT, cwd=settings.BASE_DIR
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
