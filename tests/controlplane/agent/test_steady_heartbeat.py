"""The steady heartbeat: nothing changed, so one read and no write in the request.

The answer of a node whose work and caps have not changed is served from a per-process cache
keyed by the node's desired-state generation, which PostgreSQL triggers count. Every way the
desired state changes must still reach the node on its next heartbeat, a revoked token must
stop working at once, and the readings and liveness a steady heartbeat defers to the telemetry
batch must still land on the rows.
"""

import datetime as dt
import io
import json

import pytest
from django.db import connection
from django.utils import timezone

from controlplane.cluster import telemetry
from controlplane.cluster.agent_auth import revoke_node_token
from controlplane.cluster.models import GPU, GpuTelemetry, Node
from controlplane.jobs import actions
from controlplane.jobs.models import AttemptState, JobAttempt

from .conftest import readings, running

pytestmark = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="the steady path needs PostgreSQL's triggers"
)


@pytest.fixture
def batched(settings, monkeypatch):
    settings.TELEMETRY_FLUSH_INTERVAL_S = 60.0
    held = telemetry.TelemetryBuffer(background=False)
    monkeypatch.setattr(telemetry, "buffer", held)
    return held


def heartbeat_steadily(agent, token, node, attempts) -> dict:
    """A heartbeat that must take the steady path: it leaves the node's liveness to the batch."""
    earlier = timezone.now() - dt.timedelta(seconds=5)
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=earlier)
    answer = agent.heartbeat(token, readings(node), attempts)
    assert Node.objects.get(pk=node.pk).last_heartbeat_at == earlier, "not a steady heartbeat"
    return answer


@pytest.fixture
def steady_node(agent, node01, make_job, vision, alice, admit, batched):
    """node-01 running one job, its attempt RUNNING and its heartbeats steady, with batched
    telemetry: (node, token, attempt)."""
    node, token = node01
    attempt = admit(make_job(vision, alice, gpus=1), node)
    agent.heartbeat(token, readings(node), [running(attempt)])
    attempt.refresh_from_db()
    assert attempt.state == AttemptState.RUNNING
    heartbeat_steadily(agent, token, node, [running(attempt)])
    return node, token, attempt


def test_a_steady_heartbeat_leaves_its_readings_and_liveness_to_the_batch(
    agent, steady_node, batched
):
    node, token, attempt = steady_node
    batched.flush()
    Node.objects.filter(pk=node.pk).update(
        last_heartbeat_at=timezone.now() - dt.timedelta(seconds=5)
    )
    before = Node.objects.get(pk=node.pk).last_heartbeat_at

    answer = agent.heartbeat(
        token, readings(node, power_draw_w=612.0), [running(attempt, energy_j=777.0)]
    )

    assert [a["attempt_id"] for a in answer["attempts"]] == [attempt.pk]
    # Nothing written yet: the request only read.
    assert Node.objects.get(pk=node.pk).last_heartbeat_at == before
    assert not GPU.objects.filter(node=node, power_draw_w=612.0).exists()

    batched.flush()

    assert Node.objects.get(pk=node.pk).last_heartbeat_at > before
    assert set(GPU.objects.filter(node=node).values_list("power_draw_w", flat=True)) == {612.0}
    assert GpuTelemetry.objects.filter(gpu__node=node, power_draw_w__isnull=False).count() == 8
    assert JobAttempt.objects.get(pk=attempt.pk).energy_j == 777.0


def test_readings_of_a_steady_heartbeat_are_written_inline_without_a_batch(
    agent, steady_node, settings
):
    node, token, attempt = steady_node
    settings.TELEMETRY_FLUSH_INTERVAL_S = 0

    agent.heartbeat(token, readings(node, temperature_c=71.0), [running(attempt, energy_j=55.0)])

    assert set(GPU.objects.filter(node=node).values_list("temperature_c", flat=True)) == {71.0}
    assert JobAttempt.objects.get(pk=attempt.pk).energy_j == 55.0


def test_new_work_reaches_a_steady_node_on_its_next_heartbeat(
    agent, steady_node, make_job, vision, alice, admit
):
    node, token, first = steady_node
    heartbeat_steadily(agent, token, node, [running(first)])

    second = admit(make_job(vision, alice, gpus=2), node, gpu_indexes=(3, 4))
    answer = agent.heartbeat(token, readings(node), [running(first)])

    assert [a["attempt_id"] for a in answer["attempts"]] == [first.pk, second.pk]
    assert answer["attempts"][1]["gpu_uuids"] == ["GPU-node-01-3", "GPU-node-01-4"]


def test_a_stop_reaches_a_steady_node_on_its_next_heartbeat(agent, steady_node, alice):
    node, token, attempt = steady_node
    heartbeat_steadily(agent, token, node, [running(attempt)])

    actions.cancel_job(attempt.job, actor=alice)
    answer = agent.heartbeat(token, readings(node), [running(attempt)])

    assert answer["attempts"] == []


def test_a_cap_change_reaches_a_steady_node_on_its_next_heartbeat(agent, steady_node):
    node, token, attempt = steady_node
    heartbeat_steadily(agent, token, node, [running(attempt)])

    GPU.objects.filter(node=node, index=6).update(desired_power_cap_w=420.0)
    answer = agent.heartbeat(token, readings(node), [running(attempt)])
    assert answer["power_caps_w"] == {"GPU-node-01-6": 420.0}

    GPU.objects.filter(node=node, index=6).update(desired_power_cap_w=None)
    assert agent.heartbeat(token, readings(node), [running(attempt)])["power_caps_w"] == {}


def test_work_lost_by_the_sweep_leaves_the_answer_of_a_returning_node(agent, steady_node):
    from .conftest import sweep_while_hearing

    node, token, attempt = steady_node
    heartbeat_steadily(agent, token, node, [running(attempt)])
    silent_since = timezone.now() - dt.timedelta(hours=1)
    Node.objects.filter(pk=node.pk).update(last_heartbeat_at=silent_since)
    sweep_while_hearing()  # not ready, and its lease long gone: its attempt lost
    assert JobAttempt.objects.get(pk=attempt.pk).state == AttemptState.LOST

    answer = agent.heartbeat(token, readings(node), [running(attempt)])

    assert answer["attempts"] == []
    assert Node.objects.get(pk=node.pk).ready


def test_a_gang_stopped_leaves_the_answers_of_both_its_nodes(
    agent, make_job, vision, alice, batched
):
    tokens = {name: agent.register(name) for name in ("node-01", "node-02")}
    nodes = {n.name: n for n in Node.objects.all()}
    job = make_job(vision, alice, gpus=16)
    attempt = actions.admit_job(
        job, node=nodes["node-01"], gpus=list(GPU.objects.all()), borrowed=False
    )
    # The gang runs (and its heartbeats can be steady) once both its members run.
    for name, token in tokens.items():
        agent.heartbeat(token, readings(nodes[name]), [running(attempt)])
    for name, token in tokens.items():
        answer = heartbeat_steadily(agent, token, nodes[name], [running(attempt)])
        assert [a["attempt_id"] for a in answer["attempts"]] == [attempt.pk]

    actions.cancel_job(job, actor=alice)

    for name, token in tokens.items():
        assert agent.heartbeat(token, readings(nodes[name]), [running(attempt)])["attempts"] == []


def test_a_revoked_token_of_a_steady_node_is_refused_at_once(agent, steady_node):
    node, token, attempt = steady_node
    heartbeat_steadily(agent, token, node, [running(attempt)])

    revoke_node_token(node)

    response = agent.post("heartbeat", agent.heartbeat_body(readings(node)), token)
    assert response.status_code == 401


def test_a_re_registered_node_is_answered_under_its_new_token_only(agent, steady_node):
    node, old_token, attempt = steady_node
    heartbeat_steadily(agent, old_token, node, [running(attempt)])

    new_token = agent.rejoin("node-01")

    body = agent.heartbeat_body(readings(node), [running(attempt)])
    assert agent.post("heartbeat", body, old_token).status_code == 401
    answer = agent.heartbeat(new_token, readings(node), [running(attempt)])
    assert [a["attempt_id"] for a in answer["attempts"]] == [attempt.pk]


def test_a_changed_condition_is_recorded_at_once(agent, steady_node):
    node, token, attempt = steady_node
    condition = {"type": "PowerCapFailed", "gpu_uuid": "GPU-node-01-0", "message": "no permission"}

    agent.heartbeat(token, readings(node), [running(attempt)], conditions=[condition])

    stored = Node.objects.get(pk=node.pk).conditions
    assert [(c["type"], c["gpu_uuid"]) for c in stored] == [("PowerCapFailed", "GPU-node-01-0")]
    agent.heartbeat(token, readings(node), [running(attempt)])
    assert Node.objects.get(pk=node.pk).conditions == []


# --- the WSGI shortcut (controlplane.wsgi.application) -----------------------------------------


def call_wsgi(path: str, body: bytes, token: str | None, method: str = "POST"):
    from controlplane.wsgi import application

    environ = {
        "REQUEST_METHOD": method,
        "PATH_INFO": path,
        "SCRIPT_NAME": "",
        "QUERY_STRING": "",
        "SERVER_NAME": "testserver",
        "SERVER_PORT": "80",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(body)),
        "wsgi.input": io.BytesIO(body),
        "wsgi.errors": io.StringIO(),
        "wsgi.url_scheme": "http",
        "wsgi.version": (1, 0),
        "wsgi.multithread": True,
        "wsgi.multiprocess": True,
        "wsgi.run_once": False,
    }
    if token:
        environ["HTTP_AUTHORIZATION"] = f"Bearer {token}"
    started = {}

    def start_response(status, headers, exc_info=None):
        started["status"] = int(status.split()[0])
        started["headers"] = dict(headers)

    payload = b"".join(application(environ, start_response))
    return started["status"], started["headers"], payload


def test_the_wsgi_entry_answers_heartbeats_like_the_view(agent, steady_node, make_job, vision):
    node, token, attempt = steady_node
    body = json.dumps(agent.heartbeat_body(readings(node), [running(attempt)])).encode()

    status, headers, payload = call_wsgi("/api/agent/v1/heartbeat", body, token)

    assert status == 200
    assert headers["Content-Type"] == "application/json"
    assert json.loads(payload) == agent.heartbeat(token, readings(node), [running(attempt)])


def test_the_wsgi_entry_refuses_what_the_view_refuses(agent, steady_node):
    node, token, _ = steady_node
    good = json.dumps(agent.heartbeat_body(readings(node))).encode()

    status, headers, _ = call_wsgi("/api/agent/v1/heartbeat", good, "gcpn_not-a-token")
    assert status == 401
    assert headers["WWW-Authenticate"].startswith("Bearer")
    assert call_wsgi("/api/agent/v1/heartbeat", good, None)[0] == 401
    status, _, payload = call_wsgi("/api/agent/v1/heartbeat", b'{"seq": 1}', token)
    assert status == 400
    assert "sent_at" in json.loads(payload) or "gpus" in json.loads(payload)
    # Anything else goes to Django, which knows the agent API answers only POST.
    assert call_wsgi("/api/agent/v1/heartbeat", b"", token, method="GET")[0] == 405


def test_the_wsgi_entry_answers_watches_like_the_view(agent, steady_node):
    node, token, attempt = steady_node
    heartbeat_steadily(agent, token, node, [running(attempt)])
    quiet = json.dumps({"timeout_s": 0}).encode()

    status, headers, payload = call_wsgi("/api/agent/v1/watch", quiet, token)
    assert (status, json.loads(payload)) == (200, {"changed": False})
    assert headers["Content-Type"] == "application/json"
    GPU.objects.filter(node=node, index=2).update(desired_power_cap_w=600.0)
    assert json.loads(call_wsgi("/api/agent/v1/watch", quiet, token)[2]) == {"changed": True}
    assert json.loads(call_wsgi("/api/agent/v1/watch", quiet, token)[2]) == (
        agent.post("watch", {"timeout_s": 0}, token).json()
    )
    # Refused as the view refuses: a bad token, a bad body; a GET goes to Django.
    assert call_wsgi("/api/agent/v1/watch", quiet, "gcpn_not-a-token")[0] == 401
    status, _, payload = call_wsgi("/api/agent/v1/watch", b'{"timeout_s": -1}', token)
    assert status == 400 and "timeout_s" in json.loads(payload)
    assert call_wsgi("/api/agent/v1/watch", b"", token, method="GET")[0] == 405


def test_a_watch_after_steady_heartbeats_has_nothing_to_tell(agent, steady_node, settings):
    # The steady path must describe the desired state exactly as the watch reads it, or every
    # watch would wake at once and the agent would heartbeat in a loop.
    node, token, attempt = steady_node
    GPU.objects.filter(node=node, index=2).update(desired_power_cap_w=512.5)
    agent.heartbeat(token, readings(node), [running(attempt)])
    heartbeat_steadily(agent, token, node, [running(attempt)])

    response = agent.post("watch", {"timeout_s": 0}, token)

    assert response.status_code == 200
    assert response.json() == {"changed": False}
    GPU.objects.filter(node=node, index=2).update(desired_power_cap_w=600.0)
    assert agent.post("watch", {"timeout_s": 0}, token).json() == {"changed": True}
