"""Node liveness: silent nodes get no new work, then lose their attempts; returning nodes are fenced."""

import datetime as dt
import threading
import time

import pytest
from django.db import connection
from django.utils import timezone

from controlplane.cluster.models import Node
from controlplane.cluster.tasks import sweep_node_liveness
from controlplane.jobs.models import AttemptState, Job, JobAttempt, JobEvent, JobState

from .conftest import readings

INTERVAL_S = 10.0


@pytest.fixture
def grace_s(settings):
    settings.NODE_LOST_GRACE_S = 60.0
    return 60.0


def silent_for(node, seconds):
    """Make the node's last heartbeat `seconds` old; returns 'now' for the sweep."""
    now = timezone.now()
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=now - dt.timedelta(seconds=seconds))
    return now


def test_a_node_silent_for_three_intervals_becomes_not_ready(node01):
    node, _ = node01

    assert sweep_node_liveness(silent_for(node, 2.9 * INTERVAL_S))["not_ready"] == []
    assert Node.objects.get(pk=node.pk).ready is True

    assert sweep_node_liveness(silent_for(node, 3.1 * INTERVAL_S))["not_ready"] == ["node-01"]
    assert Node.objects.get(pk=node.pk).ready is False


def test_a_not_ready_node_is_unschedulable_for_the_scheduler(node01, agent):
    from controlplane.scheduling.loader import load_snapshot

    node, token = node01
    sweep_node_liveness(silent_for(node, 3.1 * INTERVAL_S))

    schedulable = {n.name: n.schedulable for n in load_snapshot().snapshot.nodes}
    assert schedulable["node-01"] is False

    agent.heartbeat(token, readings(node))
    schedulable = {n.name: n.schedulable for n in load_snapshot().snapshot.nodes}
    assert schedulable["node-01"] is True


def test_a_node_that_never_heartbeated_counts_from_its_creation(make_node):
    node = make_node("hand-made", gpus=1)
    Node.objects.filter(pk=node.pk).update(created_at=timezone.now() - dt.timedelta(hours=1))
    assert sweep_node_liveness()["not_ready"] == ["hand-made"]


def test_after_the_grace_period_restartable_jobs_are_requeued_and_others_fail(
    node01, make_job, vision, alice, admit, grace_s
):
    node, _ = node01
    restartable = make_job(vision, alice, name="restartable", restartable=True)
    one_shot = make_job(vision, alice, name="one-shot", restartable=False)
    a1 = admit(restartable, node, gpu_indexes=(0,))
    a2 = admit(one_shot, node, gpu_indexes=(1,))
    now = silent_for(node, 3 * INTERVAL_S + 1)
    sweep_node_liveness(now)

    # Not ready, but still within the grace: nothing is lost yet.
    assert sweep_node_liveness(now + dt.timedelta(seconds=grace_s - 5))["lost_attempts"] == []
    result = sweep_node_liveness(now + dt.timedelta(seconds=grace_s + 1))

    assert sorted(result["lost_attempts"]) == sorted([a1.pk, a2.pk])
    assert JobAttempt.objects.get(pk=a1.pk).state == AttemptState.LOST
    restartable.refresh_from_db()
    one_shot.refresh_from_db()
    assert restartable.state == JobState.PENDING
    assert one_shot.state == JobState.FAILED
    assert "not restartable" in one_shot.state_reason
    assert not node.gpus.filter(allocations__active=True).exists()


def test_a_second_sweep_declares_nothing_lost_twice(node01, make_job, vision, alice, admit):
    node, _ = node01
    job = make_job(vision, alice)
    admit(job, node)
    now = silent_for(node, 3600)
    first = sweep_node_liveness(now)
    second = sweep_node_liveness(now)

    assert (first["not_ready"], len(first["lost_attempts"])) == (["node-01"], 1)
    assert second == {"not_ready": [], "lost_attempts": [], "telemetry_pruned": 0}
    assert JobEvent.objects.filter(job=job, kind="lost").count() == 1


def test_a_node_back_within_the_grace_keeps_its_attempts(
    agent, node01, make_job, vision, alice, admit
):
    node, token = node01
    attempt = admit(make_job(vision, alice), node)
    sweep_node_liveness(silent_for(node, 3 * INTERVAL_S + 1))

    answer = agent.heartbeat(token, readings(node))

    assert [a["attempt_id"] for a in answer["attempts"]] == [attempt.pk]
    assert Node.objects.get(pk=node.pk).ready is True
    assert sweep_node_liveness()["lost_attempts"] == []


def test_a_node_that_comes_back_after_being_lost_gets_no_stale_attempt(
    agent, node01, make_job, vision, alice, admit
):
    node, token = node01
    job = make_job(vision, alice)
    attempt = admit(job, node)
    started = time.time() - 3700
    agent.heartbeat(token, readings(node), [_running(attempt, started)])
    sweep_node_liveness(silent_for(node, 3600))
    job.refresh_from_db()
    assert job.state == JobState.PENDING

    # The agent was cut off, not dead: its container kept running and it says so.
    answer = agent.heartbeat(token, readings(node), [_running(attempt, started)])

    assert answer["attempts"] == []  # so the agent stops it: it must not run twice
    assert JobAttempt.objects.get(pk=attempt.pk).state == AttemptState.LOST
    assert Job.objects.get(pk=job.pk).state == JobState.PENDING
    # Its exit report, once it has killed the container, changes nothing either.
    agent.heartbeat(
        token, readings(node), [{**_running(attempt, started), "state": "exited", "exit_code": 137}]
    )
    assert JobAttempt.objects.get(pk=attempt.pk).state == AttemptState.LOST
    assert Job.objects.get(pk=job.pk).state == JobState.PENDING


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
def test_concurrent_sweeps_declare_each_attempt_lost_once(make_node, make_job, vision, alice):
    from controlplane.jobs import actions

    nodes = [make_node(f"node-{i}", gpus=2) for i in range(4)]
    jobs = []
    for node in nodes:
        for gpu in node.gpus.all():
            job = make_job(vision, alice)
            actions.admit_job(job, node=node, gpus=[gpu], borrowed=False)
            jobs.append(job)
    now = timezone.now() + dt.timedelta(hours=1)
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
    assert sorted(n for r in results for n in r["not_ready"]) == sorted(n.name for n in nodes)
    for job in jobs:
        assert JobEvent.objects.filter(job=job, kind="lost").count() == 1
        assert Job.objects.get(pk=job.pk).state == JobState.PENDING


def _running(attempt, started_at):
    return {"attempt_id": attempt.pk, "state": "running", "started_at": started_at, "energy_j": 1.0}
