"""One scheduling cycle at a time, across every worker: whoever comes second skips.

On PostgreSQL a transaction-scoped advisory lock (pg_try_advisory_xact_lock) does it: it never
waits, and it is released by the same COMMIT or ROLLBACK that ends the cycle, so a worker that
dies half-way frees it with its connection. SQLite only serves the embedded mode, one process,
so a process-local lock is enough there.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection, transaction

# A fixed 32-bit key, derived from a name so that other advisory locks can pick distinct ones.
CYCLE_LOCK_KEY = zlib.crc32(b"gpucp.scheduling.cycle")

_process_lock = threading.Lock()


@contextmanager
def cycle_transaction() -> Iterator[bool]:
    """Open the cycle's transaction and yield whether this caller holds the cycle lock.

    When it yields False another cycle is running: do nothing and leave the block.
    """
    if connection.vendor == "postgresql":
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [CYCLE_LOCK_KEY])
                (held,) = cursor.fetchone()
            yield bool(held)
        return
    if not _process_lock.acquire(blocking=False):
        yield False
        return
    try:
        with transaction.atomic():
            yield True
    finally:
        _process_lock.release()
