"""One Redis subscriber per web process for the agents' watches (docs/agent-protocol.md, "watch").

A watch used to open a pub/sub connection of its own: a TCP connect, a SUBSCRIBE and a
disconnect per request, paid again every time a node re-arms its watch after a change, which
under a flood of short jobs is after every job. Here each process has one subscriber: a daemon
thread, started by the first watch, holding one connection subscribed to every node's channel
(PSUBSCRIBE on the pattern), that wakes the watches waiting in this process for the node a
message names. A watch then costs no Redis command at all.

Every node's signal reaches every web process (a small message per change and process) rather
than only the one holding the node's watch: a channel per watched node would cost a SUBSCRIBE
and an UNSUBSCRIBE per watch, and a round trip to wait for before the watch may look at the
desired state, which is what this module is here to save.

**No wakeup is lost.** A watch registers its waiter first, then notes the subscription's
*epoch* (None while it is not live), then checks the desired state (`Hub.wait`). A change
committed before that check is seen by the check; the signal of one committed after it is
published after its commit (controlplane.wakeups.notify_nodes), so it reaches the live
subscription, which sets the registered waiter's event, whenever the watch gets to wait on it.
While the subscription is not live (not yet confirmed, broken, reconnecting), a publish reaches
no one: every waiter is woken when the connection breaks and again once a new subscription is
confirmed, checks the desired state each time, and meanwhile checks it every POLL_S. A watch
sleeps for the rest of its timeout only on an epoch that was live before its last check.

**Faults.** Any error on the connection ends it; the thread reconnects after a jittered pause
doubling from BACKOFF_FIRST_S to BACKOFF_MAX_S. A connection that went silent without closing
(a dead peer, a dropped route) is found by a PING after IDLE_PING_S without a message, left
unanswered for PING_TIMEOUT_S. The connection is a plain one, not redis-py's PubSub, which
reconnects and resubscribes on its own and so would hide the gap in which signals were lost.

**Fork.** A thread does not survive fork() but its object would: a child (a gunicorn worker
forked from a master that had one, a test) drops the hub it inherited, closing its copy of the
socket without a word to Redis, and starts its own on its first watch.

Memory: a waiter lives as long as its watch; a node's entry goes with its last waiter.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from typing import NoReturn

import redis
from django.conf import settings
from redis.connection import ConnectionInterface
from redis.exceptions import ConnectionError as RedisConnectionError

from controlplane.wakeups import node_channel_pattern, node_channel_prefix

log = logging.getLogger(__name__)

# While the subscription is not live, how often a waiting watch looks at the desired state.
POLL_S = 1.0
BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 5.0
IDLE_PING_S = 15.0
PING_TIMEOUT_S = 5.0
# How long connecting may take before it counts as a failure.
CONNECT_TIMEOUT_S = 5.0


class Waiter:
    """One watch waiting in this process: `event` is set when it should look again, and
    `signalled` too when that is because its node was signalled."""

    __slots__ = ("event", "name", "signalled")

    def __init__(self, name: str) -> None:
        self.name = name
        self.event = threading.Event()
        self.signalled = False


class Hub:
    def __init__(self, url: str) -> None:
        self.url = url
        self._lock = threading.Lock()
        self._waiters: dict[str, set[Waiter]] = {}
        # Counts confirmed subscriptions; None while none is live.
        self._epoch = 0
        self._live = False
        self._connection: ConnectionInterface | None = None
        self._thread = threading.Thread(target=self._run, name="gpucp-watch-hub", daemon=True)
        self._thread.start()

    # --- the watches' side -------------------------------------------------------------------

    def wait(self, name: str, timeout_s: float, changed: Callable[[], bool]) -> bool:
        """True as soon as `changed()` is true or the node is signalled; False at the timeout.

        `changed` says whether the node should be told something new; it is called once the
        waiter is registered, and again whenever signals may have been lost.
        """
        deadline = time.monotonic() + timeout_s
        waiter = self._register(name)
        try:
            live = self.live_epoch()
            if changed():
                return True
            while (remaining_s := deadline - time.monotonic()) > 0:
                waiter.event.wait(remaining_s if live is not None else min(remaining_s, POLL_S))
                if waiter.signalled:
                    return True
                # Cleared before the epoch is read: a break or a new subscription after this
                # point sets the event again, so the next wait returns at once.
                waiter.event.clear()
                now_live = self.live_epoch()
                if now_live is None or now_live != live:
                    live = now_live
                    if changed():
                        return True
            return False
        finally:
            self._unregister(waiter)

    def live_epoch(self) -> int | None:
        """Which subscription is live (a number that changes with each new one), or None."""
        with self._lock:
            return self._epoch if self._live else None

    @property
    def waiting(self) -> int:
        """How many watches wait here now."""
        with self._lock:
            return sum(len(waiters) for waiters in self._waiters.values())

    def _register(self, name: str) -> Waiter:
        waiter = Waiter(name)
        with self._lock:
            self._waiters.setdefault(name, set()).add(waiter)
        return waiter

    def _unregister(self, waiter: Waiter) -> None:
        with self._lock:
            waiters = self._waiters.get(waiter.name)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiters[waiter.name]

    # --- the subscriber thread ---------------------------------------------------------------

    def _signal(self, name: str) -> None:
        with self._lock:
            for waiter in self._waiters.get(name, ()):
                waiter.signalled = True
                waiter.event.set()

    def _set_live(self, live: bool) -> None:
        """Wake every waiter: signals may have been lost (a break), or waiting is safe again
        once each has looked (a new subscription)."""
        with self._lock:
            if not live and not self._live:
                return  # still down: the waiters are polling already
            if live:
                self._epoch += 1
            self._live = live
            for waiters in self._waiters.values():
                for waiter in waiters:
                    waiter.event.set()

    def _run(self) -> None:
        failures = 0
        while True:
            epoch = self._epoch
            try:
                self._connection = _connect(self.url)
                self._listen(self._connection)
            except Exception as exc:  # whatever it was, the thread carries on
                error = exc
            self._set_live(False)
            connection, self._connection = self._connection, None
            if connection is not None:
                connection.disconnect()
            # A connection that got as far as a subscription starts the backoff afresh.
            failures = 1 if self._epoch != epoch else failures + 1
            pause_s = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (failures - 1))
            pause_s *= random.uniform(0.5, 1.5)
            log.log(
                logging.WARNING if failures == 1 else logging.DEBUG,
                "watch subscriber lost Redis (%s): watches poll every %.0f s; "
                "reconnecting in %.1f s",
                error,
                POLL_S,
                pause_s,
            )
            time.sleep(pause_s)

    def _listen(self, connection: ConnectionInterface) -> NoReturn:
        """Deliver messages until the connection fails (it raises; it never returns)."""
        # This deployment's channels, named when the subscription is made (a test database is
        # named after settings load).
        prefix = node_channel_prefix(self.url)
        pattern, prefix_bytes = node_channel_pattern(self.url), prefix.encode()
        connection.send_command("PSUBSCRIBE", pattern, check_health=False)
        pinged = False
        while True:
            if not connection.can_read(timeout=PING_TIMEOUT_S if pinged else IDLE_PING_S):
                if pinged:
                    raise RedisConnectionError(f"no answer to PING in {PING_TIMEOUT_S:.0f} s")
                connection.send_command("PING", check_health=False)
                pinged = True
                continue
            # push_request: under RESP3 (redis-py's default) pub/sub messages are pushes.
            reply = connection.read_response(push_request=True)
            pinged = False
            kind = reply[0] if isinstance(reply, list) and reply else None
            if kind == b"pmessage" and reply[2].startswith(prefix_bytes):
                self._signal(reply[2][len(prefix_bytes) :].decode())
            elif kind == b"psubscribe":
                self._set_live(True)
                log.info("watch subscriber listening on %s", pattern)

    def forget_in_child(self) -> None:
        """In a forked child: close this process's copy of the socket, sending nothing (the
        connection is the parent's), so that the child holds no Redis connection of it."""
        connection = self._connection
        if connection is not None:
            # redis-py sends no QUIT and shuts nothing down from a process other than the one
            # that connected: it only closes this process's descriptor.
            connection.disconnect()


def _connect(url: str) -> ConnectionInterface:
    pool = redis.ConnectionPool.from_url(
        url,
        client_name=f"gpucp-watch-hub-{os.getpid()}",
        socket_timeout=PING_TIMEOUT_S,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_keepalive=True,
        health_check_interval=0,
    )
    connection = pool.make_connection()
    connection.connect()
    return connection


_hub: Hub | None = None
_hub_lock = threading.Lock()


def hub() -> Hub:
    """This process's hub, started on first use (on settings.REDIS_URL)."""
    global _hub
    with _hub_lock:
        if _hub is None:
            _hub = Hub(settings.REDIS_URL)
        return _hub


def _after_fork_in_child() -> None:
    global _hub, _hub_lock
    # The lock may have been held by a thread that does not exist here.
    _hub_lock = threading.Lock()
    inherited, _hub = _hub, None
    if inherited is not None:
        inherited.forget_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
