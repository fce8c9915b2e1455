import json
import time

import pytest

from controlplane import wakeups as trigger
from tests.controlplane.scheduling.conftest import purge_queue, queued_messages

# pytest-django runs database-free tests last, after the end-to-end suites whose session-wide
# Celery worker would consume the queued cycle these tests count; asking for the database puts
# them first.
_before_any_worker = pytest.mark.django_db


def _queued_triggers(conn, queue):
    bodies = [json.loads(raw) for raw in conn.lrange(queue, 0, -1)]
    return [b["headers"]["task"] for b in bodies]


@_before_any_worker
def test_requests_before_the_requested_cycle_starts_share_it(redis_conn, settings):
    settings.SCHEDULER_DEBOUNCE_S = 0.3
    purge_queue(redis_conn)
    for _ in range(50):
        trigger.request_cycle("submit")
    assert queued_messages(redis_conn) == 1
    assert _queued_triggers(redis_conn, settings.CELERY_TASK_DEFAULT_QUEUE) == [
        "controlplane.scheduling.tasks.run_cycle"
    ]
    # Past the debounce window, but the cycle has not started: it will still see the change.
    time.sleep(0.4)
    trigger.request_cycle("cancel")
    assert queued_messages(redis_conn) == 1
    purge_queue(redis_conn)


@_before_any_worker
def test_a_change_after_the_requested_cycle_started_asks_for_one_more(redis_conn, settings):
    purge_queue(redis_conn)
    trigger.request_cycle("submit")
    trigger.requested_cycle_starting()
    trigger.request_cycle("job_end")
    trigger.request_cycle("job_end")
    assert queued_messages(redis_conn) == 2
    purge_queue(redis_conn)


@_before_any_worker
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
def test_a_burst_of_submits_asks_for_one_cycle_while_none_has_started(
    redis_conn, make_job, vision, alice
):
    purge_queue(redis_conn)
    for i in range(300):
        make_job(vision, alice, name=f"burst-{i}")
    # No worker runs here, so no requested cycle starts: the whole burst shares one.
    assert queued_messages(redis_conn) == 1
    purge_queue(redis_conn)
