"""Batched telemetry: heartbeats leave readings in a buffer; one flush writes them all."""

import pytest

from controlplane.cluster import telemetry
from controlplane.cluster.models import GPU, GpuTelemetry, Node

from .conftest import readings


@pytest.fixture
def batched(settings, monkeypatch):
    settings.TELEMETRY_FLUSH_INTERVAL_S = 60.0
    held = telemetry.TelemetryBuffer(background=False)
    monkeypatch.setattr(telemetry, "buffer", held)
    return held


def test_buffered_readings_reach_the_rows_at_the_next_flush(agent, batched):
    tokens = {name: agent.register(name, gpus=4) for name in ("node-01", "node-02", "node-03")}
    nodes = {n.name: n for n in Node.objects.all()}
    for name, token in tokens.items():
        agent.heartbeat(token, readings(nodes[name], power_draw_w=333.0))

    assert batched.pending() == 3
    assert not GPU.objects.filter(telemetry_at__isnull=False).exists()
    # Registration counts as a sign of life; a steady heartbeat's own rides with the batch.
    assert Node.objects.filter(last_heartbeat_at__isnull=False).count() == 3

    assert batched.flush() == 3

    assert set(GPU.objects.values_list("power_draw_w", flat=True)) == {333.0}
    assert GpuTelemetry.objects.count() == 12
    assert batched.pending() == 0


def test_a_node_heartbeating_twice_before_a_flush_keeps_its_latest_readings(agent, batched):
    token = agent.register("node-01", gpus=2)
    node = Node.objects.get(name="node-01")
    agent.heartbeat(token, readings(node, power_draw_w=100.0))
    agent.heartbeat(token, readings(node, power_draw_w=200.0))

    batched.flush()

    assert set(GPU.objects.values_list("power_draw_w", flat=True)) == {200.0}


def test_a_batch_marks_gpus_a_node_stopped_listing_unhealthy(agent, batched):
    token = agent.register("node-01", gpus=3)
    node = Node.objects.get(name="node-01")
    agent.heartbeat(token, readings(node)[:2])

    batched.flush()

    assert list(GPU.objects.filter(healthy=False).values_list("index", flat=True)) == [2]


def test_buffered_energy_does_not_overwrite_an_attempt_that_ended_meanwhile(
    agent, batched, make_job, vision, alice, admit
):
    import time

    token = agent.register("node-01", gpus=1)
    node = Node.objects.get(name="node-01")
    attempt = admit(make_job(vision, alice, gpus=1), node)
    report = {"attempt_id": attempt.pk, "state": "running", "started_at": time.time() - 5}
    agent.heartbeat(token, readings(node), [{**report, "energy_j": 10.0}])
    agent.heartbeat(token, readings(node), [{**report, "energy_j": 500.0}])
    agent.heartbeat(
        token,
        readings(node),
        [
            {
                **report,
                "state": "exited",
                "exit_code": 0,
                "finished_at": time.time(),
                "energy_j": 900.0,
            }
        ],
    )

    batched.flush()

    attempt.refresh_from_db()
    assert attempt.energy_j == 900.0
