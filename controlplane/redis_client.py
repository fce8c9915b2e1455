"""One shared Redis connection pool per process."""

import functools

import redis
from django.conf import settings


@functools.cache
def get_redis() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5, health_check_interval=30)
