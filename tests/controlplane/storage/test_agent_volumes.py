"""GET/POST /api/agent/v1/volumes: what a node should have and delete, and what it reports."""

from __future__ import annotations

import datetime as dt
import json

import pytest

from controlplane.audit.models import AuditEvent
from controlplane.cluster.models import Node, Pool
from controlplane.jobs.models import Job

pytestmark = pytest.mark.django_db
URL = "/api/agent/v1/volumes"


@pytest.fixture
def agent(client, make_node, node_token):
    """(node, call): call(method, body=None) speaks to the endpoint as the node."""

    def for_node(name: str, pool=None):
        node = make_node(name, gpus=1)
        if pool is not None:
            Node.objects.filter(pk=node.pk).update(pool=pool)
        token = node_token(node)

        def call(method: str = "GET", body=None):
            headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
            if method == "GET":
                return client.get(URL, **headers)
            data = body if isinstance(body, str | bytes) else json.dumps(body)
            return client.post(URL, data=data, content_type="application/json", **headers)

        return node, call

    return for_node


def test_a_node_is_told_the_volumes_of_its_pool_only(agent, make_volume, pool):
    other = Pool.objects.create(name="other")
    make_volume("everywhere")
    make_volume("here", pools=[pool])
    make_volume("there", "/mnt/there", pools=[other])
    _, call = agent("gpu-1")
    answer = call().json()
    assert [v["name"] for v in answer["volumes"]] == ["everywhere", "here"]
    assert answer["volumes"][0] == {
        "name": "everywhere",
        "kind": "host_path",
        "source": "/mnt/everywhere",
        "checkpoints": False,
    }
    _, call_other = agent("gpu-2", pool=other)
    assert [v["name"] for v in call_other().json()["volumes"]] == ["everywhere", "there"]


def test_a_report_stores_only_volumes_that_exist_and_apply_and_asks_for_a_cycle_on_change(
    agent, make_volume, pool, monkeypatch, django_capture_on_commit_callbacks
):
    from controlplane import wakeups

    asked: list[str] = []
    monkeypatch.setattr(wakeups, "request_cycle", asked.append)
    make_volume("here", pools=[pool])
    make_volume("everywhere")
    make_volume("there", pools=[Pool.objects.create(name="other")])
    node, call = agent("gpu-1")
    with django_capture_on_commit_callbacks(execute=True):
        response = call("POST", {"present": ["here", "there", "unknown", "everywhere"]})
    assert response.status_code == 200 and response.json() == {"ok": True}
    node.refresh_from_db()
    assert node.volumes == ["everywhere", "here"]
    assert node.volumes_reported_at is not None
    assert asked == ["node_volumes"]
    with django_capture_on_commit_callbacks(execute=True):
        call("POST", {"present": ["everywhere", "here"]})
    assert asked == ["node_volumes"]  # the same set: no cycle, no audit row
    assert AuditEvent.objects.filter(action="node.volumes").count() == 1


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ([], "non_field_errors"),
        ("{not json", "non_field_errors"),
        ({"present": "here"}, "present"),
        ({"present": [1]}, "present[0]"),
        ({"present": ["ok", "a\x00b"]}, "present[1]"),
        ({"present": ["\ud800"]}, "present[0]"),
        ({"present": [""]}, "present[0]"),
        ({"present": ["x" * 64]}, "present[0]"),
        ({"present": ["v"] * 1001}, "present"),
        ({"deleted_checkpoints": {"1": 1}}, "deleted_checkpoints"),
        ({"deleted_checkpoints": [0]}, "deleted_checkpoints[0]"),
        ({"deleted_checkpoints": [True]}, "deleted_checkpoints[0]"),
        ({"deleted_checkpoints": ["1"]}, "deleted_checkpoints[0]"),
        ({"deleted_checkpoints": [2**64]}, "deleted_checkpoints[0]"),
        ({"deleted_checkpoints": [1.5]}, "deleted_checkpoints[0]"),
    ],
)
def test_a_bad_body_is_refused_naming_the_field(agent, body, field):
    node, call = agent("gpu-1")
    response = call("POST", body)
    assert response.status_code == 400
    assert field in response.json()
    node.refresh_from_db()
    assert node.volumes_reported_at is None


def test_without_a_node_token_nothing_is_answered(client, make_volume):
    make_volume("here")
    assert client.get(URL).status_code == 401
    assert client.get(URL, HTTP_AUTHORIZATION="Bearer nope").status_code == 401
    assert client.put(URL).status_code == 405


def test_a_node_is_told_of_due_deletions_only_on_a_checkpoint_volume_it_has(
    agent, ckpt_volume, finished_job
):
    due = finished_job(ckpt_volume, ago=dt.timedelta(hours=2))
    node, call = agent("gpu-1")
    assert call().json()["checkpoint_deletions"] == []  # it has not reported the volume
    call("POST", {"present": ["ckpt"]})
    assert call().json()["checkpoint_deletions"] == [
        {"job_id": due.pk, "host_path": f"/srv/ckpt/checkpoints/vision/{due.pk}"}
    ]
    assert call("POST", {"present": ["ckpt"], "deleted_checkpoints": [due.pk]}).status_code == 200
    assert Job.objects.get(pk=due.pk).checkpoint_deleted_at is not None
    assert call().json()["checkpoint_deletions"] == []


def test_a_node_of_another_pool_sees_nothing_of_this_pools_checkpoints_and_cannot_strike_them(
    agent, make_volume, pool, finished_job
):
    from controlplane.storage.models import Volume

    ckpt = make_volume("ckpt", "/srv/ckpt", checkpoints=True, checkpoint_retention_s=0)
    Volume.objects.get(pk=ckpt.pk).pools.set([pool])
    due = finished_job(ckpt, ago=dt.timedelta(hours=2))
    other = Pool.objects.create(name="other")
    stranger, call = agent("gpu-9", pool=other)
    answer = call("POST", {"present": ["ckpt"], "deleted_checkpoints": [due.pk]})
    assert answer.status_code == 200
    stranger.refresh_from_db()
    assert stranger.volumes == []
    body = call().json()
    assert body == {"volumes": [], "checkpoint_deletions": []}
    assert Job.objects.get(pk=due.pk).checkpoint_deleted_at is None


def test_a_node_cannot_strike_out_a_running_jobs_checkpoints(agent, ckpt_volume, finished_job):
    running = finished_job(ckpt_volume, ago=None, state="RUNNING")
    _, call = agent("gpu-1")
    call("POST", {"present": ["ckpt"], "deleted_checkpoints": [running.pk, 10**9]})
    assert Job.objects.get(pk=running.pk).checkpoint_deleted_at is None
