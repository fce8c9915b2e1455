from celery import shared_task

TICK = "tick"


@shared_task(acks_late=True, ignore_result=True)
def run_cycle(trigger: str = TICK, queue: str | None = None) -> dict:
    """One cycle; a requested one (trigger other than TICK) names the queue it was sent to."""
    from controlplane.scheduling.cycle import run_scheduling_cycle
    from controlplane.wakeups import (
        request_cycle,
        requested_cycle_finished,
        requested_cycle_starting,
    )

    if trigger == TICK:
        return run_scheduling_cycle(trigger=trigger)
    # Before the snapshot: a change that commits from here on queues the next cycle.
    requested_cycle_starting(queue)
    result: dict = {}
    try:
        result = run_scheduling_cycle(trigger=trigger)
        if result.get("skipped"):
            # The cycle that holds the lock may have read its snapshot before this request's
            # change committed: ask again rather than leave the change to the next tick. Asked
            # while this one still counts as running, so the retry comes a debounce later
            # instead of spinning against the lock.
            request_cycle(trigger, queue)
    finally:
        requested_cycle_finished(queue, ran=bool(result) and not result.get("skipped"))
    return result


@shared_task(ignore_result=True)
def prune_scheduling_cycles() -> int:
    """Delete cycle rows past SCHEDULER_CYCLE_RETENTION_DAYS (beat runs it hourly)."""
    import logging

    from django.conf import settings
    from django.utils import timezone

    from controlplane.scheduling import actions

    days = settings.SCHEDULER_CYCLE_RETENTION_DAYS
    deleted = actions.prune_cycles(timezone.now(), days)
    if deleted:
        logging.getLogger(__name__).info(
            "deleted %d scheduling cycle rows older than %g days", deleted, days
        )
    return deleted


# Celery's autodiscovery reads only `tasks` modules; the what-if task lives beside this one.
from controlplane.scheduling import whatif_tasks  # noqa: E402, F401
