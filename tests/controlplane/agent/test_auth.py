"""The agent API and the user API are separate trust domains: neither credential opens the other."""

import pytest

from controlplane.cluster.agent_auth import revoke_node_token
from controlplane.tenancy.models import ApiToken

from .conftest import readings

# User endpoints that exist in every build of this project; the jobs API joins them when present.
USER_ENDPOINTS = ["/api/v1/", "/api/v1/accounting/usage/"]
AGENT_CALLS = [
    ("heartbeat", {"seq": 1, "sent_at": 1.0, "gpus": [], "attempts": []}),
    ("watch", {"timeout_s": 0}),
    ("logs", {"attempt_id": 1, "offset": 0, "data": "x"}),
]


def user_endpoints():
    from django.urls import Resolver404, resolve

    try:
        resolve("/api/v1/jobs/")
        return [*USER_ENDPOINTS, "/api/v1/jobs/"]
    except Resolver404:
        return USER_ENDPOINTS


@pytest.mark.parametrize("path", user_endpoints())
def test_a_node_token_cannot_call_user_endpoints(client, node01, path, alice):
    _, node_token = node01

    response = client.get(path, HTTP_AUTHORIZATION=f"Bearer {node_token}")

    assert response.status_code == 401
    # The same endpoint does answer a person, so the 401 is about the credential.
    _, user_token = ApiToken.issue(alice, "laptop")
    assert client.get(path, HTTP_AUTHORIZATION=f"Bearer {user_token}").status_code != 401


@pytest.mark.parametrize(("call", "body"), AGENT_CALLS, ids=[c for c, _ in AGENT_CALLS])
def test_a_user_token_is_refused_by_the_agent_api(agent, alice, call, body):
    _, user_token = ApiToken.issue(alice, "laptop")

    response = agent.post(call, body, user_token)

    assert response.status_code == 401
    assert response["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize(("call", "body"), AGENT_CALLS, ids=[c for c, _ in AGENT_CALLS])
def test_a_session_is_refused_by_the_agent_api(agent, client, cluster_admin, call, body):
    client.force_login(cluster_admin)

    assert agent.post(call, body, None).status_code == 401


def test_a_join_token_cannot_heartbeat(agent, node01):
    node, _ = node01
    response = agent.post("heartbeat", agent.heartbeat_body(readings(node)), agent.join_token)
    assert response.status_code == 401


def test_a_stolen_but_revoked_node_token_gets_401(agent, node01):
    node, token = node01
    agent.heartbeat(token, readings(node))

    revoke_node_token(node)

    response = agent.post("heartbeat", agent.heartbeat_body(readings(node)), token)
    assert response.status_code == 401
    assert agent.post("logs", {"attempt_id": 1, "offset": 0, "data": "x"}, token).status_code == 401


def test_the_agent_api_answers_only_post(client, node01):
    _, token = node01
    response = client.get("/api/agent/v1/heartbeat", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert response.status_code == 405
