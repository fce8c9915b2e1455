"""API and join tokens: shown once, stored hashed, and refused once revoked or expired."""

from datetime import timedelta

from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.cluster.models import JoinToken
from controlplane.tenancy.auth import LAST_USED_RESOLUTION_S
from controlplane.tenancy.models import ApiToken, hash_token


def bearer(raw: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def issue_via_api(world, **body):
    response = world.client("member").post(
        "/api/v1/api-tokens/", {"name": "laptop", **body}, format="json"
    )
    assert response.status_code == 201, response.content
    return response.json()


def test_a_new_token_is_shown_once_and_only_its_hash_is_stored(world):
    created = issue_via_api(world)
    raw = created["token"]
    assert raw.startswith("gcp_") and len(raw) > 40
    row = ApiToken.objects.get(pk=created["id"])
    assert row.token_hash == hash_token(raw)
    assert all(raw not in str(value) for value in ApiToken.objects.values().get(pk=row.pk).values())
    client = world.client("member")
    listed = client.get("/api/v1/api-tokens/").content.decode()
    detail = client.get(f"/api/v1/api-tokens/{row.pk}/").content.decode()
    assert raw not in listed and raw not in detail
    assert '"token"' not in listed and '"token"' not in detail


def test_a_token_authenticates_its_owner(world):
    world.ensure("vision_job")
    raw = issue_via_api(world)["token"]
    response = bearer(raw).get("/api/v1/jobs/")
    assert response.status_code == 200
    assert [j["submitted_by"] for j in response.json()["results"]] == ["alice"]
    assert ApiToken.objects.get(token_hash=hash_token(raw)).last_used_at is not None


def test_last_used_is_written_once_a_minute_not_on_every_request(world):
    world.ensure("vision_job")
    raw = issue_via_api(world)["token"]
    client = bearer(raw)
    assert client.get("/api/v1/jobs/").status_code == 200
    first = ApiToken.objects.get(token_hash=hash_token(raw)).last_used_at
    assert client.get("/api/v1/jobs/").status_code == 200
    assert ApiToken.objects.get(token_hash=hash_token(raw)).last_used_at == first
    # A minute later (made so by moving the stored time back), the next request writes it.
    ApiToken.objects.filter(token_hash=hash_token(raw)).update(
        last_used_at=first - timedelta(seconds=LAST_USED_RESOLUTION_S)
    )
    assert client.get("/api/v1/jobs/").status_code == 200
    assert ApiToken.objects.get(token_hash=hash_token(raw)).last_used_at > first


def test_a_revoked_token_is_refused_with_401(world):
    created = issue_via_api(world)
    client = bearer(created["token"])
    assert client.delete(f"/api/v1/api-tokens/{created['id']}/").status_code == 204
    response = client.get("/api/v1/jobs/")
    assert response.status_code == 401
    assert ApiToken.objects.get(pk=created["id"]).revoked_at is not None


def test_an_expired_token_is_refused_with_401(world):
    created = issue_via_api(world, expires_at=(timezone.now() + timedelta(hours=1)).isoformat())
    ApiToken.objects.filter(pk=created["id"]).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    assert bearer(created["token"]).get("/api/v1/jobs/").status_code == 401


def test_a_token_of_a_deactivated_user_is_refused(world):
    raw = issue_via_api(world)["token"]
    world.alice.is_active = False
    world.alice.save(update_fields=["is_active"])
    assert bearer(raw).get("/api/v1/jobs/").status_code == 401


def test_an_unknown_token_is_refused(world):
    assert bearer("gcp_not-a-real-token").get("/api/v1/jobs/").status_code == 401


def test_a_node_token_is_refused_on_user_endpoints(world):
    node = world.node
    raw = "gcpn_" + "n" * 43
    node.token_hash = hash_token(raw)
    node.save(update_fields=["token_hash"])
    for url in ("/api/v1/jobs/", "/api/v1/nodes/", f"/api/v1/nodes/{node.name}/"):
        assert bearer(raw).get(url).status_code == 401, url


def test_a_join_token_is_refused_on_user_endpoints(world):
    assert bearer("gcpj_" + "j" * 43).get("/api/v1/jobs/").status_code == 401


def test_anonymous_requests_get_401_with_a_bearer_challenge(world):
    response = APIClient().get("/api/v1/jobs/")
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Bearer"


def test_a_join_token_is_shown_once_stored_hashed_and_revocable(world):
    client = world.client("cluster_admin")
    response = client.post(
        "/api/v1/join-tokens/", {"pool": world.pool.name, "max_uses": 3}, format="json"
    )
    assert response.status_code == 201, response.content
    created = response.json()
    raw = created["token"]
    assert raw.startswith("gcpj_")
    row = JoinToken.objects.get(pk=created["id"])
    assert row.token_hash == hash_token(raw) and row.max_uses == 3 and row.is_usable
    assert timedelta(hours=23) < row.expires_at - timezone.now() <= timedelta(days=1)
    assert raw not in client.get("/api/v1/join-tokens/").content.decode()

    assert client.delete(f"/api/v1/join-tokens/{row.pk}/").status_code == 204
    row.refresh_from_db()
    assert row.revoked_at is not None and not row.is_usable
    listed = client.get("/api/v1/join-tokens/?usable=false").json()["results"]
    assert [t["id"] for t in listed] == [row.pk]


def test_every_link_of_the_api_root_answers_a_token_client_with_json(world):
    raw = issue_via_api(world)["token"]
    client = bearer(raw)
    root = client.get("/api/v1/")
    assert root.status_code == 200
    links = root.json()
    assert {"jobs", "nodes", "tenants", "volumes"} <= set(links)
    for name, url in links.items():
        assert url.startswith("http://testserver/api/v1/"), (name, url)
        response = client.get(url)
        # Admin-only collections answer 403 to a member; none sends them to the login page.
        assert response.status_code in (200, 403), (name, response.status_code)
        assert response["Content-Type"].startswith("application/json"), name
