"""The scheduling loop of the embedded mode (`make run`): a thread instead of Celery and beat.

It runs the very cycle the Celery worker runs, every SCHEDULER_CYCLE_INTERVAL_S, and sooner
when a submit, cancel or job end sets wakeups.embedded_wakeup_event(), by the rule the Celery
path follows (controlplane/wakeups.py): at once when the loop is idle; requests that arrive
while a requested cycle runs share one follow-up, SCHEDULER_DEBOUNCE_S after that cycle
started. It also runs the node liveness sweep that beat runs in production, so a stopped
agent's node goes down here too, and beat's hourly upkeep (expired submit keys, the audit
trail's and the cycle record's retention), so a laptop left running does not grow without end.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

from django.conf import settings
from django.db import connections

from controlplane.accounting.tasks import check_budgets
from controlplane.scheduling.cycle import run_scheduling_cycle
from controlplane.wakeups import embedded_wakeup_event

log = logging.getLogger(__name__)

UPKEEP_INTERVAL_S = 3600.0


def _hourly_upkeep() -> None:
    """What beat runs hourly in production (controlplane/settings.py CELERY_BEAT_SCHEDULE)."""
    from controlplane.audit.tasks import prune_audit_trail
    from controlplane.jobs.tasks import delete_expired_submit_keys
    from controlplane.scheduling.tasks import prune_scheduling_cycles

    delete_expired_submit_keys()
    prune_audit_trail()
    prune_scheduling_cycles()


def _liveness_sweep() -> Callable[[], object] | None:
    try:
        from controlplane.cluster.tasks import sweep_node_liveness
    except ImportError:
        return None
    return sweep_node_liveness


class SchedulingLoop:
    """A daemon thread that runs scheduling cycles until stop() is called."""

    def __init__(
        self,
        *,
        interval_s: float | None = None,
        debounce_s: float | None = None,
        liveness_interval_s: float | None = None,
    ):
        self.interval_s = settings.SCHEDULER_CYCLE_INTERVAL_S if interval_s is None else interval_s
        self.debounce_s = settings.SCHEDULER_DEBOUNCE_S if debounce_s is None else debounce_s
        self.liveness_interval_s = (
            settings.AGENT_HEARTBEAT_INTERVAL_S
            if liveness_interval_s is None
            else liveness_interval_s
        )
        self.cycles = 0
        self.failures = 0
        self._stop = threading.Event()
        self._wakeup = embedded_wakeup_event()
        self._sweep = _liveness_sweep()
        self._thread = threading.Thread(target=self._run, name="scheduling-loop", daemon=True)

    def start(self) -> SchedulingLoop:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wakeup.set()  # so a thread waiting for the next tick notices at once
        self._thread.join(timeout=timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        next_sweep = time.monotonic() + self.liveness_interval_s
        # Once soon after the start (a laptop is rarely up for an hour), then hourly.
        next_upkeep = time.monotonic() + self.liveness_interval_s
        # When the requests that arrived during the last requested cycle are due, if any did.
        follow_up_at: float | None = None
        while not self._stop.is_set():
            requested = self._wakeup.wait(timeout=self.interval_s)
            if self._stop.is_set():
                break
            if requested:
                if follow_up_at is not None:
                    # A burst of submits costs one cycle per debounce, not one each.
                    self._stop.wait(max(0.0, follow_up_at - time.monotonic()))
                # Cleared before the cycle: a request that arrives during it gets another one.
                self._wakeup.clear()
            started = time.monotonic()
            trigger = "request" if requested else "tick"
            self._step(functools.partial(run_scheduling_cycle, trigger=trigger))
            self.cycles += 1
            busy = requested and self._wakeup.is_set()
            follow_up_at = started + self.debounce_s if busy else None
            if time.monotonic() >= next_sweep:
                if self._sweep is not None:
                    self._step(self._sweep)
                self._step(check_budgets)
                next_sweep = time.monotonic() + self.liveness_interval_s
            if time.monotonic() >= next_upkeep:
                self._step(_hourly_upkeep)
                next_upkeep = time.monotonic() + UPKEEP_INTERVAL_S
        # Once soon after the start (a laptop is rarely up for an hour), then hourly.
        next_upkeep = time.monotonic() + self.liveness_interval_s

    def _step(self, work: Callable[[], object]) -> None:
        try:
            work()
        except Exception:
            self.failures += 1
            log.exception("embedded scheduling loop: a step failed; the next tick retries")
        finally:
            # This thread's connections: SQLite must not keep a stale one between cycles.
            connections.close_all()
