from celery import shared_task

TICK = "tick"


@shared_task(acks_late=True, ignore_result=True)
def run_cycle(trigger: str = TICK) -> dict:
    from controlplane.scheduling.cycle import run_scheduling_cycle
    from controlplane.wakeups import request_cycle, requested_cycle_starting

    if trigger != TICK:
        requested_cycle_starting()
    result = run_scheduling_cycle(trigger=trigger)
    if result.get("skipped") and trigger != TICK:
        # The cycle that holds the lock may have read its snapshot before this request's change
        # committed: ask again (debounced) rather than leave the change to the next tick.
        request_cycle(trigger)
    return result


# Celery's autodiscovery reads only `tasks` modules; the what-if task lives beside this one.
from controlplane.scheduling import whatif_tasks  # noqa: E402, F401
