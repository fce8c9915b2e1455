import json
import math
import time

import pytest

from controlplane.scheduling import trigger
from tests.controlplane.scheduling.conftest import purge_queue, queued_messages


def _queued_triggers(conn, queue):
    bodies = [json.loads(raw) for raw in conn.lrange(queue, 0, -1)]
    return [b["headers"]["task"] for b in bodies]


def test_requests_within_one_debounce_window_schedule_one_cycle(redis_conn, settings):
    settings.SCHEDULER_DEBOUNCE_S = 0.3
    purge_queue(redis_conn)
    for _ in range(50):
        trigger.request_cycle("submit")
    assert queued_messages(redis_conn) == 1
    assert _queued_triggers(redis_conn, settings.CELERY_TASK_DEFAULT_QUEUE) == [
        "controlplane.scheduling.tasks.run_cycle"
    ]
    time.sleep(0.4)
    trigger.request_cycle("cancel")
    assert queued_messages(redis_conn) == 2
    purge_queue(redis_conn)


def test_the_embedded_mode_wakes_its_loop_instead_of_calling_celery(redis_conn, settings):
    settings.SCHEDULER_EMBEDDED = True
    purge_queue(redis_conn)
    trigger.embedded_wakeup_event().clear()
    trigger.request_cycle("submit")
    assert trigger.embedded_wakeup_event().is_set()
    assert queued_messages(redis_conn) == 0
    trigger.embedded_wakeup_event().clear()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_burst_of_a_thousand_submits_asks_for_a_handful_of_cycles_not_a_thousand(
    redis_conn, settings, make_job, vision, alice
):
    settings.SCHEDULER_DEBOUNCE_S = 0.5
    purge_queue(redis_conn)
    began = time.monotonic()
    for i in range(1000):
        make_job(vision, alice, name=f"burst-{i}")
    elapsed_s = time.monotonic() - began
    requested = queued_messages(redis_conn)
    # At most one cycle per debounce window the burst spanned, and at least one.
    assert 1 <= requested <= math.ceil(elapsed_s / settings.SCHEDULER_DEBOUNCE_S) + 1
    assert requested < 100
    purge_queue(redis_conn)
