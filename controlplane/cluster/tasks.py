"""Node liveness: a node that stops heartbeating gets no new work, then loses its attempts.

Celery beat runs `sweep_node_liveness` every heartbeat interval. A node's silence counts only
while the control plane could hear it (controlplane.cluster.lease): its own outages never count
against a node. A node silent for NODE_NOT_READY_AFTER_INTERVALS intervals gets no new work; its
attempts are declared lost only once its lease has run out with a margin, by which time the
node's agent has stopped them itself (docs/agent-protocol.md, "Leases").

Two sweeps may overlap (two workers, a slow one): every write is conditional, so each node is
declared down once and each attempt lost once, and a heartbeat that arrives during a sweep wins
over it. This module judges and schedules; the writes are controlplane.cluster.actions'
(mark_node_not_ready, lose_node_attempts), which audit them and ask for a cycle.
"""

from __future__ import annotations

import datetime as dt
import logging

from celery import shared_task
from django.db.models import Q
from django.utils import timezone

from controlplane.cluster import actions, lease, telemetry
from controlplane.cluster.models import Node
from controlplane.jobs.models import ACTIVE_ATTEMPT_STATES, Allocation, JobAttempt

log = logging.getLogger(__name__)

NODE_FIELDS = ("id", "name", "last_heartbeat_at", "created_at", "heartbeat_interval_s")


def _renewals(nodes: list[Node]) -> dict[int, dt.datetime] | None:
    """Renewals granted while PostgreSQL was out of reach; None when they cannot be read."""
    try:
        return lease.degraded_renewals([n.pk for n in nodes])
    except lease.LeaseStoreUnavailable as exc:
        log.warning("cannot read lease renewals from Redis (%s): nothing is judged this sweep", exc)
        return None


def mark_silent_nodes_not_ready(now: dt.datetime, hearing: lease.Hearing) -> list[str]:
    """Ready nodes silent for NODE_NOT_READY_AFTER_INTERVALS of their intervals become not ready."""
    candidates = [
        n
        for n in Node.objects.filter(ready=True).only(*NODE_FIELDS)
        if now - lease.silent_since(n, hearing.since) >= lease.not_ready_after(n)
    ]
    renewed = _renewals(candidates) if candidates else {}
    if renewed is None:
        return []
    marked = []
    for node in candidates:
        if now - lease.silent_since(node, hearing.since, renewed.get(node.pk)) < (
            lease.not_ready_after(node)
        ):
            continue
        if actions.mark_node_not_ready(node, silent_since=lease.silent_since(node, hearing.since)):
            marked.append(node.name)
    return marked


def declare_attempts_lost(now: dt.datetime, hearing: lease.Hearing) -> list[int]:
    """Active attempts of nodes whose lease ran out, as the control plane could hear, are lost."""
    # Only nodes that still hold work are worth a look; most down nodes hold none.
    holding_work = JobAttempt.objects.filter(state__in=ACTIVE_ATTEMPT_STATES).values("node_id")
    holding_gpus = Allocation.objects.filter(active=True).values("gpu__node_id")
    busy = Node.objects.filter(ready=False).filter(Q(pk__in=holding_work) | Q(pk__in=holding_gpus))
    expired = [
        n
        for n in busy.only(*NODE_FIELDS)
        if now - lease.silent_since(n, hearing.since) >= lease.lost_after()
    ]
    renewed = _renewals(expired) if expired else {}
    if renewed is None:
        return []
    lost: list[int] = []
    for node in expired:
        if now - lease.silent_since(node, hearing.since, renewed.get(node.pk)) < (
            lease.lost_after()
        ):
            continue
        lost.extend(actions.lose_node_attempts(node, now, renewed.get(node.pk)))
    return lost


def sweep_node_liveness(now: dt.datetime | None = None) -> dict:
    """One pass of the liveness rules; returns what it changed."""
    now = now or timezone.now()
    hearing = lease.note_hearing(now)
    return {
        "deaf": hearing.deaf_reason,
        "not_ready": mark_silent_nodes_not_ready(now, hearing),
        "lost_attempts": declare_attempts_lost(now, hearing),
        "telemetry_pruned": telemetry.prune_history(now),
    }


@shared_task(name="controlplane.cluster.tasks.sweep_node_liveness", ignore_result=True)
def sweep_node_liveness_task() -> dict:
    return sweep_node_liveness()
