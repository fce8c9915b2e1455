from celery import shared_task


@shared_task(acks_late=True, ignore_result=True)
def run_cycle(trigger: str = "tick") -> dict:
    from controlplane.scheduling.cycle import run_scheduling_cycle

    return run_scheduling_cycle(trigger=trigger)
