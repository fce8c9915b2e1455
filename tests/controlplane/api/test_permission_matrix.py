"""Every endpoint and method, for every role: the status it answers, what a list shows, and that a
refused write changes nothing.

The objects are vision's; `other_tenant` (bob, of nlp) must get 404 for them, never 403, so ids
leak nothing. A member lacking the role gets 403; anonymous 401.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from controlplane.audit.models import AuditEvent
from controlplane.cluster.models import GpuClaimConflict, JoinToken, Node, Pool
from controlplane.jobs.models import Job
from controlplane.storage.models import Volume
from controlplane.tenancy.models import ApiToken, Budget, Invitation, Membership, Quota, Tenant
from tests.controlplane.api.helpers import ROLES, job_body, results

VISION_ROLES = frozenset({"viewer", "member", "tenant_admin", "cluster_admin"})
SIGNED_IN_ROLES = frozenset(ROLES) - {"anonymous"}


def answers(anonymous, other_tenant, viewer, member, tenant_admin, cluster_admin) -> dict:
    return dict(
        anonymous=anonymous,
        other_tenant=other_tenant,
        viewer=viewer,
        member=member,
        tenant_admin=tenant_admin,
        cluster_admin=cluster_admin,
    )


LIST = answers(401, 200, 200, 200, 200, 200)
READ_VISION = answers(401, 404, 200, 200, 200, 200)
READ_SHARED = answers(401, 200, 200, 200, 200, 200)


def staff_writes_vision(ok):
    return answers(401, 404, 403, 403, 403, ok)


def tenant_admin_writes_vision(ok):
    return answers(401, 404, 403, 403, ok, ok)


def staff_only(ok):
    return answers(401, 403, 403, 403, 403, ok)


def anyone_signed_in(ok):
    return answers(401, ok, ok, ok, ok, ok)


def own_only(ok):
    return answers(401, 404, 404, ok, 404, 404)


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    url: Callable
    expect: dict
    body: Callable | None = None
    # For lists: (field, value) of a vision-side row, and who must see it.
    listed: Callable | None = None
    listed_for: frozenset = VISION_ROLES
    # For writes: the rows a refused request must leave exactly as they were.
    touches: Callable | None = None
    # Objects made before the request, so a list has rows of both tenants.
    setup: Callable = field(default=lambda w: None)


def gpu_claim_conflict(w) -> GpuClaimConflict:
    """A refused claim on one of the node's GPUs (made once per test)."""
    gpu = w.node.gpus.first()
    conflict, _ = GpuClaimConflict.objects.get_or_create(
        gpu_uuid=gpu.uuid,
        claimant="intruder-01",
        defaults={"holder": w.node, "holder_name": w.node.name, "reason": "the node is live"},
    )
    return conflict


def vision_audit_row(w) -> AuditEvent:
    """A change of vision's quota, as its action leaves it (made once per test)."""
    row, _ = AuditEvent.objects.get_or_create(
        tenant=w.vision,
        action="quota.update",
        object_type="quota",
        object_id="4242",
        defaults={"before": {"limit_gpus": 8}, "after": {"limit_gpus": 12}},
    )
    return row


def rows(queryset):
    return sorted(queryset.values(), key=lambda r: r["id"])


def as_seen_by_staff(w, url) -> dict:
    return w.client("cluster_admin").get(url).json()


def updates(prefix: str, url: Callable, expect: dict, body: Callable, touches: Callable):
    """PATCH with the change, and PUT with the whole object as a cluster admin reads it plus it."""
    return [
        Case(f"{prefix}-update", "patch", url, expect, body=body, touches=touches),
        Case(
            f"{prefix}-replace",
            "put",
            url,
            expect,
            body=lambda w: {**as_seen_by_staff(w, url(w)), **body(w)},
            touches=touches,
        ),
    ]


CASES = [
    # tenants
    Case(
        "tenants-list",
        "get",
        lambda w: "/api/v1/tenants/",
        LIST,
        listed=lambda w: ("slug", w.vision.slug),
        setup=lambda w: w.nlp,
    ),
    Case("tenants-retrieve", "get", lambda w: f"/api/v1/tenants/{w.vision.slug}/", READ_VISION),
    Case(
        "tenants-create",
        "post",
        lambda w: "/api/v1/tenants/",
        staff_only(201),
        body=lambda w: {"slug": "robotics", "name": "Robotics lab"},
        touches=lambda w: Tenant.objects.all(),
    ),
    *updates(
        "tenants",
        lambda w: f"/api/v1/tenants/{w.vision.slug}/",
        staff_writes_vision(200),
        lambda w: {"name": "Vision"},
        lambda w: Tenant.objects.filter(pk=w.vision.pk),
    ),
    Case(
        "tenants-delete",
        "delete",
        lambda w: f"/api/v1/tenants/{w.vision.slug}/",
        staff_writes_vision(204),
        touches=lambda w: Tenant.objects.all(),
    ),
    # memberships
    Case(
        "memberships-list",
        "get",
        lambda w: "/api/v1/memberships/",
        LIST,
        listed=lambda w: ("id", w.carol_membership.pk),
    ),
    Case(
        "memberships-retrieve",
        "get",
        lambda w: f"/api/v1/memberships/{w.carol_membership.pk}/",
        READ_VISION,
    ),
    Case(
        "memberships-create",
        "post",
        lambda w: "/api/v1/memberships/",
        staff_writes_vision(201),
        body=lambda w: {"tenant": "vision", "user": w.carol_membership.user.username + "-2"},
        setup=lambda w: w.fixture("make_user")(w.carol_membership.user.username + "-2"),
        touches=lambda w: Membership.objects.all(),
    ),
    *updates(
        "memberships",
        lambda w: f"/api/v1/memberships/{w.carol_membership.pk}/",
        tenant_admin_writes_vision(200),
        lambda w: {"role": "viewer"},
        lambda w: Membership.objects.filter(pk=w.carol_membership.pk),
    ),
    Case(
        "memberships-delete",
        "delete",
        lambda w: f"/api/v1/memberships/{w.carol_membership.pk}/",
        tenant_admin_writes_vision(204),
        touches=lambda w: Membership.objects.all(),
    ),
    # quotas
    Case(
        "quotas-list",
        "get",
        lambda w: "/api/v1/quotas/",
        LIST,
        listed=lambda w: ("id", w.vision_quota.pk),
        setup=lambda w: w.nlp,
    ),
    Case("quotas-retrieve", "get", lambda w: f"/api/v1/quotas/{w.vision_quota.pk}/", READ_VISION),
    Case(
        "quotas-create",
        "post",
        lambda w: "/api/v1/quotas/",
        staff_writes_vision(201),
        body=lambda w: {
            "tenant": "vision",
            "gpu_type": "A100-SXM4-80GB",
            "guaranteed_gpus": 1,
            "limit_gpus": 2,
        },
        setup=lambda w: w.vision,
        touches=lambda w: Quota.objects.all(),
    ),
    *updates(
        "quotas",
        lambda w: f"/api/v1/quotas/{w.vision_quota.pk}/",
        staff_writes_vision(200),
        lambda w: {"limit_gpus": 12},
        lambda w: Quota.objects.filter(pk=w.vision_quota.pk),
    ),
    Case(
        "quotas-delete",
        "delete",
        lambda w: f"/api/v1/quotas/{w.vision_quota.pk}/",
        staff_writes_vision(204),
        touches=lambda w: Quota.objects.all(),
    ),
    # budgets
    Case(
        "budgets-list",
        "get",
        lambda w: "/api/v1/budgets/",
        LIST,
        listed=lambda w: ("id", w.vision_budget.pk),
    ),
    Case(
        "budgets-retrieve", "get", lambda w: f"/api/v1/budgets/{w.vision_budget.pk}/", READ_VISION
    ),
    Case(
        "budgets-create",
        "post",
        lambda w: "/api/v1/budgets/",
        staff_writes_vision(201),
        body=lambda w: {
            "tenant": "vision",
            "kind": "gpu_hours",
            "period": "week",
            "amount": 100,
            "action": "hold",
        },
        setup=lambda w: w.vision,
        touches=lambda w: Budget.objects.all(),
    ),
    *updates(
        "budgets",
        lambda w: f"/api/v1/budgets/{w.vision_budget.pk}/",
        staff_writes_vision(200),
        lambda w: {"amount": 800},
        lambda w: Budget.objects.filter(pk=w.vision_budget.pk),
    ),
    Case(
        "budgets-delete",
        "delete",
        lambda w: f"/api/v1/budgets/{w.vision_budget.pk}/",
        staff_writes_vision(204),
        touches=lambda w: Budget.objects.all(),
    ),
    # pools
    Case(
        "pools-list",
        "get",
        lambda w: "/api/v1/pools/",
        LIST,
        listed=lambda w: ("name", w.pool.name),
        listed_for=SIGNED_IN_ROLES,
    ),
    Case("pools-retrieve", "get", lambda w: f"/api/v1/pools/{w.pool.name}/", READ_SHARED),
    Case(
        "pools-create",
        "post",
        lambda w: "/api/v1/pools/",
        staff_only(201),
        body=lambda w: {"name": "pool-b", "power_budget_w": 2000},
        touches=lambda w: Pool.objects.all(),
    ),
    *updates(
        "pools",
        lambda w: f"/api/v1/pools/{w.spare_pool.name}/",
        staff_only(200),
        lambda w: {"power_budget_w": 4000},
        lambda w: Pool.objects.filter(pk=w.spare_pool.pk),
    ),
    Case(
        "pools-delete",
        "delete",
        lambda w: f"/api/v1/pools/{w.spare_pool.name}/",
        staff_only(204),
        touches=lambda w: Pool.objects.all(),
    ),
    # volumes: vision's is a 404 to nlp's member, and only cluster admins write
    Case(
        "volumes-list",
        "get",
        lambda w: "/api/v1/volumes/",
        LIST,
        listed=lambda w: ("name", w.vision_volume.name),
        setup=lambda w: w.nlp,
    ),
    Case(
        "volumes-retrieve", "get", lambda w: f"/api/v1/volumes/{w.vision_volume.name}/", READ_VISION
    ),
    Case(
        "volumes-create",
        "post",
        lambda w: "/api/v1/volumes/",
        staff_only(201),
        body=lambda w: {"name": "scratch", "source": "/mnt/scratch", "tenants": ["vision"]},
        setup=lambda w: w.vision,
        touches=lambda w: Volume.objects.all(),
    ),
    *updates(
        "volumes",
        lambda w: f"/api/v1/volumes/{w.vision_volume.name}/",
        staff_only(200),
        lambda w: {"read_only": True},
        lambda w: Volume.objects.filter(pk=w.vision_volume.pk),
    ),
    Case(
        "volumes-delete",
        "delete",
        lambda w: f"/api/v1/volumes/{w.vision_volume.name}/",
        staff_only(204),
        touches=lambda w: Volume.objects.all(),
    ),
    # nodes
    Case(
        "nodes-list",
        "get",
        lambda w: "/api/v1/nodes/",
        LIST,
        listed=lambda w: ("name", w.node.name),
        listed_for=SIGNED_IN_ROLES,
    ),
    Case("nodes-retrieve", "get", lambda w: f"/api/v1/nodes/{w.node.name}/", READ_SHARED),
    *[
        Case(
            f"nodes-{verb}",
            "post",
            lambda w, verb=verb: f"/api/v1/nodes/{w.node.name}/{verb}/",
            staff_only(200),
            touches=lambda w: Node.objects.filter(pk=w.node.pk),
        )
        for verb in ("cordon", "drain", "uncordon", "deregister")
    ],
    # gpus
    Case(
        "gpus-list",
        "get",
        lambda w: "/api/v1/gpus/",
        LIST,
        listed=lambda w: ("id", w.node.gpus.first().pk),
        listed_for=SIGNED_IN_ROLES,
    ),
    Case(
        "gpus-retrieve",
        "get",
        lambda w: f"/api/v1/gpus/{w.node.gpus.first().uuid}/",
        READ_SHARED,
    ),
    # jobs
    Case(
        "jobs-list",
        "get",
        lambda w: "/api/v1/jobs/",
        LIST,
        listed=lambda w: ("id", w.vision_job.pk),
        setup=lambda w: w.nlp_job,
    ),
    Case("jobs-retrieve", "get", lambda w: f"/api/v1/jobs/{w.vision_job.pk}/", READ_VISION),
    Case(
        "jobs-submit",
        "post",
        lambda w: "/api/v1/jobs/",
        answers(401, 404, 403, 201, 201, 201),
        body=lambda w: job_body(),
        setup=lambda w: w.node,
        touches=lambda w: Job.objects.all(),
    ),
    Case(
        "jobs-cancel",
        "post",
        lambda w: f"/api/v1/jobs/{w.vision_job.pk}/cancel/",
        answers(401, 404, 403, 200, 200, 200),
        touches=lambda w: Job.objects.filter(pk=w.vision_job.pk),
    ),
    Case("jobs-logs", "get", lambda w: f"/api/v1/jobs/{w.vision_job.pk}/logs/", READ_VISION),
    *[
        Case(
            f"jobs-{method}-is-not-offered",
            method,
            lambda w: f"/api/v1/jobs/{w.vision_job.pk}/",
            answers(401, 405, 405, 405, 405, 405),
            body=lambda w: {"state": "SUCCEEDED"},
            touches=lambda w: Job.objects.filter(pk=w.vision_job.pk),
        )
        for method in ("put", "patch", "delete")
    ],
    # job arrays
    Case(
        "arrays-list",
        "get",
        lambda w: "/api/v1/arrays/",
        LIST,
        listed=lambda w: ("id", w.vision_array.pk),
        setup=lambda w: w.nlp_array,
    ),
    Case("arrays-retrieve", "get", lambda w: f"/api/v1/arrays/{w.vision_array.pk}/", READ_VISION),
    Case(
        "arrays-create",
        "post",
        lambda w: "/api/v1/arrays/",
        answers(401, 404, 403, 201, 201, 201),
        body=lambda w: job_body(array="0-2", max_parallel=2),
        setup=lambda w: w.node,
        touches=lambda w: Job.objects.all(),
    ),
    Case(
        "arrays-cancel",
        "post",
        lambda w: f"/api/v1/arrays/{w.vision_array.pk}/cancel/",
        answers(401, 404, 403, 200, 200, 200),
        touches=lambda w: Job.objects.filter(array_id=w.vision_array.pk),
    ),
    *[
        Case(
            f"arrays-{method}-is-not-offered",
            method,
            lambda w: f"/api/v1/arrays/{w.vision_array.pk}/",
            answers(401, 405, 405, 405, 405, 405),
            body=lambda w: {"max_parallel": 2},
            touches=lambda w: Job.objects.filter(array_id=w.vision_array.pk),
        )
        for method in ("put", "patch", "delete")
    ],
    # join tokens
    Case(
        "join-tokens-list",
        "get",
        lambda w: "/api/v1/join-tokens/",
        staff_only(200),
        listed=lambda w: ("id", w.join_token.pk),
        listed_for=frozenset({"cluster_admin"}),
    ),
    Case(
        "join-tokens-retrieve",
        "get",
        lambda w: f"/api/v1/join-tokens/{w.join_token.pk}/",
        staff_only(200),
    ),
    Case(
        "join-tokens-create",
        "post",
        lambda w: "/api/v1/join-tokens/",
        staff_only(201),
        body=lambda w: {"pool": w.pool.name, "max_uses": 2},
        touches=lambda w: JoinToken.objects.all(),
    ),
    Case(
        "join-tokens-revoke",
        "delete",
        lambda w: f"/api/v1/join-tokens/{w.join_token.pk}/",
        staff_only(204),
        touches=lambda w: JoinToken.objects.all(),
    ),
    # invitations: a tenant's members see them, its admins make and withdraw them; only the
    # invitee (not in this world: see test_invitations.py) accepts or declines
    Case(
        "invitations-list",
        "get",
        lambda w: "/api/v1/invitations/",
        LIST,
        listed=lambda w: ("id", w.vision_invitation.pk),
    ),
    Case(
        "invitations-retrieve",
        "get",
        lambda w: f"/api/v1/invitations/{w.vision_invitation.pk}/",
        READ_VISION,
    ),
    Case(
        "invitations-create",
        "post",
        lambda w: "/api/v1/invitations/",
        tenant_admin_writes_vision(201),
        body=lambda w: {"tenant": "vision", "invitee": "newcomer", "role": "viewer"},
        touches=lambda w: Invitation.objects.all(),
    ),
    Case(
        "invitations-delete",
        "delete",
        lambda w: f"/api/v1/invitations/{w.vision_invitation.pk}/",
        tenant_admin_writes_vision(204),
        touches=lambda w: Invitation.objects.all(),
    ),
    *[
        Case(
            f"invitations-{verb}",
            "post",
            lambda w, verb=verb: f"/api/v1/invitations/{w.vision_invitation.pk}/{verb}/",
            answers(401, 404, 403, 403, 403, 403),
            touches=lambda w: Invitation.objects.all(),
        )
        for verb in ("accept", "decline")
    ],
    # GPU claims refused at registration: cluster admins only
    Case(
        "gpu-claim-conflicts-list",
        "get",
        lambda w: "/api/v1/gpu-claim-conflicts/",
        staff_only(200),
        listed=lambda w: ("id", gpu_claim_conflict(w).pk),
        listed_for=frozenset({"cluster_admin"}),
    ),
    Case(
        "gpu-claim-conflicts-retrieve",
        "get",
        lambda w: f"/api/v1/gpu-claim-conflicts/{gpu_claim_conflict(w).pk}/",
        staff_only(200),
    ),
    Case(
        "gpu-claim-conflicts-resolve",
        "post",
        lambda w: f"/api/v1/gpu-claim-conflicts/{gpu_claim_conflict(w).pk}/resolve/",
        staff_only(200),
        body=lambda w: {"resolution": "dismissed"},
        touches=lambda w: GpuClaimConflict.objects.all(),
    ),
    # api tokens: each person's own, admins included
    Case(
        "api-tokens-list",
        "get",
        lambda w: "/api/v1/api-tokens/",
        LIST,
        listed=lambda w: ("id", w.alice_token.pk),
        listed_for=frozenset({"member"}),
    ),
    Case(
        "api-tokens-retrieve",
        "get",
        lambda w: f"/api/v1/api-tokens/{w.alice_token.pk}/",
        own_only(200),
    ),
    Case(
        "api-tokens-create",
        "post",
        lambda w: "/api/v1/api-tokens/",
        anyone_signed_in(201),
        body=lambda w: {"name": "ci"},
        touches=lambda w: ApiToken.objects.all(),
    ),
    Case(
        "api-tokens-revoke",
        "delete",
        lambda w: f"/api/v1/api-tokens/{w.alice_token.pk}/",
        own_only(204),
        touches=lambda w: ApiToken.objects.all(),
    ),
    # accounting (chargeback): members see their tenants' rows only
    Case(
        "accounting-usage",
        "get",
        lambda w: "/api/v1/accounting/usage/",
        LIST,
        listed=lambda w: ("tenant", w.vision.slug),
        setup=lambda w: w.nlp,
    ),
    Case("accounting-usage-csv", "get", lambda w: "/api/v1/accounting/usage.csv", LIST),
    # the audit trail: a cluster admin reads every row, a tenant admin their tenants', no one
    # else any; nobody writes it through the API
    Case(
        "audit-list",
        "get",
        lambda w: "/api/v1/audit/",
        LIST,
        listed=lambda w: ("object_id", str(vision_audit_row(w).object_id)),
        listed_for=frozenset({"tenant_admin", "cluster_admin"}),
    ),
    Case(
        "audit-retrieve",
        "get",
        lambda w: f"/api/v1/audit/{vision_audit_row(w).pk}/",
        answers(401, 404, 404, 404, 200, 200),
    ),
    Case("audit-csv", "get", lambda w: "/api/v1/audit/csv/", LIST),
]


@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_every_endpoint_answers_each_role_as_declared(world, case, role):
    case.setup(world)
    url = case.url(world)
    body = case.body(world) if case.body else None
    client = world.client(role)
    before = rows(case.touches(world)) if case.touches else None
    key, value = case.listed(world) if case.listed else (None, None)

    response = getattr(client, case.method)(url, body, format="json")

    assert response.status_code == case.expect[role], response.content
    if case.listed and response.status_code == 200:
        shown = [row[key] for row in results(response)]
        assert (value in shown) == (role in case.listed_for), shown
    if case.touches and response.status_code >= 400:
        assert rows(case.touches(world)) == before


def test_every_api_route_is_in_the_matrix():
    """A new endpoint without a row above fails here, so nobody forgets its permissions."""
    from controlplane.api_urls import router

    covered = {c.name.split("-is-not-offered")[0] for c in CASES}
    for prefix, viewset, _ in router.registry:
        for route in router.get_routes(viewset):
            for method, action in route.mapping.items():
                if not hasattr(viewset, action):
                    continue
                name = {
                    "list": "list",
                    "retrieve": "retrieve",
                    "create": "submit" if prefix == "jobs" else "create",
                    "partial_update": "update",
                    "update": "replace",
                    "destroy": "revoke" if prefix.endswith("tokens") else "delete",
                }.get(action, action)
                assert f"{prefix}-{name}" in covered, f"{method.upper()} {prefix} ({action})"
