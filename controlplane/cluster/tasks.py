"""Node liveness: a node that stops heartbeating gets no new work, then loses its attempts.

Celery beat runs `sweep_node_liveness` every heartbeat interval. Two sweeps may overlap (two
workers, a slow one): every write is conditional, so each node is declared down once and each
attempt lost once, and a heartbeat that arrives during a sweep wins over it.
"""

from __future__ import annotations

import datetime as dt
import logging

from celery import shared_task
from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from controlplane.cluster import telemetry
from controlplane.cluster.models import Node
from controlplane.jobs import actions
from controlplane.jobs.models import ACTIVE_ATTEMPT_STATES, Allocation, JobAttempt

log = logging.getLogger(__name__)


def _silent_since(node: Node) -> dt.datetime:
    # A node created by hand that never heartbeated counts from its creation.
    return node.last_heartbeat_at or node.created_at


def not_ready_after(node: Node) -> dt.timedelta:
    return dt.timedelta(seconds=settings.NODE_NOT_READY_AFTER_INTERVALS * node.heartbeat_interval_s)


def lost_after(node: Node) -> dt.timedelta:
    return not_ready_after(node) + dt.timedelta(seconds=settings.NODE_LOST_GRACE_S)


def mark_silent_nodes_not_ready(now: dt.datetime) -> list[str]:
    """Ready nodes silent for NODE_NOT_READY_AFTER_INTERVALS of their intervals become not ready."""
    marked = []
    candidates = Node.objects.filter(ready=True).only(
        "id", "name", "last_heartbeat_at", "created_at", "heartbeat_interval_s"
    )
    for node in candidates:
        if now - _silent_since(node) < not_ready_after(node):
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
                _silent_since(node).isoformat(),
            )
    return marked


def declare_attempts_lost(now: dt.datetime) -> list[int]:
    """Active attempts on nodes not ready for NODE_LOST_GRACE_S more are lost."""
    lost: list[int] = []
    # Only nodes that still hold work are worth a look; most down nodes hold none.
    holding_work = JobAttempt.objects.filter(state__in=ACTIVE_ATTEMPT_STATES).values("node_id")
    holding_gpus = Allocation.objects.filter(active=True).values("gpu__node_id")
    busy = Node.objects.filter(ready=False).filter(Q(pk__in=holding_work) | Q(pk__in=holding_gpus))
    for node in busy.only("id", "name", "last_heartbeat_at", "created_at", "heartbeat_interval_s"):
        if now - _silent_since(node) < lost_after(node):
            continue
        lost.extend(_lose_node_attempts(node, now))
    return lost


def _lose_node_attempts(node: Node, now: dt.datetime) -> list[int]:
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
                    attempt,
                    exit_code=None,
                    finished_at=now,
                    lost=True,
                    message=f"Node {node.name} stopped answering",
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
    result = {
        "not_ready": mark_silent_nodes_not_ready(now),
        "lost_attempts": declare_attempts_lost(now),
        "telemetry_pruned": telemetry.prune_history(now),
    }
    return result


@shared_task(name="controlplane.cluster.tasks.sweep_node_liveness", ignore_result=True)
def sweep_node_liveness_task() -> dict:
    return sweep_node_liveness()
