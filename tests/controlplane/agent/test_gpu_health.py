"""GPU health from heartbeats: throttle reasons and ECC errors on the GPU row, the API, /metrics.

A value the agent could not read stays unknown (null, no series), never 0 or "not throttled".
"""

import datetime as dt
import time

import pytest
from django.db import connection
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families
from rest_framework.test import APIClient

from controlplane.cluster import telemetry
from controlplane.cluster.models import GPU, Node
from controlplane.jobs.models import AttemptState

from .conftest import readings


def metrics(settings) -> dict[str, dict[tuple, float]]:
    """Each family's samples, by (GPU index, throttle reason or None)."""
    settings.METRICS_TOKEN = "scrape-secret"
    response = APIClient().get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-secret")
    assert response.status_code == 200
    return {
        family.name: {
            (s.labels.get("gpu"), s.labels.get("reason")): s.value
            for s in family.samples
            if s.labels.get("Hostname") == "node-01"
        }
        for family in text_string_to_metric_families(response.content.decode())
    }


def gpus_api(user) -> dict:
    client = APIClient()
    client.force_authenticate(user)
    response = client.get("/api/v1/gpus/")
    assert response.status_code == 200
    body = response.json()
    rows = body["results"] if isinstance(body, dict) else body
    # Members are not shown UUIDs: key the rows by the one the test agent gives (node, index).
    return {f"GPU-{g['node']}-{g['index']}": g for g in rows}


def test_reported_health_reaches_the_row_the_api_and_the_metrics(agent, node01, alice, settings):
    node, token = node01
    gpus = readings(node)
    gpus[0].update(throttle_reasons=["sw_power_cap", "hw_thermal_slowdown"], ecc_errors=3)
    gpus[1].update(throttle_reasons=[], ecc_errors=0)

    agent.heartbeat(token, gpus)

    rows = {g.index: g for g in GPU.objects.filter(node=node)}
    assert (rows[0].throttle_reasons, rows[0].ecc_errors) == (
        ["sw_power_cap", "hw_thermal_slowdown"],
        3,
    )
    assert (rows[1].throttle_reasons, rows[1].ecc_errors) == ([], 0)
    api = gpus_api(alice)
    assert api["GPU-node-01-0"]["throttle_reasons"] == ["sw_power_cap", "hw_thermal_slowdown"]
    assert api["GPU-node-01-0"]["ecc_errors"] == 3
    assert (api["GPU-node-01-1"]["throttle_reasons"], api["GPU-node-01-1"]["ecc_errors"]) == (
        [],
        0,
    )
    scraped = metrics(settings)
    ecc = scraped["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"]
    assert (ecc[("0", None)], ecc[("1", None)]) == (3, 0)
    # Not throttled: no series for GPU 1.
    assert scraped["gpucp_gpu_throttled"] == {
        ("0", "sw_power_cap"): 1,
        ("0", "hw_thermal_slowdown"): 1,
    }


def test_health_the_agent_cannot_read_is_unknown_not_zero(agent, node01, alice, settings):
    node, token = node01
    agent.heartbeat(token, readings(node, throttle_reasons=["gpu_idle"], ecc_errors=5))
    unknown = readings(node)
    for g in unknown:
        del g["throttle_reasons"], g["ecc_errors"]

    agent.heartbeat(token, unknown)

    # The old values are replaced, not kept: the agent no longer vouches for them.
    assert set(GPU.objects.filter(node=node).values_list("throttle_reasons", "ecc_errors")) == {
        (None, None)
    }
    api = gpus_api(alice)
    assert {(g["throttle_reasons"], g["ecc_errors"]) for g in api.values()} == {(None, None)}
    scraped = metrics(settings)
    assert scraped["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"] == {}
    assert scraped["gpucp_gpu_throttled"] == {}


def test_a_gpu_the_node_stopped_listing_loses_its_health(agent, node01):
    node, token = node01
    agent.heartbeat(token, readings(node, throttle_reasons=["sw_power_cap"], ecc_errors=1))

    agent.heartbeat(token, readings(node)[1:])

    gone = GPU.objects.get(node=node, index=0)
    assert (gone.healthy, gone.throttle_reasons, gone.ecc_errors) == (False, None, None)


def test_health_is_written_by_the_batch_for_many_nodes_at_once(agent, settings, monkeypatch):
    settings.TELEMETRY_FLUSH_INTERVAL_S = 60.0
    held = telemetry.TelemetryBuffer(background=False)
    monkeypatch.setattr(telemetry, "buffer", held)
    tokens = {name: agent.register(name, gpus=2) for name in ("node-01", "node-02")}
    nodes = {n.name: n for n in Node.objects.all()}
    agent.heartbeat(tokens["node-01"], readings(nodes["node-01"], ecc_errors=7))
    unknown = readings(nodes["node-02"])
    for g in unknown:
        del g["ecc_errors"]
    agent.heartbeat(tokens["node-02"], unknown)

    assert held.flush() == 2

    assert dict(GPU.objects.values_list("uuid", "ecc_errors")) == {
        "GPU-node-01-0": 7,
        "GPU-node-01-1": 7,
        "GPU-node-02-0": None,
        "GPU-node-02-1": None,
    }
    # Reported as "not throttled" ([]) by both: stored as such, not as unknown.
    assert list(GPU.objects.values_list("throttle_reasons", flat=True)) == [[]] * 4


@pytest.mark.skipif(
    connection.vendor != "postgresql", reason="the steady path needs PostgreSQL's triggers"
)
def test_a_health_change_of_a_steady_node_reaches_the_row(
    agent, node01, make_job, vision, alice, admit, settings, monkeypatch
):
    """Health is telemetry: a steady heartbeat (cached answer, no write in the request) still
    carries it to the row through the batch."""
    settings.TELEMETRY_FLUSH_INTERVAL_S = 60.0
    held = telemetry.TelemetryBuffer(background=False)
    monkeypatch.setattr(telemetry, "buffer", held)
    node, token = node01
    attempt = admit(make_job(vision, alice, gpus=1), node)
    report = {"attempt_id": attempt.pk, "state": "running", "started_at": time.time() - 5}
    agent.heartbeat(token, readings(node), [report])
    attempt.refresh_from_db()
    assert attempt.state == AttemptState.RUNNING
    held.flush()
    assert set(GPU.objects.filter(node=node).values_list("ecc_errors", flat=True)) == {0}
    earlier = timezone.now() - dt.timedelta(seconds=5)
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=earlier)

    agent.heartbeat(token, readings(node, throttle_reasons=["hw_slowdown"], ecc_errors=2), [report])

    assert Node.objects.get(pk=node.pk).last_heartbeat_at == earlier, "not a steady heartbeat"
    held.flush()
    assert set(GPU.objects.filter(node=node).values_list("ecc_errors", flat=True)) == {2}
    assert [r for (r,) in GPU.objects.filter(node=node).values_list("throttle_reasons")] == [
        ["hw_slowdown"]
    ] * 8


def test_the_nodes_page_shows_ecc_errors_and_throttle_reasons(agent, node01, cluster_admin):
    from django.test import Client
    from django.urls import reverse

    node, token = node01
    gpus = readings(node)
    gpus[3].update(throttle_reasons=["hw_thermal_slowdown"], ecc_errors=4)
    agent.heartbeat(token, gpus)
    admin = Client()
    admin.force_login(cluster_admin)

    listed = admin.get(reverse("node-list")).content.decode()
    page = admin.get(reverse("node-detail", args=[node.name])).content.decode()

    # The list says it in words, once for the node; the node's page has the GPU's own row.
    assert "GPU 3 is slowed by the hardware: it is too hot." in listed
    assert "GPU 3 has uncorrected memory (ECC) errors: 4 since its driver loaded." in listed
    assert ">ECC 4<" in page
    assert "slowed by the hardware: it is too hot" in page
    assert 'title="reported as hw_thermal_slowdown"' in page
    # Zero errors and no throttling say nothing.
    assert page.count(">ECC ") == 1
    assert listed.count("ECC") == 1
