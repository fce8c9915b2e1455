"""A join token cannot take another node's GPUs: a GPU joins another node only once its own
node is gone for good, never while an active allocation holds it; a refused claim is a 409
naming each GPU and its holder, recorded for an admin, who can resolve it."""

import datetime as dt
import threading

import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.audit.models import AuditEvent
from controlplane.cluster import lease
from controlplane.cluster.models import GPU, GpuClaimConflict, JoinToken, Node
from controlplane.jobs.models import AttemptState, JobAttempt, JobState

from .conftest import (
    exited,
    hearing_until,
    inventory,
    readings,
    rejoin_token,
    running,
    sweep_while_hearing,
)


def claiming(name: str, uuids: list[str], new: int = 0) -> dict:
    """An inventory for node `name` listing these UUIDs (another node's) and `new` fresh GPUs."""
    body = inventory(name, gpus=len(uuids) + new)
    for gpu, uuid in zip(body["gpus"], uuids, strict=False):
        gpu["uuid"] = uuid
    return body


def admin_client(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


@pytest.fixture
def victim(agent, node01, make_job, nlp, bob, admit):
    """node-01 running a job of another tenant that may not be restarted, on GPU 0."""
    node, token = node01
    job = make_job(nlp, bob, restartable=False)
    attempt = admit(job, node, gpu_indexes=(0,))
    agent.heartbeat(token, readings(node), [running(attempt)])
    return node, token, job, attempt


def silent_past_the_lost_threshold(node: Node) -> dt.datetime:
    """Make `node` one the liveness rules see as lost: down, silent for longer than its lease
    and margin while the control plane could hear. Returns now."""
    now = timezone.now()
    long_ago = now - lease.lost_after() - dt.timedelta(seconds=60)
    Node.objects.filter(pk=node.pk).update(ready=False, last_heartbeat_at=long_ago)
    hearing_until(now)
    return now


# --- the attack --------------------------------------------------------------------------------


def test_a_fresh_node_listing_a_live_nodes_gpu_is_refused_and_the_victims_job_runs_on(
    agent, victim
):
    node, token, job, attempt = victim
    uses = JoinToken.objects.get().uses

    response = agent.post("register", claiming("intruder", ["GPU-node-01-0"]), agent.join_token)

    assert response.status_code == 409
    body = response.json()
    assert body["gpus"] == [
        {"uuid": "GPU-node-01-0", "node": "node-01", "reason": body["gpus"][0]["reason"]}
    ]
    assert "GPU-node-01-0" in body["detail"] and "node-01" in body["detail"]
    assert "active allocation" in body["gpus"][0]["reason"]
    # Nothing of the registration happened, and the join token's use was not spent.
    assert not Node.objects.filter(name="intruder").exists()
    assert GPU.objects.get(uuid="GPU-node-01-0").node == node
    assert JoinToken.objects.get().uses == uses
    # The victim's job runs on: its node keeps the GPU in its answer, and when the intruder
    # stays silent nothing of the victim's is declared lost.
    answer = agent.heartbeat(token, readings(node), [running(attempt)])
    assert answer["attempts"][0]["gpu_uuids"] == ["GPU-node-01-0"]
    sweep_while_hearing(timezone.now() + lease.lost_after() / 2)
    job.refresh_from_db()
    assert job.state == JobState.RUNNING
    assert JobAttempt.objects.get(pk=attempt.pk).state == AttemptState.RUNNING


@pytest.mark.parametrize(
    ("listed", "new"),
    [
        (["GPU-node-01-3"], 2),  # one free GPU of a live node among new ones
        ([f"GPU-node-01-{i}" for i in range(8)], 0),  # all of them
        (["GPU-node-01-0", "GPU-node-01-5"], 1),  # a busy one and a free one
    ],
    ids=["one-among-new", "all", "busy-and-free"],
)
def test_no_gpu_of_a_live_node_moves_whatever_else_the_inventory_lists(agent, victim, listed, new):
    node, _, _, _ = victim
    before = sorted(GPU.objects.values_list("uuid", "node_id", "index"))

    response = agent.post("register", claiming("intruder", listed, new), agent.join_token)

    assert response.status_code == 409
    assert sorted(g["uuid"] for g in response.json()["gpus"]) == sorted(listed)
    assert {g["node"] for g in response.json()["gpus"]} == {"node-01"}
    assert sorted(GPU.objects.values_list("uuid", "node_id", "index")) == before
    assert not Node.objects.filter(name="intruder").exists()


def test_a_rejoining_node_cannot_take_a_gpu_of_another_live_node(agent, node01):
    agent.register("node-02", gpus=1)
    body = claiming("node-02", ["GPU-node-01-4"], new=1)

    response = agent.post("register", body, rejoin_token("node-02"))

    assert response.status_code == 409
    assert response.json()["gpus"][0]["uuid"] == "GPU-node-01-4"
    assert GPU.objects.get(uuid="GPU-node-01-4").node.name == "node-01"


# --- nodes that are gone, or not quite ------------------------------------------------------


def test_a_gpu_of_a_node_down_for_less_than_the_lost_threshold_stays(agent, node01):
    node, _ = node01
    now = timezone.now()
    Node.objects.filter(pk=node.pk).update(
        ready=False, last_heartbeat_at=now - dt.timedelta(seconds=30)
    )
    hearing_until(now)

    response = agent.post("register", claiming("node-02", ["GPU-node-01-2"]), agent.join_token)

    assert response.status_code == 409
    assert "silent only" in response.json()["gpus"][0]["reason"]


def test_a_gpu_of_a_lost_node_that_still_has_an_active_attempt_stays(agent, victim):
    node, _, _, attempt = victim
    silent_past_the_lost_threshold(node)  # and no sweep has declared its attempt lost yet

    busy = agent.post("register", claiming("node-02", ["GPU-node-01-0"]), agent.join_token)
    free = agent.post("register", claiming("node-02", ["GPU-node-01-1"]), agent.join_token)

    assert (busy.status_code, free.status_code) == (409, 409)
    assert "active allocation" in busy.json()["gpus"][0]["reason"]
    assert f"[{attempt.pk}]" in free.json()["gpus"][0]["reason"]
    assert GPU.objects.get(uuid="GPU-node-01-1").node == node


def test_a_gpu_of_a_node_lost_with_its_attempts_ended_moves_with_its_history(agent, victim):
    node, _, job, attempt = victim
    now = silent_past_the_lost_threshold(node)
    sweep_while_hearing(now)  # the attempt is declared lost, its GPUs released
    assert JobAttempt.objects.get(pk=attempt.pk).state == AttemptState.LOST

    response = agent.post(
        "register", claiming("node-02", ["GPU-node-01-0"], new=1), agent.join_token
    )

    assert response.status_code == 201, response.content
    gpu = GPU.objects.get(uuid="GPU-node-01-0")
    assert (gpu.node.name, gpu.index, gpu.healthy) == ("node-02", 0, True)
    assert gpu.allocations.filter(attempt=attempt).exists()  # its history came with it


def test_a_gpu_of_a_deregistered_node_moves(agent, node01, cluster_admin):
    node, old_token = node01
    deregistered = admin_client(cluster_admin).post(f"/api/v1/nodes/{node.name}/deregister/")
    assert deregistered.status_code == 200, deregistered.content
    assert deregistered.json()["status"] == "deregistered"

    response = agent.post(
        "register", claiming("node-02", ["GPU-node-01-0", "GPU-node-01-1"]), agent.join_token
    )

    assert response.status_code == 201, response.content
    assert set(Node.objects.get(name="node-02").gpus.values_list("uuid", flat=True)) == {
        "GPU-node-01-0",
        "GPU-node-01-1",
    }
    # The deregistered node's agent is out: its token no longer works.
    body = agent.heartbeat_body([])
    assert agent.post("heartbeat", body, old_token).status_code == 401


def test_a_node_running_work_cannot_be_deregistered(victim, cluster_admin):
    node, _, _, attempt = victim

    response = admin_client(cluster_admin).post(f"/api/v1/nodes/{node.name}/deregister/")

    assert response.status_code == 409
    assert str(attempt.pk) in response.json()["detail"]
    assert Node.objects.get(pk=node.pk).deregistered_at is None


# --- what an admin sees and does ---------------------------------------------------------------


def test_refusals_are_recorded_once_per_gpu_and_claimant_and_counted(agent, victim):
    for _ in range(3):
        agent.post("register", claiming("intruder", ["GPU-node-01-0"]), agent.join_token)

    conflict = GpuClaimConflict.objects.get()
    assert (conflict.gpu_uuid, conflict.claimant, conflict.holder_name) == (
        "GPU-node-01-0",
        "intruder",
        "node-01",
    )
    assert conflict.refusals == 3
    assert conflict.join_token == JoinToken.objects.get()
    assert conflict.resolved_at is None


def test_an_admin_resolves_a_conflict_by_deregistering_the_holder_once_its_work_ended(
    agent, victim, cluster_admin
):
    node, token, job, attempt = victim
    agent.post("register", claiming("node-02", ["GPU-node-01-0"], new=1), agent.join_token)
    admin = admin_client(cluster_admin)
    listed = admin.get("/api/v1/gpu-claim-conflicts/?open=true").json()
    [conflict] = listed["results"] if isinstance(listed, dict) else listed
    assert (conflict["gpu_uuid"], conflict["holder"], conflict["open"]) == (
        "GPU-node-01-0",
        "node-01",
        True,
    )
    url = f"/api/v1/gpu-claim-conflicts/{conflict['id']}/resolve/"

    # While the holder runs the job, deregistering it is refused, and nothing changes.
    busy = admin.post(url, {"resolution": "holder_deregistered"}, format="json")
    assert busy.status_code == 409
    assert admin.get(url.replace("resolve/", "")).json()["open"] is True

    agent.heartbeat(token, readings(node), [exited(attempt, 0)])
    resolved = admin.post(url, {"resolution": "holder_deregistered"}, format="json")
    assert resolved.status_code == 200, resolved.content
    assert resolved.json()["resolution"] == "holder_deregistered"
    assert resolved.json()["resolved_by"] == cluster_admin.username
    [audited] = AuditEvent.objects.filter(action="gpu_claim.resolve")
    assert (audited.actor, audited.after["resolution"]) == (cluster_admin, "holder_deregistered")

    again = agent.post("register", claiming("node-02", ["GPU-node-01-0"], new=1), agent.join_token)
    assert again.status_code == 201, again.content
    assert GPU.objects.get(uuid="GPU-node-01-0").node.name == "node-02"


def test_an_admin_dismisses_a_hostile_claim_and_nothing_else_changes(agent, victim, cluster_admin):
    agent.post("register", claiming("intruder", ["GPU-node-01-0"]), agent.join_token)
    conflict = GpuClaimConflict.objects.get()

    response = admin_client(cluster_admin).post(
        f"/api/v1/gpu-claim-conflicts/{conflict.pk}/resolve/",
        {"resolution": "dismissed"},
        format="json",
    )

    assert response.status_code == 200
    assert response.json()["resolution"] == "dismissed"
    assert Node.objects.get(name="node-01").deregistered_at is None
    refused = agent.post("register", claiming("intruder", ["GPU-node-01-0"]), agent.join_token)
    assert refused.status_code == 409  # dismissing allowed nothing: a new conflict is open
    assert GpuClaimConflict.objects.filter(resolved_at__isnull=True).count() == 1


@pytest.mark.parametrize("resolution", ["", "delete_node", None])
def test_an_unknown_resolution_is_refused_naming_the_field(
    victim, agent, cluster_admin, resolution
):
    agent.post("register", claiming("intruder", ["GPU-node-01-0"]), agent.join_token)
    conflict = GpuClaimConflict.objects.get()

    response = admin_client(cluster_admin).post(
        f"/api/v1/gpu-claim-conflicts/{conflict.pk}/resolve/",
        {"resolution": resolution},
        format="json",
    )

    assert response.status_code == 400
    assert "resolution" in response.json()


def test_conflicts_are_listed_in_django_admin(agent, victim, cluster_admin):
    agent.post("register", claiming("intruder", ["GPU-node-01-0"]), agent.join_token)
    client = Client()
    client.force_login(cluster_admin)

    page = client.get("/admin/cluster/gpuclaimconflict/")

    assert page.status_code == 200
    assert b"GPU-node-01-0" in page.content and b"intruder" in page.content


# --- who sees GPU UUIDs ------------------------------------------------------------------------


def test_gpu_uuids_are_shown_to_cluster_admins_only(node01, alice, cluster_admin):
    member, admin = APIClient(), admin_client(cluster_admin)
    member.force_authenticate(alice)

    as_member = member.get("/api/v1/gpus/?node=node-01").json()["results"]
    as_admin = admin.get("/api/v1/gpus/?node=node-01").json()["results"]

    assert len(as_member) == len(as_admin) == 8
    assert all("uuid" not in g for g in as_member)
    assert {g["uuid"] for g in as_admin} == {f"GPU-node-01-{i}" for i in range(8)}
    one = member.get("/api/v1/gpus/GPU-node-01-0/")
    assert one.status_code == 200 and "uuid" not in one.json()


# --- races ---------------------------------------------------------------------------------------


def register_at_once(raw: str, names: list[str], uuids: list[str]) -> dict[str, int]:
    """Each node registers with this join token, listing these GPU UUIDs, all released at
    once from threads of their own; the status each got, by name."""
    barrier = threading.Barrier(len(names))
    statuses = {}

    def register(name):
        barrier.wait()
        try:
            response = Client().post(
                "/api/agent/v1/register",
                data=claiming(name, uuids),
                content_type="application/json",
                HTTP_AUTHORIZATION=f"Bearer {raw}",
            )
            statuses[name] = response.status_code
        finally:
            connection.close()

    threads = [threading.Thread(target=register, args=(name,)) for name in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses


@pytest.mark.django_db(transaction=True)
def test_two_registrations_racing_for_a_freed_gpu_get_it_once(pool, cluster_admin):
    from controlplane.cluster.agent_auth import issue_join_token
    from controlplane.cluster.gpu_claims import deregister_node

    expires_at = timezone.now() + dt.timedelta(hours=1)
    _, raw = issue_join_token(pool, expires_at=expires_at, max_uses=10)
    first = Client().post(
        "/api/agent/v1/register",
        data=inventory("old-node", gpus=2),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {raw}",
    )
    assert first.status_code == 201
    deregister_node(Node.objects.get(name="old-node"))
    statuses = register_at_once(
        raw, [f"new-{i}" for i in range(4)], ["GPU-old-node-0", "GPU-old-node-1"]
    )

    assert sorted(statuses.values()) == [201, 409, 409, 409]
    [winner] = [name for name, status in statuses.items() if status == 201]
    assert set(GPU.objects.values_list("node__name", flat=True)) == {winner}
    assert Node.objects.filter(name__startswith="new-").count() == 1
    assert JoinToken.objects.get().uses == 2


@pytest.mark.django_db(transaction=True)
def test_nodes_registering_at_once_that_list_the_same_new_gpus_get_them_once(pool):
    """Registrations with one join token run side by side: two hosts that both list GPUs no
    node has held yet (a cloned inventory, a misconfigured simulator) cannot both get them.
    One registers; the others are refused with 409 naming the GPUs, and leave nothing behind."""
    from controlplane.cluster.agent_auth import issue_join_token

    _, raw = issue_join_token(pool, expires_at=timezone.now() + dt.timedelta(hours=1), max_uses=10)
    statuses = register_at_once(
        raw, [f"host-{i}" for i in range(4)], ["GPU-shared-0", "GPU-shared-1"]
    )

    assert sorted(statuses.values()) == [201, 409, 409, 409]
    [winner] = [name for name, status in statuses.items() if status == 201]
    assert set(GPU.objects.values_list("node__name", flat=True)) == {winner}
    assert list(Node.objects.values_list("name", flat=True)) == [winner]
    assert JoinToken.objects.get().uses == 1
