"""Node liveness: a node that stops heartbeating gets no new work, then loses its attempts.

Celery beat runs `sweep_node_liveness` every heartbeat interval. A node's silence counts only
while the control plane could hear it (controlplane.cluster.lease): its own outages never count
against a node. A node silent for NODE_NOT_READY_AFTER_INTERVALS intervals gets no new work; its
attempts are declared lost only once its lease has run out with a margin, by which time the
node's agent has stopped them itself (docs/agent-protocol.md, "Leases").

Two sweeps may overlap (two workers, a slow one): every write is conditional, so each node is
declared down once and each attempt lost once, and a heartbeat that arrives during a sweep wins
over it.
"""

from __future__ import annotations

import datetime as dt
import logging

from celery import shared_task
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from controlplane.cluster import lease, telemetry
from controlplane.cluster.models import Node
from controlplane.jobs import actions
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
        # Conditional on the heartbeat time we judged: a heartbeat that landed since wins.
        changed = Node.objects.filter(
            pk=node.pk, ready=True, last_heartbeat_at=node.last_heartbeat_at
        ).update(ready=False)
        if changed:
            marked.append(node.name)
            log.warning(
                "node %s silent since %s: not ready, gets no new work",
                node.name,
                lease.silent_since(node, hearing.since).isoformat(),
            )
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
        lost.extend(_lose_node_attempts(node, now, renewed.get(node.pk)))
    return lost


def _lose_node_attempts(
    node: Node, now: dt.datetime, renewed: dt.datetime | None = None
) -> list[int]:
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
                if actions.finish_attempt(
                    attempt, exit_code=None, finished_at=ended_at, lost=True, message=message
                ):
                    lost.append(attempt.pk)
            except (actions.IllegalTransition, actions.ConcurrentUpdate) as exc:
                log.info("attempt %s not declared lost: %s", attempt.pk, exc)
    if lost:
        log.warning("node %s lost: attempts %s declared lost", node.name, lost)
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
