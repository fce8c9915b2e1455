"""Request rates of the user API (/api/v1/), counted in Django's cache.

With REDIS_URL set the cache is Redis (settings.CACHES), so every gunicorn worker and web host
counts against the same limits; without it (the embedded mode, one process) it is local memory.
Counts are fixed windows kept with the cache's atomic increment: DRF's own SimpleRateThrottle
reads and rewrites a list of timestamps, so two workers answering at once lose one of the two.

The agent API (/api/agent/) is plain Django views, not DRF, and none of this applies to it: its
load is the heartbeat rate of the nodes, sized and measured on its own (bench_heartbeat.py).
When the cache cannot be reached, requests are let through: an outage of Redis must not turn
into an outage of the API.
"""

from __future__ import annotations

import abc
import logging
import math
import time
import weakref

from django.conf import settings
from django.core.cache import cache, caches
from django.core.cache.backends.redis import RedisCache
from rest_framework.settings import api_settings
from rest_framework.throttling import BaseThrottle

log = logging.getLogger(__name__)

PERIOD_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


# After the cache failed to answer, requests skip it for this long instead of each waiting for
# its own timeout: a stopped Redis costs one request half a second, not every request.
CACHE_RETRY_AFTER_S = 5.0
_cache_down_until = 0.0


def _cache_call(scope: str, call, default):
    """call() against the cache, or `default` while it is (or just was) unreachable."""
    global _cache_down_until
    if time.monotonic() < _cache_down_until:
        return default
    try:
        return call()
    except Exception:  # noqa: BLE001 - any cache failure: fail open, see the module doc
        _cache_down_until = time.monotonic() + CACHE_RETRY_AFTER_S
        log.warning("Throttle %s: the cache did not answer; not counting for a while", scope)
        return default


# One redis.Redis per cache backend object (Django keeps one per thread), made once.
_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _redis_client(backend: RedisCache):
    """The Redis cache backend's own client (Django's RedisCache has no public pipeline), so a
    count lands where cache.get() would read it, under the same key prefix and version.

    Made once per backend: Django's get_client builds a new redis.Redis on every call (its
    table of response callbacks alone is a few hundred dictionary writes), which cost every
    API request about as much CPU as its round trips to Redis. The client only wraps the
    backend's connection pool, so one serves every later call.
    """
    client = _clients.get(backend)
    if client is None:
        client = _clients[backend] = backend._cache.get_client(write=True)
    return client


def _read_count(key: str) -> int:
    """The window's count, 0 when it has none."""
    backend = caches["default"]
    if isinstance(backend, RedisCache):
        # INCRBY keeps the count as a plain integer, which is how Django's Redis serializer
        # stores an int: cache.get() would read the same, through a new client.
        value = _redis_client(backend).get(backend.make_and_validate_key(key))
        return int(value) if value is not None else 0
    return int(cache.get(key, 0))


def _count_in(key: str, amount: int, ttl_s: int) -> int:
    """Add `amount` to the window's count and return the new count.

    On Redis one round trip: INCRBY and EXPIRE in one MULTI. The window is in the key, so
    renewing its expiry on every count keeps it at most ttl_s past the window's end. Django's
    add-then-incr would be three (SET NX, EXISTS, INCRBY), on every request.
    """
    backend = caches["default"]
    if isinstance(backend, RedisCache):
        full_key = backend.make_and_validate_key(key)
        client = _redis_client(backend)
        with client.pipeline(transaction=True) as pipe:
            pipe.incrby(full_key, amount)
            pipe.expire(full_key, ttl_s)
            count, _ = pipe.execute()
        return int(count)
    cache.add(key, 0, timeout=ttl_s)
    try:
        return cache.incr(key, amount)
    except ValueError:
        # The window's key expired between add and incr: that window is over.
        return 0


def parse_rate(rate: str) -> tuple[int, int]:
    """'30/minute' -> (30, 60): requests allowed per period of that many seconds."""
    count, _, period = rate.partition("/")
    return int(count), PERIOD_S[period.strip()[0]]


def client_ip(request) -> str:
    """The client's address: REMOTE_ADDR, or behind NUM_PROXIES trusted proxies the address the
    outermost of them saw (the entry that many from the right of X-Forwarded-For). Entries to the
    left of it were written by the client and prove nothing."""
    remote = request.META.get("REMOTE_ADDR", "") or ""
    proxies = settings.NUM_PROXIES
    forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "")
    if proxies and forwarded:
        hops = [h.strip() for h in forwarded.split(",") if h.strip()]
        if hops:
            return hops[-min(proxies, len(hops))]
    return remote


class WindowCounter:
    """Requests per fixed window for one scope, keyed by who is asking."""

    def __init__(self, scope: str):
        self.scope = scope

    def limit(self) -> tuple[int, int] | None:
        rate = api_settings.DEFAULT_THROTTLE_RATES.get(self.scope)
        # "N/period" strings (DRF's stubs type the rates as numbers, which DRF never takes).
        return parse_rate(str(rate)) if rate else None

    def _key(self, ident: str, period_s: int, now: float) -> str:
        return f"throttle:{self.scope}:{ident}:{int(now // period_s)}"

    @staticmethod
    def wait_s(period_s: int, now: float) -> int:
        return max(1, math.ceil(period_s - now % period_s))

    def count(self, ident: str) -> int:
        """How many were counted in this window, without counting one more."""
        limit = self.limit()
        if limit is None:
            return 0
        key = self._key(ident, limit[1], time.time())
        return _cache_call(self.scope, lambda: _read_count(key), 0)

    def add(self, ident: str, amount: int = 1) -> int:
        """Count `amount` more in this window and return the new count (0 when not counted)."""
        limit = self.limit()
        if limit is None:
            return 0
        key = self._key(ident, limit[1], time.time())
        return _cache_call(self.scope, lambda: _count_in(key, amount, limit[1] + 1), 0)

    def over(self, count: int) -> bool:
        """A window that counted `count` (this one included) went past the rate."""
        limit = self.limit()
        return limit is not None and count > limit[0]

    def full(self, count: int) -> bool:
        """A window that counted `count` so far has no room for one more."""
        limit = self.limit()
        return limit is not None and count >= limit[0]

    def retry_after_s(self) -> int:
        limit = self.limit()
        return self.wait_s(limit[1], time.time()) if limit else 1


class CountingThrottle(BaseThrottle, abc.ABC):
    """DRF throttle on a WindowCounter; subclasses say whom a request counts against."""

    scope = ""

    def __init__(self):
        self.counter = WindowCounter(self.scope)
        self._wait = None

    @abc.abstractmethod
    def ident_for(self, request) -> str | None:
        """Whom this request counts against, or None when this throttle does not apply to it."""

    def get_ident(self, request) -> str:
        return client_ip(request)

    def allow_request(self, request, view) -> bool:
        ident = self.ident_for(request)
        if ident is None:
            return True
        # A request that does the work of several (a list of jobs) counts as that many: a batch
        # must not be a way around the rate.
        weigh = getattr(view, "throttle_weight", None)
        weight = weigh(request) if weigh is not None else 1
        if self.counter.over(self.counter.add(ident, weight)):
            self._wait = self.counter.retry_after_s()
            return False
        return True

    def wait(self):
        return self._wait


class AnonThrottle(CountingThrottle):
    """Requests without credentials, per client address (only a few endpoints answer them)."""

    scope = "anon"

    def ident_for(self, request):
        if request.user and request.user.is_authenticated:
            return None
        return self.get_ident(request)


class UserThrottle(CountingThrottle):
    """Requests of one signed-in person, all their tokens and sessions together."""

    scope = "user"

    def ident_for(self, request):
        if request.user and request.user.is_authenticated:
            return str(request.user.pk)
        return None


# Failed bearer-token checks per client address (BearerTokenAuthentication counts them): past
# the rate, every bearer token from that address is answered 429 unread until the window ends,
# so guessing gets no answer, right or wrong.
bearer_failures = WindowCounter("bearer_failure")
