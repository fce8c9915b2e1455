"""The control plane's side of node leases: what an answer grants, what a renewal needs, what a
node's own stop and a late report mean for its jobs (docs/agent-protocol.md, "Leases")."""

import datetime as dt
import time

import pytest
from django.db import OperationalError
from django.utils import timezone

from controlplane.cluster import heartbeat as hb_logic
from controlplane.cluster import lease as leases
from controlplane.cluster import telemetry
from controlplane.cluster.agent_auth import node_token_digest
from controlplane.cluster.models import Node
from controlplane.jobs import actions
from controlplane.jobs.models import AttemptState, Job, JobAttempt, JobEvent, JobState

from .conftest import exited, readings, running, sweep_while_hearing


@pytest.fixture
def lease(settings):
    settings.NODE_LEASE_S = 120.0
    settings.NODE_LEASE_MARGIN_S = 10.0
    return 130.0


def test_every_answer_grants_the_lease_the_sweep_counts_with(agent, node01, lease, settings):
    node, token = node01
    settings.NODE_FENCE_MARGIN_S = 6.0
    answer = agent.heartbeat(token, readings(node))
    assert (answer["lease_s"], answer["fence_margin_s"]) == (120.0, 6.0)
    response = agent.post("register", _inventory("node-02"), agent.join_token)
    assert (response.json()["lease_s"], response.json()["fence_margin_s"]) == (120.0, 6.0)


def _inventory(name):
    from .conftest import inventory

    return inventory(name, gpus=1)


# --- renewals while PostgreSQL is out of reach -------------------------------------------------


class Unreachable(OperationalError):
    """What Django raises when the connection is refused: no SQLSTATE."""


def database_down(monkeypatch, error=None):
    def read_node(_digest):
        raise error or Unreachable("connection refused")

    monkeypatch.setattr(hb_logic, "read_node", read_node)


def test_while_the_database_is_out_of_reach_a_known_node_keeps_its_lease_and_nothing_else(
    agent, node01, monkeypatch, settings, lease
):
    if not settings.REDIS_URL:
        pytest.skip("needs Redis (REDIS_URL)")
    node, token = node01
    agent.heartbeat(token, readings(node))  # this process checks the token once
    database_down(monkeypatch)
    before = timezone.now()

    response = agent.post("heartbeat", agent.heartbeat_body(readings(node)), token)

    assert response.status_code == 200
    answer = response.json()
    assert answer["degraded"] is True and answer["lease_s"] == 120.0
    # No desired state: the agent starts and stops nothing on it.
    assert "attempts" not in answer and "power_caps_w" not in answer
    renewed = leases.degraded_renewals([node.pk])[node.pk]
    assert before <= renewed <= timezone.now()


def test_while_the_database_is_out_of_reach_an_unknown_token_gets_no_lease(
    agent, node01, monkeypatch, lease
):
    node, token = node01
    leases.forget_token(node_token_digest(f"Bearer {token}"))
    database_down(monkeypatch)

    response = agent.post("heartbeat", agent.heartbeat_body(readings(node)), token)

    assert response.status_code == 503
    assert response["Retry-After"] == "1"
    assert leases.degraded_renewals([node.pk]) == {}


def test_a_token_another_web_process_checked_is_trusted_through_redis(
    agent, node01, monkeypatch, settings, lease
):
    """A web process started during the outage (or the one an agent's kept-alive connection
    reaches) never saw the token itself: the others shared it."""
    if not settings.REDIS_URL:
        pytest.skip("needs Redis (REDIS_URL)")
    node, token = node01
    agent.heartbeat(token, readings(node))
    with leases._trusted_lock:
        leases._trusted.clear()  # this process is a new one
    database_down(monkeypatch)

    response = agent.post("heartbeat", agent.heartbeat_body(readings(node)), token)

    assert response.status_code == 200 and response.json()["degraded"] is True
    assert node.pk in leases.degraded_renewals([node.pk])


def test_a_token_is_shared_again_after_redis_lost_its_keys(
    agent, node01, monkeypatch, settings, lease
):
    """Redis restarted without persistence (or failed over) forgets every shared token; a
    process that keeps checking the token (the node heartbeats on) shares it again within
    TOKEN_SHARE_EVERY_S, so a web process started during a later database outage can still
    renew the node's lease."""
    if not settings.REDIS_URL:
        pytest.skip("needs Redis (REDIS_URL)")
    from controlplane.redis_client import get_redis

    monkeypatch.setattr(leases, "TOKEN_SHARE_EVERY_S", 0.5)
    node, token = node01
    agent.heartbeat(token, readings(node))
    digest = node_token_digest(f"Bearer {token}")
    key = leases.trusted_token_key(digest)
    assert get_redis().get(key) is not None
    get_redis().flushdb()  # the restart

    # Heartbeats far more often than TOKEN_SHARE_EVERY_S, as nodes do.
    shared_again_after = None
    began = time.monotonic()
    while time.monotonic() - began < 3.0:
        agent.heartbeat(token, readings(node))
        if get_redis().get(key) is not None:
            shared_again_after = time.monotonic() - began
            break
        time.sleep(0.05)
    assert shared_again_after is not None, "never shared again while the node heartbeated"

    with leases._trusted_lock:
        leases._trusted.clear()  # a new web process
    database_down(monkeypatch)
    response = agent.post("heartbeat", agent.heartbeat_body(readings(node)), token)

    assert response.status_code == 200 and response.json()["degraded"] is True
    assert node.pk in leases.degraded_renewals([node.pk])


def test_a_rotated_token_loses_its_trust_everywhere(
    agent, node01, monkeypatch, settings, lease, django_capture_on_commit_callbacks
):
    if not settings.REDIS_URL:
        pytest.skip("needs Redis (REDIS_URL)")
    node, token = node01
    agent.heartbeat(token, readings(node))
    with django_capture_on_commit_callbacks(execute=True):
        agent.rejoin("node-01")  # a new node token; the old one must not renew anything
    database_down(monkeypatch)

    response = agent.post("heartbeat", agent.heartbeat_body(readings(node)), token)

    assert response.status_code == 503
    digest = node_token_digest(f"Bearer {token}")
    from controlplane.redis_client import get_redis

    assert get_redis().get(leases.trusted_token_key(digest)) is None


def test_a_token_refused_by_the_database_is_never_trusted_again_when_it_is_down(
    agent, node01, monkeypatch, lease
):
    from controlplane.cluster.agent_auth import revoke_node_token

    node, token = node01
    agent.heartbeat(token, readings(node))
    revoke_node_token(node)
    assert agent.post("heartbeat", agent.heartbeat_body(readings(node)), token).status_code == 401
    database_down(monkeypatch)

    assert agent.post("heartbeat", agent.heartbeat_body(readings(node)), token).status_code == 503


def test_a_watch_while_the_database_is_out_of_reach_is_answered_503_with_retry_after(
    agent, node01, monkeypatch, lease
):
    """Not a 500: the agent backs off and keeps its periodic heartbeats."""
    node, token = node01
    agent.heartbeat(token, readings(node))
    database_down(monkeypatch)

    response = agent.post("watch", {"timeout_s": 5}, token)

    assert response.status_code == 503
    assert response["Retry-After"] == "1"
    assert "unreachable" in response.json()["detail"]


def test_a_statement_that_fails_is_an_error_not_a_degraded_answer(
    agent, node01, monkeypatch, lease
):
    import psycopg

    node, token = node01
    agent.heartbeat(token, readings(node))
    error = OperationalError("canceling statement due to lock timeout")
    error.__cause__ = psycopg.errors.LockNotAvailable()
    database_down(monkeypatch, error)

    with pytest.raises(OperationalError):
        agent.post("heartbeat", agent.heartbeat_body(readings(node)), token)


def test_a_process_whose_liveness_does_not_reach_the_database_stops_answering_from_its_cache(
    agent, node01, make_job, vision, alice, admit, settings, monkeypatch
):
    """Its cached answers would renew leases the sweep never hears of: it writes them itself."""
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("the steady path needs PostgreSQL's triggers")
    node, token = node01
    attempt = admit(make_job(vision, alice), node)
    settings.TELEMETRY_FLUSH_INTERVAL_S = 60.0
    held = telemetry.TelemetryBuffer(background=False)
    monkeypatch.setattr(telemetry, "buffer", held)
    agent.heartbeat(token, readings(node), [running(attempt)])
    earlier = timezone.now() - dt.timedelta(seconds=5)
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=earlier)
    agent.heartbeat(token, readings(node), [running(attempt)])
    assert Node.objects.get(pk=node.pk).last_heartbeat_at == earlier  # steady: buffered

    monkeypatch.setattr(held, "alive_backlog_s", lambda: settings.LIVENESS_BACKLOG_MAX_S + 1)
    agent.heartbeat(token, readings(node), [running(attempt)])

    assert Node.objects.get(pk=node.pk).last_heartbeat_at > earlier


def test_liveness_that_failed_to_reach_the_database_is_kept_and_ages(node01, monkeypatch):
    node, _ = node01
    buffer = telemetry.TelemetryBuffer(background=False)
    buffer.add(node.pk, timezone.now(), {}, {}, alive=True)

    def broken(_alive):
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(telemetry, "write_alive", broken)
    time.sleep(0.05)
    buffer.flush()

    assert buffer.alive_backlog_s() >= 0.05  # still waiting, and its age kept
    monkeypatch.undo()
    buffer.flush()
    assert buffer.alive_backlog_s() == 0.0


# --- the node stops an attempt itself ----------------------------------------------------------


@pytest.mark.parametrize("restartable", [True, False])
def test_an_attempt_the_node_fenced_is_requeued_or_failed_as_for_a_lost_node(
    agent, node01, make_job, vision, alice, admit, restartable
):
    node, token = node01
    job = make_job(vision, alice, restartable=restartable)
    attempt = admit(job, node)
    agent.heartbeat(token, readings(node), [running(attempt)])

    answer = agent.heartbeat(token, readings(node), [exited(attempt, 143, stop_cause="fenced")])

    assert answer["attempts"] == []
    attempt.refresh_from_db()
    job.refresh_from_db()
    assert (attempt.state, attempt.exit_code) == (AttemptState.LOST, 143)
    assert job.state == (JobState.PENDING if restartable else JobState.FAILED)
    assert "lease" in JobEvent.objects.get(job=job, kind="lost").message
    assert not attempt.allocations.filter(active=True).exists()  # the node says it is gone


def test_an_attempt_the_node_refused_to_start_as_its_lease_ran_out_is_requeued_even_if_not_restartable(
    agent, node01, make_job, vision, alice, admit
):
    node, token = node01
    job = make_job(vision, alice, restartable=False)
    attempt = admit(job, node)
    report = {
        "attempt_id": attempt.pk,
        "state": "failed_to_start",
        "message": "the node's lease ran out before the job could start",
        "stop_cause": "fenced",
        "finished_at": time.time(),
    }

    agent.heartbeat(token, readings(node), [report])

    job.refresh_from_db()
    assert job.state == JobState.PENDING  # nothing of it ran
    assert JobAttempt.objects.get(pk=attempt.pk).state == AttemptState.LOST


def test_a_stop_cause_the_protocol_does_not_know_leaves_the_attempt_as_it_was(
    agent, node01, make_job, vision, alice, admit
):
    node, token = node01
    attempt = admit(make_job(vision, alice), node)
    body = agent.heartbeat_body(readings(node), [exited(attempt, 0, stop_cause="bored")])
    response = agent.post("heartbeat", body, token)
    assert response.status_code == 200
    assert "attempts[0].stop_cause" in response.json()["warnings"]
    # Not applied (it may decide the job's fate), and not taken for a vanished attempt either.
    assert JobAttempt.objects.get(pk=attempt.pk).state == AttemptState.ADMITTED
    assert [a["attempt_id"] for a in response.json()["attempts"]] == [attempt.pk]


# --- an attempt told to stop before it started -------------------------------------------------


def test_an_attempt_cancelled_before_its_agent_started_it_frees_its_gpus_at_the_next_heartbeat(
    agent, node01, make_job, vision, alice, admit
):
    node, token = node01
    job = make_job(vision, alice)
    attempt = admit(job, node)
    actions.cancel_job(job, actor=alice)
    # The next heartbeat was answered without it (the cancel came first)...
    assert agent.heartbeat(token, readings(node))["attempts"] == []
    assert JobAttempt.objects.get(pk=attempt.pk).state == AttemptState.ADMITTED
    # ...so the one after, which does not report it either, proves it never started.
    agent.heartbeat(token, readings(node))

    attempt.refresh_from_db()
    assert attempt.state == AttemptState.STOPPED
    assert not attempt.allocations.filter(active=True).exists()
    assert Job.objects.get(pk=job.pk).state == JobState.CANCELLED


def test_an_attempt_preempted_before_it_started_is_requeued_without_pretending_it_ran(
    agent, node01, make_job, vision, alice, admit
):
    node, token = node01
    job = make_job(vision, alice)
    attempt = admit(job, node)
    actions.request_stop(attempt, reason="preempted", message="to give GPUs back")
    agent.heartbeat(token, readings(node))
    agent.heartbeat(token, readings(node))

    job.refresh_from_db()
    assert job.state == JobState.PENDING
    kinds = list(JobEvent.objects.filter(job=job).values_list("kind", flat=True))
    assert "running" not in kinds and kinds[-2:] == ["preempted", "requeued"]


def test_a_stop_asked_after_the_last_answer_does_not_finish_an_attempt_that_may_be_starting(
    agent, node01, make_job, vision, alice, admit
):
    node, token = node01
    job = make_job(vision, alice)
    attempt = admit(job, node)
    agent.heartbeat(token, readings(node))  # answered with the attempt: the agent may start it
    actions.cancel_job(job, actor=alice)

    agent.heartbeat(token, readings(node))  # sent before the agent could report a start

    assert JobAttempt.objects.get(pk=attempt.pk).state == AttemptState.ADMITTED
    assert attempt.allocations.filter(active=True).exists()


# --- late reports ------------------------------------------------------------------------------


@pytest.fixture
def lost_attempt(agent, node01, make_job, vision, alice, admit, lease):
    """Make a lost attempt: (node, token, attempt), its job as the loss left it."""

    def make(**job_fields):
        node, token = node01
        job = make_job(vision, alice, **job_fields)
        attempt = admit(job, node)
        agent.heartbeat(token, readings(node), [running(attempt, started_at=time.time() - 600)])
        now = timezone.now()
        Node.objects.filter(pk=node.pk).update(last_heartbeat_at=now - dt.timedelta(seconds=600))
        assert sweep_while_hearing(now)["lost_attempts"] == [attempt.pk]
        attempt.refresh_from_db()
        return node, token, attempt

    return make


def late_exit(attempt, exit_code, **fields):
    """An exit report, ten minutes late, of an attempt that ran for ten seconds."""
    report = exited(attempt, exit_code, started_at=time.time() - 600, energy_j=1000.0, **fields)
    report["finished_at"] = time.time() - 590
    return report


def test_a_late_report_of_success_finishes_a_requeued_job_that_has_not_started_again(
    agent, lost_attempt
):
    node, token, attempt = lost_attempt(restartable=True)
    assert attempt.job.state == JobState.PENDING

    agent.heartbeat(token, readings(node), [late_exit(attempt, 0)])

    attempt.refresh_from_db()
    job = Job.objects.get(pk=attempt.job_id)
    assert (job.state, job.exit_code) == (JobState.SUCCEEDED, 0)
    assert (attempt.state, attempt.exit_code) == (AttemptState.SUCCEEDED, 0)
    assert attempt.finished_at.timestamp() == pytest.approx(time.time() - 590, abs=5)
    assert attempt.energy_j == 1000.0
    assert "really exited with code 0" in job.state_reason


def test_a_late_report_of_failure_fails_a_requeued_job_as_its_process_did(agent, lost_attempt):
    node, token, attempt = lost_attempt(restartable=True)

    agent.heartbeat(token, readings(node), [late_exit(attempt, 3)])

    job = Job.objects.get(pk=attempt.job_id)
    assert (job.state, job.exit_code) == (JobState.FAILED, 3)


def test_a_late_report_withdraws_a_copy_that_is_admitted_but_not_started(
    agent, lost_attempt, make_node
):
    node, token, attempt = lost_attempt(restartable=True)
    other = make_node("node-02", gpus=1)
    job = Job.objects.get(pk=attempt.job_id)
    copy = actions.admit_job(job, node=other, gpus=list(other.gpus.all()), borrowed=False)

    agent.heartbeat(token, readings(node), [late_exit(attempt, 0)])

    job.refresh_from_db()
    copy.refresh_from_db()
    assert job.state == JobState.SUCCEEDED
    assert copy.stop_requested_at is not None and copy.stop_reason == "superseded"


def test_a_late_report_leaves_a_copy_that_already_runs_to_decide_the_job(
    agent, lost_attempt, make_node
):
    node, token, attempt = lost_attempt(restartable=True)
    other = make_node("node-02", gpus=1)
    job = Job.objects.get(pk=attempt.job_id)
    copy = actions.admit_job(job, node=other, gpus=list(other.gpus.all()), borrowed=False)
    actions.mark_attempt_running(copy)

    agent.heartbeat(token, readings(node), [late_exit(attempt, 0)])

    job.refresh_from_db()
    assert job.state == JobState.RUNNING
    assert JobAttempt.objects.get(pk=copy.pk).stop_requested_at is None
    assert JobAttempt.objects.get(pk=attempt.pk).state == AttemptState.SUCCEEDED
    assert JobEvent.objects.filter(job=job, kind="late_report").count() == 1


@pytest.mark.parametrize(("exit_code", "state"), [(0, JobState.SUCCEEDED), (7, JobState.FAILED)])
def test_a_job_failed_only_for_the_loss_becomes_what_its_process_did(
    agent, lost_attempt, exit_code, state
):
    node, token, attempt = lost_attempt(restartable=False)
    assert attempt.job.state == JobState.FAILED

    agent.heartbeat(token, readings(node), [late_exit(attempt, exit_code)])

    job = Job.objects.get(pk=attempt.job_id)
    assert (job.state, job.exit_code) == (state, exit_code)


def test_a_late_report_of_a_fenced_process_keeps_the_loss(agent, lost_attempt):
    node, token, attempt = lost_attempt(restartable=False)

    agent.heartbeat(token, readings(node), [late_exit(attempt, 143, stop_cause="fenced")])

    attempt.refresh_from_db()
    job = Job.objects.get(pk=attempt.job_id)
    assert (attempt.state, attempt.exit_code) == (AttemptState.LOST, 143)
    assert (job.state, job.exit_code) == (JobState.FAILED, None)
    assert "stopped by its node" in JobEvent.objects.get(job=job, kind="late_report").message


def test_a_late_report_counts_once(agent, lost_attempt):
    node, token, attempt = lost_attempt(restartable=False)

    agent.heartbeat(token, readings(node), [late_exit(attempt, 7)])
    agent.heartbeat(token, readings(node), [late_exit(attempt, 0)])

    job = Job.objects.get(pk=attempt.job_id)
    assert (job.state, job.exit_code) == (JobState.FAILED, 7)
    assert JobEvent.objects.filter(job=job, kind="late_report").count() == 1


def test_a_late_report_from_another_node_changes_nothing(agent, lost_attempt):
    _, _, attempt = lost_attempt(restartable=True)
    other_token = agent.register("node-02", gpus=1)
    other = Node.objects.get(name="node-02")

    agent.heartbeat(other_token, readings(other), [late_exit(attempt, 0)])

    assert Job.objects.get(pk=attempt.job_id).state == JobState.PENDING
    assert JobAttempt.objects.get(pk=attempt.pk).state == AttemptState.LOST


def test_a_late_report_of_a_fenced_stop_keeps_how_the_stop_went(agent, lost_attempt):
    node, token, attempt = lost_attempt()
    report = late_exit(attempt, 143, stop_cause="fenced", killed_after_grace=True)
    report["stop_signal_at"] = report["finished_at"] - 30
    agent.heartbeat(token, readings(node), [report])
    stored = JobAttempt.objects.get(pk=attempt.pk)
    assert stored.exit_reported_at is not None
    assert stored.killed_after_grace is True
    assert stored.stop_signal_at.timestamp() == pytest.approx(report["stop_signal_at"], abs=1e-3)


@pytest.mark.parametrize("endpoint", ["register", "logs", "volumes"])
def test_an_agent_request_the_database_cannot_answer_is_a_503_to_retry_not_a_500(
    agent, node01, monkeypatch, endpoint
):
    """Registration and the other agent requests answered by Django: an outage (or a pool
    with no connection to give) is told as such, with when to try again, as the web API
    does (controlplane.unavailable), not as the 500 of a bug."""
    from controlplane.cluster import actions as cluster_actions
    from controlplane.cluster import agent_api
    from controlplane.unavailable import RETRY_AFTER_S

    from .conftest import inventory

    _, token = node01

    def unreachable(*args, **kwargs):
        raise Unreachable("connection refused")

    monkeypatch.setattr(cluster_actions, "register_node", unreachable)
    monkeypatch.setattr(agent_api, "authenticate_node", unreachable)
    if endpoint == "register":
        response = agent.post("register", inventory("node02", gpus=1), agent.join_token)
    else:
        response = agent.post(endpoint, {}, token)
    assert response.status_code == 503, response.content
    assert response["Retry-After"] == str(RETRY_AFTER_S)
    assert "database" in response.json()["detail"]
