"""Ask for a scheduling cycle sooner than the next periodic tick, debounced.

A burst of 1,000 submits must cause a handful of cycles, not 1,000: the first request in a
debounce window sets a short-lived Redis key and schedules one cycle at the end of the window;
requests that find the key already set do nothing.
"""

import logging
import threading

from django.conf import settings

log = logging.getLogger(__name__)

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

        debounce_ms = max(1, int(settings.SCHEDULER_DEBOUNCE_S * 1000))
        if get_redis().set("gpucp:cycle-requested", reason, nx=True, px=debounce_ms):
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
