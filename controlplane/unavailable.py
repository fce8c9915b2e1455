"""503 with Retry-After, not 500, while the database cannot answer.

A web process outlives outages of PostgreSQL (a restart, a failover, a full connection table):
its requests then fail in the database driver with OperationalError (connection refused,
terminated, deadlock detected, statement timeout) or InterfaceError (a connection that broke
earlier). None of these is a fault of the request or of the code, and all of them pass: the
client is told so, and when to try again, instead of getting the 500 of a bug. Other database
errors (DataError, IntegrityError) stay 500s: they are bugs of validation to be fixed.

Only what the views raise comes here (Django's process_exception); the API's own exception
handler (controlplane.api) leaves these exceptions to it. Whatever the request wrote in its
transaction was rolled back with the connection; a submit that cannot know whether its commit
landed is made safe to repeat by its Idempotency-Key.
"""

from __future__ import annotations

import logging

from django.db import InterfaceError, OperationalError
from django.http import HttpResponse, JsonResponse

log = logging.getLogger(__name__)

API_PREFIX = "/api/"
# The agent API decides for itself what a database error means for a heartbeat and a watch (a
# degraded answer that keeps leases; they raise nothing here). Its other requests (register,
# logs, volumes...) get the 503 of an outage only when the connection itself failed: a
# deadlock or a lock timeout there stays an error the agent retries, as it retries any 5xx.
AGENT_API_PREFIX = "/api/agent/"
RETRY_AFTER_S = 5
MESSAGE = "The database cannot be reached right now; try again in a few seconds."


def connection_lost(exc: OperationalError | InterfaceError) -> bool:
    """True when the error says the database cannot be talked to at all, not that a statement
    failed (a lock timeout, a deadlock).

    No SQLSTATE (the connection was refused or broke, or a pool had none to give in time), class
    08 (connection exception) or 57P (the server is shutting down, or not accepting connections
    yet).
    """
    if isinstance(exc, InterfaceError):
        return True
    sqlstate = getattr(exc.__cause__, "sqlstate", None)
    return sqlstate is None or sqlstate.startswith(("08", "57P"))


class DatabaseUnavailableMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_exception(self, request, exception):
        if not isinstance(exception, OperationalError | InterfaceError):
            return None
        if request.path_info.startswith(AGENT_API_PREFIX) and not connection_lost(exception):
            return None
        log.warning("%s %s: database unavailable: %s", request.method, request.path, exception)
        headers = {"Retry-After": str(RETRY_AFTER_S)}
        if request.path_info.startswith(API_PREFIX):
            return JsonResponse({"detail": MESSAGE}, status=503, headers=headers)
        return HttpResponse(
            f"<!doctype html><title>Unavailable</title><h1>Unavailable</h1><p>{MESSAGE}</p>",
            status=503,
            headers=headers,
        )
