"""Tenant admins add people by invitation, and nothing they do tells them who has an account.

Tenants alpha and beta; alpha-viewer belongs to alpha. beta's admin must neither enrol
alpha-viewer (or anyone) directly nor learn, from any answer, whether a username exists.
"""

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.audit.models import AuditEvent
from controlplane.tenancy.models import Invitation, Membership, Tenant

pytestmark = pytest.mark.django_db


@pytest.fixture
def people(make_user):
    alpha = Tenant.objects.create(slug="alpha", name="Alpha")
    beta = Tenant.objects.create(slug="beta", name="Beta")
    users = {
        "alpha-viewer": make_user("alpha-viewer"),
        "alpha-admin": make_user("alpha-admin"),
        "beta-admin": make_user("beta-admin"),
        "beta-member": make_user("beta-member"),
        "loner": make_user("loner"),  # an account in no tenant
        "ops": make_user("ops", staff=True),
    }
    users["loner"].email = "Loner@Example.org"
    users["loner"].save(update_fields=["email"])
    inactive = make_user("gone")
    inactive.is_active = False
    inactive.save(update_fields=["is_active"])
    for username, tenant, role in (
        ("alpha-viewer", alpha, "viewer"),
        ("alpha-admin", alpha, "admin"),
        ("beta-admin", beta, "admin"),
        ("beta-member", beta, "member"),
    ):
        Membership.objects.create(user=users[username], tenant=tenant, role=role)
    return users


def as_(people, username) -> APIClient:
    client = APIClient()
    client.force_authenticate(people[username])
    return client


# Who a tenant admin might name: someone of another tenant, of no tenant, of their own tenant,
# an inactive account, a cluster admin, and names and addresses nobody has.
NAMES = [
    "alpha-viewer",
    "loner",
    "beta-member",
    "gone",
    "ops",
    "no-such-person",
    "loner@example.org",
    "nobody@example.org",
]

PER_REQUEST = ("id", "created_at", "expires_at")


def without(body: dict, keys) -> dict:
    return {k: v for k, v in body.items() if k not in keys}


# --- direct enrolment ---------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["viewer", "member", "admin"])
def test_a_tenant_admin_cannot_enrol_anyone_directly_and_every_name_gets_the_same_answer(
    people, role
):
    answers = []
    for name in NAMES:
        response = as_(people, "beta-admin").post(
            "/api/v1/memberships/", {"tenant": "beta", "user": name, "role": role}, format="json"
        )
        answers.append((response.status_code, response.json()))
    assert {a for a, _ in answers} == {403}
    assert all(body == answers[0][1] for _, body in answers)
    assert "invite" in answers[0][1]["detail"]
    assert (
        not Membership.objects.filter(tenant__slug="beta")
        .exclude(user__username__in=["beta-admin", "beta-member"])
        .exists()
    )


def test_a_tenant_admin_cannot_enrol_into_another_tenant_either(people):
    response = as_(people, "beta-admin").post(
        "/api/v1/memberships/", {"tenant": "alpha", "user": "loner"}, format="json"
    )
    assert response.status_code == 404


def test_a_cluster_admin_still_adds_people_directly_and_it_is_recorded(people):
    response = as_(people, "ops").post(
        "/api/v1/memberships/", {"tenant": "beta", "user": "loner", "role": "viewer"}, format="json"
    )
    assert response.status_code == 201, response.content
    assert Membership.objects.get(user=people["loner"]).tenant.slug == "beta"
    event = AuditEvent.objects.get(tenant__slug="beta", action="membership.create")
    assert event.actor.username == "ops" and event.after["user"] == "loner"


# --- invitations: same answer and same work for every name --------------------------------------


def invite(people, name, *, by="beta-admin", tenant="beta", role="member"):
    return as_(people, by).post(
        "/api/v1/invitations/", {"tenant": tenant, "invitee": name, "role": role}, format="json"
    )


def test_inviting_answers_the_same_for_every_name_and_does_the_same_work(people):
    answers, query_counts = [], []
    for name in NAMES:
        with CaptureQueriesContext(connection) as queries:
            response = invite(people, name)
        query_counts.append(len(queries))
        body = without(response.json(), PER_REQUEST)
        answers.append((response.status_code, {**body, "invitee": "<name>"}))
        assert body["invitee"] == name
        # The name is written down, never looked up among the accounts.
        naming = [q["sql"] for q in queries if f"'{name}'" in q["sql"] or f'"{name}"' in q["sql"]]
        assert naming and all(
            "tenancy_invitation" in sql or "audit_auditevent" in sql for sql in naming
        ), naming
    assert {status for status, _ in answers} == {201}
    assert all(body == answers[0][1] for _, body in answers)
    assert len(set(query_counts)) == 1, dict(zip(NAMES, query_counts, strict=True))
    assert Invitation.objects.filter(tenant__slug="beta").count() == len(NAMES)
    assert Membership.objects.filter(tenant__slug="beta").count() == 2


@pytest.mark.parametrize(
    "invitee",
    ["", "   ", "two words", "semi;colon", "x" * 255, "<script>"],
    ids=["empty", "blank", "space", "semicolon", "too-long", "markup"],
)
def test_an_invitee_that_is_neither_a_username_nor_an_address_is_a_400_naming_it(people, invitee):
    response = invite(people, invitee)
    assert response.status_code == 400
    assert "invitee" in response.json()
    assert not Invitation.objects.exists()


def test_an_open_invitation_for_the_same_name_is_refused_naming_the_invitee(people):
    assert invite(people, "loner").status_code == 201
    again = invite(people, "loner")
    assert again.status_code == 400
    assert "already has an open invitation" in again.json()["invitee"][0]


@pytest.mark.parametrize("who, status", [("beta-member", 403), ("alpha-admin", 404)])
def test_only_the_tenants_admins_invite(people, who, status):
    assert invite(people, "loner", by=who).status_code == status
    assert not Invitation.objects.exists()


# --- the flow ------------------------------------------------------------------------------------


def test_the_invitee_sees_accepts_and_joins_with_the_role(people):
    created = invite(people, "loner", role="viewer").json()
    mine = as_(people, "loner").get("/api/v1/invitations/").json()["results"]
    assert [(i["id"], i["tenant"], i["state"], i["invited_by"]) for i in mine] == [
        (created["id"], "beta", "open", "beta-admin")
    ]
    response = as_(people, "loner").post(f"/api/v1/invitations/{created['id']}/accept/")
    assert response.status_code == 201, response.content
    assert (response.json()["tenant"], response.json()["role"]) == ("beta", "viewer")
    tenants = as_(people, "loner").get("/api/v1/tenants/").json()["results"]
    assert [t["slug"] for t in tenants] == ["beta"]
    seen = as_(people, "beta-admin").get(f"/api/v1/invitations/{created['id']}/").json()
    assert seen["state"] == "accepted" and seen["accepted_at"]
    kinds = set(AuditEvent.objects.filter(tenant__slug="beta").values_list("action", flat=True))
    assert {"invitation.create", "invitation.accept"} <= kinds


def test_an_invitation_by_address_is_accepted_by_the_account_with_that_address(people):
    created = invite(people, "LONER@example.ORG").json()
    response = as_(people, "loner").post(f"/api/v1/invitations/{created['id']}/accept/")
    assert response.status_code == 201
    assert Membership.objects.filter(user=people["loner"], tenant__slug="beta").exists()


def test_an_invitation_is_accepted_once(people):
    created = invite(people, "loner").json()
    url = f"/api/v1/invitations/{created['id']}/accept/"
    assert as_(people, "loner").post(url).status_code == 201
    again = as_(people, "loner").post(url)
    assert again.status_code == 409
    assert "already accepted" in again.json()["detail"]


def test_an_expired_invitation_cannot_be_accepted(people):
    created = invite(people, "loner").json()
    Invitation.objects.filter(pk=created["id"]).update(
        expires_at=timezone.now() - timedelta(seconds=1)
    )
    response = as_(people, "loner").post(f"/api/v1/invitations/{created['id']}/accept/")
    assert response.status_code == 409
    assert "expired" in response.json()["detail"]
    assert not Membership.objects.filter(user=people["loner"]).exists()


def test_a_withdrawn_or_declined_invitation_cannot_be_accepted(people):
    withdrawn = invite(people, "loner").json()
    assert as_(people, "beta-admin").delete(f"/api/v1/invitations/{withdrawn['id']}/").status_code
    declined = invite(people, "loner").json()
    answer = as_(people, "loner").post(f"/api/v1/invitations/{declined['id']}/decline/")
    assert answer.status_code == 200 and answer.json()["state"] == "withdrawn"
    for created in (withdrawn, declined):
        response = as_(people, "loner").post(f"/api/v1/invitations/{created['id']}/accept/")
        assert response.status_code == 409
    assert not Membership.objects.filter(user=people["loner"]).exists()


def test_accepting_when_already_a_member_is_a_409(people):
    created = invite(people, "beta-member").json()
    response = as_(people, "beta-member").post(f"/api/v1/invitations/{created['id']}/accept/")
    assert response.status_code == 409
    assert "already belong to beta" in response.json()["detail"]


def test_nobody_else_can_accept_an_invitation(people):
    created = invite(people, "loner").json()
    url = f"/api/v1/invitations/{created['id']}/accept/"
    # Someone outside beta does not see it at all; beta's own admin sees it but may not accept it.
    assert as_(people, "alpha-viewer").post(url).status_code == 404
    assert as_(people, "beta-admin").post(url).status_code == 403
    assert not Membership.objects.filter(user=people["loner"]).exists()


def test_another_tenants_invitations_are_404_everywhere(people):
    created = invite(people, "loner").json()
    base = f"/api/v1/invitations/{created['id']}/"
    for who in ("alpha-admin", "alpha-viewer"):
        client = as_(people, who)
        assert client.get(base).status_code == 404
        assert client.delete(base).status_code == 404
        assert client.post(base + "accept/").status_code == 404
        assert client.post(base + "decline/").status_code == 404
        assert client.get("/api/v1/invitations/").json()["results"] == []
    assert Invitation.objects.get().state == "open"


def test_a_member_sees_the_tenants_invitations_but_may_not_withdraw_them(people):
    created = invite(people, "loner").json()
    member = as_(people, "beta-member")
    listed = member.get("/api/v1/invitations/").json()["results"]
    assert [i["id"] for i in listed] == [created["id"]]
    assert member.delete(f"/api/v1/invitations/{created['id']}/").status_code == 403
    assert Invitation.objects.get().state == "open"


def test_the_invitations_web_page_accepts_and_declines(people, client):
    accept_me = invite(people, "loner", role="viewer").json()
    alpha = invite(people, "loner", by="alpha-admin", tenant="alpha").json()
    client.force_login(people["loner"])
    page = client.get("/invitations/").content.decode()
    assert "Beta (beta)" in page and "Alpha (alpha)" in page
    client.post(f"/invitations/{alpha['id']}/decline/")
    client.post(f"/invitations/{accept_me['id']}/accept/")
    assert list(
        Membership.objects.filter(user=people["loner"]).values_list("tenant__slug", "role")
    ) == [("beta", "viewer")]
    # Someone else's invitation is not found on this page either.
    client.force_login(people["alpha-viewer"])
    assert client.post(f"/invitations/{accept_me['id']}/accept/").status_code == 404
