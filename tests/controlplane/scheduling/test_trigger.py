import base64
import json
import time
from datetime import UTC, datetime, timedelta

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


def _queued_etas(conn, queue):
    return [json.loads(raw)["headers"]["eta"] for raw in conn.lrange(queue, 0, -1)]


@_before_any_worker
def test_a_cycle_runs_at_once_unless_requested_while_one_runs_then_a_debounce_after_its_start(
    redis_conn, settings
):
    settings.SCHEDULER_DEBOUNCE_S = 30.0
    queue = settings.CELERY_TASK_DEFAULT_QUEUE
    purge_queue(redis_conn)
    trigger.request_cycle("submit")
    assert _queued_etas(redis_conn, queue) == [None]
    purge_queue(redis_conn, keep_request=True)

    trigger.requested_cycle_starting()
    before = datetime.now(UTC)
    trigger.request_cycle("job_end")
    trigger.request_cycle("submit")
    after = datetime.now(UTC)
    (eta,) = _queued_etas(redis_conn, queue)
    # Due a debounce after the running cycle's start, not after this request.
    assert before < datetime.fromisoformat(eta) <= after + timedelta(seconds=30)
    purge_queue(redis_conn, keep_request=True)

    # That follow-up started and ended: the next request finds the queue quiet again.
    trigger.requested_cycle_starting()
    trigger.requested_cycle_finished()
    trigger.request_cycle("job_end")
    assert _queued_etas(redis_conn, queue) == [None]
    purge_queue(redis_conn)


@_before_any_worker
def test_a_busy_loop_of_cheap_cycles_spaces_them_by_what_they_take_not_the_whole_debounce(
    redis_conn, settings
):
    settings.SCHEDULER_DEBOUNCE_S = 30.0
    queue = settings.CELERY_TASK_DEFAULT_QUEUE
    _, _, took = trigger.request_keys()
    purge_queue(redis_conn)
    trigger.requested_cycle_starting()
    time.sleep(0.1)
    trigger.requested_cycle_finished()  # a cycle of ~0.1 s
    assert 100 <= int(redis_conn.get(took)) < 30_000

    # The last one took 2 s: the follow-up is due three times that after this one's start,
    # well inside the 30 s debounce (the worker keeps two thirds of its time).
    # Bounded by clock readings on both sides of the start and the request, so that a stall of
    # this busy machine between them cannot fail it (Redis keeps the start, on the same clock).
    redis_conn.set(took, 2000)
    before = datetime.now(UTC)
    trigger.requested_cycle_starting()
    trigger.request_cycle("job_end")
    after = datetime.now(UTC)
    (eta,) = _queued_etas(redis_conn, queue)
    slack = timedelta(seconds=0.1)  # the ETA's and the clocks' rounding
    assert before + timedelta(seconds=6) - slack < datetime.fromisoformat(eta)
    assert datetime.fromisoformat(eta) < after + timedelta(seconds=6) + slack
    purge_queue(redis_conn, keep_request=True)

    # A cycle that found the lock held took nothing worth spacing by: the duration stays.
    recorded = redis_conn.get(took)
    trigger.requested_cycle_finished(ran=False)
    assert redis_conn.get(took) == recorded
    purge_queue(redis_conn)


@_before_any_worker
def test_a_request_sent_to_another_queue_does_not_silence_this_queue(redis_conn, settings):
    # Another deployment on the same Redis database, or a script whose CELERY_QUEUE is not the
    # worker's (bench_throughput's own set-up actions): its cycle runs elsewhere, or never.
    ours = settings.CELERY_TASK_DEFAULT_QUEUE
    theirs = f"elsewhere-{ours}"
    purge_queue(redis_conn)
    settings.CELERY_TASK_DEFAULT_QUEUE = theirs
    trigger.request_cycle("submit")
    assert redis_conn.llen(theirs) == 1
    settings.CELERY_TASK_DEFAULT_QUEUE = ours
    trigger.request_cycle("submit")
    assert queued_messages(redis_conn) == 1
    for key in redis_conn.scan_iter(match=f"*{theirs}*"):
        redis_conn.delete(key)
    purge_queue(redis_conn)


@_before_any_worker
def test_a_requested_cycle_that_never_starts_silences_requests_only_for_the_grace(
    redis_conn, settings
):
    settings.SCHEDULER_REQUEST_GRACE_S = 0.5
    purge_queue(redis_conn)
    trigger.request_cycle("submit")
    assert queued_messages(redis_conn) == 1
    # Its worker died with it: the message is gone, the cycle never starts.
    purge_queue(redis_conn, keep_request=True)
    time.sleep(0.7)
    trigger.request_cycle("submit")
    assert queued_messages(redis_conn) == 1
    purge_queue(redis_conn)


@_before_any_worker
def test_a_request_whose_cycle_could_not_be_sent_does_not_silence_the_next(
    redis_conn, settings, monkeypatch, caplog
):
    from controlplane.celery import app

    purge_queue(redis_conn)

    def broker_down(*args, **kwargs):
        raise ConnectionError("broker unreachable")

    monkeypatch.setattr(app, "send_task", broker_down)
    trigger.request_cycle("submit")
    assert "could not request a scheduling cycle" in caplog.text
    monkeypatch.undo()
    trigger.request_cycle("submit")
    assert queued_messages(redis_conn) == 1
    purge_queue(redis_conn)


@_before_any_worker
def test_a_requested_cycle_clears_the_request_of_the_queue_it_was_sent_to(redis_conn, settings):
    from controlplane.scheduling.tasks import run_cycle

    # The worker's own CELERY_QUEUE may differ from the queue it serves (-Q): the message says.
    ours = settings.CELERY_TASK_DEFAULT_QUEUE
    theirs = f"elsewhere-{ours}"
    trigger.request_cycle("submit", theirs)
    (body,) = [json.loads(raw) for raw in redis_conn.lrange(theirs, 0, -1)]
    _, kwargs, _ = json.loads(base64.b64decode(body["body"]))
    assert kwargs == {"trigger": "submit", "queue": theirs}
    run_cycle.run(trigger="submit", queue=theirs)
    trigger.request_cycle("submit", theirs)
    assert redis_conn.llen(theirs) == 2
    for key in redis_conn.scan_iter(match=f"*{theirs}*"):
        redis_conn.delete(key)
