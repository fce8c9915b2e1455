"""What a node reports of checkpoints and stops (the job contract): stored, never moving
backwards, refused when unreadable, the steady path kept for repeats, and every stop told on
the job's timeline with how it went.

The `contract` fixture (conftest) has the agent API parse these fields.
"""

import datetime as dt
import json
import math
import time

import pytest
from django.db import connection
from django.utils import timezone

from controlplane.cluster import heartbeat, telemetry
from controlplane.cluster.models import Node
from controlplane.jobs import actions
from controlplane.jobs.models import AttemptState, Job, JobAttempt, JobEvent

from .conftest import exited, readings, running

needs_triggers = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="the steady path needs PostgreSQL's triggers"
)


@pytest.fixture
def started(agent, node01, make_job, vision, alice, admit):
    """node-01 running one job of grace 30 s: (node, token, attempt)."""
    node, token = node01
    attempt = admit(make_job(vision, alice, gpus=1), node)
    agent.heartbeat(token, readings(node), [running(attempt)])
    attempt.refresh_from_db()
    assert attempt.state == AttemptState.RUNNING
    return node, token, attempt


def _stored(attempt):
    attempt = JobAttempt.objects.get(pk=attempt.pk)
    return attempt.last_checkpoint_at, Job.objects.get(pk=attempt.job_id).checkpoint_bytes


def test_a_checkpoint_report_is_stored_and_never_moves_backwards(agent, started):
    node, token, attempt = started
    t1 = time.time() - 10
    agent.heartbeat(
        token, readings(node), [running(attempt, last_checkpoint_at=t1, checkpoint_bytes=4096)]
    )
    at, size = _stored(attempt)
    assert at.timestamp() == pytest.approx(t1, abs=1e-3)
    assert size == 4096

    # A late heartbeat with an older checkpoint; the size is what was measured last.
    agent.heartbeat(
        token, readings(node), [running(attempt, last_checkpoint_at=t1 - 60, checkpoint_bytes=10)]
    )
    at, size = _stored(attempt)
    assert at.timestamp() == pytest.approx(t1, abs=1e-3)
    assert size == 10


def test_a_checkpoint_time_ahead_of_the_clock_is_clamped_to_now(agent, started):
    node, token, attempt = started
    agent.heartbeat(token, readings(node), [running(attempt, last_checkpoint_at=time.time() + 1e6)])
    at, _ = _stored(attempt)
    assert at <= timezone.now()


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("last_checkpoint_at", "yesterday"),
        ("last_checkpoint_at", -5),
        ("last_checkpoint_at", 1e12),
        ("last_checkpoint_at", math.nan),
        ("last_checkpoint_at", True),
        ("checkpoint_bytes", -1),
        ("checkpoint_bytes", 2**64),
        ("checkpoint_bytes", 1.5),
        ("checkpoint_bytes", "1GB"),
        ("stop_signal_at", math.inf),
        ("killed_after_grace", "yes"),
    ],
)
def test_an_unreadable_value_is_left_out_and_named_while_the_rest_applies(
    agent, started, key, value
):
    node, token, attempt = started
    report = running(attempt, checkpoint_bytes=77)
    if key == "checkpoint_bytes":
        report["last_checkpoint_at"] = time.time() - 1
    report[key] = value
    body = agent.heartbeat_body(readings(node), [report])
    response = agent.post("heartbeat", json.dumps(body, allow_nan=True), token)
    assert response.status_code == 200, response.content
    assert f"attempts[0].{key}" in response.json()["warnings"]
    at, size = _stored(attempt)
    if key == "checkpoint_bytes":
        assert at is not None and size == 0
    else:
        assert size == 77
        assert at is None
    assert JobAttempt.objects.get(pk=attempt.pk).state == AttemptState.RUNNING


@needs_triggers
def test_a_repeated_checkpoint_report_keeps_the_steady_path(agent, started, settings, monkeypatch):
    node, token, attempt = started
    settings.TELEMETRY_FLUSH_INTERVAL_S = 60.0
    monkeypatch.setattr(telemetry, "buffer", telemetry.TelemetryBuffer(background=False))
    full = []
    process = heartbeat.process_heartbeat
    monkeypatch.setattr(
        heartbeat, "process_heartbeat", lambda *a, **k: full.append(1) or process(*a, **k)
    )
    t1 = time.time() - 5
    report = running(attempt, last_checkpoint_at=t1, checkpoint_bytes=2048)

    def beat(r):
        Node.objects.filter(pk=node.pk).update(
            last_heartbeat_at=timezone.now() - dt.timedelta(seconds=1)
        )
        agent.heartbeat(token, readings(node), [r])

    beat(report)
    assert len(full) == 1, "news of a checkpoint takes the full path, which stores it"
    beat(report)
    beat(report)
    assert len(full) == 1, "a repeat of what was stored is steady"
    beat(running(attempt, last_checkpoint_at=t1 + 1, checkpoint_bytes=2048))
    assert len(full) == 2
    assert _stored(attempt)[0].timestamp() == pytest.approx(t1 + 1, abs=1e-3)
    # A clock ahead of ours: stored as now, and its repeats are no news for ever after.
    ahead = running(attempt, last_checkpoint_at=time.time() + 3600, checkpoint_bytes=2048)
    beat(ahead)
    beat(ahead)
    beat(ahead)
    assert len(full) == 3


# --- how a stop went, on the timeline -------------------------------------------------------------


def _stop_events(attempt):
    return list(
        JobEvent.objects.filter(job_id=attempt.job_id, kind=actions.STOP_NOTICE_EVENT).values_list(
            "message", "data"
        )
    )


def test_a_preempted_job_that_left_in_time_is_told_with_how_long_it_took(agent, started):
    node, token, attempt = started
    actions.request_stop(attempt, reason="preempted", message="Preempted")
    finished = time.time()
    agent.heartbeat(
        token,
        readings(node),
        [
            running(
                attempt,
                state="exited",
                exit_code=143,
                finished_at=finished,
                stop_signal_at=finished - 4.2,
                killed_after_grace=False,
            )
        ],
    )
    stored = JobAttempt.objects.get(pk=attempt.pk)
    assert stored.killed_after_grace is False
    assert stored.stop_signal_at.timestamp() == pytest.approx(finished - 4.2, abs=1e-3)
    ((message, data),) = _stop_events(attempt)
    assert message == f"Attempt {attempt.number} preempted: left 4.2 s after SIGTERM (grace 30 s)"
    assert data["stop"] == "preempted" and data["killed"] is False


def test_a_cancelled_job_that_had_to_be_killed_is_told_so(agent, started):
    node, token, attempt = started
    Job.objects.filter(pk=attempt.job_id).update(stop_signal="SIGUSR1", preemption_grace_s=20)
    actions.cancel_job(Job.objects.get(pk=attempt.job_id), reason="not needed")
    finished = time.time()
    agent.heartbeat(
        token,
        readings(node),
        [
            running(
                attempt,
                state="exited",
                exit_code=137,
                finished_at=finished,
                stop_signal_at=finished - 20.1,
                killed_after_grace=True,
            )
        ],
    )
    assert JobAttempt.objects.get(pk=attempt.pk).killed_after_grace is True
    ((message, data),) = _stop_events(attempt)
    assert message == (
        f"Attempt {attempt.number} cancelled: did not leave within its 20 s grace after "
        "SIGUSR1: killed"
    )
    assert (data["stop"], data["signal"], data["grace_s"]) == ("cancelled", "SIGUSR1", 20)


def test_a_fenced_attempt_says_its_node_stopped_it(agent, started):
    node, token, attempt = started
    finished = time.time()
    agent.heartbeat(
        token,
        readings(node),
        [
            running(
                attempt,
                state="exited",
                exit_code=143,
                finished_at=finished,
                stop_cause="fenced",
                stop_signal_at=finished - 1,
                killed_after_grace=False,
            )
        ],
    )
    ((message, data),) = _stop_events(attempt)
    assert "fenced by its node: left 1.0 s after SIGTERM" in message
    assert data["stop"] == "fenced"


def test_an_attempt_that_ended_by_itself_has_no_stop_story(agent, started):
    node, token, attempt = started
    agent.heartbeat(token, readings(node), [exited(attempt, 0)])
    assert _stop_events(attempt) == []
    stored = JobAttempt.objects.get(pk=attempt.pk)
    assert (stored.stop_signal_at, stored.killed_after_grace) == (None, None)
