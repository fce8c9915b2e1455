"""A real Celery worker on the test database, and a clean Redis queue for it."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

from controlplane.scheduling.trigger import REQUEST_KEY

WORKER_READY_TIMEOUT_S = 90.0


@pytest.fixture
def redis_conn():
    from controlplane.redis_client import get_redis

    if not settings.REDIS_URL:
        pytest.fail("REDIS_URL must point at a real Redis for the scheduling-loop tests")
    conn = get_redis()
    conn.delete(REQUEST_KEY)
    return conn


def purge_queue(conn) -> None:
    queue = settings.CELERY_TASK_DEFAULT_QUEUE
    # kombu's Redis transport keeps a queue as a list per priority step, named after the queue.
    for key in conn.scan_iter(match=f"{queue}*"):
        conn.delete(key)
    conn.delete(REQUEST_KEY, "unacked", "unacked_index")


def queued_messages(conn) -> int:
    queue = settings.CELERY_TASK_DEFAULT_QUEUE
    return sum(
        conn.llen(key) for key in conn.scan_iter(match=f"{queue}*") if conn.type(key) == b"list"
    )


def _database_url() -> str:
    db = connection.settings_dict
    user = db.get("USER") or "postgres"
    host = db.get("HOST") or "127.0.0.1"
    port = db.get("PORT") or 5432
    return f"postgres://{user}@{host}:{port}/{db['NAME']}"


@pytest.fixture(scope="module")
def celery_worker(django_db_setup, django_db_blocker, tmp_path_factory):
    """A worker process consuming this session's queue, on the test database; killed after."""
    from controlplane.redis_client import get_redis

    with django_db_blocker.unblock():
        url = _database_url()
    queue = settings.CELERY_TASK_DEFAULT_QUEUE
    purge_queue(get_redis())
    log_path = Path(tmp_path_factory.mktemp("celery")) / "worker.log"
    env = {
        **os.environ,
        "DATABASE_URL": url,
        "REDIS_URL": settings.REDIS_URL,
        "CELERY_QUEUE": queue,
        "SCHEDULER_EMBEDDED": "0",
        "SCHEDULER_DEBOUNCE_S": str(settings.SCHEDULER_DEBOUNCE_S),
        "DB_CONN_MAX_AGE": "0",
    }
    celery = Path(sys.executable).with_name("celery")
    cmd = [
        str(celery),
        "-A",
        "controlplane",
        "worker",
        "-Q",
        queue,
        "--pool=solo",
        "-n",
        f"{queue}-test@%h",
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
        purge_queue(get_redis())


def wait_until(predicate, timeout_s: float = 60.0, interval_s: float = 0.2):
    """Poll predicate until it returns something truthy; return its last value either way."""
    deadline = time.monotonic() + timeout_s
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval_s)
        value = predicate()
    return value


def submit(client, token, **fields):
    payload = {
        "tenant": "vision",
        "name": "train",
        "image": "registry.local/team/train:1",
        "command": ["python", "train.py"],
        **fields,
    }
    response = client.post(
        "/api/v1/jobs/",
        payload,
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )
    assert response.status_code == 201, response.content
    return response.json()["id"]


def read(client, token, job_id):
    response = client.get(f"/api/v1/jobs/{job_id}/", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 200, response.content
    return response.json()


@pytest.fixture
def alice_token(alice):
    """A real API token of alice (member of vision), for requests as a script would send them."""
    from controlplane.tenancy.models import ApiToken

    return ApiToken.issue(alice, "tests")[1]
