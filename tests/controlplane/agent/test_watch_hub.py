"""Watch under load and faults: one Redis subscriber per process (controlplane.cluster.watch_hub).

Real PostgreSQL and Redis. The tests that change the database from one thread while watches
wait in others commit their changes (transactional_db), as the scheduler does before it
signals the nodes.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time

import pytest
from django.db import connection, connections
from django.test import Client

from controlplane import wakeups
from controlplane.cluster import agent_api, watch_hub
from controlplane.cluster import heartbeat as hb_logic
from controlplane.wakeups import node_channel, notify_nodes

from .conftest import AgentClient, readings

pytestmark = pytest.mark.skipif(
    not os.environ.get("REDIS_URL"), reason="the watch hub is the Redis path"
)

# Long enough never to be what ends a watch that should be woken, on a loaded machine.
PATIENCE_S = 20.0


def redis():
    from controlplane.redis_client import get_redis

    return get_redis()


def our_db() -> int:
    return int(redis().connection_pool.connection_kwargs.get("db", 0))


def subscribers(pid: int | None = None) -> list[dict]:
    """The pub/sub connections in this suite's Redis database (of one process's hub: `pid`)."""
    clients = [
        c
        for c in redis().client_list()
        if int(c["db"]) == our_db() and (int(c["sub"]) > 0 or int(c["psub"]) > 0)
    ]
    if pid is not None:
        clients = [c for c in clients if c.get("name") == f"gpucp-watch-hub-{pid}"]
    return clients


def eventually(condition, what: str, timeout_s: float = PATIENCE_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"never happened: {what}")


def live_hub() -> watch_hub.Hub:
    hub = watch_hub.hub()
    eventually(lambda: hub.live_epoch() is not None, "the hub subscribed")
    return hub


class Watch(threading.Thread):
    """One watch request served by this process, from a thread of its own."""

    def __init__(self, join_token: str, token: str, timeout_s: float):
        super().__init__(daemon=True)
        self.agent = AgentClient(Client(), join_token)
        self.token = token
        self.timeout_s = timeout_s
        self.changed: bool | None = None
        self.status: int | None = None
        self.waited_s: float | None = None
        self.start()

    def run(self):
        started = time.monotonic()
        try:
            response = self.agent.post("watch", {"timeout_s": self.timeout_s}, self.token)
            self.waited_s = time.monotonic() - started
            self.status = response.status_code
            if response.status_code == 200:
                self.changed = response.json()["changed"]
        finally:
            connection.close()

    def result(self) -> bool | None:
        self.join(self.timeout_s + PATIENCE_S)
        assert not self.is_alive(), "the watch never answered"
        assert self.status == 200
        return self.changed


def admit_and_signal(make_job, vision, alice, admit, node, gpu_index: int = 0):
    """A change of the node's desired state as the scheduler makes one: committed, then
    signalled."""
    admit(make_job(vision, alice), node, gpu_indexes=(gpu_index,))
    notify_nodes([node.name])


def test_a_signal_published_by_another_process_wakes_a_waiting_watch(agent, node01, settings):
    node, token = node01
    agent.heartbeat(token, readings(node))
    hub = live_hub()
    publisher = (
        "import redis, sys; redis.Redis.from_url(sys.argv[1]).publish(sys.argv[2], 'changed')"
    )

    def publish_once_waiting():
        eventually(lambda: hub.waiting == 1, "the watch waits")
        subprocess.run(
            [sys.executable, "-c", publisher, settings.REDIS_URL, node_channel(node.name)],
            check=True,
            timeout=PATIENCE_S,
        )

    publisher_thread = threading.Thread(target=publish_once_waiting)
    publisher_thread.start()
    response = agent.post("watch", {"timeout_s": PATIENCE_S}, token)
    publisher_thread.join()

    assert response.json() == {"changed": True}


def test_a_signal_right_after_the_watchs_check_is_not_lost(agent, node01, monkeypatch):
    """The window between looking at the desired state and waiting: a change that commits
    there is not in what the check read, so only its signal can wake the watch. Here the
    signal has been delivered in this process before the check even returns."""
    node, token = node01
    agent.heartbeat(token, readings(node))
    hub = live_hub()
    checked = agent_api._differs_from_last_answer

    def check_then_signal(info):
        differs = checked(info)
        # A second waiter for the node, to know when the hub has delivered the signal.
        before = hub.waiting
        probe = threading.Thread(target=hub.wait, args=(info.name, PATIENCE_S, lambda: False))
        probe.start()
        eventually(lambda: hub.waiting == before + 1, "the probe waits")
        notify_nodes([info.name])
        probe.join()
        return differs

    monkeypatch.setattr(agent_api, "_differs_from_last_answer", check_then_signal)

    response = agent.post("watch", {"timeout_s": PATIENCE_S}, token)

    assert response.json() == {"changed": True}


@pytest.mark.django_db(transaction=True)
def test_no_change_is_lost_whenever_it_lands_around_a_watchs_start(
    agent, join_token, nodes, make_job, vision, alice, admit
):
    """Watches of many nodes start while some of the nodes change at random moments: before
    the watch is served, while it registers, while it checks, while it waits. Every watch of
    a changed node says so; no other does."""
    live_hub()
    rng = random.Random(14)
    fleet = nodes(6)
    for gpu_index in range(4):  # one GPU per round: each change is a new admission
        # Every node has been told its desired state as it now is: a watch that says changed
        # can only have seen a change of this round.
        for node, token in fleet:
            agent.heartbeat(token, readings(node))
        changing = rng.sample(fleet, rng.randint(1, len(fleet) - 1))
        delays_s = {node.name: rng.uniform(0, 0.06) for node, _ in changing}

        def change_all(changing=changing, delays_s=delays_s, gpu_index=gpu_index):
            started = time.monotonic()
            try:
                for node, _ in sorted(changing, key=lambda nt: delays_s[nt[0].name]):
                    time.sleep(max(0.0, started + delays_s[node.name] - time.monotonic()))
                    admit_and_signal(make_job, vision, alice, admit, node, gpu_index)
            finally:
                connection.close()

        changer = threading.Thread(target=change_all)
        # A changed node's watch may wait as long as it takes the changer to get to it on a
        # loaded machine (it is woken, not timed out); the others end after 2 s, with the
        # changes of the other nodes landing while they wait.
        changed_names = {node.name for node, _ in changing}
        watches = {
            node.name: Watch(
                join_token, token, timeout_s=PATIENCE_S if node.name in changed_names else 2.0
            )
            for node, token in fleet
        }
        changer.start()
        changer.join()
        results = {name: w.result() for name, w in watches.items()}

        assert results == {node.name: node in [n for n, _ in changing] for node, _ in fleet}


@pytest.mark.django_db(transaction=True)
def test_many_watches_in_one_process_share_one_redis_connection(agent, join_token, nodes):
    ((node, token),) = nodes(1)
    hub = live_hub()
    watches = [Watch(join_token, token, timeout_s=PATIENCE_S) for _ in range(20)]
    eventually(lambda: hub.waiting == 20, "all 20 watches wait")

    in_use = subscribers()
    notify_nodes([node.name])
    results = [w.result() for w in watches]

    assert len(in_use) == 1, in_use
    assert results == [True] * 20
    assert hub.waiting == 0


@pytest.mark.django_db(transaction=True)
def test_a_signal_published_for_a_node_of_another_database_wakes_no_watch(agent, join_token, nodes):
    """Pub/sub channels are shared by every database of a Redis server: another deployment
    (another test worker) on another database signalling a node of the same name must not end
    this one's watch."""
    ((node, token),) = nodes(1)
    hub = live_hub()
    watch = Watch(join_token, token, timeout_s=2.0)
    eventually(lambda: hub.waiting == 1, "the watch waits")
    other_url = f"redis://127.0.0.1:6379/{(our_db() + 1) % 16}"
    redis().publish(f"{wakeups.node_channel_prefix(other_url)}{node.name}", "changed")

    assert watch.result() is False


@pytest.mark.django_db(transaction=True)
def test_watches_wake_after_the_subscriber_connection_is_killed(
    agent, join_token, nodes, make_job, vision, alice, admit
):
    ((node, token),) = nodes(1)
    hub = live_hub()
    waiting = Watch(join_token, token, timeout_s=PATIENCE_S)
    eventually(lambda: hub.waiting == 1, "the watch waits")
    epoch = hub.live_epoch()

    (killed,) = subscribers(os.getpid())
    redis().client_kill_filter(_id=killed["id"])
    eventually(lambda: hub.live_epoch() not in (None, epoch), "the hub subscribed again")
    # The signal of a change made once the hub is back wakes the watch that waited through.
    admit_and_signal(make_job, vision, alice, admit, node)

    assert waiting.result() is True
    assert len(subscribers(os.getpid())) == 1


@pytest.mark.django_db(transaction=True)
def test_a_change_while_redis_cannot_be_reached_still_ends_the_watch(
    agent, join_token, nodes, make_job, vision, alice, admit, monkeypatch
):
    """Signals published while the hub has no subscription reach no one: the watch finds the
    change by looking, and watches are signalled again once the hub is back."""
    ((node, token),) = nodes(1)
    hub = live_hub()
    unreachable = threading.Event()
    unreachable.set()
    connect = watch_hub._connect

    def connect_unless_unreachable(url):
        if unreachable.is_set():
            raise ConnectionRefusedError("Redis is unreachable (test)")
        return connect(url)

    monkeypatch.setattr(watch_hub, "_connect", connect_unless_unreachable)
    # Ended by the change, not by its timeout (after which it would look once more anyway).
    waiting = Watch(join_token, token, timeout_s=agent_api.WATCH_MAX_TIMEOUT_S)
    eventually(lambda: hub.waiting == 1, "the watch waits")
    (killed,) = subscribers(os.getpid())
    redis().client_kill_filter(_id=killed["id"])
    eventually(lambda: hub.live_epoch() is None, "the hub lost its subscription")

    admit_and_signal(make_job, vision, alice, admit, node)  # the signal is lost

    assert waiting.result() is True
    assert waiting.waited_s < waiting.timeout_s
    agent.heartbeat(token, readings(node))
    unreachable.clear()
    live_hub()
    again = Watch(join_token, token, timeout_s=PATIENCE_S)
    eventually(lambda: hub.waiting == 1, "the next watch waits")
    notify_nodes([node.name])
    assert again.result() is True


def test_a_watch_of_an_unchanged_node_does_not_read_its_work_again(
    agent, node01, make_job, vision, alice, admit, monkeypatch
):
    """The check reuses the answer prepared for the node's generation; a change moves the
    generation, and the next check reads the work and reports the change."""
    node, token = node01
    agent.heartbeat(token, readings(node))
    agent.post("watch", {"timeout_s": 0}, token)  # prepares the answer for this generation
    reads = []
    load_work = hb_logic.load_work
    monkeypatch.setattr(
        hb_logic, "load_work", lambda node_id: reads.append(node_id) or load_work(node_id)
    )

    unchanged = [agent.post("watch", {"timeout_s": 0}, token).json() for _ in range(3)]
    admit(make_job(vision, alice), node)
    after_change = agent.post("watch", {"timeout_s": 0}, token).json()

    assert unchanged == [{"changed": False}] * 3
    assert after_change == {"changed": True}
    assert reads == [node.pk]


@pytest.mark.django_db(transaction=True)
def test_a_watch_served_by_a_forked_process_is_woken(
    agent, join_token, nodes, make_job, vision, alice, admit
):
    """As in a gunicorn worker forked from a process that already had a hub: the child
    starts its own subscriber, and the parent's keeps working."""
    ((node, token),) = nodes(1)
    live_hub()
    child = os.fork()
    if child == 0:
        code = 1
        inherited = []
        try:
            for conn in connections.all(initialized_only=True):
                # The parent's database connection stays the parent's: kept referenced (freeing
                # it would say goodbye to PostgreSQL on the parent's behalf), never used.
                inherited.append(conn.connection)
                conn.connection = None
            answer = AgentClient(Client(), join_token).post(
                "watch", {"timeout_s": PATIENCE_S}, token
            )
            code = 0 if answer.status_code == 200 and answer.json() == {"changed": True} else 2
        finally:
            os._exit(code)
    try:
        eventually(lambda: subscribers(child), "the child's own subscriber")
        admit_and_signal(make_job, vision, alice, admit, node)
    finally:
        _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0

    agent.heartbeat(token, readings(node))
    hub = live_hub()
    parent_watch = Watch(join_token, token, timeout_s=PATIENCE_S)
    eventually(lambda: hub.waiting == 1, "the parent's watch waits")
    notify_nodes([node.name])
    assert parent_watch.result() is True


@pytest.mark.django_db(transaction=True)
def test_a_signal_for_a_node_of_another_deployment_on_this_redis_database_wakes_no_watch(
    agent, join_token, nodes, settings
):
    """Two deployments on one Redis database (a staging copy beside production, two test
    workers) have nodes of the same names: a signal for the other's node of this name must not
    end this one's watch (it did: a flake of the suite's parallel workers, and in production a
    heartbeat for nothing)."""
    ((node, token),) = nodes(1)
    hub = live_hub()
    watch = Watch(join_token, token, timeout_s=2.0)
    eventually(lambda: hub.waiting == 1, "the watch waits")
    ours = wakeups.node_channel(node.name)
    prefix = settings.REDIS_KEY_PREFIX
    settings.REDIS_KEY_PREFIX = "gpucp:another-deployment"
    theirs = wakeups.node_channel(node.name)
    settings.REDIS_KEY_PREFIX = prefix
    assert theirs != ours
    redis().publish(theirs, "changed")

    assert watch.result() is False


@pytest.mark.parametrize(
    "prefix, look_alike",
    [("dep*", "depX"), ("de?p", "deXp"), ("[ab]", "a"), ("d\\p", "dp"), ("d[^x]", "dy")],
    ids=["star", "question mark", "brackets", "backslash", "caret"],
)
def test_the_pattern_a_hub_subscribes_takes_this_deployments_channels_only(
    settings, prefix, look_alike
):
    """A REDIS_KEY_PREFIX holding a glob character must not subscribe every web process to the
    channels of other deployments that the unescaped prefix would match (it did: their signals
    were received by every hub, and dropped)."""
    base = f"gpucp-test-{os.getpid()}-"
    settings.REDIS_KEY_PREFIX = base + prefix
    ours = node_channel("n1")
    theirs = base + look_alike + ours[len(settings.REDIS_KEY_PREFIX) :]
    pubsub = redis().pubsub(ignore_subscribe_messages=True)
    try:
        pubsub.psubscribe(wakeups.node_channel_pattern())
        eventually(lambda: redis().pubsub_numpat() > 0 and pubsub.subscribed, "subscribed")
        time.sleep(0.05)  # the subscription's confirmation is read by get_message below
        redis().publish(theirs, "changed")
        redis().publish(ours, "changed")
        received = []
        deadline = time.monotonic() + PATIENCE_S
        while ours not in received and time.monotonic() < deadline:
            message = pubsub.get_message(timeout=0.1)
            if message is not None:
                received.append(message["channel"].decode())
    finally:
        pubsub.close()

    assert received == [ours]
