"""Wake-ups: ask for a scheduling cycle, and tell node agents their desired state changed.

Below every app: it imports none of them (only settings, the Redis client and the Celery app),
so any app's actions can call it, and the scheduling loop it wakes can import those actions
without an import cycle.

**Cycle requests**, debounced. A burst of 1,000 submits must cause a handful of cycles, not
1,000. The first request sets a Redis key (SET NX) and schedules one cycle SCHEDULER_DEBOUNCE_S
later; every request that finds the key set does nothing, because that cycle is still to come.
The cycle deletes the key just before it reads its snapshot, so whatever commits after that asks
for exactly one more cycle. However long cycles take, at most one requested cycle waits in the
queue. In the embedded mode (no Celery) a request wakes the in-process loop.

**Node notifications** (docs/agent-protocol.md, "watch"). Two channels carry the same signal: a
Redis PUBLISH on `gpucp:node:<name>` reaches watch requests served by any web process; an
in-process condition variable reaches watch requests served by this process, which is all there
is in the embedded mode (no Redis). Call notify_nodes only after the change has committed: an
agent that heartbeats on the signal must see the new state.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from django.conf import settings

log = logging.getLogger(__name__)

# The Celery task that runs one cycle (controlplane/scheduling/tasks.py), sent by its name.
RUN_CYCLE_TASK = "controlplane.scheduling.tasks.run_cycle"

REQUEST_KEY = "gpucp:cycle-requested"
# Should the requested cycle never run (its worker died with it), requests resume after this;
# the periodic tick covers the gap.
REQUEST_TTL_S = 60.0

_embedded_wakeup = threading.Event()


def embedded_wakeup_event() -> threading.Event:
    return _embedded_wakeup


def request_cycle(reason: str) -> None:
    if settings.SCHEDULER_EMBEDDED:
        _embedded_wakeup.set()
        return
    if not settings.REDIS_URL:
        return
    try:
        from controlplane.celery import app
        from controlplane.redis_client import get_redis

        ttl_ms = int(max(REQUEST_TTL_S, 2 * settings.SCHEDULER_DEBOUNCE_S) * 1000)
        if get_redis().set(REQUEST_KEY, reason, nx=True, px=ttl_ms):
            # By name: this module sits below the apps and imports none of them.
            app.send_task(
                RUN_CYCLE_TASK, kwargs={"trigger": reason}, countdown=settings.SCHEDULER_DEBOUNCE_S
            )
    except Exception:
        # The periodic tick still runs the cycle; a broker hiccup must not fail a submit.
        log.warning(
            "could not request a scheduling cycle (%s); the next tick will run it",
            reason,
            exc_info=True,
        )


def requested_cycle_starting() -> None:
    """Called by a requested cycle before it reads its snapshot: later changes need a new one."""
    if not settings.REDIS_URL:
        return
    try:
        from controlplane.redis_client import get_redis

        get_redis().delete(REQUEST_KEY)
    except Exception:
        log.warning("could not clear the cycle request; requests resume in %.0f s", REQUEST_TTL_S)


# --- node notifications ----------------------------------------------------------------------

CHANNEL_PREFIX = "gpucp:node:"
CHANGED_MESSAGE = "changed"

_changed = threading.Condition()
# A counter per node name, bumped on every change: a waiter compares it with the value it saw
# before it started waiting, so a change that lands between two waits is never missed.
_versions: dict[str, int] = {}


def node_channel(name: str) -> str:
    """The Redis pub/sub channel a node's watchers subscribe to."""
    return f"{CHANNEL_PREFIX}{name}"


def node_version(name: str) -> int:
    """How many changes this process has signalled for the node so far."""
    with _changed:
        return _versions.get(name, 0)


def wait_for_node_change(name: str, seen_version: int, timeout_s: float) -> bool:
    """Block until the node's version moves past seen_version (True) or timeout_s passes (False)."""
    with _changed:
        return _changed.wait_for(lambda: _versions.get(name, 0) > seen_version, timeout=timeout_s)


def notify_nodes(names: Iterable[str]) -> int:
    """Signal every named node on both channels; returns how many nodes were signalled."""
    unique = sorted(set(names))
    if not unique:
        return 0
    with _changed:
        for name in unique:
            _versions[name] = _versions.get(name, 0) + 1
        _changed.notify_all()
    if settings.REDIS_URL:
        try:
            from controlplane.redis_client import get_redis

            pipe = get_redis().pipeline(transaction=False)
            for name in unique:
                pipe.publish(node_channel(name), CHANGED_MESSAGE)
            pipe.execute()
        except Exception:
            # The agents' periodic heartbeat still picks the change up; only the latency suffers.
            log.warning(
                "could not publish desired-state changes for %d nodes", len(unique), exc_info=True
            )
    return len(unique)
