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
