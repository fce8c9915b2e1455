"""Reading the audit trail: the API (filtered, scoped, as CSV), the admin's page, the retention.

A cluster admin reads every row; a tenant admin the rows of their tenants only; a member or a
viewer none. Bad filters are a 400 naming the parameter."""

import csv
import datetime as dt
import io
import json

import pytest
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.audit import tasks, trail
from controlplane.audit.models import AuditEvent
from controlplane.cluster import actions as cluster_actions
from controlplane.tenancy import actions as tenancy_actions
from controlplane.tenancy.models import Quota

pytestmark = pytest.mark.django_db


def api_as(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


@pytest.fixture
def changes(cluster_admin, vision_admin, vision, nlp, pool):
    """Three changes: vision's quota (by its tenant admin), nlp's quota, a pool's budget."""
    vision_quota = Quota.objects.create(tenant=vision, gpu_type="", guaranteed_gpus=4, limit_gpus=8)
    nlp_quota = Quota.objects.create(tenant=nlp, gpu_type="", guaranteed_gpus=2, limit_gpus=4)
    tenancy_actions.update_quota(vision_quota, actor=cluster_admin, guaranteed_gpus=6)
    tenancy_actions.update_quota(nlp_quota, actor=cluster_admin, limit_gpus=6)
    cluster_actions.update_pool(pool, actor=cluster_admin, power_budget_w=9000.0)
    return AuditEvent.objects.order_by("id")


def rows(response) -> list[dict]:
    assert response.status_code == 200, response.content[:500]
    return response.json()["results"]


def test_a_cluster_admin_reads_every_change_newest_first_with_before_and_after(
    cluster_admin, changes
):
    got = rows(api_as(cluster_admin).get("/api/v1/audit/"))
    assert [r["id"] for r in got] == [e.pk for e in reversed(changes)]
    vision_change = next(r for r in got if r["tenant"] == "vision")
    assert vision_change["action"] == "quota.update"
    assert vision_change["actor"] == cluster_admin.username
    assert vision_change["before"] == {"guaranteed_gpus": 4}
    assert vision_change["after"] == {"guaranteed_gpus": 6}


def test_filters_narrow_the_rows(cluster_admin, changes):
    client = api_as(cluster_admin)
    assert {r["action"] for r in rows(client.get("/api/v1/audit/?action=quota"))} == {
        "quota.update"
    }
    assert [r["tenant"] for r in rows(client.get("/api/v1/audit/?tenant=nlp"))] == ["nlp"]
    assert [r["action"] for r in rows(client.get("/api/v1/audit/?action=pool."))] == [
        "pool.set_power_budget"
    ]
    later = (timezone.now() + dt.timedelta(minutes=1)).isoformat()
    assert rows(client.get("/api/v1/audit/", {"after": later})) == []
    assert len(rows(client.get("/api/v1/audit/", {"before": later}))) == 3


def test_a_tenant_admin_reads_their_tenants_rows_only_and_a_member_none(
    vision_admin, alice, changes
):
    assert {r["tenant"] for r in rows(api_as(vision_admin).get("/api/v1/audit/"))} == {"vision"}
    nlp_row = changes.get(tenant__slug="nlp")
    assert api_as(vision_admin).get(f"/api/v1/audit/{nlp_row.pk}/").status_code == 404
    assert rows(api_as(alice).get("/api/v1/audit/")) == []
    assert APIClient().get("/api/v1/audit/").status_code in (401, 403)


def test_the_trail_cannot_be_written_through_the_api(cluster_admin, changes):
    client = api_as(cluster_admin)
    row = changes.first()
    assert client.post("/api/v1/audit/", {"action": "x"}, format="json").status_code == 405
    assert client.delete(f"/api/v1/audit/{row.pk}/").status_code == 405
    assert client.patch(f"/api/v1/audit/{row.pk}/", {"action": "x"}).status_code == 405


@pytest.mark.parametrize(
    "query, field",
    [
        ({"action": "quota\x00"}, "action"),
        ({"after": "99999-01-01T00:00:00Z"}, "after"),
        ({"before": "0001-01-01T00:00:00+19:35"}, "before"),
    ],
)
def test_a_bad_filter_is_a_400_naming_it(cluster_admin, changes, query, field):
    response = api_as(cluster_admin).get("/api/v1/audit/", query)
    assert response.status_code == 400
    assert field in response.json()


def test_the_csv_holds_the_same_rows_with_before_and_after_as_json(vision_admin, changes):
    # As the SDK asks for it (gpucp.Client.audit_csv): Accept: text/csv.
    response = api_as(vision_admin).get("/api/v1/audit/csv/?action=quota", HTTP_ACCEPT="text/csv")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/csv")
    table = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert [(r["tenant"], r["action"]) for r in table] == [("vision", "quota.update")]
    assert json.loads(table[0]["after"]) == {"guaranteed_gpus": 6}


def test_the_retention_deletes_only_rows_past_it_and_zero_keeps_all(changes, settings):
    old = changes.first()
    AuditEvent.objects.filter(pk=old.pk).update(at=timezone.now() - dt.timedelta(days=400))
    settings.AUDIT_RETENTION_DAYS = 0
    assert tasks.prune_audit_trail() == 0 and AuditEvent.objects.count() == 3
    settings.AUDIT_RETENTION_DAYS = 365
    assert tasks.prune_audit_trail() == 1
    assert not AuditEvent.objects.filter(pk=old.pk).exists()
    assert AuditEvent.objects.count() == 2
    assert trail.prune(timezone.now(), 365) == 0


def test_the_admins_page_lists_filters_and_links_the_csv(cluster_admin, alice, changes):
    web = Client()
    web.force_login(cluster_admin)
    page = web.get("/manage/audit/?tenant=nlp").content.decode()
    assert "quota.update" in page and "nlp" in page and "pool.set_power_budget" not in page
    assert 'href="/api/v1/audit/csv/?tenant=nlp"' in page
    assert web.get("/manage/audit/", {"after": "99999-01-01"}).status_code == 400
    member = Client()
    member.force_login(alice)
    assert member.get("/manage/audit/").status_code == 403


@pytest.mark.parametrize("url", ["/api/v1/audit/csv/", "/api/v1/accounting/usage.csv"])
def test_the_csv_endpoints_answer_a_client_that_asks_for_csv(cluster_admin, changes, url):
    """gpucp.Client sends Accept: text/csv; a 406 there broke `usage_csv` and `audit_csv`.
    An error still comes back as JSON text the client can show."""
    client = api_as(cluster_admin)
    answer = client.get(url, HTTP_ACCEPT="text/csv")
    assert answer.status_code == 200 and answer["Content-Type"].startswith("text/csv")
    refused = client.get(f"{url}?tenant=a%00b", HTTP_ACCEPT="text/csv")
    assert refused.status_code == 400 and "tenant" in json.loads(refused.content)
