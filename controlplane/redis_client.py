"""One shared Redis connection pool per process, and the names of this deployment's keys."""

import functools

import redis
from django.conf import settings


@functools.cache
def get_redis() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5, health_check_interval=30)


def deployment_key(name: str) -> str:
    """`name` under this deployment's prefix: `REDIS_KEY_PREFIX` when set, else
    ``gpucp:<the name of its PostgreSQL database>``.

    Deployments that share one Redis database (a staging copy beside production, the servers a
    test starts beside the suite's own) have node ids and names in common. A key named by those
    alone would let one deployment read another's lease renewals, pruning marker or answers.
    The database's name is read when the key is made, not when settings load: every process
    on one database (a test database, named once settings have loaded, included) then agrees
    on it. From settings, not the connection: a connection is a thread-local lookup that cost
    a request more than its whole use of Redis keys.
    """
    prefix = settings.REDIS_KEY_PREFIX or f"gpucp:{settings.DATABASES['default']['NAME']}"
    return f"{prefix}:{name}"
