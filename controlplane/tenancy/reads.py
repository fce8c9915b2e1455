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


def token_with_user(token_hash: str, *, with_memberships: bool = False) -> ApiToken | None:
    """ApiToken.objects.select_related("user").get(token_hash=...), or None.

    `with_memberships`: the user's memberships are read in the same statement (and
    memberships_with_tenants answers from them). A submit needs both, and they cost one round
    trip together instead of two; a read needs no roles, and would pay for their columns."""
    quote = connection.ops.quote_name
    user_pk = quote(_USER.model._meta.pk.column)
    if with_memberships:
        sql = _statement(
            "token-memberships",
            lambda: (
                f"SELECT {_TOKEN.select()}, {_USER.select()}, {_memberships_select()} "
                f"FROM {_TOKEN.table()} "
                f"JOIN {_USER.table()} ON u.{user_pk} = k.{quote('user_id')} "
                f"LEFT JOIN {_MEMBERSHIP.table()} ON m.{quote('user_id')} = u.{user_pk} "
                f"{_memberships_joins()} "
                f"WHERE k.{quote('token_hash')} = %s {_memberships_order()}"
            ),
        )
    else:
        sql = _statement(
            "token",
            lambda: (
                f"SELECT {_TOKEN.select()}, {_USER.select()} FROM {_TOKEN.table()} "
                f"JOIN {_USER.table()} ON u.{user_pk} = k.{quote('user_id')} "
                f"WHERE k.{quote('token_hash')} = %s"
            ),
        )
    rows = fetch(sql, [token_hash])
    if not rows:
        return None
    row = rows[0]
    token = _TOKEN.build(row[: len(_TOKEN)])
    token.user = _USER.build(row[len(_TOKEN) : len(_TOKEN) + len(_USER)])
    if with_memberships:
        skip = len(_TOKEN) + len(_USER)
        # Kept as rows until a view asks for them.
        setattr(token.user, _MEMBERSHIP_ROWS, [row[skip:] for row in rows])
    return token


def memberships_with_tenants(user) -> list[Membership]:
    """Membership.objects.filter(user=...).select_related("tenant"), by tenant slug, each
    tenant with its quotas read along (quotas_of answers from them): every submit reads both.
    A user authenticated by a token (token_with_user) brought them along: no read at all."""
    rows = getattr(user, _MEMBERSHIP_ROWS, None)
    if rows is not None:
        return _memberships(rows)
    quote = connection.ops.quote_name
    sql = _statement(
        "memberships",
        lambda: (
            f"SELECT {_memberships_select()} FROM {_MEMBERSHIP.table()} {_memberships_joins()} "
            f"WHERE m.{quote('user_id')} = %s {_memberships_order()}"
        ),
    )
    return _memberships(fetch(sql, [user.pk]))


# The parts of both statements that read memberships, their tenants and those tenants' quotas.
def _memberships_select() -> str:
    return f"{_MEMBERSHIP.select()}, {_TENANT.select()}, {_QUOTA.select()}"


def _memberships_joins() -> str:
    quote = connection.ops.quote_name
    return (
        f"LEFT JOIN {_TENANT.table()} ON t.{quote('id')} = m.{quote('tenant_id')} "
        f"LEFT JOIN {_QUOTA.table()} ON q.{quote('tenant_id')} = t.{quote('id')}"
    )


def _memberships_order() -> str:
    quote = connection.ops.quote_name
    return f"ORDER BY t.{quote('slug')}, q.{quote('gpu_type')}"


def _memberships(rows) -> list[Membership]:
    """Memberships from rows of _memberships_select(), a row per quota of each tenant (one of
    nulls for a tenant without quotas, and one of nulls only for a user without memberships)."""
    found: list[Membership] = []
    tenant_end, membership_pk = len(_MEMBERSHIP) + len(_TENANT), _MEMBERSHIP.pk_index
    for row in rows:
        if row[membership_pk] is None:
            continue
        if not found or found[-1].pk != row[membership_pk]:
            membership = _MEMBERSHIP.build(row[: len(_MEMBERSHIP)])
            membership.tenant = _TENANT.build(row[len(_MEMBERSHIP) : tenant_end])
            setattr(membership.tenant, _QUOTAS_READ, [])
            found.append(membership)
        if row[tenant_end + _QUOTA.pk_index] is not None:
            getattr(found[-1].tenant, _QUOTAS_READ).append(_QUOTA.build(row[tenant_end:]))
    return found


# Where a user read by token_with_user keeps the rows of their memberships, read at the same
# moment.
_MEMBERSHIP_ROWS = "_gpucp_membership_rows"

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
