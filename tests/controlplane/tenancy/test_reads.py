"""The fixed-statement reads (controlplane.tenancy.reads) return what the querysets they replace
return: every column, converted as the ORM converts it, in the same order."""

import datetime as dt
import functools

import pytest
from django.db import connection
from django.db.models import prefetch_related_objects
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from controlplane.tenancy import reads
from controlplane.tenancy.models import ApiToken, Membership, Quota, Role, Tenant, hash_token


def _columns(instance) -> dict:
    return {f.attname: getattr(instance, f.attname) for f in type(instance)._meta.concrete_fields}


@pytest.mark.parametrize("with_memberships", [False, True], ids=["a-read", "a-write"])
def test_a_token_and_its_user_come_back_as_the_orm_reads_them(alice, with_memberships):
    parent, _ = ApiToken.issue(alice, "ci", timezone.now() + dt.timedelta(days=3))
    child, _ = ApiToken.issue(alice, "ci-child", scopes=["read"], parent=parent)
    ApiToken.objects.filter(pk=parent.pk).update(
        revoked_at=timezone.now(), last_used_at=timezone.now() - dt.timedelta(minutes=5)
    )
    for token in (parent, child):
        expected = ApiToken.objects.select_related("user").get(pk=token.pk)
        got = reads.token_with_user(token.token_hash, with_memberships=with_memberships)
        assert got is not None
        assert _columns(got) == _columns(expected)
        assert _columns(got.user) == _columns(expected.user)
        # What authentication asks of them.
        assert got.is_usable == expected.is_usable
        assert got.allows("write") == expected.allows("write")
        assert got.user.is_active is True
    read = functools.partial(reads.token_with_user, with_memberships=with_memberships)
    assert not read(parent.token_hash).is_usable  # revoked
    assert read(child.token_hash).scopes == ["read"]
    assert read("0" * 64) is None


def test_memberships_come_with_their_tenants_in_slug_order(make_user, vision, nlp):
    person = make_user("pat")
    zeta = Tenant.objects.create(slug="zeta", name="Zeta", weight=2.5, checkpoint_limit_bytes=10)
    for tenant, role in ((zeta, Role.ADMIN), (vision, Role.MEMBER), (nlp, Role.VIEWER)):
        Membership.objects.create(user=person, tenant=tenant, role=role)
    make_user("someone-else")

    got = reads.memberships_with_tenants(person)
    expected = list(Membership.objects.filter(user=person).select_related("tenant"))
    assert [m.tenant.slug for m in got] == ["nlp", "vision", "zeta"]
    assert [_columns(m) for m in got] == [_columns(m) for m in expected]
    assert [_columns(m.tenant) for m in got] == [_columns(m.tenant) for m in expected]
    assert reads.memberships_with_tenants(make_user("nobody")) == []


def test_a_tenants_quotas_in_gpu_type_order(vision, nlp):
    Quota.objects.create(tenant=vision, gpu_type="", guaranteed_gpus=0, limit_gpus=4)
    Quota.objects.create(
        tenant=vision, gpu_type="A100", guaranteed_gpus=1, limit_gpus=2, max_running_jobs=7
    )
    got = reads.quotas_of(vision)
    assert [q.gpu_type for q in got] == ["", "A100", "H100-SXM-80GB"]
    assert [_columns(q) for q in got] == [_columns(q) for q in vision.quotas.all()]
    assert [q.gpu_type for q in reads.quotas_of(nlp)] == ["H100-SXM-80GB"]
    # A prefetch is used as it is, with no read of its own.
    prefetch_related_objects([nlp], "quotas")
    with CaptureQueriesContext(connection) as captured:
        assert [q.gpu_type for q in reads.quotas_of(nlp)] == ["H100-SXM-80GB"]
    assert captured.captured_queries == []


def test_memberships_bring_each_tenants_quotas_and_quotas_of_answers_from_them(
    make_user, vision, nlp
):
    # A submit reads the user's memberships, then the chosen tenant's quotas: one round trip.
    person = make_user("quinn")
    bare = Tenant.objects.create(slug="bare", name="Bare")
    Quota.objects.create(tenant=vision, gpu_type="", guaranteed_gpus=0, limit_gpus=4)
    Quota.objects.create(tenant=vision, gpu_type="A100", guaranteed_gpus=1, limit_gpus=2)
    for tenant in (vision, nlp, bare):
        Membership.objects.create(user=person, tenant=tenant, role=Role.MEMBER)

    with CaptureQueriesContext(connection) as captured:
        got = {m.tenant.slug: m.tenant for m in reads.memberships_with_tenants(person)}
        quotas = {slug: reads.quotas_of(tenant) for slug, tenant in got.items()}
    assert len(captured.captured_queries) == 1
    assert list(got) == ["bare", "nlp", "vision"]
    for slug in got:
        expected = list(Tenant.objects.get(slug=slug).quotas.all())
        assert [_columns(q) for q in quotas[slug]] == [_columns(q) for q in expected]
    assert [q.gpu_type for q in quotas["vision"]] == ["", "A100", "H100-SXM-80GB"]
    assert quotas["bare"] == []


def test_a_token_brings_its_users_memberships_with_their_tenants_and_quotas(make_user, vision, nlp):
    # Authentication reads them with the token; the submit's check of roles then reads nothing.
    person = make_user("rin")
    Quota.objects.create(tenant=vision, gpu_type="A100", guaranteed_gpus=1, limit_gpus=2)
    bare = Tenant.objects.create(slug="bare", name="Bare")
    for tenant, role in ((vision, Role.MEMBER), (nlp, Role.ADMIN), (bare, Role.VIEWER)):
        Membership.objects.create(user=person, tenant=tenant, role=role)
    _, raw = ApiToken.issue(person, "ci")
    loner = make_user("loner")
    _, loner_raw = ApiToken.issue(loner, "ci")

    token = reads.token_with_user(hash_token(raw), with_memberships=True)
    with CaptureQueriesContext(connection) as captured:
        got = reads.memberships_with_tenants(token.user)
        quotas = {m.tenant.slug: [q.gpu_type for q in reads.quotas_of(m.tenant)] for m in got}
    assert captured.captured_queries == []
    expected = reads.memberships_with_tenants(person)  # a user of no token: read afresh
    assert [_columns(m) for m in got] == [_columns(m) for m in expected]
    assert [_columns(m.tenant) for m in got] == [_columns(m.tenant) for m in expected]
    assert quotas == {"bare": [], "nlp": ["H100-SXM-80GB"], "vision": ["A100", "H100-SXM-80GB"]}
    assert _columns(token.user) == _columns(person)
    loner_token = reads.token_with_user(hash_token(loner_raw), with_memberships=True)
    assert reads.memberships_with_tenants(loner_token.user) == []
    # Without them (a read): the token and its user as before, and the roles read when asked.
    plain = reads.token_with_user(hash_token(raw))
    assert _columns(plain) == _columns(token) and _columns(plain.user) == _columns(token.user)
    with CaptureQueriesContext(connection) as captured:
        assert [m.tenant.slug for m in reads.memberships_with_tenants(plain.user)] == list(quotas)
    assert len(captured.captured_queries) == 1
