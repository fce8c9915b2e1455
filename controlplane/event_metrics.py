"""Counters and histograms of events (requests, cycles, job ends, queue waits), kept in Redis.

/metrics must answer the same cluster-wide figures from every web process, and the events
happen in several processes on possibly several hosts: gunicorn workers (requests, job ends
reported by heartbeats, cancels), the Celery worker (scheduling cycles, admissions). Counters and
histograms must also only ever grow, so they cannot be recomputed from rows that retention
prunes (cycle records, finished jobs). Hence one Redis hash per family, incremented where the
event happens and read by the exposition (controlplane.accounting.metrics) at scrape time.
HTTP requests, by far the most frequent events, are summed in each process first and written
every HTTP_FLUSH_EVERY_S (and before the process reads the figures, and at its exit).

prometheus_client's own multiprocess mode was weighed and left: it sums mmap files in one
directory, so it only sees the processes of its own host, and a web process on host A would
answer without host B's requests and without the Celery worker's cycles; it also needs the
directory wiped at each deploy. A Redis hash is shared by every host, survives deploys, and a
FLUSHALL is a reset Prometheus detects like a restarted exporter's.

A histogram's hash holds, per label set, the count of observations of each bucket (not
cumulative: one HINCRBY per observation instead of one per bucket) and their sum; the reader
makes them cumulative. Buckets are stored by their upper bound, so the boundaries below may be
changed: a stored bound that is no longer one counts in the next larger one, which keeps every
cumulative bucket from going down.

Recording never fails its caller: without REDIS_URL (the embedded mode may have none) it does
nothing; a Redis error is logged at debug and the events of the next few seconds are dropped
rather than each waiting for a Redis that does not answer (BACKOFF_S). The reader answers None
then, and the exposition leaves these families out.

Below every app, like controlplane.wakeups: it imports only settings and redis, so any app's
actions, the scheduling loop and the middleware may call it.
"""

from __future__ import annotations

import atexit
import bisect
import functools
import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import redis
from django.conf import settings

from controlplane.redis_client import deployment_key

log = logging.getLogger(__name__)

# Every family's hash is this followed by its name, under the deployment's prefix (another
# deployment on the same Redis counts its own); the tests give each test a prefix of its own.
KEY_PREFIX = "metrics:"
# A Redis that does not answer costs a request at most this, once per BACKOFF_S per process.
CONNECT_TIMEOUT_S = 0.25
SOCKET_TIMEOUT_S = 0.5
BACKOFF_S = 5.0


@dataclass(frozen=True, slots=True)
class Family:
    """One counter or histogram: its name as exposed, and its label names in storage order."""

    name: str
    kind: str  # "counter" or "histogram"
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()  # upper bounds, increasing; +Inf is implied

    @property
    def key(self) -> str:
        return deployment_key(f"{KEY_PREFIX}{self.name}")


# Queue waits span an idle cluster's sub-second admissions to a busy one's days.
QUEUE_WAIT_BUCKETS_S = (
    0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0,
    14400.0, 28800.0, 86400.0, 172800.0, 604800.0,
)  # fmt: skip
# A quiet cluster's cycle takes milliseconds; a cold start over thousands of jobs, seconds to tens.
CYCLE_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0,
)  # fmt: skip
# An API answer: 5 ms for a cached read to 30 s for a large array's submit or an export.
HTTP_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

# Stored by tenant id (the slug is read at scrape time: recording costs no query).
QUEUE_WAIT = Family(
    "gpucp_job_queue_wait_seconds",
    "histogram",
    "Time from a job's submission to its first admission onto GPUs (the scheduler's placement; "
    "image pull and container start come after), by tenant. Includes time held for "
    "dependencies or array slots; a requeued job's later waits are not counted.",
    ("tenant",),
    QUEUE_WAIT_BUCKETS_S,
)
# Stored by tenant id and JobState value, by controlplane.jobs.actions.jobs_finished, and by
# controlplane.jobs.dependencies for the jobs it cancels itself (a dependency never met).
JOBS_FINISHED = Family(
    "gpucp_jobs_finished_total",
    "counter",
    "Jobs that reached a final state, by tenant and outcome (succeeded, failed, cancelled).",
    ("tenant", "outcome"),
)
CYCLE_DURATION = Family(
    "gpucp_scheduling_cycle_duration_seconds",
    "histogram",
    "Wall time of scheduling cycles that ran (lock, load, plan, apply, commit).",
    (),
    CYCLE_BUCKETS_S,
)
HTTP_REQUESTS = Family(
    "gpucp_http_requests_total",
    "counter",
    "HTTP requests answered by Django, by method, URL pattern and status "
    "(agents' heartbeats and watches take a shortcut past Django and are not counted).",
    ("method", "route", "status"),
)
HTTP_DURATION = Family(
    "gpucp_http_request_duration_seconds",
    "histogram",
    "Time Django took to answer, by method and URL pattern (a stream: until its first byte).",
    ("method", "route"),
    HTTP_BUCKETS_S,
)
FAMILIES = (QUEUE_WAIT, JOBS_FINISHED, CYCLE_DURATION, HTTP_REQUESTS, HTTP_DURATION)

# Per Redis URL: until when (time.monotonic) it is left alone after an error.
_resting_until: dict[str, float] = {}


@functools.cache
def _client(url: str) -> redis.Redis:
    # Its own pool, with timeouts far below the shared client's 5 s: a request must not wait
    # on a counter.
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
        socket_timeout=SOCKET_TIMEOUT_S,
        health_check_interval=30,
    )


def _redis() -> redis.Redis | None:
    url = settings.REDIS_URL
    if not url or _resting_until.get(url, 0.0) > time.monotonic():
        return None
    return _client(url)


def _rest(error: Exception) -> None:
    _resting_until[settings.REDIS_URL] = time.monotonic() + BACKOFF_S
    log.debug("metrics: Redis unavailable (%s); skipped for %.0f s", error, BACKOFF_S)


def enabled() -> bool:
    """Whether events are recorded at all: a caller may skip preparing them otherwise."""
    return bool(settings.REDIS_URL)


def _field(*parts: str) -> str:
    # JSON: label values are free text (URL patterns hold any character), so no separator is safe.
    return json.dumps(parts, separators=(",", ":"))


def _bound(value: float) -> str:
    return repr(float(value))


class Batch:
    """Increments sent together, in one round trip and one MULTI, so that a scrape never sees
    a histogram's bucket counted without its sum."""

    def __init__(self) -> None:
        # By (family's name, field). The family's Redis key is made when the batch is sent, not
        # at each count: the request path counts three times per request.
        self._ints: dict[tuple[str, str], int] = {}
        self._floats: dict[tuple[str, str], float] = {}
        self._families: dict[str, Family] = {}

    def count(self, family: Family, labels: Iterable[object], by: int = 1) -> Batch:
        assert family.kind == "counter", family.name
        self._families[family.name] = family
        key = (family.name, _field(*map(str, labels)))
        self._ints[key] = self._ints.get(key, 0) + by
        return self

    def observe(self, family: Family, labels: Iterable[object], value: float) -> Batch:
        assert family.kind == "histogram", family.name
        values = tuple(map(str, labels))
        if math.isnan(value):
            return self
        index = bisect.bisect_left(family.buckets, value)
        bound = _bound(family.buckets[index]) if index < len(family.buckets) else "+Inf"
        self._families[family.name] = family
        key = (family.name, _field("bucket", *values, bound))
        self._ints[key] = self._ints.get(key, 0) + 1
        key = (family.name, _field("sum", *values))
        self._floats[key] = self._floats.get(key, 0.0) + value
        return self

    def send(self) -> None:
        """Write the increments; never raises."""
        if not self._ints:
            return
        conn = _redis()
        if conn is None:
            return
        try:
            keys = {name: family.key for name, family in self._families.items()}
            pipe = conn.pipeline(transaction=True)
            for (name, field), n in self._ints.items():
                pipe.hincrby(keys[name], field, n)
            for (name, field), amount in self._floats.items():
                pipe.hincrbyfloat(keys[name], field, amount)
            pipe.execute()
        except Exception as error:
            _rest(error)


# --- what the events record ---------------------------------------------------------------


# Requests are counted in the process and written to Redis at most this often (and before this
# process reads the figures, and at its exit): a round trip per request cost a submit 7 % of its
# CPU, for figures Prometheus scrapes every 15 s or more. A process killed outright loses at most
# this much of its request counts, never more.
HTTP_FLUSH_EVERY_S = 1.0

_http_pending = Batch()
_http_lock = threading.Lock()
_http_flusher_pid: int | None = None


def record_http_request(method: str, route: str, status: int, duration_s: float) -> None:
    with _http_lock:
        _http_pending.count(HTTP_REQUESTS, (method, route, status)).observe(
            HTTP_DURATION, (method, route), duration_s
        )
    if _http_flusher_pid != os.getpid():
        _start_http_flusher()


def flush_http_requests() -> None:
    """Write the requests this process counted since the last flush."""
    global _http_pending
    with _http_lock:
        batch, _http_pending = _http_pending, Batch()
    batch.send()


def _start_http_flusher() -> None:
    # Per process: gunicorn forks its workers after the app is loaded, and a thread does not
    # survive a fork, so each worker starts its own at its first request.
    global _http_flusher_pid
    with _http_lock:
        if _http_flusher_pid == os.getpid():
            return
        _http_flusher_pid = os.getpid()
    threading.Thread(target=_flush_http_forever, name="http-metrics", daemon=True).start()
    atexit.register(flush_http_requests)


def _flush_http_forever() -> None:
    while True:
        time.sleep(HTTP_FLUSH_EVERY_S)
        flush_http_requests()


def record_cycle(duration_s: float) -> None:
    Batch().observe(CYCLE_DURATION, (), duration_s).send()


def record_jobs_finished(outcomes: Iterable[tuple[int, str]]) -> None:
    """(tenant id, final JobState) for each job that just ended, once per real end."""
    batch = Batch()
    for tenant_id, state in outcomes:
        batch.count(JOBS_FINISHED, (tenant_id, state))
    batch.send()


def record_queue_waits(waits: Iterable[tuple[int, float]]) -> None:
    """(tenant id, seconds from submission to first admission) for each job just admitted."""
    batch = Batch()
    for tenant_id, wait_s in waits:
        batch.observe(QUEUE_WAIT, (tenant_id,), max(0.0, wait_s))
    batch.send()


# --- what the exposition reads ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HistogramValue:
    buckets: list[tuple[float, int]]  # (upper bound, cumulative count), ending with +Inf
    sum: float

    @property
    def count(self) -> int:
        return self.buckets[-1][1]


@dataclass(frozen=True, slots=True)
class Stored:
    """What Redis holds, by family name, then by label values (as recorded)."""

    counters: dict[str, dict[tuple[str, ...], float]]
    histograms: dict[str, dict[tuple[str, ...], HistogramValue]]


def read() -> Stored | None:
    """Every family's values, or None when Redis cannot say."""
    # This process's own requests so far count: a scrape follows the requests it answered.
    flush_http_requests()
    conn = _redis()
    if conn is None:
        return None
    try:
        pipe = conn.pipeline(transaction=True)
        for family in FAMILIES:
            pipe.hgetall(family.key)
        raw = pipe.execute()
    except Exception as error:
        _rest(error)
        return None
    stored = Stored({}, {})
    for family, fields in zip(FAMILIES, raw, strict=True):
        if family.kind == "counter":
            stored.counters[family.name] = {
                tuple(json.loads(field)): float(value) for field, value in fields.items()
            }
        else:
            stored.histograms[family.name] = _decode(family, fields)
    return stored


def _decode(family: Family, fields: Mapping[bytes, bytes]) -> dict[tuple[str, ...], HistogramValue]:
    bounds = (*family.buckets, math.inf)
    per_bucket: dict[tuple[str, ...], list[int]] = {}
    sums: dict[tuple[str, ...], float] = {}
    for field, value in fields.items():
        kind, *parts = json.loads(field)
        if kind == "sum":
            sums[tuple(parts)] = float(value)
            continue
        *labels, stored = parts
        # A bound no longer in use counts in the next larger one (see the module's docstring).
        index = bisect.bisect_left(bounds, float(stored))
        counts_of = per_bucket.setdefault(tuple(labels), [0] * len(bounds))
        counts_of[min(index, len(bounds) - 1)] += int(value)
    values: dict[tuple[str, ...], HistogramValue] = {}
    for labels, counts_of in per_bucket.items():
        running, cumulative = 0, []
        for bound, n in zip(bounds, counts_of, strict=True):
            running += n
            cumulative.append((bound, running))
        values[labels] = HistogramValue(cumulative, sums.get(labels, 0.0))
    return values


def empty_histogram(family: Family) -> HistogramValue:
    return HistogramValue([(b, 0) for b in (*family.buckets, math.inf)], 0.0)
