"""Who may take a GPU that another node holds, the record of a refusal, and an admin's way out.

A GPU is known by its UUID, and a registration lists the UUIDs of its node's GPUs. Were any
listed UUID simply moved to the registering node, a join token would be enough to take another
node's GPUs: the scheduler would place work "there", and the real node's running jobs would be
declared lost once the GPU rows left it. So a GPU moves to another node only when the node that
holds it is gone for good:

- an admin deregistered it (`deregister_node`: only once no attempt is active there), or
- it is down and has been silent past the lost-node threshold (its lease and margin, counted
  as the liveness sweep counts them), and none of its attempts is active any more;

and never while an active allocation holds the GPU. Anything else refuses the whole
registration (409, naming each GPU and its holder) and records a `GpuClaimConflict`, which an
admin sees in the REST API and Django admin and resolves: by deregistering the holder (the GPU
really moved to a new host), or by dismissing the claim (it was a mistake or an attack).
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

from django.db import IntegrityError, transaction
from django.db.models import F, Q
from django.utils import timezone

from controlplane.cluster import lease
from controlplane.cluster.models import (
    GPU,
    GpuClaimConflict,
    GpuClaimResolution,
    JoinToken,
    LivenessClock,
    Node,
)
from controlplane.jobs.models import ACTIVE_ATTEMPT_STATES, Allocation, JobAttempt

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Claim:
    """One listed GPU that another node holds, and why it may not move."""

    uuid: str
    holder_id: int | None
    holder_name: str
    reason: str

    def as_json(self) -> dict:
        return {"uuid": self.uuid, "node": self.holder_name, "reason": self.reason}


class GpuClaimRefused(Exception):
    """A registration listed GPUs other nodes still hold; nothing of it may be applied."""

    def __init__(self, claims: list[Claim], join_token: JoinToken | None = None):
        self.claims = claims
        self.join_token = join_token
        uuids = ", ".join(c.uuid for c in claims)
        super().__init__(f"GPUs held by other nodes: {uuids}")

    def answer(self) -> dict:
        listed = "; ".join(f"{c.uuid} is held by node {c.holder_name}: {c.reason}" for c in self)
        return {
            "detail": (
                f"Refused: this inventory lists GPUs that other nodes hold ({listed}). A GPU "
                "moves to another node only once its node is gone for good: deregistered by "
                "an admin, or lost with none of its attempts active. An admin can see and "
                "resolve this conflict (GET /api/v1/gpu-claim-conflicts/)."
            ),
            "gpus": [c.as_json() for c in self.claims],
        }

    def __iter__(self):
        return iter(self.claims)


class NodeBusy(Exception):
    """A node that still runs work cannot be deregistered."""


def _hearing_since(now: dt.datetime) -> dt.datetime:
    """Since when the control plane could hear its nodes: the liveness sweep's clock. With no
    sweep recorded yet, nobody has been counting silence, so none counts."""
    clock = LivenessClock.objects.filter(pk=1).values_list("hearing_since", flat=True).first()
    return clock or now


def _active_attempts(node: Node) -> list[int]:
    on_node = Q(node_id=node.pk) | Q(
        pk__in=Allocation.objects.filter(active=True, gpu__node_id=node.pk).values("attempt_id")
    )
    return list(
        JobAttempt.objects.filter(on_node, state__in=ACTIVE_ATTEMPT_STATES)
        .order_by("pk")
        .values_list("pk", flat=True)[:10]
    )


def why_held(gpu: GPU, holder: Node, now: dt.datetime) -> str | None:
    """Why `holder` still holds `gpu` (None: it is gone for good and the GPU may move).

    Call with both rows locked, so that neither a heartbeat nor the scheduler changes the answer
    before the caller's transaction ends.
    """
    held_by = (
        Allocation.objects.filter(gpu_id=gpu.pk, active=True)
        .values_list("attempt_id", "attempt__job_id")
        .first()
    )
    if held_by is not None:
        return f"an active allocation holds it (attempt {held_by[0]} of job {held_by[1]})"
    if holder.deregistered_at is not None:
        return None
    if holder.ready:
        heard = holder.last_heartbeat_at or holder.created_at
        return f"the node is live (last heard {heard:%Y-%m-%d %H:%M:%S} UTC)"
    try:
        renewed = lease.degraded_renewals([holder.pk]).get(holder.pk)
    except lease.LeaseStoreUnavailable:
        return "the node is down, but renewals of its lease cannot be read now (Redis)"
    silent_s = (now - lease.silent_since(holder, _hearing_since(now), renewed)).total_seconds()
    lost_after_s = lease.lost_after().total_seconds()
    if silent_s < lost_after_s:
        return (
            f"the node is down but has been silent only {max(0.0, silent_s):.0f} s; its GPUs "
            f"may move after {lost_after_s:.0f} s of silence, once its attempts have ended"
        )
    active = _active_attempts(holder)
    if active:
        return f"the node is lost but its attempts {active} are still active"
    return None


def lock_claims(own_id: int | None, uuids: list[str], now: dt.datetime) -> dict[str, GPU]:
    """Lock the listed GPUs that a node other than the registering one (`own_id`, None for a
    new node) holds, and those nodes.

    Returns them by UUID when every holder is gone for good; raises GpuClaimRefused naming
    every one that is not. Holders are locked before their GPUs, in id order: a heartbeat locks
    its node row and then writes its GPU rows, so the same order cannot deadlock with it.
    """
    if not uuids:
        return {}
    elsewhere = GPU.objects.filter(uuid__in=uuids)
    if own_id is not None:
        elsewhere = elsewhere.exclude(node_id=own_id)
    for _ in range(3):
        holder_ids = set(elsewhere.values_list("node_id", flat=True))
        if not holder_ids:
            return {}
        holders = {
            n.pk: n
            for n in Node.objects.select_for_update().filter(pk__in=holder_ids).order_by("pk")
        }
        gpus = list(elsewhere.select_for_update().order_by("pk"))
        if any(g.node_id not in holders for g in gpus):
            continue  # one changed hands while we locked: look again with its new holder
        refused = []
        for gpu in gpus:
            holder = holders[gpu.node_id]
            reason = why_held(gpu, holder, now)
            if reason is not None:
                refused.append(Claim(gpu.uuid, holder.pk, holder.name, reason))
        if refused:
            raise GpuClaimRefused(refused)
        for gpu in gpus:
            log.warning(
                "GPU %s moves from node %s, gone for good, to a registering node",
                gpu.uuid,
                holders[gpu.node_id].name,
            )
        return {g.uuid: g for g in gpus}
    raise GpuClaimRefused(
        [Claim(u, None, "(changing)", "another registration is taking it right now") for u in uuids]
    )


def claims_raced(node_name: str, uuids: list[str]) -> list[Claim]:
    """After a registration failed on the GPU UUID constraint: which listed GPUs another
    registration, committed meanwhile, now holds."""
    return [
        Claim(g.uuid, g.node_id, g.node.name, "another node registered it at the same time")
        for g in GPU.objects.filter(uuid__in=uuids)
        .exclude(node__name=node_name)
        .select_related("node")
    ]


def record_refusal(refused: GpuClaimRefused, claimant: str) -> None:
    """Keep one open conflict per GPU and claimant, counting the refusals (agents retry)."""
    now = timezone.now()
    for claim in refused:
        fields = {
            "holder_id": claim.holder_id,
            "holder_name": claim.holder_name[:253],
            "reason": claim.reason[:300],
            "join_token": refused.join_token,
            "last_refused_at": now,
        }
        open_rows = GpuClaimConflict.objects.filter(
            gpu_uuid=claim.uuid, claimant=claimant, resolved_at__isnull=True
        )
        if open_rows.update(refusals=F("refusals") + 1, **fields):
            continue
        try:
            with transaction.atomic():
                GpuClaimConflict.objects.create(
                    gpu_uuid=claim.uuid, claimant=claimant, first_refused_at=now, **fields
                )
        except IntegrityError:
            # Another refusal of the same claim created it first: count this one there.
            open_rows.update(refusals=F("refusals") + 1, **fields)
    log.warning(
        "registration of %s refused: it lists GPUs other nodes hold (%s)",
        claimant,
        ", ".join(f"{c.uuid} on {c.holder_name}" for c in refused),
    )


def note_claimed(node: Node, uuids: list[str], now: dt.datetime) -> None:
    """The claimant registered with these GPUs after all: its open conflicts are over."""
    GpuClaimConflict.objects.filter(
        claimant=node.name, gpu_uuid__in=uuids, resolved_at__isnull=True
    ).update(resolved_at=now, resolution=GpuClaimResolution.CLAIMED)


# --- what an admin does ------------------------------------------------------------------------


@transaction.atomic
def deregister_node(node: Node, *, actor=None) -> Node:
    """The node is gone for good: revoke its token, take it out of scheduling, free its GPUs'
    identity for another node. Refused (NodeBusy) while any attempt is active there; a node
    that died with work has its attempts declared lost by the liveness sweep first.

    Re-joining it (a join token issued for its name) undoes this.
    """
    node = Node.objects.select_for_update().get(pk=node.pk)
    if node.deregistered_at is not None:
        return node
    active = _active_attempts(node)
    if active:
        raise NodeBusy(
            f"Node {node.name} still has active attempts {active}: cancel or drain them, or, "
            "if the node is dead, wait until the liveness sweep declares them lost (its lease "
            "and margin after it was last heard)."
        )
    now = timezone.now()
    lease.forget_token_on_commit(node.token_hash)
    Node.objects.filter(pk=node.pk).update(
        deregistered_at=now, ready=False, token_hash=None, token_prefix=""
    )
    who = actor.username if actor is not None else "system"
    log.warning("node %s deregistered by %s: its GPUs may join another node", node.name, who)
    node.refresh_from_db()
    return node


@transaction.atomic
def resolve_conflict(
    conflict: GpuClaimConflict, resolution: str, *, actor=None
) -> GpuClaimConflict:
    """Close a conflict. `holder_deregistered` deregisters its holder first (NodeBusy while the
    holder runs work), after which the claimant's next registration takes the GPU; `dismissed`
    changes nothing else (revoke the join token if the claim was hostile)."""
    conflict = GpuClaimConflict.objects.select_for_update().get(pk=conflict.pk)
    if conflict.resolved_at is not None:
        return conflict
    now = timezone.now()
    closing = GpuClaimConflict.objects.filter(pk=conflict.pk)
    if resolution == GpuClaimResolution.HOLDER_DEREGISTERED:
        if conflict.holder_id is not None:
            deregister_node(Node.objects.get(pk=conflict.holder_id), actor=actor)
            # Every open claim on that node's GPUs is settled the same way.
            closing = GpuClaimConflict.objects.filter(
                holder_id=conflict.holder_id, resolved_at__isnull=True
            )
    elif resolution != GpuClaimResolution.DISMISSED:
        raise ValueError(f"unknown resolution {resolution!r}")
    closing.update(resolved_at=now, resolved_by=actor, resolution=resolution)
    conflict.refresh_from_db()
    return conflict
