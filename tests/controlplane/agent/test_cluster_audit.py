"""What nodes and the liveness sweep change leaves its audit row and wakes the scheduler once it
commits: a registration (by its join token), a re-join, a node going silent, a node lost."""

import datetime as dt

import pytest
from django.utils import timezone

from controlplane import wakeups
from controlplane.audit.models import AuditEvent
from controlplane.cluster.models import Node

from .conftest import inventory, sweep_while_hearing

pytestmark = pytest.mark.django_db


@pytest.fixture
def cycles(monkeypatch, django_capture_on_commit_callbacks):
    asked: list[str] = []
    monkeypatch.setattr(wakeups, "request_cycle", asked.append)
    return asked


@pytest.fixture
def lease(settings):
    settings.NODE_LEASE_S = 120.0
    settings.NODE_LEASE_MARGIN_S = 10.0
    settings.LIVENESS_SWEEP_GAP_S = 30.0
    settings.LIVENESS_DEAF_AFTER_S = 30.0


def test_a_registration_is_audited_by_its_join_token_and_wakes_the_scheduler(
    agent, join_token, cycles, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        agent.register("node-01", gpus=2)
    [row] = AuditEvent.objects.filter(action="node.register")
    assert (row.actor, row.actor_label) == (None, f"join token {join_token[:12]}")
    assert row.before is None
    assert row.after["gpus"] == ["GPU-node-01-0", "GPU-node-01-1"]
    assert row.after["pool"] == Node.objects.get().pool_id
    assert "node_registered" in cycles


def test_a_rejoin_records_the_inventory_before_and_after(agent, cycles):
    agent.register("node-01", gpus=2)
    agent.rejoin("node-01", gpus=1)
    rejoined = AuditEvent.objects.filter(action="node.register").order_by("id").last()
    assert rejoined.before["gpus"] == ["GPU-node-01-0", "GPU-node-01-1"]
    assert rejoined.after["gpus"] == ["GPU-node-01-0"]
    assert "re-joined" in rejoined.message


def test_a_refused_registration_leaves_no_row(agent, cycles):
    agent.register("node-01")
    # A join token for new nodes may not take over an existing name.
    again = agent.post("register", inventory("node-01"), agent.join_token)
    assert again.status_code == 409
    assert AuditEvent.objects.filter(action="node.register").count() == 1


def test_the_sweep_audits_a_silent_node_and_its_lost_attempts(
    node01, make_job, vision, alice, admit, lease, cycles, django_capture_on_commit_callbacks
):
    node, _ = node01
    attempt = admit(make_job(vision, alice), node)
    now = timezone.now()
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=now - dt.timedelta(seconds=3600))
    cycles.clear()
    with django_capture_on_commit_callbacks(execute=True):
        result = sweep_while_hearing(now)

    assert result["not_ready"] == ["node-01"] and result["lost_attempts"] == [attempt.pk]
    down = AuditEvent.objects.get(action="node.not_ready")
    assert (down.actor_label, down.before, down.after) == (
        "liveness sweep",
        {"ready": True},
        {"ready": False},
    )
    lost = AuditEvent.objects.get(action="node.attempts_lost")
    assert (lost.object_repr, lost.after["attempts"]) == ("node-01", [attempt.pk])
    assert {"node_not_ready", "node_lost"} <= set(cycles)
    # A second sweep finds nothing to do, and writes nothing.
    sweep_while_hearing(now)
    assert (
        AuditEvent.objects.filter(action__in=["node.not_ready", "node.attempts_lost"]).count() == 2
    )
