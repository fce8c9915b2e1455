"""Wake-ups: ask for a scheduling cycle, and tell node agents their desired state changed.

Below every app: it imports none of them (only settings, the Redis client and the Celery app),
so any app's actions can call it, and the scheduling loop it wakes can import those actions
without an import cycle.

**Cycle requests** (docs/architecture.md, "Wake-up"): leading edge when quiet, coalescing when
busy. A request queues a cycle unless one is already queued. That cycle runs at once when no
requested cycle is running; else it is the one follow-up of every request that arrives until
it starts, due after the running one started by three times what the last requested cycle
took (at least MIN_SPACING_S, at most SCHEDULER_DEBOUNCE_S). So a submit on an idle cluster is
scheduled without waiting; a flood of short jobs whose starts and ends keep requesting cycles
gets them as often as the worker can afford while it keeps two thirds of its time free (cheap
cycles, tens of milliseconds, come a few times a second, which is what turns GPUs over
quickly); and a burst of 1,000 submits into a large cluster, whose cycles take long, costs
about one cycle per SCHEDULER_DEBOUNCE_S, not 1,000. Per Celery queue, two Redis keys carry
it, both read and written by Lua scripts on Redis's own clock (no two hosts' clocks are
compared): the marker of the queued cycle, and the start of the running one.
A requested cycle deletes the marker just before it reads its snapshot, so:

- whatever commits after a cycle read its snapshot gets exactly one more cycle;
- at most one requested cycle waits in the queue, unless it has not started
  SCHEDULER_REQUEST_GRACE_S after it was due (its worker died with it, or its message never
  reached the queue): the marker then expires, and the next request queues another. Until
  then the periodic tick covers what the lost cycle would have done; no marker outlives that;
- a requested cycle that finds the cycle lock held asks again (tasks.py), spaced like any
  follow-up, since the cycle holding the lock may have read its snapshot before the change.

The keys are named after the queue the cycle is sent to: a process that sends its tasks
elsewhere (another deployment on the same Redis database, a script with another CELERY_QUEUE)
never silences this queue's requests. In the embedded mode (no Celery) a request wakes the
in-process loop, which follows the same rule (scheduling/embedded.py).

**Node notifications** (docs/agent-protocol.md, "watch"). Two channels carry the same signal: a
Redis PUBLISH on `gpucp:node:<name>` reaches watch requests served by any web process (through
its one subscriber, controlplane.cluster.watch_hub); an in-process condition variable reaches
watch requests served by this process, which is all there is in the embedded mode (no Redis). Call notify_nodes only after the change has committed: an
agent that heartbeats on the signal must see the new state.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

from django.conf import settings

if TYPE_CHECKING:
    from redis.commands.core import Script

log = logging.getLogger(__name__)

# The Celery task that runs one cycle (controlplane/scheduling/tasks.py), sent by its name.
RUN_CYCLE_TASK = "controlplane.scheduling.tasks.run_cycle"

# Followed by the Celery queue's name (request_keys).
REQUEST_KEY_PREFIX = "gpucp:cycle-requested:"
RUNNING_KEY_PREFIX = "gpucp:cycle-running:"
TOOK_KEY_PREFIX = "gpucp:cycle-took:"
# A busy loop's follow-up comes this many times the last cycle's duration after the running
# cycle started: the worker spends at most a third of its time in requested cycles. A cycle
# costs about the same whether it starts 17 jobs or 20 (it reads, plans and gives a reason to
# every waiting job), so in a flood fewer, fuller cycles are cheaper per job: at 3 rather than
# 2, a 2,000-job array took 96-106 cycles instead of 112-121, the worker and PostgreSQL spent
# about 0.6 and 0.4 ms less per job, and as many jobs ended per second (issue 14).
SPACING_PER_CYCLE_TIME = 3.0
# ...and never sooner than this after it started.
MIN_SPACING_S = 0.05
# How long the last duration is remembered (a quiet hour forgets it; the debounce spaces then).
TOOK_TTL_S = 3600

# KEYS: the marker, the running cycle's start, the last one's duration. ARGV: debounce ms, grace
# ms, reason, least spacing ms, spacing per ms of cycle. Returns the countdown in ms of the
# cycle it queued (the caller sends it), or -1 when one is queued already.
_REQUEST_SCRIPT = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return -1
end
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local countdown_ms = 0
local started_ms = redis.call('GET', KEYS[2])
if started_ms then
  -- One is running: the follow-up comes after its start by what the last cycle took, twice,
  -- within the least spacing and the debounce.
  local spacing_ms = tonumber(ARGV[1])
  local took_ms = redis.call('GET', KEYS[3])
  if took_ms then
    spacing_ms = math.min(spacing_ms,
      math.max(tonumber(ARGV[4]), tonumber(took_ms) * tonumber(ARGV[5])))
  end
  countdown_ms = math.max(0, tonumber(started_ms) + spacing_ms - now_ms)
end
redis.call('SET', KEYS[1], ARGV[3], 'PX', countdown_ms + tonumber(ARGV[2]))
return countdown_ms
"""

# KEYS: the marker, the running cycle's start. ARGV: how long the start is kept at most, in ms:
# should its worker die in the middle of the cycle, requests are not spaced for longer.
_STARTING_SCRIPT = """
local now = redis.call('TIME')
redis.call('DEL', KEYS[1])
redis.call('SET', KEYS[2], tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000),
  'PX', ARGV[1])
return 1
"""

# KEYS: the running cycle's start, the last one's duration. ARGV: 1 to record the duration (a
# cycle that ran; one that found the lock held took nothing worth spacing by), its TTL in ms.
_FINISHED_SCRIPT = """
local started_ms = redis.call('GET', KEYS[1])
redis.call('DEL', KEYS[1])
if started_ms and ARGV[1] == '1' then
  local now = redis.call('TIME')
  local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
  redis.call('SET', KEYS[2], math.max(0, now_ms - tonumber(started_ms)), 'PX', ARGV[2])
end
return 1
"""

_embedded_wakeup = threading.Event()


def embedded_wakeup_event() -> threading.Event:
    return _embedded_wakeup


def request_keys(queue: str | None = None) -> tuple[str, str, str]:
    """A queue's keys (this process's by default): its queued cycle's marker, its running one's
    start, and how long the last requested cycle took."""
    queue = queue or settings.CELERY_TASK_DEFAULT_QUEUE
    return (
        f"{REQUEST_KEY_PREFIX}{queue}",
        f"{RUNNING_KEY_PREFIX}{queue}",
        f"{TOOK_KEY_PREFIX}{queue}",
    )


@functools.cache
def _scripts() -> tuple[Script, Script, Script]:
    from controlplane.redis_client import get_redis

    conn = get_redis()
    return (
        conn.register_script(_REQUEST_SCRIPT),
        conn.register_script(_STARTING_SCRIPT),
        conn.register_script(_FINISHED_SCRIPT),
    )


def request_cycle(reason: str, queue: str | None = None) -> None:
    """Ask for a cycle on queue (this process's by default); see the module's docstring."""
    if settings.SCHEDULER_EMBEDDED:
        _embedded_wakeup.set()
        return
    if not settings.REDIS_URL:
        return
    try:
        from controlplane.celery import app

        queue = queue or settings.CELERY_TASK_DEFAULT_QUEUE
        marker, running, took = request_keys(queue)
        countdown_ms = int(
            _scripts()[0](
                keys=[marker, running, took],
                args=[
                    int(settings.SCHEDULER_DEBOUNCE_S * 1000),
                    int(settings.SCHEDULER_REQUEST_GRACE_S * 1000),
                    reason,
                    int(MIN_SPACING_S * 1000),
                    SPACING_PER_CYCLE_TIME,
                ],
            )
        )
        if countdown_ms < 0:
            return  # the queued cycle has not started: it will read this change
        try:
            # By name: this module sits below the apps and imports none of them. Without a
            # countdown the worker runs it as soon as it is free.
            app.send_task(
                RUN_CYCLE_TASK,
                # The queue goes along: the cycle clears this queue's marker whatever its
                # worker's own settings say.
                kwargs={"trigger": reason, "queue": queue},
                countdown=countdown_ms / 1000.0 if countdown_ms else None,
                queue=queue,
            )
        except Exception:
            # Nothing was queued: the marker must not silence the requests that follow.
            _forget_marker(marker)
            raise
    except Exception:
        # The periodic tick still runs the cycle; a broker hiccup must not fail a submit.
        log.warning(
            "could not request a scheduling cycle (%s); the next tick will run it",
            reason,
            exc_info=True,
        )


def _forget_marker(marker: str) -> None:
    from controlplane.redis_client import get_redis

    try:
        get_redis().delete(marker)
    except Exception:
        log.warning(
            "could not clear the cycle request; requests resume in %.0f s",
            settings.SCHEDULER_REQUEST_GRACE_S,
        )


def requested_cycle_starting(queue: str | None = None) -> None:
    """Called by a requested cycle before it reads its snapshot: later changes need a new one."""
    if not settings.REDIS_URL:
        return
    try:
        _scripts()[1](
            keys=list(request_keys(queue)[:2]),
            args=[int(settings.SCHEDULER_REQUEST_GRACE_S * 1000)],
        )
    except Exception:
        log.warning(
            "could not clear the cycle request; requests resume in %.0f s",
            settings.SCHEDULER_REQUEST_GRACE_S,
        )


def requested_cycle_finished(queue: str | None = None, *, ran: bool = True) -> None:
    """Called by a requested cycle once it is over: the next request runs its cycle at once,
    and follow-ups are spaced by what this one took (ran: it was not skipped on the lock)."""
    if not settings.REDIS_URL:
        return
    try:
        _scripts()[2](keys=list(request_keys(queue)[1:]), args=[1 if ran else 0, TOOK_TTL_S * 1000])
    except Exception:
        # Only the spacing suffers: requests come a debounce apart until the key expires.
        log.warning("could not record the end of a requested cycle", exc_info=True)


# --- node notifications ----------------------------------------------------------------------


def node_channel_prefix(redis_url: str | None = None) -> str:
    """Where the node channels of this deployment begin, on this Redis URL (settings' own by
    default): ``gpucp:<database name>:<Redis database>:node:``.

    Pub/sub ignores the database number: a channel named the same in two databases is one
    channel, so the names carry the Redis database. They carry the deployment too (its
    PostgreSQL database's name, or REDIS_KEY_PREFIX, as every key of ours does): two
    deployments on one Redis database (a staging copy beside production, two test workers)
    have nodes of the same names, and a signal for one's node woke the other's watch of it.
    Read at each call, as deployment_key is: a test database is named after settings load.
    """
    from controlplane.redis_client import deployment_key

    url = (settings.REDIS_URL or "") if redis_url is None else redis_url
    return deployment_key(f"{_redis_database(url)}:node:")


def node_channel_pattern(redis_url: str | None = None) -> str:
    """The PSUBSCRIBE pattern of this deployment's node channels, and of no other's.

    The prefix with Redis's glob characters escaped: a REDIS_KEY_PREFIX (or a database name)
    holding `*`, `?` or `[` would otherwise subscribe the hub to other deployments' channels
    too, and every web process would receive and drop their signals.
    """
    return _GLOB_SPECIAL.sub(r"\\\g<0>", node_channel_prefix(redis_url)) + "*"


# Special in a Redis glob pattern (util.c, stringmatchlen): escaped with a backslash.
_GLOB_SPECIAL = re.compile(r"[\\*?\[\]^]")


@functools.cache
def _redis_database(redis_url: str) -> int:
    from redis.connection import parse_url

    try:
        return int(parse_url(redis_url).get("db", 0)) if redis_url else 0
    except ValueError:
        return 0


CHANGED_MESSAGE = "changed"

_changed = threading.Condition()
# A counter per node name, bumped on every change: a waiter compares it with the value it saw
# before it started waiting, so a change that lands between two waits is never missed.
_versions: dict[str, int] = {}


def node_channel(name: str) -> str:
    """The Redis pub/sub channel a node's watchers subscribe to."""
    return f"{node_channel_prefix()}{name}"


def node_version(name: str) -> int:
    """How many changes this process has signalled for the node so far."""
    with _changed:
        return _versions.get(name, 0)


def wait_for_node_change(name: str, seen_version: int, timeout_s: float) -> bool:
    """Block until the node's version moves past seen_version (True) or timeout_s passes (False)."""
    with _changed:
        return _changed.wait_for(lambda: _versions.get(name, 0) > seen_version, timeout=timeout_s)


def notify_nodes(names: Iterable[str]) -> int:
    """Signal every named node on both channels; returns how many nodes were signalled."""
    unique = sorted(set(names))
    if not unique:
        return 0
    with _changed:
        for name in unique:
            _versions[name] = _versions.get(name, 0) + 1
        _changed.notify_all()
    if settings.REDIS_URL:
        try:
            from controlplane.redis_client import get_redis

            pipe = get_redis().pipeline(transaction=False)
            for name in unique:
                pipe.publish(node_channel(name), CHANGED_MESSAGE)
            pipe.execute()
        except Exception:
            # The agents' periodic heartbeat still picks the change up; only the latency suffers.
            log.warning(
                "could not publish desired-state changes for %d nodes", len(unique), exc_info=True
            )
    return len(unique)
