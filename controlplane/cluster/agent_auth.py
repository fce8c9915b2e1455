"""Credentials of the agent API: join tokens (to register) and node tokens (for everything else).

The agent API is a separate trust domain from the user API. A node token opens the agent API
and nothing else (the user authentication refuses anything that is not `gcp_...`); here, a user
token or a session opens nothing, because only a `gcpn_` bearer token is looked at.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

from django.db import connection
from django.db.models import F
from django.http import HttpRequest
from django.utils import timezone

from controlplane.cluster.models import JoinToken, Node, Pool
from controlplane.tenancy.models import hash_token, new_raw_token

NODE_TOKEN_PREFIX = "gcpn"
JOIN_TOKEN_PREFIX = "gcpj"


class AgentAuthError(Exception):
    """The request carries no usable agent credential; the API answers 401."""


def bearer_token(request: HttpRequest) -> str | None:
    return bearer_of(request.headers.get("Authorization", ""))


def bearer_of(header: str | None) -> str | None:
    parts = (header or "").split()
    if len(parts) != 2 or parts[0] != "Bearer":
        return None
    return parts[1]


def node_token_digest(authorization: str | None) -> str:
    """The hash of the node token in this Authorization header (not yet checked against any
    node), or AgentAuthError."""
    raw = bearer_of(authorization)
    if raw is None:
        raise AgentAuthError("A node token is required (Authorization: Bearer gcpn_...).")
    if not raw.startswith(NODE_TOKEN_PREFIX + "_"):
        raise AgentAuthError("Only node tokens may call the agent API.")
    return hash_token(raw)


def authenticate_node(request: HttpRequest) -> Node:
    """The node whose current token the request carries, or AgentAuthError."""
    node = node_by_token_hash(node_token_digest(request.headers.get("Authorization")))
    if node is None:
        # Rotated, revoked, or never issued: all look the same from outside.
        raise AgentAuthError("Invalid node token.")
    return node


def node_by_token_hash(digest: str) -> Node | None:
    """The fields of the node a heartbeat needs, by one indexed read.

    Raw SQL because every agent call starts here (a thousand a second in a large cluster), and
    building the ORM query costs more than the database's work for it.
    """
    qn = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT id, name, ready, last_heartbeat_at, heartbeat_interval_s, conditions "
            f"FROM {qn(Node._meta.db_table)} WHERE token_hash = %s",
            [digest],
        )
        row = cursor.fetchone()
    if row is None:
        return None
    node_id, name, ready, last_heartbeat_at, interval_s, conditions = row
    return Node(
        id=node_id,
        name=name,
        ready=bool(ready),
        last_heartbeat_at=db_datetime(last_heartbeat_at),
        heartbeat_interval_s=interval_s,
        conditions=json.loads(conditions) if isinstance(conditions, str | bytes) else conditions,
        token_hash=digest,
    )


def db_datetime(value) -> datetime | None:
    """A timestamp column read by raw SQL: PostgreSQL gives an aware datetime, SQLite naive UTC
    or text."""
    if value is None:
        return None
    parsed = value if isinstance(value, datetime) else datetime.fromisoformat(value)
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def issue_join_token(
    pool: Pool, *, expires_at: datetime, max_uses: int = 1, created_by=None, node_name: str = ""
) -> tuple[JoinToken, str]:
    """Create a join token and return it with its raw secret, which is never stored."""
    raw = new_raw_token(JOIN_TOKEN_PREFIX)
    token = JoinToken.objects.create(
        token_hash=hash_token(raw),
        prefix=raw[:12],
        pool=pool,
        created_by=created_by,
        expires_at=expires_at,
        max_uses=max_uses,
        node_name=node_name,
    )
    return token, raw


def usable_join_token(raw: str | None) -> JoinToken:
    """The join token this secret names, if a node may join with it now (not revoked, not
    expired, a use left), or AgentAuthError. Spends nothing: see spend_join_token."""
    if not raw or not raw.startswith(JOIN_TOKEN_PREFIX + "_"):
        raise AgentAuthError("A join token is required (Authorization: Bearer gcpj_...).")
    token = (
        JoinToken.objects.select_related("pool")
        .filter(
            token_hash=hash_token(raw),
            revoked_at__isnull=True,
            expires_at__gt=timezone.now(),
            uses__lt=F("max_uses"),
        )
        .first()
    )
    if token is None:
        raise AgentAuthError(_UNUSABLE)
    return token


def spend_join_token(token: JoinToken) -> None:
    """Spend one use of it, or AgentAuthError when it has none left or was revoked or expired
    since it was read.

    The use is counted by a conditional UPDATE, so two agents racing for the last use of a
    token cannot both get in: the row count says who won. The UPDATE holds the token's row
    until the transaction ends, so registrations call it last: those of other nodes with the
    same token then wait for each other's commit only, not for each other's whole work.
    """
    spent = JoinToken.objects.filter(
        pk=token.pk,
        revoked_at__isnull=True,
        expires_at__gt=timezone.now(),
        uses__lt=F("max_uses"),
    ).update(uses=F("uses") + 1)
    if spent == 0:
        raise AgentAuthError(_UNUSABLE)


_UNUSABLE = "Join token invalid, expired, revoked or used up."


def rotate_node_token(node: Node) -> str:
    """Give the node a fresh token; the previous one stops working at once."""
    raw = new_raw_token(NODE_TOKEN_PREFIX)
    _forget_current_token(node)
    Node.objects.filter(pk=node.pk).update(token_hash=hash_token(raw), token_prefix=raw[:12])
    node.token_hash = hash_token(raw)
    node.token_prefix = raw[:12]
    return raw


def revoke_node_token(node: Node) -> None:
    """Cut a node off (a stolen token, a decommissioned host): it must register again."""
    _forget_current_token(node)
    Node.objects.filter(pk=node.pk).update(token_hash=None, token_prefix="")
    node.token_hash = None
    node.token_prefix = ""


def _forget_current_token(node: Node) -> None:
    """The token the node holds now stops being trusted anywhere once this change commits, even
    by a web process answering heartbeats while the database is out of reach."""
    from controlplane.cluster import lease

    current = Node.objects.filter(pk=node.pk).values_list("token_hash", flat=True).first()
    lease.forget_token_on_commit(current)
