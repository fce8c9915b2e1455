"""Watch: the long poll that lets new work start within a second, not at the next heartbeat."""

import threading
import time

import pytest
from django.db import transaction

from controlplane.jobs import actions
from controlplane.wakeups import node_channel, node_version, notify_nodes

from .conftest import readings


def watch(agent, token, timeout_s):
    started = time.monotonic()
    response = agent.post("watch", {"timeout_s": timeout_s}, token)
    assert response.status_code == 200, response.content
    return response.json()["changed"], time.monotonic() - started


def next_message(pubsub, timeout_s):
    # get_message answers None for the subscription's own confirmation too; read past it.
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.5)
        if message is not None:
            return message
    return None


def later(seconds, fn):
    timer = threading.Timer(seconds, fn)
    timer.start()
    return timer


def test_watch_answers_changed_when_the_node_is_signalled(agent, node01):
    node, token = node01
    agent.heartbeat(token, readings(node))
    timer = later(0.3, lambda: notify_nodes([node.name]))

    changed, waited_s = watch(agent, token, 10)

    timer.join()
    assert changed is True
    assert waited_s < 10


def test_a_signal_for_another_node_does_not_wake_this_one(agent, node01):
    node, token = node01
    agent.heartbeat(token, readings(node))
    timer = later(0.2, lambda: notify_nodes(["node-99"]))

    changed, _ = watch(agent, token, 1)

    timer.join()
    assert changed is False


def test_watch_times_out_unchanged(agent, node01):
    node, token = node01
    agent.heartbeat(token, readings(node))
    assert watch(agent, token, 0.5)[0] is False


def test_watch_answers_at_once_when_work_arrived_after_the_last_heartbeat(
    agent, node01, make_job, vision, alice, admit
):
    node, token = node01
    agent.heartbeat(token, readings(node))
    # Admitted between the heartbeat and the watch: the signal came before anyone listened.
    admit(make_job(vision, alice), node)

    changed, waited_s = watch(agent, token, 10)

    assert changed is True
    assert waited_s < 5


@pytest.mark.parametrize("redis", [True, False], ids=["redis", "in-process"])
def test_both_signal_channels_wake_a_watch(agent, node01, settings, redis):
    if not redis:
        settings.REDIS_URL = ""
    node, token = node01
    agent.heartbeat(token, readings(node))
    timer = later(0.3, lambda: notify_nodes([node.name]))

    changed, _ = watch(agent, token, 10)

    timer.join()
    assert changed is True


def test_cancelling_a_job_signals_the_node_that_runs_it(
    agent, node01, make_job, vision, alice, admit, settings, django_capture_on_commit_callbacks
):
    node, token = node01
    job = make_job(vision, alice)
    admit(job, node)
    seen = node_version(node.name)
    pubsub = None
    if settings.REDIS_URL:
        from controlplane.redis_client import get_redis

        pubsub = get_redis().pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(node_channel(node.name))
    try:
        with django_capture_on_commit_callbacks(execute=True):
            with transaction.atomic():
                actions.cancel_job(job, actor=alice)
        message = next_message(pubsub, timeout_s=5) if pubsub else None
    finally:
        if pubsub:
            pubsub.close()

    assert node_version(node.name) == seen + 1
    if pubsub:
        assert message is not None
        assert message["channel"].decode() == node_channel(node.name)


def test_a_watch_over_the_processs_limit_is_turned_away_so_heartbeats_keep_their_threads(
    agent, node01, settings
):
    from controlplane.cluster.agent_api import watch_slots

    node, token = node01
    settings.AGENT_WATCH_MAX_PER_PROCESS = 2
    assert watch_slots.try_acquire() and watch_slots.try_acquire()
    try:
        response = agent.post("watch", {"timeout_s": 5}, token)
        assert response.status_code == 429
        assert response["Retry-After"]
        # Heartbeats are not limited.
        agent.heartbeat(token, readings(node))
    finally:
        watch_slots.release()
        watch_slots.release()
    assert watch(agent, token, 0)[0] is False


def test_a_node_of_the_same_name_in_another_deployment_on_this_redis_does_not_wake_it(
    agent, node01, settings
):
    # Two deployments (or two of the suite's parallel workers) on one Redis database, each with
    # a node called node-01: each one's watch compares with what its own heartbeat answered.
    if not settings.REDIS_URL:
        pytest.skip("the answers are kept in Redis only with REDIS_URL")
    from controlplane.cluster import heartbeat

    node, token = node01
    agent.heartbeat(token, readings(node))
    ours = heartbeat.last_answer_digest(node)
    assert ours is not None
    prefix = settings.REDIS_KEY_PREFIX
    settings.REDIS_KEY_PREFIX = "gpucp:another-deployment"
    heartbeat.remember_answer(node, "the other deployment's answer")
    settings.REDIS_KEY_PREFIX = prefix
    with heartbeat._answered_lock:  # this process's copy aside: Redis alone is compared
        heartbeat._answered.clear()
    assert heartbeat.last_answer_digest(node) == ours
    changed, _ = watch(agent, token, 0.5)
    assert changed is False


def test_while_redis_cannot_be_read_a_watch_waits_instead_of_trusting_this_processs_copy(
    agent, node01, monkeypatch
):
    # Another web process may have answered the node's last heartbeat, so this one's copy of
    # the answer may be older. Compared with it, every watch said "changed" at once, and the
    # agent heartbeat and watched again, for as long as Redis was away (chaos: 250 watches a
    # second during an 8 s Redis outage). The agent's next heartbeat comes within its interval.
    import redis

    from controlplane import redis_client
    from controlplane.cluster import heartbeat

    node, token = node01
    agent.heartbeat(token, readings(node))
    with heartbeat._answered_lock:
        heartbeat._answered[node.name] = "an older answer this process gave"
    away = redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    monkeypatch.setattr(redis_client, "get_redis", lambda: away)

    changed, waited_s = watch(agent, token, 0.5)

    assert changed is False and waited_s >= 0.4


# --- what Redis holds of the last answer, when more than one web process answers a node ------
#
# Each web process stores its answer to a heartbeat in Redis at once when it differs from the
# one it gave before, and only renews the key's expiry (with the telemetry batch) when it is the
# same. Were the renewal to hold anything but what Redis already has, a watch would compare
# with an answer the node is no longer told, say "changed" at once, and the agent would
# heartbeat and watch again in a loop until the next batch: the burst of a few hundred watches
# a second seen in chaos runs after a Redis outage.


@pytest.fixture
def batched_answers(settings):
    if not settings.REDIS_URL:
        pytest.skip("the answers are kept in Redis only with REDIS_URL")
    from controlplane.cluster import telemetry

    settings.TELEMETRY_FLUSH_INTERVAL_S = 60  # flushed by the test, not by the clock
    telemetry.buffer.flush()
    yield telemetry.buffer
    telemetry.buffer.flush()


def as_another_process(monkeypatch):
    """This process's answers set aside: what follows answers as a second web process would."""
    from controlplane.cluster import heartbeat

    monkeypatch.setattr(heartbeat, "_answered", {})


def test_a_renewal_batched_by_one_process_does_not_bring_back_its_older_answer(
    node01, batched_answers, monkeypatch
):
    from controlplane.cluster import heartbeat

    node, _ = node01
    heartbeat.remember_answer(node, "first answer")
    heartbeat.remember_answer(node, "first answer")  # the same again: a renewal, batched
    as_another_process(monkeypatch)
    heartbeat.remember_answer(node, "newer answer")  # the desired state changed meanwhile
    monkeypatch.undo()
    assert heartbeat.last_answer_digest(node) == "newer answer"

    batched_answers.flush()  # the first process's renewal lands after the newer answer

    assert heartbeat.last_answer_digest(node) == "newer answer"
    # Redis does not hold its answer, so the first process's next answer is stored at once.
    heartbeat.remember_answer(node, "first answer")
    assert heartbeat.last_answer_digest(node) == "first answer"


@pytest.mark.parametrize("how", ["redis lost the key", "the store failed"])
def test_an_answer_redis_does_not_hold_is_stored_at_the_next_heartbeat_not_at_the_next_batch(
    node01, batched_answers, monkeypatch, how
):
    import redis

    from controlplane import redis_client
    from controlplane.cluster import heartbeat

    node, _ = node01
    if how == "redis lost the key":  # restarted without its data, or the key expired
        heartbeat.remember_answer(node, "the answer")
        heartbeat.remember_answer(node, "the answer")
        redis_client.get_redis().delete(heartbeat._answered_key(node.name))
        batched_answers.flush()
        assert heartbeat.last_answer_digest(node) is None  # renewed only while it holds it
    else:
        reachable = redis_client.get_redis
        away = redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
        monkeypatch.setattr(redis_client, "get_redis", lambda: away)
        heartbeat.remember_answer(node, "the answer")
        monkeypatch.setattr(redis_client, "get_redis", reachable)
        assert heartbeat.last_answer_digest(node) is None
        heartbeat._store_failed_at -= heartbeat.ANSWER_STORE_BACKOFF_S  # the back-off is over

    heartbeat.remember_answer(node, "the answer")

    assert heartbeat.last_answer_digest(node) == "the answer"


def test_a_watch_after_another_process_answered_does_not_say_changed_in_a_loop(
    agent, node01, batched_answers, monkeypatch
):
    from controlplane.cluster import heartbeat

    # The loop itself: the node heartbeats to two web processes in turn, the first's renewal
    # of the answer it gave before a change lands after the second's, and the watch must still
    # see the answer the node was last given.
    node, token = node01
    as_another_process(monkeypatch)
    heartbeat.remember_answer(node, "an answer given before a change")
    heartbeat.remember_answer(node, "an answer given before a change")
    monkeypatch.undo()
    agent.heartbeat(token, readings(node))
    batched_answers.flush()

    assert watch(agent, token, 0.5)[0] is False


def test_while_redis_fails_a_store_heartbeats_do_not_wait_on_it_one_by_one(
    node01, batched_answers, monkeypatch
):
    # A Redis that hangs makes each store wait out the client's timeout (5 s). Only the first
    # answer after a failure may try it from the request; those of the next moment are not
    # tried (nor remembered as stored), and the first after the back-off tries again.
    from controlplane import redis_client
    from controlplane.cluster import heartbeat

    node, _ = node01
    reachable = redis_client.get_redis
    tries: list[str] = []

    class Hanging:
        def set(self, key, value, **kwargs):
            tries.append(value)
            raise TimeoutError("Timeout reading from socket")

    monkeypatch.setattr(redis_client, "get_redis", lambda: Hanging())
    for answer in ("first", "first", "first", "second", "second"):
        heartbeat.remember_answer(node, answer)
    assert tries == ["first"]
    assert node.name not in heartbeat._answered  # nothing believed stored

    monkeypatch.setattr(redis_client, "get_redis", reachable)
    heartbeat._store_failed_at -= heartbeat.ANSWER_STORE_BACKOFF_S  # the back-off is over
    heartbeat.remember_answer(node, "third")
    assert heartbeat.last_answer_digest(node) == "third"  # at once, not with the next batch
