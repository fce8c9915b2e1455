"""Bad input on every other write: 400 naming the field at fault, and no row written or changed."""

from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.cluster.models import JoinToken, Pool
from controlplane.tenancy.models import ApiToken, Budget, Membership, Quota, Tenant

PAST = (timezone.now() - timedelta(hours=1)).isoformat()
FAR = (timezone.now() + timedelta(days=365)).isoformat()


def quota(**overrides):
    body = {"tenant": "vision", "gpu_type": "A100-SXM4-80GB", "guaranteed_gpus": 2, "limit_gpus": 4}
    return {**body, **overrides}


def budget(**overrides):
    body = {"tenant": "vision", "kind": "energy_kwh", "period": "month", "amount": 500}
    return {**body, **overrides}


def rows(model):
    return sorted(model.objects.values(), key=lambda r: r["id"])


CREATES = [
    # (url, body, field at fault, model that must not change, who sends it)
    ("/api/v1/quotas/", quota(limit_gpus=1), "limit_gpus", Quota, "cluster_admin"),
    ("/api/v1/quotas/", quota(guaranteed_gpus=-1), "guaranteed_gpus", Quota, "cluster_admin"),
    ("/api/v1/quotas/", quota(limit_gpus=10**7), "limit_gpus", Quota, "cluster_admin"),
    ("/api/v1/quotas/", quota(gpu_type="H100-SXM-80GB"), "gpu_type", Quota, "cluster_admin"),
    ("/api/v1/quotas/", quota(max_running_jobs=-3), "max_running_jobs", Quota, "cluster_admin"),
    ("/api/v1/budgets/", budget(amount=-5), "amount", Budget, "cluster_admin"),
    ("/api/v1/budgets/", budget(amount=0), "amount", Budget, "cluster_admin"),
    ("/api/v1/budgets/", budget(amount=1e12), "amount", Budget, "cluster_admin"),
    ("/api/v1/budgets/", budget(kind="gpu_hours", amount=1e12), "amount", Budget, "cluster_admin"),
    ("/api/v1/budgets/", budget(amount="lots"), "amount", Budget, "cluster_admin"),
    ("/api/v1/budgets/", budget(period="year"), "period", Budget, "cluster_admin"),
    ("/api/v1/budgets/", budget(period="fortnight"), "period", Budget, "cluster_admin"),
    ("/api/v1/budgets/", budget(kind="dollars"), "kind", Budget, "cluster_admin"),
    ("/api/v1/budgets/", budget(action="explode"), "action", Budget, "cluster_admin"),
    ("/api/v1/budgets/", budget(warn_at_fraction=1.5), "warn_at_fraction", Budget, "cluster_admin"),
    ("/api/v1/budgets/", budget(warn_at_fraction=0), "warn_at_fraction", Budget, "cluster_admin"),
    (
        "/api/v1/pools/",
        {"name": "b", "power_budget_w": -1},
        "power_budget_w",
        Pool,
        "cluster_admin",
    ),
    ("/api/v1/pools/", {"name": "b", "power_budget_w": 0}, "power_budget_w", Pool, "cluster_admin"),
    (
        "/api/v1/pools/",
        {"name": "b", "power_budget_w": 1e12},
        "power_budget_w",
        Pool,
        "cluster_admin",
    ),
    ("/api/v1/pools/", {"name": "has space"}, "name", Pool, "cluster_admin"),
    ("/api/v1/pools/", {"name": "default"}, "name", Pool, "cluster_admin"),
    (
        "/api/v1/tenants/",
        {"slug": "x", "name": "X", "weight": 0},
        "weight",
        Tenant,
        "cluster_admin",
    ),
    (
        "/api/v1/tenants/",
        {"slug": "x", "name": "X", "weight": -1},
        "weight",
        Tenant,
        "cluster_admin",
    ),
    ("/api/v1/tenants/", {"slug": "Not A Slug", "name": "X"}, "slug", Tenant, "cluster_admin"),
    ("/api/v1/tenants/", {"slug": "vision", "name": "Again"}, "slug", Tenant, "cluster_admin"),
    (
        "/api/v1/memberships/",
        {"tenant": "vision", "user": "nobody"},
        "user",
        Membership,
        "cluster_admin",
    ),
    (
        "/api/v1/memberships/",
        {"tenant": "vision", "user": "alice"},
        "user",
        Membership,
        "cluster_admin",
    ),
    (
        "/api/v1/memberships/",
        {"tenant": "vision", "user": "bob", "role": "owner"},
        "role",
        Membership,
        "cluster_admin",
    ),
    (
        "/api/v1/join-tokens/",
        {"pool": "default", "max_uses": 0},
        "max_uses",
        JoinToken,
        "cluster_admin",
    ),
    ("/api/v1/join-tokens/", {"pool": "nowhere"}, "pool", JoinToken, "cluster_admin"),
    (
        "/api/v1/join-tokens/",
        {"pool": "default", "expires_at": PAST},
        "expires_at",
        JoinToken,
        "cluster_admin",
    ),
    (
        "/api/v1/join-tokens/",
        {"pool": "default", "expires_at": FAR},
        "expires_at",
        JoinToken,
        "cluster_admin",
    ),
    ("/api/v1/api-tokens/", {"name": "ci", "expires_at": PAST}, "expires_at", ApiToken, "member"),
    ("/api/v1/api-tokens/", {"name": "ci", "expires_at": FAR}, "expires_at", ApiToken, "member"),
    ("/api/v1/api-tokens/", {"name": "ci", "scopes": ["root"]}, "scopes", ApiToken, "member"),
    ("/api/v1/api-tokens/", {"name": "ci", "scopes": "write"}, "scopes", ApiToken, "member"),
    ("/api/v1/api-tokens/", {}, "name", ApiToken, "member"),
]


@pytest.mark.parametrize(
    ("url", "body", "field", "model", "role"),
    CREATES,
    ids=[f"{c[0].split('/')[3]}-{c[2]}-{i}" for i, c in enumerate(CREATES)],
)
def test_a_bad_create_is_refused_naming_the_field_and_writes_nothing(
    world, url, body, field, model, role
):
    world.ensure("users", "node")
    before = rows(model)
    response = world.client(role).post(url, body, format="json")
    assert response.status_code == 400, response.content
    assert field in response.json(), response.json()
    assert rows(model) == before


def test_a_quota_changed_to_a_limit_below_its_guarantee_is_refused(world):
    quota = world.vision_quota
    response = world.client("cluster_admin").patch(
        f"/api/v1/quotas/{quota.pk}/", {"limit_gpus": 4}, format="json"
    )
    assert response.status_code == 400
    assert "limit_gpus" in response.json()
    quota.refresh_from_db()
    assert (quota.guaranteed_gpus, quota.limit_gpus) == (8, 16)


def test_raising_a_guarantee_above_the_limit_is_refused_on_the_limit(world):
    quota = world.vision_quota
    response = world.client("cluster_admin").patch(
        f"/api/v1/quotas/{quota.pk}/", {"guaranteed_gpus": 20}, format="json"
    )
    assert response.status_code == 400
    assert "limit_gpus" in response.json()


def test_a_budget_changed_to_an_absurd_amount_is_refused(world):
    budget = world.vision_budget
    response = world.client("cluster_admin").patch(
        f"/api/v1/budgets/{budget.pk}/", {"amount": -1}, format="json"
    )
    assert response.status_code == 400
    assert "amount" in response.json()
    budget.refresh_from_db()
    assert budget.amount == 500.0


def test_a_quotas_tenant_and_type_are_fixed_once_it_exists(world):
    quota = world.vision_quota
    world.ensure("nlp")
    response = world.client("cluster_admin").patch(
        f"/api/v1/quotas/{quota.pk}/", {"tenant": "nlp", "gpu_type": "A100"}, format="json"
    )
    assert response.status_code == 200
    quota.refresh_from_db()
    assert (quota.tenant.slug, quota.gpu_type) == ("vision", "H100-SXM-80GB")


def test_a_tenant_admin_cannot_remove_the_last_tenant_admin(world):
    world.ensure("users")
    mine = Membership.objects.get(user=world.users["tenant_admin"], tenant=world.vision)
    client = world.client("tenant_admin")
    demote = client.patch(f"/api/v1/memberships/{mine.pk}/", {"role": "member"}, format="json")
    remove = client.delete(f"/api/v1/memberships/{mine.pk}/")
    assert demote.status_code == remove.status_code == 409
    mine.refresh_from_db()
    assert mine.role == "admin"


def test_a_tenant_with_jobs_cannot_be_deleted(world):
    world.ensure("vision_job")
    response = world.client("cluster_admin").delete("/api/v1/tenants/vision/")
    assert response.status_code == 409
    assert "jobs" in response.json()["detail"]
    assert Tenant.objects.filter(slug="vision").exists()


def test_a_pool_with_nodes_cannot_be_deleted(world):
    world.ensure("node")
    response = world.client("cluster_admin").delete(f"/api/v1/pools/{world.pool.name}/")
    assert response.status_code == 409
    assert Pool.objects.filter(pk=world.pool.pk).exists()
