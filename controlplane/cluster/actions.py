"""Every write to the cluster's configuration and liveness: a node registering, an admin's wish
for a node (cordon / drain / uncordon / deregister), the liveness sweep's verdicts, and pools
with their power budgets. The REST API, the web UI, the Django admin, the agent API and the
liveness task call these; none of them writes these rows itself.

Each action is atomic, checks its rule (`controlplane.cluster.rules`, which the serializers and
forms call too), leaves one row in the audit trail (`controlplane.audit`) and, since every one of
these changes what the scheduler may place where, asks for a scheduling cycle once it has
committed. Telemetry and heartbeats (`heartbeat.py`, `telemetry.py`) are not configuration and
write on their own fast paths.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from controlplane import wakeups
from controlplane.audit import trail
from controlplane.cluster import gpu_claims, lease, rules
from controlplane.cluster.agent_auth import (
    JOIN_TOKEN_PREFIX,
    issue_join_token,
    rotate_node_token,
    spend_join_token,
    usable_join_token,
)
from controlplane.cluster.models import (
    GPU,
    GpuClaimConflict,
    GpuClaimResolution,
    JoinToken,
    Node,
    Pool,
)
from controlplane.jobs import actions as job_actions
from controlplane.jobs.models import ACTIVE_ATTEMPT_STATES, Allocation, JobAttempt
from controlplane.tenancy.models import hash_token

log = logging.getLogger(__name__)

# Indexes real GPUs never have: where a GPU that left the node is kept, and where one that
# changes index waits during a registration.
RETIRED_INDEX = 1000
PARKED_INDEX = 1_000_000

# Who the system's own writes are by, in the audit trail.
LIVENESS_SWEEP = "liveness sweep"

NODE_INVENTORY_FIELDS = ("pool", "cpus", "memory_mib", "labels", "agent_version", "runtime")


def _cycle_on_commit(reason: str) -> None:
    transaction.on_commit(lambda: wakeups.request_cycle(reason))


# --- registration -------------------------------------------------------------------------------


class RegistrationRefused(Exception):
    """The join token may not register this node. `conflict` is False when the credential is
    simply not for this name (the agent API answers 403), True when the name is taken (409)."""

    def __init__(self, message: str, *, conflict: bool):
        self.message = message
        self.conflict = conflict
        super().__init__(message)


def _name_taken(name: str) -> RegistrationRefused:
    return RegistrationRefused(
        f"A node named {name!r} is already registered. To join it again (its agent lost its "
        "node token), use a join token issued for this node name (node_name).",
        conflict=True,
    )


def _spare_index(node: Node) -> int:
    top = GPU.objects.filter(node=node).order_by("-index").values_list("index", flat=True).first()
    return max(RETIRED_INDEX, (top or 0) + 1)


def _inventory(node: Node | None, gpu_uuids: list[str]) -> dict | None:
    if node is None:
        return None
    return {**trail.snapshot(node, NODE_INVENTORY_FIELDS), "gpus": sorted(gpu_uuids)}


@transaction.atomic
def register_node(raw_join_token: str | None, data: dict) -> tuple[Node, str]:
    """Spend a use of the join token, create the node or update it when the token was issued for
    its name, lay out its GPUs as reported, and issue a node token; (node, raw node token).

    A join token that names no node makes new nodes only: registering an existing name would
    hand its holder that node's identity (a fresh node token, the node's work to come, the
    right to report its attempts' exits). Nor does it take GPUs another node holds: a listed
    GPU joins this node only when its node is gone for good (controlplane.cluster.gpu_claims,
    whose GpuClaimRefused carries the join token so the refusal can be recorded once this
    transaction has rolled back). Raises AgentAuthError for a join token that does not work.
    """
    now = timezone.now()
    key = data.get("registration_key")
    if key and raw_join_token:
        # The tries of one registration (its join token and node name) wait for each other
        # here: a retry that arrives while the first try is still being written waits for it,
        # then finds its node. Other nodes joining with the same token do not wait.
        _one_registration_at_a_time(raw_join_token, data["name"])
        again = _registered_again(raw_join_token, data, key, now)
        if again is not None:
            return again
    join = usable_join_token(raw_join_token)
    try:
        registered = _register(join, data, now)
    except gpu_claims.GpuClaimRefused as exc:
        exc.join_token = join
        raise
    # Last: spending the use locks the token's row until this transaction ends, and every
    # node joining with the token spends one. Done first, it made a pool's nodes register one
    # after another (250 agents restarted together took minutes, each waiting seconds); a use
    # found gone here rolls the registration back whole.
    spend_join_token(join)
    return registered


def _one_registration_at_a_time(raw_join_token: str, name: str) -> None:
    """Wait for any other transaction registering this node name with this join token (a
    transaction-scoped advisory lock; SQLite, the embedded mode, has one writer anyway)."""
    if connection.vendor != "postgresql":
        return
    digest = hashlib.sha256(f"gpucp.register:{hash_token(raw_join_token)}:{name}".encode())
    key = int.from_bytes(digest.digest()[:8], "big", signed=True)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [key])


# How long after a registration its agent may send it again and get a node token: a retry
# after an answer lost on the way (a timeout under load, a dropped connection) comes within
# seconds; later, the node must join with a join token that still has a use.
REGISTRATION_RETRY_S = 600.0


def _registered_again(
    raw_join_token: str, data: dict, key: str, now: dt.datetime
) -> tuple[Node, str] | None:
    """The retry of a registration whose answer its agent never got: the same join token (not
    revoked, not expired; its use was spent by the first), the same node name and the same
    registration key, a later try than any that got a node token, within REGISTRATION_RETRY_S,
    before any heartbeat used a node token they issued. The node gets a fresh node token (the
    one before, never received, stops working); nothing else changes, and no use of the join
    token is spent. None when it is not that.

    Tries are numbered by the agent: an earlier one still in flight when the agent gave up on
    it, and answered after a later one, must not take the node token the later one delivered.
    """
    if not raw_join_token.startswith(JOIN_TOKEN_PREFIX + "_"):
        return None
    try_number = data.get("registration_try") or 1
    if try_number <= 1:
        # A first try follows none (a node stores the number of the try that made it, at
        # least 1): the read below would find nothing, at a fifth of a registration's CPU.
        return None
    node = (
        Node.objects.select_for_update()
        .filter(
            name=data["name"],
            registration_try__lt=try_number,
            registration_key_hash=hash_token(key),
            registration_join_token__token_hash=hash_token(raw_join_token),
            registration_join_token__revoked_at__isnull=True,
            registration_join_token__expires_at__gt=now,
            registered_at__gte=now - dt.timedelta(seconds=REGISTRATION_RETRY_S),
            # A heartbeat moves last_heartbeat_at past the registration: the first answer did
            # arrive, and whoever holds its token is the node.
            last_heartbeat_at__lte=F("registered_at"),
            deregistered_at__isnull=True,
        )
        .select_related("registration_join_token")
        .first()
    )
    if node is None:
        return None
    token = rotate_node_token(node)
    Node.objects.filter(pk=node.pk).update(registration_try=try_number)
    join = node.registration_join_token
    trail.record(
        "node.register",
        actor_label=f"join token {join.prefix if join else ''}",
        obj=node,
        message=f"Node {node.name} sent its registration again (its answer was lost); "
        "it has a new node token.",
    )
    return node, token


def _register(join, data: dict, now: dt.datetime) -> tuple[Node, str]:
    name = data["name"]
    if join.node_name and join.node_name != name:
        # The name may well be free; this credential is simply not for it.
        raise RegistrationRefused(
            f"This join token was issued for node {join.node_name!r} only, not {name!r}.",
            conflict=False,
        )
    own = Node.objects.filter(name=name).first()
    if own is not None and not join.node_name:
        raise _name_taken(name)
    before = (
        _inventory(own, list(GPU.objects.filter(node=own).values_list("uuid", flat=True)))
        if own is not None
        else None
    )
    # Before this node's own row: holders, then their GPUs, then this node (see lock_claims).
    moving_in = gpu_claims.lock_claims(
        own.pk if own else None, [g["uuid"] for g in data["gpus"]], now
    )
    fields = {
        "pool": join.pool,
        "cpus": data["cpus"],
        "memory_mib": data["memory_mib"],
        "labels": data["labels"],
        "agent_version": data["agent_version"],
        "runtime": data["runtime"],
        **data.get("address", {}),
        "heartbeat_interval_s": settings.AGENT_HEARTBEAT_INTERVAL_S,
        "last_heartbeat_at": now,
        "ready": True,
        "deregistered_at": None,
        "registered_at": now,
        "registration_join_token": join,
        "registration_key_hash": hash_token(key) if (key := data.get("registration_key")) else "",
        "registration_try": data.get("registration_try") or 1,
    }
    if join.node_name:
        node, _ = Node.objects.select_for_update().update_or_create(name=name, defaults=fields)
    else:
        try:
            # Create, not get-or-create: a name taken between the look-up and the insert
            # (another registration racing this one) is refused by the unique constraint.
            with transaction.atomic():
                node = Node.objects.create(name=name, **fields)
        except IntegrityError:
            raise _name_taken(name) from None
    reported = {g["uuid"]: g for g in data["gpus"]}
    existing = {g.uuid: g for g in GPU.objects.select_for_update().filter(node=node)}
    # A GPU that left this node (pulled, swapped, dead) is kept for its history but marked
    # unhealthy, and moved off the index a replacement may now have.
    taken = {g["index"] for g in data["gpus"]}
    for uuid, gpu in existing.items():
        if uuid not in reported:
            updates: dict[str, bool | int] = {"healthy": False}
            if gpu.index in taken:
                updates["index"] = _spare_index(node)
            GPU.objects.filter(pk=gpu.pk).update(**updates)
    # Park the GPUs that change index out of the way first, so a reordering (two GPUs swapping
    # indexes) never collides with the one-index-per-node constraint half way through.
    moving = [u for u, g in existing.items() if u in reported and g.index != reported[u]["index"]]
    if moving:
        GPU.objects.filter(node=node, uuid__in=moving).update(index=F("index") + PARKED_INDEX)
    new_gpus = []
    for g in data["gpus"]:
        inventory = {k: g[k] for k in g if k != "uuid"}
        known = existing.get(g["uuid"]) or moving_in.get(g["uuid"])
        if known is None:
            new_gpus.append(GPU(uuid=g["uuid"], **inventory, node=node, healthy=True))
        else:
            # Its own, or one whose node is gone for good (locked): it keeps its history.
            GPU.objects.filter(pk=known.pk).update(**inventory, node=node, healthy=True)
    # Inserted, not updated-or-created, and in one statement (a node's GPUs one by one were a
    # quarter of a registration's CPU): a row of one of these UUIDs made since lock_claims
    # looked (another registration) fails it on the unique constraint, never taken over. The
    # node's own save above has told this process's cluster shape to be read again.
    GPU.objects.bulk_create(new_gpus)
    gpu_claims.note_claimed(node, list(reported), now)
    token = rotate_node_token(node)
    trail.record(
        "node.register",
        actor_label=f"join token {join.prefix}",
        obj=node,
        before=before,
        after=_inventory(node, list(reported)),
        message=f"Node {node.name} {'re-joined' if own else 'registered'} with "
        f"{len(reported)} GPUs in pool {join.pool.name}.",
    )
    _cycle_on_commit("node_registered")
    return node, token


# --- join tokens -------------------------------------------------------------------------------


@transaction.atomic
def create_join_token(
    pool: Pool,
    *,
    actor,
    expires_at: dt.datetime | None = None,
    max_uses: int = 1,
    node_name: str = "",
) -> tuple[JoinToken, str]:
    """A token nodes join `pool` with (a day by default); (token, raw secret shown once)."""
    now = timezone.now()
    expires_at = expires_at or now + rules.DEFAULT_JOIN_TOKEN_LIFETIME
    token, raw = issue_join_token(
        pool, expires_at=expires_at, max_uses=max_uses, created_by=actor, node_name=node_name
    )
    trail.record(
        "join_token.create",
        actor=actor,
        obj=token,
        object_repr=token.prefix,
        after={
            "pool": pool.name,
            "expires_at": expires_at,
            "max_uses": max_uses,
            "node_name": node_name,
        },
        message=f"Join token {token.prefix} for pool {pool.name} issued.",
    )
    return token, raw


@transaction.atomic
def revoke_join_token(token: JoinToken, *, actor) -> bool:
    """No node can register with it any more; True when this call revoked it."""
    now = timezone.now()
    if not JoinToken.objects.filter(pk=token.pk, revoked_at__isnull=True).update(revoked_at=now):
        return False
    trail.record(
        "join_token.revoke",
        actor=actor,
        obj=token,
        object_repr=token.prefix,
        before={"revoked_at": None},
        after={"revoked_at": now},
        message=f"Join token {token.prefix} revoked.",
    )
    return True


# --- an admin's wish for a node -----------------------------------------------------------------


@transaction.atomic
def set_node_state(node: Node, state: str, *, actor=None) -> bool:
    """Set the admin state (ready / cordoned / draining); True when it changed.

    The scheduler reads Node.state at its next cycle, asked for on commit: a cordoned node gets
    no new work, a draining one also has its borrowed work preempted. Liveness (Node.ready) is
    the agent's, never set here.
    """
    rules.check_node_state(state)
    was = Node.objects.select_for_update().filter(pk=node.pk).values_list("state", flat=True).get()
    node.state = state
    if was == state:
        return False
    Node.objects.filter(pk=node.pk).update(state=state)
    who = trail.actor_label_of(actor)
    log.info("node %s is now %s (by %s)", node.name, state, who)
    trail.record(
        "node.set_state",
        actor=actor,
        obj=node,
        before={"state": was},
        after={"state": state},
        message=f"Node {node.name} {was} → {state}.",
    )
    _cycle_on_commit(f"node_{state}")
    return True


@transaction.atomic
def deregister_node(node: Node, *, actor=None) -> Node:
    """The node is gone for good (controlplane.cluster.gpu_claims.deregister_node says what that
    means); raises gpu_claims.NodeBusy while any attempt is active there."""
    was = node.deregistered_at
    node = gpu_claims.deregister_node(node, actor=actor)
    if was is None and node.deregistered_at is not None:
        trail.record(
            "node.deregister",
            actor=actor,
            obj=node,
            before={"deregistered_at": None},
            after={"deregistered_at": node.deregistered_at},
            message=f"Node {node.name} deregistered: its GPUs may join another node.",
        )
        _cycle_on_commit("node_deregistered")
    return node


@transaction.atomic
def resolve_gpu_claim(conflict: GpuClaimConflict, resolution: str, *, actor=None):
    """Close a refused registration's GPU claim (gpu_claims.resolve_conflict says how); raises
    gpu_claims.NodeBusy while the holder to deregister still runs work."""
    was_open = conflict.resolved_at is None
    conflict = gpu_claims.resolve_conflict(conflict, resolution, actor=actor)
    if was_open and conflict.resolved_at is not None:
        trail.record(
            "gpu_claim.resolve",
            actor=actor,
            obj=conflict,
            object_repr=f"{conflict.gpu_uuid} claimed by {conflict.claimant}",
            before={"resolution": ""},
            after={"resolution": conflict.resolution, "holder": conflict.holder_name},
            message=f"GPU {conflict.gpu_uuid} claim by {conflict.claimant} resolved: "
            f"{conflict.resolution}.",
        )
        if conflict.resolution == GpuClaimResolution.HOLDER_DEREGISTERED:
            _cycle_on_commit("node_deregistered")
    return conflict


# --- liveness: the sweep's verdicts -------------------------------------------------------------


@transaction.atomic
def mark_node_not_ready(node: Node, *, silent_since: dt.datetime) -> bool:
    """A ready node that fell silent gets no new work; True when this call marked it.

    Conditional on the heartbeat time the sweep judged: a heartbeat that landed since wins.
    """
    changed = Node.objects.filter(
        pk=node.pk, ready=True, last_heartbeat_at=node.last_heartbeat_at
    ).update(ready=False)
    if not changed:
        return False
    log.warning(
        "node %s silent since %s: not ready, gets no new work",
        node.name,
        silent_since.isoformat(),
    )
    trail.record(
        "node.not_ready",
        actor_label=LIVENESS_SWEEP,
        obj=node,
        before={"ready": True},
        after={"ready": False},
        message=f"Node {node.name} silent since {silent_since:%H:%M:%S} UTC: gets no new work.",
    )
    _cycle_on_commit("node_not_ready")
    return True


def lose_node_attempts(
    node: Node, now: dt.datetime, renewed: dt.datetime | None = None
) -> list[int]:
    """Declare lost the active attempts of a node whose lease ran out; their ids.

    Each attempt's exit goes through jobs.actions.finish_attempt (which requeues or fails its
    job, and asks for a cycle). Nothing happens if the node was heard from since it was judged.
    """
    heard = node.last_heartbeat_at or node.created_at
    if renewed is not None and renewed > heard:
        heard = renewed
    # By the end of its lease the node's agent had stopped them (or the node is gone): book
    # them to then, not to whenever this sweep got round to it. A late report corrects both.
    ended_at = min(now, heard + dt.timedelta(seconds=lease.lease_s()))
    message = (
        f"Node {node.name} stopped answering: its lease ran out "
        f"{lease.lease_s():.0f} s after it was last heard, at {heard:%H:%M:%S} UTC"
    )
    with transaction.atomic():
        # Hold the node row while its attempts are declared lost: a heartbeat arriving now
        # waits, then finds them gone from its answer; or it got here first, and the node is
        # no longer the silent one we judged, so nothing is lost. skip_locked: another sweep
        # holding the row is doing this very work.
        still_silent = (
            Node.objects.select_for_update(skip_locked=True)
            .filter(pk=node.pk, ready=False, last_heartbeat_at=node.last_heartbeat_at)
            .exists()
        )
        if not still_silent:
            return []
        on_node = Q(node_id=node.pk) | Q(
            pk__in=Allocation.objects.filter(active=True, gpu__node_id=node.pk).values("attempt_id")
        )
        attempts = list(
            JobAttempt.objects.filter(on_node, state__in=ACTIVE_ATTEMPT_STATES).select_related(
                "node", "job"
            )
        )
        lost = []
        for attempt in attempts:
            try:
                if len(attempt.node_addrs or ()) > 1:
                    # A gang loses its member here alone; the others are told to stop, and
                    # their GPUs free when their own nodes say so.
                    gone = job_actions.record_member_report(
                        job_actions.MemberReport(
                            attempt.pk,
                            node.pk,
                            ended=True,
                            finished_at=ended_at,
                            lost=True,
                            message=message,
                        )
                    )
                else:
                    gone = job_actions.finish_attempt(
                        attempt, exit_code=None, finished_at=ended_at, lost=True, message=message
                    )
                if gone:
                    lost.append(attempt.pk)
            except (job_actions.IllegalTransition, job_actions.ConcurrentUpdate) as exc:
                log.info("attempt %s not declared lost: %s", attempt.pk, exc)
        if lost:
            trail.record(
                "node.attempts_lost",
                actor_label=LIVENESS_SWEEP,
                obj=node,
                after={"attempts": lost, "ended_at": ended_at},
                message=f"{message}: attempts {', '.join(map(str, lost))} declared lost.",
            )
            _cycle_on_commit("node_lost")
    if lost:
        log.warning("node %s lost: attempts %s declared lost", node.name, lost)
    return lost


def record_node_address(node_id: int, address: dict) -> None:
    """What a heartbeat says of where the node's jobs are reached (agent_api.node_address), when
    it differs from what is stored: new attempts' members get it (running ones keep theirs)."""
    differs = Q()
    for key, value in address.items():
        differs |= ~Q(**{key: value})
    Node.objects.filter(differs, pk=node_id).update(**address)


# --- pools ---------------------------------------------------------------------------------------

POOL_FIELDS = ("name", "power_budget_w")


def _watts(value: float | None) -> str:
    return "none" if value is None else f"{value:g} W"


def _budget_change(pool: Pool, before: dict, after: dict) -> tuple[str, str] | None:
    if list(after) != ["power_budget_w"]:
        return None
    return "pool.set_power_budget", (
        f"Power budget of pool {pool.name}: {_watts(before['power_budget_w'])} → "
        f"{_watts(after['power_budget_w'])}."
    )


POOL = trail.Kind(
    "pool", POOL_FIELDS, POOL_FIELDS, title=lambda p: f"Pool {p.name}", named_change=_budget_change
)


@transaction.atomic
def create_pool(*, actor, name: str, power_budget_w: float | None = None) -> Pool:
    values = {"name": name, "power_budget_w": power_budget_w}
    rules.check_pool(values)
    pool = Pool.objects.create(**values)
    trail.created(POOL, pool, actor=actor)
    _cycle_on_commit("pool_created")
    return pool


@transaction.atomic
def update_pool(pool: Pool, *, actor, **values) -> Pool:
    """Rename a pool or set its power budget (None: no budget)."""
    rules.check_pool(values, pool)
    after = trail.save_changes(POOL, pool, values, actor=actor)
    if "power_budget_w" in after:
        _cycle_on_commit("pool_power_budget")
    return pool


def set_pool_power_budget(pool: Pool, power_budget_w: float | None, *, actor) -> Pool:
    return update_pool(pool, actor=actor, power_budget_w=power_budget_w)


@transaction.atomic
def delete_pool(pool: Pool, *, actor) -> None:
    """Raises ProtectedError while nodes are in it (nothing is written then)."""
    trail.deleted(POOL, pool, actor=actor)
    _cycle_on_commit("pool_deleted")


@transaction.atomic
def import_telemetry(readings, *, actor_label: str) -> int:
    """Fold past readings into the GPUs' history buckets: (GPU, time, {field: value}) with the
    fields of a heartbeat's reading (utilization_pct, power_draw_w, power_cap_w, ...).

    For a past recorded elsewhere (the demo's generated week): the same buckets heartbeats fill,
    so charts read both alike. The GPU rows' latest values are left alone: they are the present.
    Readings the history would no longer keep are left out (with a few minutes to spare, so the
    next prune does not find them already too old).
    """
    from controlplane.cluster import telemetry

    kept_from = timezone.now() - dt.timedelta(seconds=telemetry.TELEMETRY_RETENTION_S - 600.0)
    written = telemetry.record_history(
        (gpu.pk, at, telemetry.GpuSample(uuid=gpu.uuid, **fields))
        for gpu, at, fields in readings
        if at >= kept_from
    )
    trail.record(
        "telemetry.history_imported",
        actor_label=actor_label,
        object_type="gpu",
        message=f"Imported {written} telemetry buckets",
        after={"buckets": written},
    )
    return written
