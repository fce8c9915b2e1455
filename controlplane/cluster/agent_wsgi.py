"""The WSGI shortcut for heartbeats and watches: the hottest requests of the system, without
Django's stack.

A heartbeat needs none of what Django's request handling does for it: no session, no CSRF,
no user, no messages, no URL resolution, no per-request signals. At 10,000 nodes every 10 s
that stack cost more CPU than the heartbeat itself; and a watch, re-armed by every agent after
every change, cost twice what it does past the stack once it needed no Redis connection of its
own. `with_agent_shortcut(django_app)` answers POST /api/agent/v1/heartbeat and
POST /api/agent/v1/watch directly, through the same code as the Django views
(agent_api.answer_heartbeat_request, agent_api.answer_watch_request), and hands every other
request to Django unchanged.

What Django would still have done, done here: this thread's database connection is closed
when broken or past CONN_MAX_AGE, before and after (request_started / request_finished), and
an unexpected error is logged and answered 500 as JSON. Where SECURE_SSL_REDIRECT asks for
HTTPS, the shortcut steps aside for plain HTTP so that SecurityMiddleware can redirect.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

HEARTBEAT_PATH = "/api/agent/v1/heartbeat"
WATCH_PATH = "/api/agent/v1/watch"
# A heartbeat of a node with a few hundred GPUs and attempts is well under this.
MAX_BODY_BYTES = 4 * 1024 * 1024
STATUS_LINES = {
    200: "200 OK",
    400: "400 Bad Request",
    401: "401 Unauthorized",
    413: "413 Content Too Large",
    429: "429 Too Many Requests",
    500: "500 Internal Server Error",
    503: "503 Service Unavailable",
}


def with_agent_shortcut(django_app):
    from django.conf import settings

    https_only = bool(getattr(settings, "SECURE_SSL_REDIRECT", False))

    def application(environ, start_response):
        path = environ.get("PATH_INFO")
        if (
            path not in (HEARTBEAT_PATH, WATCH_PATH)
            or environ.get("REQUEST_METHOD") != "POST"
            or (https_only and environ.get("wsgi.url_scheme") != "https")
        ):
            return django_app(environ, start_response)
        if path == WATCH_PATH:
            return watch_app(environ, start_response)
        return heartbeat_app(environ, start_response)

    return application


def heartbeat_app(environ, start_response):
    from controlplane.cluster import agent_api

    return _agent_app(environ, start_response, agent_api.answer_heartbeat_request, "heartbeat")


def watch_app(environ, start_response):
    from controlplane.cluster import agent_api

    return _agent_app(environ, start_response, agent_api.answer_watch_request, "watch")


def _agent_app(environ, start_response, answer, what: str):
    from django.db import connection

    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = -1
    if not 0 <= length <= MAX_BODY_BYTES:
        return _respond(start_response, 413, b'{"detail": "Missing or too large body."}', [])
    body = environ["wsgi.input"].read(length) if length else b""
    _close_if_unusable(connection)
    try:
        status, payload, headers = answer(environ.get("HTTP_AUTHORIZATION"), body)
    except Exception:
        log.exception("%s failed", what)
        status, payload, headers = 500, b'{"detail": "Server error."}', []
    finally:
        _close_if_unusable(connection)
    return _respond(start_response, status, payload, headers)


def _close_if_unusable(connection) -> None:
    # Django's close_old_connections, for the one connection a heartbeat uses. Inside an
    # atomic block (a test's transaction; never between two requests in production) it would
    # close the connection for not being in autocommit, which is why Django's test tools
    # disconnect it from the request signals; so does this.
    if not connection.in_atomic_block:
        connection.close_if_unusable_or_obsolete()


def _respond(start_response, status: int, payload: bytes, headers: list[tuple[str, str]]):
    start_response(
        STATUS_LINES[status],
        [
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(payload))),
            *headers,
        ],
    )
    return [payload]
