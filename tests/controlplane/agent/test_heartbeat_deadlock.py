"""A heartbeat whose report loses a real PostgreSQL deadlock still applies it, exactly once.

A heartbeat records its reports (actions.record_reports) by locking the attempts, then their
jobs, then writing the attempts, whose trigger locks the node's generation row. A rival
transaction on its own connection takes that generation row first and the job's row second,
the opposite order: once the heartbeat waits for the generation row, the rival asks for the
job, and PostgreSQL has to abort one of the two. The heartbeat's session detects deadlocks
sooner than the rival's, so it is the heartbeat that PostgreSQL aborts.
"""

import logging
import threading
import time

import pytest
from django.db import OperationalError, connection, transaction

from controlplane.jobs.models import Allocation, AttemptState, JobEvent, JobState

from .conftest import readings, running

pytestmark = pytest.mark.django_db(transaction=True)


class Rival(threading.Thread):
    """Runs `first` (taking a lock) and holds it until the heartbeat waits for it, then runs
    `then`, or keeps holding it for `hold_s`."""

    def __init__(
        self, heartbeat_pid: int, first: tuple[str, list], then: tuple[str, list] | None, hold_s=0.0
    ):
        super().__init__()
        self.hold_s = hold_s
        self.heartbeat_pid = heartbeat_pid
        self.first = first
        self.then = then
        self.locked = threading.Event()
        self.saw_heartbeat_wait = False
        self.error: Exception | None = None

    def run(self):
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                # Slow to detect a deadlock, so that the heartbeat's session detects it first.
                cursor.execute("SET LOCAL deadlock_timeout = '30s'")
                cursor.execute(*self.first)
                self.locked.set()
                self.saw_heartbeat_wait = self._wait_for_the_heartbeat_to_block(cursor)
                if self.then:
                    cursor.execute(*self.then)
                time.sleep(self.hold_s)
        except Exception as exc:  # the test reads it: a rival chosen as the victim fails it
            self.error = exc
        finally:
            self.locked.set()
            connection.close()

    def _wait_for_the_heartbeat_to_block(self, cursor) -> bool:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            # pg_locks, not pg_stat_activity, which is read once per transaction.
            cursor.execute(
                "SELECT count(*) FROM pg_locks WHERE pid = %s AND NOT granted",
                [self.heartbeat_pid],
            )
            if cursor.fetchone()[0]:
                return True
            time.sleep(0.005)
        return False


@pytest.fixture
def session_settings():
    """SET on the test's own connection (the heartbeat's), put back afterwards for later tests
    (to the value it had, which tests/conftest.py chose, not the server's default)."""
    before: dict[str, str] = {}

    def set_(name: str, value: str) -> int:
        with connection.cursor() as cursor:
            if name not in before:
                cursor.execute(f"SHOW {name}")
                before[name] = cursor.fetchone()[0]
            cursor.execute(f"SET {name} = '{value}'")
            cursor.execute("SELECT pg_backend_pid()")
            return cursor.fetchone()[0]

    yield set_
    with connection.cursor() as cursor:
        for name, value in before.items():
            cursor.execute(f"SET {name} = '{value}'")


@pytest.fixture
def running_attempt(agent, node01, make_job, vision, alice, admit):
    node, token = node01
    job = make_job(vision, alice, gpus=1)
    attempt = admit(job, node, gpu_indexes=(0,))
    agent.heartbeat(token, readings(node), [running(attempt)])
    attempt.refresh_from_db()
    assert attempt.state == AttemptState.RUNNING
    return node, token, job, attempt


def test_an_exit_report_that_loses_a_deadlock_is_applied_once(
    agent, running_attempt, session_settings, caplog
):
    node, token, job, attempt = running_attempt
    heartbeat_pid = session_settings("deadlock_timeout", "300ms")
    rival = Rival(
        heartbeat_pid,
        (
            "UPDATE cluster_nodegeneration SET generation = generation + 1 WHERE node_id = %s",
            [node.pk],
        ),
        ("SELECT id FROM jobs_job WHERE id = %s FOR UPDATE", [job.pk]),
    )
    rival.start()
    assert rival.locked.wait(timeout=20)

    with caplog.at_level(logging.INFO, logger="controlplane.cluster.heartbeat"):
        exit_report = running(attempt, state="exited", exit_code=0, finished_at=time.time())
        answer = agent.heartbeat(token, readings(node), [exit_report])
    rival.join(timeout=30)

    assert rival.saw_heartbeat_wait
    assert rival.error is None  # the rival went through: the heartbeat was the victim
    assert any("lost a deadlock" in r.getMessage() for r in caplog.records)
    assert answer["attempts"] == []
    attempt.refresh_from_db()
    job.refresh_from_db()
    assert (attempt.state, attempt.exit_code) == (AttemptState.SUCCEEDED, 0)
    assert job.state == JobState.SUCCEEDED
    assert JobEvent.objects.filter(job=job, kind="succeeded").count() == 1
    assert not Allocation.objects.filter(attempt=attempt, active=True).exists()


def test_an_error_other_than_a_deadlock_is_not_retried(
    agent, running_attempt, session_settings, caplog
):
    node, token, job, attempt = running_attempt
    # The rival only holds the job; the heartbeat gives up waiting for it (SQLSTATE 55P03).
    heartbeat_pid = session_settings("lock_timeout", "300ms")
    rival = Rival(
        heartbeat_pid,
        ("SELECT id FROM jobs_job WHERE id = %s FOR UPDATE", [job.pk]),
        None,
        hold_s=1.5,
    )
    rival.start()
    assert rival.locked.wait(timeout=20)

    with (
        caplog.at_level(logging.INFO, logger="controlplane.cluster.heartbeat"),
        pytest.raises(OperationalError),
    ):
        exit_report = running(attempt, state="exited", exit_code=0, finished_at=time.time())
        agent.post("heartbeat", agent.heartbeat_body(readings(node), [exit_report]), token)
    rival.join(timeout=30)

    assert rival.saw_heartbeat_wait and rival.error is None
    assert not any("lost a deadlock" in r.getMessage() for r in caplog.records)
    attempt.refresh_from_db()
    assert attempt.state == AttemptState.RUNNING  # rolled back whole, to be reported again
    assert not JobEvent.objects.filter(job=job, kind="succeeded").exists()
