"""What cluster admins change in the Django admin goes through the same actions as the API: a
membership added, changed or removed leaves its audit row, and revoking a token revokes what
was minted from it."""

import pytest
from django.test import Client
from django.urls import reverse

from controlplane.audit.models import AuditEvent
from controlplane.tenancy.models import ApiToken, Membership

pytestmark = pytest.mark.django_db


@pytest.fixture
def ops(cluster_admin):
    client = Client()
    client.force_login(cluster_admin)
    return client


def kinds(tenant):
    return list(
        AuditEvent.objects.filter(tenant=tenant).order_by("id").values_list("action", flat=True)
    )


def test_a_membership_added_changed_and_removed_in_the_admin_is_audited(ops, vision, make_user):
    dave = make_user("dave")
    added = ops.post(
        reverse("admin:tenancy_membership_add"),
        {
            "user": dave.pk,
            "tenant": vision.pk,
            "role": "viewer",
            "created_at_0": "2026-12-01",
            "created_at_1": "10:00:00",
        },
    )
    assert added.status_code == 302, added.content.decode()[:3000]
    membership = Membership.objects.get(user=dave)
    ops.post(
        reverse("admin:tenancy_membership_change", args=[membership.pk]),
        {
            "user": dave.pk,
            "tenant": vision.pk,
            "role": "member",
            "created_at_0": "2026-12-01",
            "created_at_1": "10:00:00",
        },
    )
    assert Membership.objects.get(user=dave).role == "member"
    ops.post(reverse("admin:tenancy_membership_delete", args=[membership.pk]), {"post": "yes"})
    assert not Membership.objects.filter(user=dave).exists()
    assert kinds(vision) == ["membership.create", "membership.update", "membership.delete"]
    assert {e.actor_label for e in AuditEvent.objects.filter(tenant=vision)} == {"root-admin"}


def test_revoking_in_the_admin_revokes_the_minted_tokens_too(ops, alice):
    parent, _ = ApiToken.issue(alice, "ci", scopes=["read", "write", "tokens"])
    child, _ = ApiToken.issue(alice, "job", parent=parent)
    grandchild, _ = ApiToken.issue(alice, "step", parent=child)
    response = ops.post(
        reverse("admin:tenancy_apitoken_changelist"),
        {"action": "revoke", "_selected_action": [parent.pk]},
    )
    assert response.status_code == 302
    assert not any(t.is_usable for t in ApiToken.objects.all())
    assert ApiToken.objects.filter(revoked_at__isnull=True).count() == 0
    assert {grandchild.pk, child.pk, parent.pk} == set(
        ApiToken.objects.values_list("pk", flat=True)
    )


def test_a_member_added_on_the_tenant_page_is_audited_too(ops, vision, make_user):
    dave = make_user("dave")
    quota = vision.quotas.get()
    data = {
        "slug": "vision",
        "name": vision.name,
        "weight": "1.0",
        "max_array_size": "1000",
        "active": "on",
        "created_at_0": "2026-12-01",
        "created_at_1": "10:00:00",
        "memberships-TOTAL_FORMS": "1",
        "memberships-INITIAL_FORMS": "0",
        "memberships-0-user": dave.pk,
        "memberships-0-role": "admin",
        "memberships-0-created_at_0": "2026-12-01",
        "memberships-0-created_at_1": "10:00:00",
        "memberships-0-tenant": vision.pk,
        "quotas-TOTAL_FORMS": "1",
        "quotas-INITIAL_FORMS": "1",
        "quotas-0-id": quota.pk,
        "quotas-0-tenant": vision.pk,
        "quotas-0-gpu_type": quota.gpu_type,
        "quotas-0-guaranteed_gpus": quota.guaranteed_gpus,
        "quotas-0-limit_gpus": quota.limit_gpus,
        "budgets-TOTAL_FORMS": "0",
        "budgets-INITIAL_FORMS": "0",
    }
    response = ops.post(reverse("admin:tenancy_tenant_change", args=[vision.pk]), data)
    assert response.status_code == 302, response.content.decode()[:3000]
    assert Membership.objects.get(user=dave).role == "admin"
    assert kinds(vision) == ["membership.create"]
