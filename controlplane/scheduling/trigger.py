"""Ask for a scheduling cycle sooner than the next periodic tick, debounced.

A burst of 1,000 submits must cause a handful of cycles, not 1,000. The first request sets a
Redis key (SET NX) and schedules one cycle SCHEDULER_DEBOUNCE_S later; every request that finds
the key set does nothing, because that cycle is still to come. The cycle deletes the key just
before it reads its snapshot, so whatever commits after that asks for exactly one more cycle.
However long cycles take, at most one requested cycle waits in the queue.
"""

import logging
import threading

from django.conf import settings

log = logging.getLogger(__name__)

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
        from controlplane.redis_client import get_redis
        from controlplane.scheduling.tasks import run_cycle

        ttl_ms = int(max(REQUEST_TTL_S, 2 * settings.SCHEDULER_DEBOUNCE_S) * 1000)
        if get_redis().set(REQUEST_KEY, reason, nx=True, px=ttl_ms):
            run_cycle.apply_async(
                kwargs={"trigger": reason}, countdown=settings.SCHEDULER_DEBOUNCE_S
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
