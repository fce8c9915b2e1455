"""Every configuration change leaves one audit row (who, what, before and after) and, where the
scheduler reads what changed, asks for a cycle once it commits: whichever way an admin makes it
(REST API, web page, Django admin). Tenant admins see their own tenant's rows only."""

import pytest
from django.test import Client
from django.urls import reverse
from rest_framework.test import APIClient

from controlplane import wakeups
from controlplane.audit.models import AuditEvent
from controlplane.cluster.models import Pool
from controlplane.tenancy.models import Budget, Quota

pytestmark = pytest.mark.django_db


@pytest.fixture
def cycles(monkeypatch):
    """The reasons of the cycles asked for, in order."""
    asked: list[str] = []
    monkeypatch.setattr(wakeups, "request_cycle", asked.append)
    return asked


@pytest.fixture
def committing(django_capture_on_commit_callbacks, cycles):
    """Run `do()`, check it asked for no cycle before its commit, then commit; the reasons."""

    def run(do):
        earlier = len(cycles)
        with django_capture_on_commit_callbacks(execute=False) as callbacks:
            result = do()
        assert len(cycles) == earlier, "a cycle was asked for before the change committed"
        for callback in callbacks:
            callback()
        return result, cycles[earlier:]

    return run


@pytest.fixture
def api(cluster_admin):
    client = APIClient()
    client.force_authenticate(cluster_admin)
    return client


@pytest.fixture
def web(cluster_admin):
    client = Client()
    client.force_login(cluster_admin)
    return client


@pytest.fixture
def budgeted_pool(pool):
    Pool.objects.filter(pk=pool.pk).update(power_budget_w=12000.0)
    pool.refresh_from_db()
    return pool


def only_row(**filters) -> AuditEvent:
    [row] = AuditEvent.objects.filter(**filters)
    return row


# --- a pool's power budget, halved three ways -----------------------------------------------------


def halve_through_api(api, web, pool):
    return api.patch(f"/api/v1/pools/{pool.name}/", {"power_budget_w": 6000}, format="json")


def halve_through_page(api, web, pool):
    return web.post(
        reverse("manage-pools"), {"pool": pool.pk, f"pool{pool.pk}-power_budget_w": "6000"}
    )


def halve_through_django_admin(api, web, pool):
    return web.post(
        reverse("admin:cluster_pool_change", args=[pool.pk]),
        {"name": pool.name, "power_budget_w": "6000"},
    )


@pytest.mark.parametrize(
    "halve", [halve_through_api, halve_through_page, halve_through_django_admin]
)
def test_halving_a_pools_power_budget_is_audited_and_wakes_the_scheduler(
    halve, api, web, budgeted_pool, cluster_admin, committing
):
    response, reasons = committing(lambda: halve(api, web, budgeted_pool))

    assert response.status_code in (200, 302), response.content.decode()[:2000]
    assert Pool.objects.get().power_budget_w == 6000.0
    row = only_row(action="pool.set_power_budget")
    assert (row.actor, row.actor_label) == (cluster_admin, "root-admin")
    assert (row.before, row.after) == ({"power_budget_w": 12000.0}, {"power_budget_w": 6000.0})
    assert (row.object_type, row.object_repr, row.tenant) == ("pool", "default", None)
    assert reasons == ["pool_power_budget"]


def test_a_refused_budget_writes_nothing_and_wakes_nobody(web, budgeted_pool, committing):
    response, reasons = committing(
        lambda: web.post(
            reverse("admin:cluster_pool_change", args=[budgeted_pool.pk]),
            {"name": "default", "power_budget_w": "-5"},
        )
    )
    assert "Must be more than 0 W" in response.content.decode()
    assert Pool.objects.get().power_budget_w == 12000.0
    assert not AuditEvent.objects.exists() and reasons == []


def test_saving_an_unchanged_budget_leaves_no_row(api, budgeted_pool, committing):
    _, reasons = committing(
        lambda: api.patch("/api/v1/pools/default/", {"power_budget_w": 12000}, format="json")
    )
    assert not AuditEvent.objects.exists() and reasons == []


def test_pools_created_and_deleted_are_audited(api, cluster_admin, committing):
    response, reasons = committing(
        lambda: api.post("/api/v1/pools/", {"name": "hall-b", "power_budget_w": 5e5}, format="json")
    )
    assert response.status_code == 201, response.content
    assert only_row(action="pool.create").after == {"name": "hall-b", "power_budget_w": 5e5}
    response, _ = committing(lambda: api.delete("/api/v1/pools/hall-b/"))
    assert response.status_code == 204
    row = only_row(action="pool.delete")
    assert (row.object_repr, row.before["power_budget_w"], row.after) == ("hall-b", 5e5, None)


# --- nodes ------------------------------------------------------------------------------------------


def test_draining_a_node_is_audited_and_wakes_the_scheduler(
    api, make_node, cluster_admin, committing
):
    make_node("gpu-1")
    response, reasons = committing(lambda: api.post("/api/v1/nodes/gpu-1/drain/"))

    assert response.status_code == 200 and response.json()["state"] == "draining"
    row = only_row(action="node.set_state")
    assert (row.actor, row.object_repr) == (cluster_admin, "gpu-1")
    assert (row.before, row.after) == ({"state": "ready"}, {"state": "draining"})
    assert reasons == ["node_draining"]


def test_cordoning_from_the_page_and_the_django_admin_is_audited(web, make_node, committing):
    node = make_node("gpu-1")
    committing(lambda: web.post(reverse("node-action", args=["gpu-1", "cordon"])))
    committing(
        lambda: web.post(
            reverse("admin:cluster_node_changelist"),
            {"action": "set_ready", "_selected_action": [node.pk]},
        )
    )
    steps = [
        (r.before["state"], r.after["state"])
        for r in AuditEvent.objects.filter(action="node.set_state").order_by("id")
    ]
    assert steps == [("ready", "cordoned"), ("cordoned", "ready")]


def test_deregistering_a_node_is_audited(api, make_node, committing):
    make_node("gpu-1")
    response, reasons = committing(lambda: api.post("/api/v1/nodes/gpu-1/deregister/"))
    assert response.status_code == 200
    assert only_row(action="node.deregister").before == {"deregistered_at": None}
    assert reasons == ["node_deregistered"]


# --- tenants, quotas, budgets, members ---------------------------------------------------------------


def test_a_quota_changed_through_the_api_is_audited_and_wakes_the_scheduler(
    api, vision, cluster_admin, committing
):
    quota = Quota.objects.get(tenant=vision)
    response, reasons = committing(
        lambda: api.patch(f"/api/v1/quotas/{quota.pk}/", {"limit_gpus": 12}, format="json")
    )
    assert response.status_code == 200, response.content
    row = only_row(action="quota.update")
    assert (row.tenant, row.actor) == (vision, cluster_admin)
    assert (row.before, row.after) == ({"limit_gpus": 16}, {"limit_gpus": 12})
    assert reasons == ["quota_changed"]


def test_a_quota_changed_in_the_django_admin_is_audited(web, vision, committing):
    quota = Quota.objects.get(tenant=vision)
    response, reasons = committing(
        lambda: web.post(
            reverse("admin:tenancy_quota_change", args=[quota.pk]),
            {"guaranteed_gpus": "4", "limit_gpus": "16", "max_running_jobs": ""},
        )
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    assert only_row(action="quota.update").after == {"guaranteed_gpus": 4}
    assert reasons == ["quota_changed"]


def test_the_django_admin_refuses_a_quota_the_api_refuses_in_the_same_words(web, api, vision):
    quota = Quota.objects.get(tenant=vision)
    page = web.post(
        reverse("admin:tenancy_quota_change", args=[quota.pk]),
        {"guaranteed_gpus": "20", "limit_gpus": "16", "max_running_jobs": ""},
    )
    answer = api.patch(f"/api/v1/quotas/{quota.pk}/", {"guaranteed_gpus": 20}, format="json")
    [words] = answer.json()["limit_gpus"]
    assert words.startswith("Must be at least guaranteed_gpus (20)")
    assert words in page.content.decode()
    assert not AuditEvent.objects.exists()


def test_a_budget_made_on_the_page_and_deleted_is_audited(web, vision, cluster_admin, committing):
    response, reasons = committing(
        lambda: web.post(
            reverse("manage-budget-create", args=["vision"]),
            {
                "kind": "gpu_hours",
                "period": "week",
                "amount": "100",
                "action": "hold",
                "warn_at_fraction": "0.8",
            },
        )
    )
    assert response.status_code == 302
    created = only_row(action="budget.create")
    assert created.after["amount"] == 100.0 and created.tenant == vision
    assert reasons == ["budget_changed"]
    budget = Budget.objects.get()
    committing(lambda: web.post(reverse("manage-budget-delete", args=[budget.pk])))
    assert only_row(action="budget.delete").before["action"] == "hold"


def test_a_tenants_weight_is_audited_and_its_name_needs_no_cycle(api, vision, committing):
    _, reasons = committing(
        lambda: api.patch("/api/v1/tenants/vision/", {"weight": 3}, format="json")
    )
    assert only_row(action="tenant.update").after == {"weight": 3.0}
    assert reasons == ["tenant_changed"]
    _, reasons = committing(
        lambda: api.patch("/api/v1/tenants/vision/", {"name": "Vision"}, format="json")
    )
    assert AuditEvent.objects.filter(action="tenant.update").count() == 2
    assert reasons == []


def test_a_membership_is_audited_but_asks_for_no_cycle(api, vision, make_user, committing):
    make_user("dave")
    response, reasons = committing(
        lambda: api.post(
            "/api/v1/memberships/", {"tenant": "vision", "user": "dave"}, format="json"
        )
    )
    assert response.status_code == 201
    assert only_row(action="membership.create").after == {"user": "dave", "role": "member"}
    assert reasons == []


# --- reading the trail ------------------------------------------------------------------------------


def test_the_django_admin_lists_and_filters_the_trail(web, api, budgeted_pool, vision, committing):
    quota = Quota.objects.get(tenant=vision)
    committing(lambda: halve_through_api(api, web, budgeted_pool))
    committing(lambda: api.patch(f"/api/v1/quotas/{quota.pk}/", {"limit_gpus": 9}, format="json"))

    listed = web.get(reverse("admin:audit_auditevent_changelist")).content.decode()
    assert "pool.set_power_budget" in listed and "quota.update" in listed
    filtered = web.get(
        reverse("admin:audit_auditevent_changelist"), {"action": "quota.update"}
    ).content.decode()
    assert "quota.update" in filtered and "Power budget of pool default" not in filtered
    by_tenant = web.get(
        reverse("admin:audit_auditevent_changelist"), {"tenant__id__exact": vision.pk}
    ).content.decode()
    assert "Quota for H100-SXM-80GB changed: limit_gpus 16 → 9." in by_tenant
    assert "Power budget of pool default" not in by_tenant
    # A trail nobody can edit or prune.
    row = AuditEvent.objects.first()
    assert web.post(reverse("admin:audit_auditevent_delete", args=[row.pk])).status_code == 403


def test_a_tenant_admin_sees_their_own_tenants_trail_only(
    client, api, vision, nlp, vision_admin, committing
):
    for tenant, limit in ((vision, 12), (nlp, 30)):
        quota = Quota.objects.get(tenant=tenant)
        committing(
            lambda q=quota, n=limit: api.patch(
                f"/api/v1/quotas/{q.pk}/", {"limit_gpus": n}, format="json"
            )
        )
    ours = AuditEvent.objects.get(tenant=vision).message
    theirs = AuditEvent.objects.get(tenant=nlp).message
    assert ours != theirs

    client.force_login(vision_admin)
    dashboard = client.get(reverse("tenant-dashboard", args=["vision"])).content.decode()
    assert ours in dashboard and theirs not in dashboard
    assert client.get(reverse("tenant-dashboard", args=["nlp"])).status_code == 404
    # The Django admin, where the whole trail is, is for cluster admins only.
    admin_page = client.get(reverse("admin:audit_auditevent_changelist"))
    assert admin_page.status_code == 302 and "/login/" in admin_page["Location"]


def test_join_tokens_issued_and_revoked_are_audited_without_their_secret(api, pool, cluster_admin):
    made = api.post("/api/v1/join-tokens/", {"pool": "default", "max_uses": 3}, format="json")
    assert made.status_code == 201, made.content
    secret = made.json()["token"]
    created = only_row(action="join_token.create")
    assert (created.actor, created.after["max_uses"], created.after["pool"]) == (
        cluster_admin,
        3,
        "default",
    )
    assert secret not in str(created.after) and secret not in created.message
    assert api.delete(f"/api/v1/join-tokens/{made.json()['id']}/").status_code == 204
    assert only_row(action="join_token.revoke").before == {"revoked_at": None}
