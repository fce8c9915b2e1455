"""A real Celery worker on the test database, and a clean Redis queue for it."""

import time
from pathlib import Path

import pytest
from django.conf import settings

from controlplane.wakeups import request_keys
from tests.celery_worker import purge_queue as shared_purge_queue
from tests.celery_worker import running_worker


@pytest.fixture
def redis_conn():
    from controlplane.redis_client import get_redis

    if not settings.REDIS_URL:
        pytest.fail("REDIS_URL must point at a real Redis for the scheduling-loop tests")
    conn = get_redis()
    conn.delete(*request_keys())
    return conn


def purge_queue(conn, *, keep_request: bool = False) -> None:
    """Empty this session's queue and, unless keep_request, its cycle request and last start."""
    shared_purge_queue(*([] if keep_request else request_keys()))


def queued_messages(conn) -> int:
    queue = settings.CELERY_TASK_DEFAULT_QUEUE
    return sum(
        conn.llen(key) for key in conn.scan_iter(match=f"{queue}*") if conn.type(key) == b"list"
    )


@pytest.fixture(scope="module")
def celery_worker(django_db_setup, django_db_blocker, tmp_path_factory):
    """A worker process consuming this session's queue, on the test database; killed after."""
    log_dir = Path(tmp_path_factory.mktemp("celery"))
    env = {"SCHEDULER_DEBOUNCE_S": str(settings.SCHEDULER_DEBOUNCE_S)}
    with running_worker(django_db_blocker, log_dir, "test", env=env) as worker:
        yield worker
    purge_queue(None)


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
