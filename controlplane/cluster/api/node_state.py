"""An admin's wish for a node (ready / cordoned / draining), shared by the REST API and the admin.

The scheduler reads Node.state at its next cycle: a cordoned node gets no new work, a draining
one also has its borrowed work preempted. Liveness (Node.ready) is the agent's, never set here.
"""

import logging

from django.db import transaction

from controlplane.cluster.models import Node
from controlplane.jobs import actions

log = logging.getLogger(__name__)


@transaction.atomic
def set_node_state(node: Node, state: str, *, actor=None) -> bool:
    """Set the admin state; True when it changed. Asks for a cycle so it takes effect now."""
    changed = Node.objects.filter(pk=node.pk).exclude(state=state).update(state=state)
    if changed:
        who = actor.username if actor is not None else "system"
        log.info("node %s is now %s (by %s)", node.name, state, who)
        actions.request_cycle(f"node_{state}")
    node.state = state
    return bool(changed)
