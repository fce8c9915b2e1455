"""Joining the cluster: a join token buys a node token, once per use, and an inventory."""

import datetime as dt
import threading

import pytest
from django.db import connection, transaction
from django.utils import timezone

from controlplane.cluster.agent_auth import (
    AgentAuthError,
    issue_join_token,
    spend_join_token,
    usable_join_token,
)
from controlplane.cluster.models import GPU, JoinToken, Node
from controlplane.tenancy.models import hash_token

from .conftest import inventory, readings, rejoin_token


def test_an_agent_registers_with_a_join_token_and_gets_a_node_token(agent, pool):
    response = agent.post("register", inventory("node-01", gpus=2), agent.join_token)

    assert response.status_code == 201
    body = response.json()
    assert body["node"] == "node-01"
    assert body["node_token"].startswith("gcpn_")
    assert body["heartbeat_interval_s"] == 10.0
    node = Node.objects.get(name="node-01")
    assert node.pool == pool
    assert (node.cpus, node.memory_mib, node.labels) == (64, 512 * 1024, {"rack": "a1"})
    assert (node.agent_version, node.runtime, node.ready) == ("0.1.0", "process", True)
    # Stored hashed: the raw token is nowhere in the database.
    assert node.token_hash == hash_token(body["node_token"])
    assert list(node.gpus.values_list("index", "uuid", "power_max_w")) == [
        (0, "GPU-node-01-0", 700.0),
        (1, "GPU-node-01-1", 700.0),
    ]
    assert JoinToken.objects.get().uses == 1
    agent.heartbeat(body["node_token"], readings(node))


def test_registering_again_rotates_the_node_token_and_the_old_one_stops_working(agent):
    old = agent.register("node-01")
    new = agent.rejoin("node-01")
    node = Node.objects.get(name="node-01")

    assert new != old
    assert agent.post("heartbeat", agent.heartbeat_body(readings(node)), old).status_code == 401
    assert agent.post("heartbeat", agent.heartbeat_body(readings(node)), new).status_code == 200
    assert Node.objects.count() == 1


def test_registering_again_updates_the_inventory(agent):
    agent.register("node-01", gpus=3)
    swapped = inventory("node-01", gpus=3, cpus=32)
    # GPU 1 was replaced by a new card; GPUs 0 and 2 were re-enumerated the other way round.
    swapped["gpus"][1]["uuid"] = "GPU-replacement"
    swapped["gpus"][0]["index"], swapped["gpus"][2]["index"] = 2, 0

    response = agent.post("register", swapped, rejoin_token("node-01"))

    assert response.status_code == 201, response.content
    node = Node.objects.get(name="node-01")
    assert node.cpus == 32
    healthy = node.gpus.filter(healthy=True).order_by("index")
    assert list(healthy.values_list("index", "uuid")) == [
        (0, "GPU-node-01-2"),
        (1, "GPU-replacement"),
        (2, "GPU-node-01-0"),
    ]
    retired = GPU.objects.get(uuid="GPU-node-01-1")
    assert retired.healthy is False
    assert retired.index >= 1000


@pytest.mark.parametrize(
    "token_fields",
    [
        {"expires_at": timezone.now() - dt.timedelta(seconds=1)},
        {"revoked_at": timezone.now()},
        {"uses": 1, "max_uses": 1},
    ],
    ids=["expired", "revoked", "used-up"],
)
def test_an_unusable_join_token_is_refused(agent, token_fields):
    JoinToken.objects.update(**token_fields)

    response = agent.post("register", inventory("node-01"), agent.join_token)

    assert response.status_code == 401
    assert not Node.objects.exists()


def test_a_node_token_or_garbage_cannot_register(agent, node01):
    _, node_token = node01
    assert agent.post("register", inventory("node-02"), node_token).status_code == 401
    assert agent.post("register", inventory("node-02"), "gcpj_not-a-real-one").status_code == 401
    assert agent.post("register", inventory("node-02"), None).status_code == 401
    assert not Node.objects.filter(name="node-02").exists()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda b: b.pop("name"), "name"),
        (lambda b: b.update(name="has space"), "name"),
        (lambda b: b.update(cpus="64"), "cpus"),
        (lambda b: b.update(cpus=-1), "cpus"),
        (lambda b: b.update(labels={"rack": 1}), "labels"),
        (lambda b: b.update(gpus={}), "gpus"),
        (lambda b: b["gpus"][1].pop("uuid"), "gpus[1].uuid"),
        (lambda b: b["gpus"][0].update(power_max_w=True), "gpus[0].power_max_w"),
        (lambda b: b["gpus"][0].update(power_min_w=800.0), "gpus[0].power_min_w"),
        (lambda b: b["gpus"][1].update(uuid="GPU-node-01-0"), "gpus[1].uuid"),
        (lambda b: b["gpus"][1].update(index=0), "gpus[1].index"),
    ],
)
def test_a_malformed_registration_is_refused_naming_the_field_and_spends_no_use(
    agent, change, field
):
    body = inventory("node-01", gpus=2)
    change(body)

    response = agent.post("register", body, agent.join_token)

    assert response.status_code == 400
    assert field in response.json()
    assert JoinToken.objects.get().uses == 0


def test_a_body_that_is_not_a_json_object_is_refused(agent):
    assert agent.post("register", "[1, 2]", agent.join_token).status_code == 400
    assert agent.post("register", "{not json", agent.join_token).status_code == 400


@pytest.mark.django_db(transaction=True)
def test_agents_racing_for_a_join_token_get_in_no_more_often_than_it_allows(pool):
    _, raw = issue_join_token(pool, expires_at=timezone.now() + dt.timedelta(hours=1), max_uses=3)
    barrier = threading.Barrier(8)
    outcomes = []

    def race():
        barrier.wait()
        try:
            # As a registration does: checked first, spent as its last write.
            with transaction.atomic():
                spend_join_token(usable_join_token(raw))
            outcomes.append("in")
        except AgentAuthError:
            outcomes.append("refused")
        finally:
            connection.close()

    threads = [threading.Thread(target=race) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert sorted(outcomes) == ["in"] * 3 + ["refused"] * 5
    assert JoinToken.objects.get().uses == 3
