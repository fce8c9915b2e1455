"""Tell node agents that their desired state changed, so they heartbeat now, not in 10 s.

Two channels carry the same signal (docs/agent-protocol.md, "watch"): a Redis PUBLISH on
`gpucp:node:<name>` reaches watch requests served by any web process; an in-process condition
variable reaches watch requests served by this process, which is all there is in the embedded
mode (no Redis). Call notify_nodes only after the change has committed: an agent that
heartbeats on the signal must see the new state.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from django.conf import settings

log = logging.getLogger(__name__)

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
