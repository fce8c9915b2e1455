"""Node liveness: silent nodes get no new work, then lose their attempts once their lease ran out;
the control plane's own deafness never counts against a node; returning nodes are fenced."""

import datetime as dt
import threading
import time

import pytest
from django.db import connection
from django.utils import timezone

from controlplane.cluster.models import LivenessClock, Node
from controlplane.cluster.tasks import sweep_node_liveness
from controlplane.jobs.models import AttemptState, Job, JobAttempt, JobEvent, JobState

from .conftest import hearing_until, readings, sweep_while_hearing

INTERVAL_S = 10.0


@pytest.fixture
def lease(settings):
    """The lease and margin of these tests: lost after 130 s of silence."""
    settings.NODE_LEASE_S = 120.0
    settings.NODE_LEASE_MARGIN_S = 10.0
    settings.LIVENESS_SWEEP_GAP_S = 30.0
    settings.LIVENESS_DEAF_AFTER_S = 30.0
    return 130.0


def silent_for(node, seconds):
    """Make the node's last heartbeat `seconds` old; returns 'now' for the sweep."""
    now = timezone.now()
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=now - dt.timedelta(seconds=seconds))
    return now


def later(now, seconds):
    return now + dt.timedelta(seconds=seconds)


def test_a_node_silent_for_three_intervals_becomes_not_ready(node01, lease):
    node, _ = node01

    assert sweep_while_hearing(silent_for(node, 2.9 * INTERVAL_S))["not_ready"] == []
    assert Node.objects.get(pk=node.pk).ready is True

    assert sweep_while_hearing(silent_for(node, 3.1 * INTERVAL_S))["not_ready"] == ["node-01"]
    assert Node.objects.get(pk=node.pk).ready is False


def test_a_not_ready_node_is_unschedulable_for_the_scheduler(node01, agent, lease):
    from controlplane.scheduling.loader import load_snapshot

    node, token = node01
    sweep_while_hearing(silent_for(node, 3.1 * INTERVAL_S))

    schedulable = {n.name: n.schedulable for n in load_snapshot().snapshot.nodes}
    assert schedulable["node-01"] is False

    agent.heartbeat(token, readings(node))
    schedulable = {n.name: n.schedulable for n in load_snapshot().snapshot.nodes}
    assert schedulable["node-01"] is True


def test_a_node_that_never_heartbeated_counts_from_its_creation(make_node, lease):
    node = make_node("hand-made", gpus=1)
    Node.objects.filter(pk=node.pk).update(created_at=timezone.now() - dt.timedelta(hours=1))
    assert sweep_while_hearing()["not_ready"] == ["hand-made"]


def test_once_the_lease_ran_out_restartable_jobs_are_requeued_and_others_fail(
    node01, make_job, vision, alice, admit, lease
):
    node, _ = node01
    restartable = make_job(vision, alice, name="restartable", restartable=True)
    one_shot = make_job(vision, alice, name="one-shot", restartable=False)
    a1 = admit(restartable, node, gpu_indexes=(0,))
    a2 = admit(one_shot, node, gpu_indexes=(1,))
    now = silent_for(node, 3 * INTERVAL_S + 1)
    sweep_while_hearing(now)

    # Not ready, but its lease (and the margin) has not run out: nothing is lost yet.
    assert sweep_while_hearing(later(now, lease - 5 - 31))["lost_attempts"] == []
    result = sweep_while_hearing(later(now, lease + 1 - 31))

    assert sorted(result["lost_attempts"]) == sorted([a1.pk, a2.pk])
    lost = JobAttempt.objects.get(pk=a1.pk)
    assert lost.state == AttemptState.LOST
    # Booked to the end of its lease, when its agent had stopped it, not to the sweep.
    heard = Node.objects.get(pk=node.pk).last_heartbeat_at
    assert lost.finished_at == heard + dt.timedelta(seconds=120)
    restartable.refresh_from_db()
    one_shot.refresh_from_db()
    assert restartable.state == JobState.PENDING
    assert one_shot.state == JobState.FAILED
    assert "Not restartable" in one_shot.state_reason
    assert not node.gpus.filter(allocations__active=True).exists()


def test_a_second_sweep_declares_nothing_lost_twice(node01, make_job, vision, alice, admit, lease):
    node, _ = node01
    job = make_job(vision, alice)
    admit(job, node)
    now = silent_for(node, 3600)
    first = sweep_while_hearing(now)
    second = sweep_while_hearing(now)

    assert (first["not_ready"], len(first["lost_attempts"])) == (["node-01"], 1)
    assert (second["not_ready"], second["lost_attempts"]) == ([], [])
    assert JobEvent.objects.filter(job=job, kind="lost").count() == 1


def test_a_node_back_before_its_lease_ran_out_keeps_its_attempts(
    agent, node01, make_job, vision, alice, admit, lease
):
    node, token = node01
    attempt = admit(make_job(vision, alice), node)
    sweep_while_hearing(silent_for(node, 3 * INTERVAL_S + 1))

    answer = agent.heartbeat(token, readings(node))

    assert [a["attempt_id"] for a in answer["attempts"]] == [attempt.pk]
    assert Node.objects.get(pk=node.pk).ready is True
    assert sweep_while_hearing()["lost_attempts"] == []


def test_a_node_that_comes_back_after_being_lost_gets_no_stale_attempt(
    agent, node01, make_job, vision, alice, admit, lease
):
    node, token = node01
    job = make_job(vision, alice)
    attempt = admit(job, node)
    started = time.time() - 3700
    agent.heartbeat(token, readings(node), [_running(attempt, started)])
    sweep_while_hearing(silent_for(node, 3600))
    job.refresh_from_db()
    assert job.state == JobState.PENDING

    # Its fence failed it (a second fault): the container kept running and it says so.
    answer = agent.heartbeat(token, readings(node), [_running(attempt, started)])

    assert answer["attempts"] == []  # so the agent stops it: it must not run twice
    assert JobAttempt.objects.get(pk=attempt.pk).state == AttemptState.LOST
    assert Job.objects.get(pk=job.pk).state == JobState.PENDING
    # Its exit report, once it has stopped the process, is recorded but changes nothing more.
    agent.heartbeat(
        token,
        readings(node),
        [{**_running(attempt, started), "state": "exited", "exit_code": 143,
          "finished_at": time.time(), "stop_cause": "unwanted"}],
    )  # fmt: skip
    attempt.refresh_from_db()
    assert (attempt.state, attempt.exit_code) == (AttemptState.LOST, 143)
    assert Job.objects.get(pk=job.pk).state == JobState.PENDING


# --- the control plane's own deafness ----------------------------------------------------------


def test_silence_while_no_sweep_ran_does_not_count_against_a_node(
    node01, make_job, vision, alice, admit, lease
):
    """A database (or broker, or worker) outage longer than the lease: nobody was listening."""
    node, _ = node01
    attempt = admit(make_job(vision, alice), node)
    now = silent_for(node, 3600)
    sweep_while_hearing(later(now, -3600))  # the last sweep before the outage

    result = sweep_node_liveness(now)

    assert result["deaf"].startswith("no liveness sweep for 3600 s")
    assert result["lost_attempts"] == [] and result["not_ready"] == []
    assert JobAttempt.objects.get(pk=attempt.pk).state == AttemptState.ADMITTED
    # Every node gets a whole lease from the moment the control plane hears again (it hears
    # the witness node throughout)...
    for seconds in range(10, int(lease), 10):
        hear_witness(later(now, seconds))
        assert sweep_node_liveness(later(now, seconds))["lost_attempts"] == [], seconds
    # ...and one that stays silent through it is lost after all: its silence is its own.
    hear_witness(later(now, lease + 5))
    assert sweep_node_liveness(later(now, lease + 5))["lost_attempts"] == [attempt.pk]


def hear_witness(at):
    Node.objects.filter(name="witness").update(last_heartbeat_at=at)


def test_when_no_node_at_all_is_heard_the_control_plane_counts_itself_deaf(
    node01, make_job, vision, alice, admit, lease
):
    """The web tier (or the way to it) was down: every node fell silent at once."""
    node, _ = node01
    attempt = admit(make_job(vision, alice), node)
    now = silent_for(node, 3600)
    LivenessClock.objects.update_or_create(
        pk=1, defaults={"last_sweep_at": later(now, -1), "hearing_since": later(now, -86400)}
    )

    result = sweep_node_liveness(now)

    assert result["deaf"] == "no node heard for 30 s"
    assert result["lost_attempts"] == []
    # Deaf for as long as nobody is heard, however long.
    for seconds in range(10, 1000, 10):
        assert sweep_node_liveness(later(now, seconds))["lost_attempts"] == []
    assert JobAttempt.objects.get(pk=attempt.pk).state == AttemptState.ADMITTED


def test_a_lease_renewed_through_redis_while_the_database_was_out_of_reach_counts(
    node01, make_job, vision, alice, admit, lease, settings
):
    from controlplane.cluster import lease as leases

    if not settings.REDIS_URL:
        pytest.skip("needs Redis (REDIS_URL)")
    node, _ = node01
    attempt = admit(make_job(vision, alice), node)
    now = silent_for(node, 3600)
    leases.record_degraded_renewal(node.pk, later(now, -20))

    result = sweep_while_hearing(now)

    assert result["not_ready"] == [] and result["lost_attempts"] == []
    assert JobAttempt.objects.get(pk=attempt.pk).state == AttemptState.ADMITTED
    assert sweep_while_hearing(later(now, lease - 20 + 1))["lost_attempts"] == [attempt.pk]


def test_nothing_is_judged_while_renewals_through_redis_cannot_be_read(
    node01, make_job, vision, alice, admit, lease, monkeypatch
):
    from controlplane.cluster import lease as leases

    node, _ = node01
    attempt = admit(make_job(vision, alice), node)

    def unreadable(_ids):
        raise leases.LeaseStoreUnavailable("connection refused")

    monkeypatch.setattr(leases, "degraded_renewals", unreadable)
    result = sweep_while_hearing(silent_for(node, 3600))

    assert result["not_ready"] == [] and result["lost_attempts"] == []
    assert JobAttempt.objects.get(pk=attempt.pk).state == AttemptState.ADMITTED


def test_the_first_sweep_ever_gives_every_node_a_whole_lease(
    node01, make_job, vision, alice, admit, lease
):
    node, _ = node01
    attempt = admit(make_job(vision, alice), node)
    LivenessClock.objects.all().delete()

    result = sweep_node_liveness(silent_for(node, 3600))

    assert result["deaf"] == "first liveness sweep"
    assert result["lost_attempts"] == []
    assert JobAttempt.objects.get(pk=attempt.pk).state == AttemptState.ADMITTED


# --- housekeeping and concurrency --------------------------------------------------------------


def test_history_older_than_the_retention_is_pruned_by_the_sweep(agent, node01, settings):
    from controlplane.cluster import telemetry
    from controlplane.cluster.models import GpuTelemetry

    node, token = node01
    agent.heartbeat(token, readings(node))
    GpuTelemetry.objects.filter(gpu__index__lt=4).update(
        bucket_at=timezone.now() - dt.timedelta(seconds=telemetry.TELEMETRY_RETENTION_S + 120)
    )

    assert telemetry.prune_history(timezone.now(), force=True) == 4
    assert GpuTelemetry.objects.count() == 4


@pytest.mark.django_db(transaction=True)
def test_concurrent_sweeps_declare_each_attempt_lost_once(
    make_node, make_job, vision, alice, lease
):
    from controlplane.jobs import actions

    nodes = [make_node(f"node-{i}", gpus=2) for i in range(4)]
    jobs = []
    for node in nodes:
        for gpu in node.gpus.all():
            job = make_job(vision, alice)
            actions.admit_job(job, node=node, gpus=[gpu], borrowed=False)
            jobs.append(job)
    now = timezone.now() + dt.timedelta(hours=1)
    hearing_until(now)
    barrier = threading.Barrier(3)
    results = []

    def sweep():
        barrier.wait()
        try:
            results.append(sweep_node_liveness(now))
        finally:
            connection.close()

    threads = [threading.Thread(target=sweep) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    lost = [a for r in results for a in r["lost_attempts"]]
    assert len(lost) == len(set(lost)) == 8
    for job in jobs:
        assert JobEvent.objects.filter(job=job, kind="lost").count() == 1
        assert Job.objects.get(pk=job.pk).state == JobState.PENDING


def _running(attempt, started_at):
    return {"attempt_id": attempt.pk, "state": "running", "started_at": started_at, "energy_j": 1.0}
