"""The tenancy reads every API request makes, as fixed statements (controlplane.modelrows).

A bearer token with its user, the user's memberships with their tenants, and a tenant's
quotas: each was an ORM query compiled anew on every request, which cost a submit more Python
than the rest of its checks. Each function returns what the queryset it replaces returned, in
the same order (the models' Meta.ordering).
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.db import connection

from controlplane.modelrows import Columns, fetch
from controlplane.tenancy.models import ApiToken, Membership, Quota, Tenant

_TOKEN = Columns(ApiToken, "k")
_USER: Columns = Columns(get_user_model(), "u")
_MEMBERSHIP = Columns(Membership, "m")
_TENANT = Columns(Tenant, "t")
_QUOTA = Columns(Quota, "q")

_statements: dict[tuple[str, str], str] = {}


def _statement(name: str, build) -> str:
    # Per backend: the embedded mode's SQLite quotes names as PostgreSQL does, but a test may
    # run both.
    key = (name, connection.vendor)
    sql = _statements.get(key)
    if sql is None:
        sql = _statements[key] = build()
    return sql


def token_with_user(token_hash: str) -> ApiToken | None:
    """ApiToken.objects.select_related("user").get(token_hash=...), or None."""
    quote = connection.ops.quote_name
    sql = _statement(
        "token",
        lambda: (
            f"SELECT {_TOKEN.select()}, {_USER.select()} FROM {_TOKEN.table()} "
            f"JOIN {_USER.table()} ON u.{quote(_USER.model._meta.pk.column)} = k.{quote('user_id')} "
            f"WHERE k.{quote('token_hash')} = %s"
        ),
    )
    rows = fetch(sql, [token_hash])
    if not rows:
        return None
    row = rows[0]
    token = _TOKEN.build(row[: len(_TOKEN)])
    token.user = _USER.build(row[len(_TOKEN) :])
    return token


def memberships_with_tenants(user_id: int) -> list[Membership]:
    """Membership.objects.filter(user=...).select_related("tenant"), by tenant slug, each
    tenant with its quotas read along (quotas_of answers from them): every submit reads both,
    and they cost one round trip together instead of one each."""
    quote = connection.ops.quote_name
    sql = _statement(
        "memberships",
        lambda: (
            f"SELECT {_MEMBERSHIP.select()}, {_TENANT.select()}, {_QUOTA.select()} "
            f"FROM {_MEMBERSHIP.table()} "
            f"JOIN {_TENANT.table()} ON t.{quote('id')} = m.{quote('tenant_id')} "
            f"LEFT JOIN {_QUOTA.table()} ON q.{quote('tenant_id')} = t.{quote('id')} "
            f"WHERE m.{quote('user_id')} = %s ORDER BY t.{quote('slug')}, q.{quote('gpu_type')}"
        ),
    )
    found: list[Membership] = []
    tenant_end, membership_pk = len(_MEMBERSHIP) + len(_TENANT), _MEMBERSHIP.pk_index
    for row in fetch(sql, [user_id]):
        if not found or found[-1].pk != row[membership_pk]:
            membership = _MEMBERSHIP.build(row[: len(_MEMBERSHIP)])
            membership.tenant = _TENANT.build(row[len(_MEMBERSHIP) : tenant_end])
            setattr(membership.tenant, _QUOTAS_READ, [])
            found.append(membership)
        if row[tenant_end + _QUOTA.pk_index] is not None:  # a tenant without quotas: nulls
            getattr(found[-1].tenant, _QUOTAS_READ).append(_QUOTA.build(row[tenant_end:]))
    return found


# Where a tenant read by memberships_with_tenants keeps its quotas, read at the same moment.
_QUOTAS_READ = "_gpucp_quotas_read"


def quotas_of(tenant: Tenant) -> list[Quota]:
    """tenant.quotas.all(), by GPU type: from the tenant's prefetch when it has one (a list of
    submits prefetches every tenant's quotas once, for all its items) or from the quotas read
    with it (memberships_with_tenants), else one read."""
    prefetched = getattr(tenant, "_prefetched_objects_cache", {}).get("quotas")
    if prefetched is None:
        prefetched = getattr(tenant, _QUOTAS_READ, None)
    if prefetched is not None:
        return list(prefetched)
    tenant_id = tenant.pk
    quote = connection.ops.quote_name
    sql = _statement(
        "quotas",
        lambda: (
            f"SELECT {_QUOTA.select()} FROM {_QUOTA.table()} "
            f"WHERE q.{quote('tenant_id')} = %s ORDER BY q.{quote('gpu_type')}"
        ),
    )
    return [_QUOTA.build(row) for row in fetch(sql, [tenant_id])]
