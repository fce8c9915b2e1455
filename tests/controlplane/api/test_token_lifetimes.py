"""API tokens never outlive what issued them: a maximum lifetime for all, children no longer than
their parent and with no more scopes, read-only tokens that cannot write anywhere, and revoking
a token revokes everything minted from it."""

import time
from datetime import timedelta

import pytest
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from drf_spectacular.generators import SchemaGenerator
from rest_framework.test import APIClient

from controlplane.cluster.models import JoinToken, Node, Pool
from controlplane.jobs.models import Job
from controlplane.tenancy.models import (
    ApiToken,
    Budget,
    Invitation,
    Membership,
    Quota,
    Tenant,
    TokenRequestRefused,
    hash_token,
)

MAX_DAYS = 90


@pytest.fixture(autouse=True)
def max_lifetime(settings):
    settings.API_TOKEN_MAX_LIFETIME_DAYS = MAX_DAYS


def bearer(raw: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def in_(**delta) -> str:
    return (timezone.now() + timedelta(**delta)).isoformat()


def mint(client, **body):
    return client.post("/api/v1/api-tokens/", {"name": "child", **body}, format="json")


def signed_in_token(world, role="member", **body) -> dict:
    """A token made in the web UI's way: with a session."""
    response = mint(world.client(role), **body)
    assert response.status_code == 201, response.content
    return response.json()


def expiry(created: dict):
    return parse_datetime(created["expires_at"])


# --- the maximum lifetime ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "expires_at",
    ["9999-12-31T00:00:00Z", "2100-01-01T00:00:00Z", "max+1h"],
    ids=["year-9999", "year-2100", "an-hour-past-the-maximum"],
)
def test_no_token_may_be_asked_to_live_past_the_maximum_lifetime(world, expires_at):
    if expires_at == "max+1h":
        expires_at = in_(days=MAX_DAYS, hours=1)
    response = mint(world.client("member"), expires_at=expires_at)
    assert response.status_code == 400
    assert f"At most {MAX_DAYS} days ahead" in response.json()["expires_at"][0]
    assert not ApiToken.objects.exists()


def test_a_token_asked_without_expiry_gets_the_maximum_lifetime(world):
    before = timezone.now()
    created = signed_in_token(world)
    assert before + timedelta(days=MAX_DAYS) <= expiry(created)
    assert expiry(created) <= timezone.now() + timedelta(days=MAX_DAYS)
    assert created["scopes"] == ["read", "write"]


def test_a_token_within_the_maximum_is_issued_as_asked(world):
    asked = timezone.now() + timedelta(days=MAX_DAYS - 1)
    created = signed_in_token(world, expires_at=asked.isoformat())
    assert expiry(created) == asked


def test_the_web_ui_refuses_a_token_past_the_maximum_at_the_expiry_field(client, alice):
    client.force_login(alice)
    response = client.post("/tokens/", {"name": "laptop", "expires_at": "9999-12-31T00:00"})
    assert response.status_code == 400
    assert f"At most {MAX_DAYS} days ahead" in response.content.decode()
    assert not ApiToken.objects.exists()
    client.post("/tokens/", {"name": "laptop"})
    token = ApiToken.objects.get()
    assert token.expires_at <= timezone.now() + timedelta(days=MAX_DAYS)


def test_tokens_issued_from_the_shell_are_capped_too(alice):
    with pytest.raises(TokenRequestRefused, match="expires_at"):
        ApiToken.issue(alice, "ops", timezone.now() + timedelta(days=MAX_DAYS + 1))
    token, _ = ApiToken.issue(alice, "ops")
    assert token.expires_at <= timezone.now() + timedelta(days=MAX_DAYS)


def test_lowering_the_maximum_also_ends_tokens_issued_before_it(world, settings):
    created = signed_in_token(world)
    legacy, legacy_raw = ApiToken.issue(world.alice, "from before lifetimes")
    ApiToken.objects.filter(pk=legacy.pk).update(expires_at=None)
    assert bearer(created["token"]).get("/api/v1/jobs/").status_code == 200
    ApiToken.objects.filter(pk__in=[created["id"], legacy.pk]).update(
        created_at=timezone.now() - timedelta(days=10)
    )
    settings.API_TOKEN_MAX_LIFETIME_DAYS = 7
    for raw in (created["token"], legacy_raw):
        assert bearer(raw).get("/api/v1/jobs/").status_code == 401
    listed = world.client("member").get("/api/v1/api-tokens/?usable=true").json()["results"]
    assert listed == []


# --- children: no longer than their parent, no more scopes -------------------------------------


def parent_token(world, *, seconds=30, scopes=("read", "write", "tokens")) -> dict:
    return signed_in_token(world, expires_at=in_(seconds=seconds), scopes=list(scopes))


def test_a_child_asked_without_expiry_expires_with_its_parent(world):
    parent = parent_token(world)
    response = mint(bearer(parent["token"]))
    assert response.status_code == 201, response.content
    child = response.json()
    assert expiry(child) == expiry(parent)
    assert child["minted_with"] == parent["id"]


@pytest.mark.parametrize(
    "asked",
    ["9999-12-31T00:00:00Z", "parent+1s", "parent+1d", "max"],
)
def test_a_child_may_not_be_asked_to_outlive_its_parent(world, asked):
    parent = parent_token(world)
    asked = {
        "parent+1s": (expiry(parent) + timedelta(seconds=1)).isoformat(),
        "parent+1d": (expiry(parent) + timedelta(days=1)).isoformat(),
        "max": in_(days=MAX_DAYS - 1),
    }.get(asked, asked)
    response = mint(bearer(parent["token"]), expires_at=asked)
    assert response.status_code == 400
    assert "cannot mint one that outlives it" in response.json()["expires_at"][0]
    assert ApiToken.objects.count() == 1


def test_a_child_stops_working_when_its_parent_expires(world):
    parent = parent_token(world, seconds=2)
    child = mint(bearer(parent["token"]), scopes=["read", "write", "tokens"]).json()
    grandchild = mint(bearer(child["token"]), scopes=["read"]).json()
    for created in (parent, child, grandchild):
        assert bearer(created["token"]).get("/api/v1/jobs/").status_code == 200
    time.sleep(max(0.0, (expiry(parent) - timezone.now()).total_seconds()) + 0.1)
    for created in (parent, child, grandchild):
        assert bearer(created["token"]).get("/api/v1/jobs/").status_code == 401


@pytest.mark.parametrize(
    "parent_scopes, asked, refused",
    [
        (["read", "write", "tokens"], ["read", "write", "tokens"], False),
        (["read", "write", "tokens"], ["read"], False),
        (["read", "write", "tokens"], ["tokens"], True),  # tokens without write
        (["read", "write", "tokens"], ["read", "bogus"], True),
    ],
)
def test_a_child_holds_only_scopes_its_parent_holds(world, parent_scopes, asked, refused):
    parent = parent_token(world, scopes=parent_scopes)
    response = mint(bearer(parent["token"]), scopes=asked)
    assert response.status_code == (400 if refused else 201), response.content
    if refused:
        assert "scopes" in response.json()
    else:
        assert set(response.json()["scopes"]) <= set(parent_scopes)


def test_a_child_of_a_child_cannot_regain_a_scope_its_parent_dropped(world):
    parent = parent_token(world)
    child = mint(bearer(parent["token"]), scopes=["read", "write", "tokens"]).json()
    narrow = mint(bearer(child["token"]), scopes=["read", "write"]).json()
    assert narrow["scopes"] == ["read", "write"]
    # `narrow` has no tokens scope: it may mint nothing at all.
    refused = mint(bearer(narrow["token"]))
    assert refused.status_code == 403
    assert "tokens scope" in refused.json()["detail"]


def test_minting_with_a_token_needs_the_tokens_scope(world):
    plain = signed_in_token(world)  # read and write: the default
    assert plain["scopes"] == ["read", "write"]
    response = mint(bearer(plain["token"]))
    assert response.status_code == 403
    assert ApiToken.objects.count() == 1


def test_a_child_asked_without_scopes_gets_read_and_write_as_far_as_its_parent_holds_them(world):
    parent = parent_token(world)
    assert mint(bearer(parent["token"])).json()["scopes"] == ["read", "write"]


# --- revocation revokes the tree ----------------------------------------------------------------


def test_revoking_a_token_revokes_every_token_minted_from_it(world):
    root = parent_token(world, seconds=3600)
    child = mint(bearer(root["token"]), scopes=["read", "write", "tokens"]).json()
    grandchild = mint(bearer(child["token"])).json()
    sibling = signed_in_token(world)  # not minted from root: unaffected

    response = world.client("member").delete(f"/api/v1/api-tokens/{root['id']}/")
    assert response.status_code == 204
    for created in (root, child, grandchild):
        assert bearer(created["token"]).get("/api/v1/jobs/").status_code == 401
    assert bearer(sibling["token"]).get("/api/v1/jobs/").status_code == 200
    listed = world.client("member").get("/api/v1/api-tokens/?usable=false").json()["results"]
    assert {t["id"] for t in listed} == {root["id"], child["id"], grandchild["id"]}


def test_revoking_in_the_web_ui_revokes_the_tree_too(client, world):
    root = parent_token(world, seconds=3600)
    child = mint(bearer(root["token"])).json()
    client.force_login(world.alice)
    client.post(f"/tokens/{root['id']}/revoke/")
    assert bearer(child["token"]).get("/api/v1/jobs/").status_code == 401


def test_a_token_may_revoke_itself_without_the_tokens_scope(world):
    plain = signed_in_token(world)
    other = signed_in_token(world)
    assert bearer(plain["token"]).delete(f"/api/v1/api-tokens/{other['id']}/").status_code == 403
    assert bearer(plain["token"]).delete(f"/api/v1/api-tokens/{plain['id']}/").status_code == 204
    assert bearer(plain["token"]).get("/api/v1/jobs/").status_code == 401
    assert bearer(other["token"]).get("/api/v1/jobs/").status_code == 200


def test_a_revoked_parent_mints_nothing(world):
    parent = parent_token(world, seconds=3600)
    world.client("member").delete(f"/api/v1/api-tokens/{parent['id']}/")
    assert mint(bearer(parent["token"])).status_code == 401
    assert ApiToken.objects.count() == 1


def test_tokens_stay_stored_hashed(world):
    parent = parent_token(world)
    child = mint(bearer(parent["token"])).json()
    for created in (parent, child):
        row = ApiToken.objects.values().get(pk=created["id"])
        assert row["token_hash"] == hash_token(created["token"])
        assert all(created["token"] not in str(v) for v in row.values())


# --- read-only tokens write nowhere --------------------------------------------------------------


def _write_operations() -> list[tuple[str, str]]:
    schema = SchemaGenerator().get_schema(request=None, public=True)
    return [
        (path, method)
        for path, item in schema["paths"].items()
        for method in item
        if method in ("post", "put", "patch", "delete")
    ]


WRITE_OPERATIONS = _write_operations()


def _real_url(world, path: str) -> str:
    """The path with its placeholder filled by an existing object, so only the scope refuses."""
    objects = {
        "tenants": lambda: world.vision.slug,
        "memberships": lambda: world.carol_membership.pk,
        "quotas": lambda: world.vision_quota.pk,
        "budgets": lambda: world.vision_budget.pk,
        "pools": lambda: world.pool.name,
        "nodes": lambda: world.node.name,
        "jobs": lambda: world.vision_job.pk,
        "join-tokens": lambda: world.join_token.pk,
        "api-tokens": lambda: world.alice_token.pk,
        "invitations": lambda: world.vision_invitation.pk,
    }
    collection = path.split("/")[3]
    if "{" not in path:
        return path
    head, _, rest = path.partition("{")
    field, _, tail = rest.partition("}")
    if collection in objects:
        return head + str(objects[collection]()) + tail
    # An endpoint added since: any of its objects, as a cluster admin lists them (or a made-up
    # id when there is none; the scope refuses before any lookup).
    listed = world.client("cluster_admin").get(f"/api/v1/{collection}/").json()
    rows = listed.get("results", []) if isinstance(listed, dict) else listed
    return head + str(rows[0][field] if rows else 1) + tail


def _everything(world) -> list:
    return [
        list(model.objects.order_by("pk").values())
        for model in (Tenant, Membership, Quota, Budget, Pool, Node, Job, JoinToken, Invitation)
    ] + [list(ApiToken.objects.order_by("pk").values("pk", "revoked_at"))]


def test_the_write_operations_are_all_listed():
    assert len(WRITE_OPERATIONS) > 25
    assert ("/api/v1/jobs/{id}/cancel/", "post") in WRITE_OPERATIONS


@pytest.mark.parametrize("path, method", WRITE_OPERATIONS, ids=lambda v: v)
def test_a_read_only_token_gets_403_on_every_write(world, path, method):
    admin = world.users["cluster_admin"]  # may do everything: only the scope can refuse
    _, raw = ApiToken.issue(admin, "dashboards", scopes=["read"])
    url = _real_url(world, path)
    before = _everything(world)
    response = getattr(bearer(raw), method)(url, {}, format="json")
    assert response.status_code == 403, response.content
    assert "may only read" in response.json()["detail"]
    assert _everything(world) == before


def test_a_read_only_token_reads(world):
    world.ensure("vision_job")
    _, raw = ApiToken.issue(world.alice, "dashboards", scopes=["read"])
    client = bearer(raw)
    for url in ("/api/v1/jobs/", f"/api/v1/jobs/{world.vision_job.pk}/", "/api/v1/tenants/"):
        assert client.get(url).status_code == 200, url
    assert client.options("/api/v1/jobs/").status_code == 200
