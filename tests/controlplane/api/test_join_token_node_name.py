"""A join token may be issued for one node name: the way an admin re-joins an existing node."""

import pytest

from controlplane.cluster.models import JoinToken


def test_a_join_token_for_a_node_name_is_created_and_listed_with_it(world):
    world.ensure("pool")
    client = world.client("cluster_admin")

    response = client.post(
        "/api/v1/join-tokens/", {"pool": "default", "node_name": "gpu-a.example"}, format="json"
    )

    assert response.status_code == 201, response.content
    created = response.json()
    assert created["node_name"] == "gpu-a.example"
    assert JoinToken.objects.get(pk=created["id"]).node_name == "gpu-a.example"
    listed = client.get("/api/v1/join-tokens/").json()["results"]
    assert [t["node_name"] for t in listed if t["id"] == created["id"]] == ["gpu-a.example"]


def test_a_join_token_without_a_node_name_is_for_new_nodes(world):
    world.ensure("pool")
    response = world.client("cluster_admin").post(
        "/api/v1/join-tokens/", {"pool": "default"}, format="json"
    )

    assert response.status_code == 201, response.content
    assert response.json()["node_name"] == ""


@pytest.mark.parametrize(
    "node_name", ["has space", "-leading-dash", "trailing.", "x" * 254, None, ["gpu-a"]]
)
def test_a_bad_node_name_is_refused_naming_the_field(world, node_name):
    world.ensure("pool")
    before = JoinToken.objects.count()

    response = world.client("cluster_admin").post(
        "/api/v1/join-tokens/", {"pool": "default", "node_name": node_name}, format="json"
    )

    assert response.status_code == 400, response.content
    assert "node_name" in response.json()
    assert JoinToken.objects.count() == before
