"""A join token cannot take over an existing node: only one issued for its name re-joins it.

Registering hands out the node's token, so whoever registers a name receives that node's work
and may report its attempts' exits. A plain join token makes new nodes only.
"""

import datetime as dt

from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.cluster.agent_auth import issue_join_token
from controlplane.cluster.models import JoinToken, Node

from .conftest import inventory, readings


def test_a_join_token_cannot_register_the_name_of_an_existing_node(agent, node01):
    node, token = node01
    uses = JoinToken.objects.get().uses

    response = agent.post("register", inventory("node-01"), agent.join_token)

    assert response.status_code == 409
    assert "node-01" in response.json()["detail"] and "node_name" in response.json()["detail"]
    # The node keeps its identity and its agent its token; the refused try spent no use.
    assert agent.post("heartbeat", agent.heartbeat_body(readings(node)), token).status_code == 200
    assert Node.objects.get(pk=node.pk).token_hash == node.token_hash
    assert JoinToken.objects.get().uses == uses


def test_a_new_name_still_registers_with_a_plain_join_token(agent, node01):
    response = agent.post("register", inventory("node-02", gpus=1), agent.join_token)

    assert response.status_code == 201, response.content
    assert sorted(Node.objects.values_list("name", flat=True)) == ["node-01", "node-02"]


def test_a_join_token_issued_for_the_name_re_joins_the_node(agent, node01, cluster_admin):
    node, old_token = node01
    # The admin's way, through the API.
    admin = APIClient()
    admin.force_authenticate(cluster_admin)
    created = admin.post(
        "/api/v1/join-tokens/", {"pool": node.pool.name, "node_name": "node-01"}, format="json"
    )
    assert created.status_code == 201, created.content

    response = agent.post("register", inventory("node-01"), created.json()["token"])

    assert response.status_code == 201, response.content
    new_token = response.json()["node_token"]
    assert (
        agent.post("heartbeat", agent.heartbeat_body(readings(node)), old_token).status_code == 401
    )
    agent.heartbeat(new_token, readings(node))
    assert Node.objects.filter(name="node-01").count() == 1


def test_a_join_token_issued_for_one_name_cannot_register_another(agent, node01, pool):
    node, token = node01
    _, for_node_02 = issue_join_token(
        pool, expires_at=timezone.now() + dt.timedelta(hours=1), node_name="node-02"
    )

    # 403 whether the other name is taken or free: this credential is not for it.
    taken = agent.post("register", inventory("node-01"), for_node_02)
    free = agent.post("register", inventory("node-03"), for_node_02)

    assert (taken.status_code, free.status_code) == (403, 403)
    assert "node-02" in taken.json()["detail"]
    assert not Node.objects.filter(name="node-03").exists()
    assert agent.post("heartbeat", agent.heartbeat_body(readings(node)), token).status_code == 200
    assert JoinToken.objects.get(node_name="node-02").uses == 0


def test_a_token_for_a_name_not_yet_taken_registers_that_new_node(agent, pool):
    _, raw = issue_join_token(
        pool, expires_at=timezone.now() + dt.timedelta(hours=1), node_name="node-07"
    )

    response = agent.post("register", inventory("node-07", gpus=1), raw)

    assert response.status_code == 201, response.content
    assert Node.objects.get(name="node-07").pool == pool
