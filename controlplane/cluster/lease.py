"""Node leases on the control plane's side (the timing argument is in docs/agent-protocol.md).

Every answered heartbeat renews its node's lease of NODE_LEASE_S. The agent counts the lease from
the moment it SENT that heartbeat and stops its own attempts before the lease runs out; the
control plane declares a node's attempts lost only NODE_LEASE_MARGIN_S after the lease ran out
as the control plane counts it, so the old processes are gone before their GPUs are given away.

What this module adds to "the last heartbeat was long ago":

- Silence is counted only while the control plane could hear. `LivenessClock.hearing_since`
  moves forward whenever it could not (see `note_hearing`), and silence counts from the later of
  a node's last heartbeat and that moment.
- A renewal is granted only once it is recorded where the sweep reads it: the node row in
  PostgreSQL, or, while a web process cannot reach PostgreSQL, a Redis hash
  (`record_degraded_renewal`) that the sweep reads beside the node rows.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction

from controlplane.cluster.models import LivenessClock, Node
from controlplane.redis_client import deployment_key

log = logging.getLogger(__name__)

# A hash under this deployment's prefix (its node ids are another's too): node id -> Unix time of
# the last renewal a web process granted without PostgreSQL.
DEGRADED_RENEWALS_KEY = "degraded-renewals"
DEGRADED_RENEWALS_TTL_S = 7 * 24 * 3600


def degraded_renewals_key() -> str:
    return deployment_key(DEGRADED_RENEWALS_KEY)


class LeaseStoreUnavailable(Exception):
    """Redis could not be read: renewals granted without PostgreSQL cannot be ruled out."""


def lease_s() -> float:
    return float(settings.NODE_LEASE_S)


def grant() -> dict[str, float]:
    """What every answer tells the agent: its lease, and how long before its end the node's
    fence must have stopped every attempt (docs/agent-protocol.md, "Leases")."""
    return {"lease_s": lease_s(), "fence_margin_s": float(settings.NODE_FENCE_MARGIN_S)}


def lost_after() -> dt.timedelta:
    """Silence after which a node's attempts are declared lost: its lease, and the margin."""
    return dt.timedelta(seconds=lease_s() + float(settings.NODE_LEASE_MARGIN_S))


def not_ready_after(node: Node) -> dt.timedelta:
    return dt.timedelta(seconds=settings.NODE_NOT_READY_AFTER_INTERVALS * node.heartbeat_interval_s)


# --- hearing -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hearing:
    """What one sweep decided about the control plane's own ability to hear."""

    since: dt.datetime
    deaf_reason: str  # why `since` moved at this sweep; "" when it did not


def note_hearing(now: dt.datetime) -> Hearing:
    """Record this sweep, and move `hearing_since` to now if the control plane was deaf.

    Deaf means: no sweep for LIVENESS_SWEEP_GAP_S (the database, the broker, beat or the
    worker was down, so nobody was listening to the silence either), or no node at all heard
    for LIVENESS_DEAF_AFTER_S (the web tier or the way to it was down: with every node silent
    at once, the likelier fault is ours), or renewals granted without PostgreSQL cannot be read.
    Moving `hearing_since` only ever delays a loss; it can never cause one.
    """
    with transaction.atomic():
        clock, _ = LivenessClock.objects.select_for_update().get_or_create(pk=1)
        reasons = []
        if clock.last_sweep_at is None or clock.hearing_since is None:
            reasons.append("first liveness sweep")
        elif (now - clock.last_sweep_at).total_seconds() > settings.LIVENESS_SWEEP_GAP_S:
            gap_s = (now - clock.last_sweep_at).total_seconds()
            reasons.append(f"no liveness sweep for {gap_s:.0f} s")
        if not reasons and not _anyone_heard(now):
            reasons.append(f"no node heard for {settings.LIVENESS_DEAF_AFTER_S:.0f} s")
        reason = "; ".join(reasons)[:200]
        if reason and not clock.deaf_reason:
            log.warning(
                "the control plane could not hear its nodes (%s): every node gets a whole lease "
                "from when it can again before anything is declared lost",
                reason,
            )
        elif clock.deaf_reason and not reason:
            log.info("the control plane hears its nodes again (was: %s)", clock.deaf_reason)
        if reason:
            clock.hearing_since = now
        clock.deaf_reason = reason
        if clock.last_sweep_at is None or now > clock.last_sweep_at:
            clock.last_sweep_at = now
        clock.save()
        assert clock.hearing_since is not None, "a first sweep is a reason to set it"
        return Hearing(since=clock.hearing_since, deaf_reason=reason)


def _anyone_heard(now: dt.datetime) -> bool:
    horizon = now - dt.timedelta(seconds=settings.LIVENESS_DEAF_AFTER_S)
    if not Node.objects.exists():
        return True  # nobody to hear: nothing can be declared lost anyway
    if Node.objects.filter(last_heartbeat_at__gte=horizon).exists():
        return True
    try:
        renewals = degraded_renewals(None)
    except LeaseStoreUnavailable:
        return False
    return any(at >= horizon for at in renewals.values())


def silent_since(node: Node, hearing_since: dt.datetime, renewed: dt.datetime | None = None):
    """From when the node's silence counts: its last renewal, or when we could hear again."""
    heard = node.last_heartbeat_at or node.created_at
    return max(heard, hearing_since, renewed or heard)


# --- renewals granted while PostgreSQL is out of reach -----------------------------------------


def record_degraded_renewal(node_id: int, at: dt.datetime) -> None:
    """Record a renewal in Redis; raises if it could not be recorded (then no renewal is due)."""
    from controlplane.redis_client import get_redis

    pipe = get_redis().pipeline(transaction=True)
    pipe.hset(degraded_renewals_key(), str(node_id), repr(at.timestamp()))
    pipe.expire(degraded_renewals_key(), DEGRADED_RENEWALS_TTL_S)
    pipe.execute()


def degraded_renewals(node_ids: Iterable[int] | None) -> dict[int, dt.datetime]:
    """The renewals granted without PostgreSQL, for these nodes (None: all)."""
    if not settings.REDIS_URL:
        return {}
    from controlplane.redis_client import get_redis

    pairs: list[tuple[bytes | str, bytes | str | None]]
    try:
        if node_ids is None:
            raw = get_redis().hgetall(degraded_renewals_key())
            pairs = [(k, v) for k, v in raw.items()]
        else:
            ids = [str(i) for i in node_ids]
            if not ids:
                return {}
            pairs = list(zip(ids, get_redis().hmget(degraded_renewals_key(), ids), strict=True))
    except Exception as exc:
        raise LeaseStoreUnavailable(str(exc)) from exc
    renewals = {}
    for key, value in pairs:
        if value is None:
            continue
        renewals[int(key)] = dt.datetime.fromtimestamp(float(value), tz=dt.UTC)
    return renewals


# --- node tokens a web process may trust while PostgreSQL is out of reach ----------------------
#
# A token is trusted when a web process found it on its node's row recently. Each process keeps
# what it checked itself, and shares it through Redis (a key per token hash, expiring after
# DEGRADED_TOKEN_TRUST_S) so that a web process started during an outage, or one an agent's
# kept-alive connection happens to reach, can renew too. A rotated or revoked token's key is
# deleted when the change commits.

TRUSTED_TOKEN_KEY = "trusted-node-token:"  # followed by the token's hash
# A process shares a token again at most this often. The key's expiry is far longer; what a
# share again is for is a Redis that lost its keys (restarted without persistence, failed
# over): until the token is shared again, a web process started during a database outage
# cannot renew its node's lease. Each share is one SET in the telemetry batch.
TOKEN_SHARE_EVERY_S = 20.0


def trusted_token_key(digest: str) -> str:
    # Under this deployment's prefix, like every key: a token trusted here means nothing to
    # another deployment on the same Redis, and deleting this deployment's keys leaves theirs.
    return deployment_key(TRUSTED_TOKEN_KEY + digest)


@dataclass(frozen=True, slots=True)
class TrustedNode:
    node_id: int
    name: str
    heartbeat_interval_s: float
    checked_at_monotonic: float
    # When this process last shared it through Redis (0: never; a trust read from Redis).
    shared_at_monotonic: float = 0.0


_trusted_lock = threading.Lock()
_trusted: dict[str, TrustedNode] = {}


def remember_checked_token(digest: str, node_id: int, name: str, interval_s: float) -> None:
    """This process just found this token hash on this node's row in PostgreSQL."""
    now = time.monotonic()
    with _trusted_lock:
        previous = _trusted.get(digest)
        # Counted from the last share, not the last check: a node heartbeats far more often
        # than TOKEN_SHARE_EVERY_S, and counted from its last check it would never be shared
        # again after Redis lost the key.
        shared_at = now
        if previous is not None and previous.node_id == node_id:
            if now - previous.shared_at_monotonic < TOKEN_SHARE_EVERY_S:
                shared_at = previous.shared_at_monotonic
        share = shared_at == now
        entry = TrustedNode(node_id, name, interval_s, now, shared_at)
        _trusted[digest] = entry
    if settings.REDIS_URL and share:
        _share(digest, entry)


def _share(digest: str, entry: TrustedNode) -> None:
    from controlplane.cluster import telemetry

    value = json.dumps([entry.node_id, entry.name, entry.heartbeat_interval_s])
    ttl_s = int(settings.DEGRADED_TOKEN_TRUST_S)
    if telemetry.flush_interval_s() > 0:
        telemetry.buffer.add_answer(trusted_token_key(digest), value, ttl_s)
    else:
        telemetry.write_answers({trusted_token_key(digest): (value, ttl_s)})


def forget_token(digest: str | None) -> None:
    """PostgreSQL no longer knows this token (rotated, revoked): never trust it again."""
    if not digest:
        return
    with _trusted_lock:
        known = _trusted.pop(digest, None)
    if settings.REDIS_URL and known is not None:
        _unshare(digest)


def _unshare(digest: str) -> None:
    from controlplane.redis_client import get_redis

    try:
        get_redis().delete(trusted_token_key(digest))
    except Exception:
        log.warning("could not withdraw a node token's trust from Redis", exc_info=True)


def forget_token_on_commit(digest: str | None) -> None:
    """A node's token changes in this transaction: its old one loses all trust once it commits."""
    if digest:
        transaction.on_commit(lambda: _forget_everywhere(digest))


def _forget_everywhere(digest: str) -> None:
    with _trusted_lock:
        _trusted.pop(digest, None)
    if settings.REDIS_URL:
        _unshare(digest)


def trusted_node(digest: str) -> TrustedNode | None:
    """The node holding this token as this process, or another through Redis, last checked it
    against PostgreSQL within DEGRADED_TOKEN_TRUST_S; None when nobody did."""
    with _trusted_lock:
        entry = _trusted.get(digest)
    if entry is not None:
        if time.monotonic() - entry.checked_at_monotonic <= settings.DEGRADED_TOKEN_TRUST_S:
            return entry
        return None
    if not settings.REDIS_URL:
        return None
    from controlplane.redis_client import get_redis

    try:
        raw = get_redis().get(trusted_token_key(digest))
    except Exception:
        return None
    if raw is None:
        return None
    node_id, name, interval_s = json.loads(raw)
    # Shared at most TOKEN_SHARE_EVERY_S ago, and the key expires with the trust.
    return TrustedNode(int(node_id), str(name), float(interval_s), time.monotonic())
