"""Django's PostgreSQL backend, with a persistent connection checked at no cost before reuse.

A thread keeps its connection between requests (CONN_MAX_AGE). When PostgreSQL restarts, or an
administrator ends the backend, the server says so on the idle connection (a FATAL error, then
the socket is closed), and nobody reads it until the thread's next request sends a statement:
that request then failed, answered 503, however long after the restart it came. Each of a web
process's threads did it once, at whatever time it next served a request.

Django's own health check (CONN_HEALTH_CHECKS) would catch it with a SELECT 1 before each
request's first statement: a round trip per request, for an event of once in months. Here the
check reads, without waiting, whatever the server has sent on the idle connection: a closed
one is found in a system call, and the request opens a new one. A server that vanished without
a word (its host gone) is not found this way; such a request fails as before, and the
connection is replaced for the next one. With a connection pool, the pool checks its own.
"""

from __future__ import annotations

import psycopg
from django.db.backends.postgresql import base
from psycopg import pq


class DatabaseWrapper(base.DatabaseWrapper):
    health_check_done: bool  # set by Django's base class, which its type stubs do not declare

    def close_if_health_check_failed(self) -> None:
        if self.pool or self.connection is None or self.health_check_done:
            return
        if not self.settings_dict["CONN_HEALTH_CHECKS"]:
            return
        self.health_check_done = True
        if self.in_atomic_block:
            return  # never between requests: a broken connection fails the block, as it must
        pgconn = self.connection.pgconn
        try:
            # Non-blocking: libpq reads only what has already arrived (its socket is always in
            # non-blocking mode) and marks the connection bad once it reads the end of it. The
            # server's farewell (a FATAL error) comes first and a read stops after it, so the
            # end is met by a second read; on a healthy connection both find nothing.
            pgconn.consume_input()
            pgconn.consume_input()
        except psycopg.OperationalError:
            pass
        if pgconn.status != pq.ConnStatus.OK or self.connection.broken:
            self.close()
