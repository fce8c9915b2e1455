"""A web thread's persistent database connection, after PostgreSQL closed it while idle.

Each thread keeps its connection between requests (CONN_MAX_AGE). A PostgreSQL restart, or an
administrator's pg_terminate_backend, closes it on the server's side while nobody reads it; the
thread's next request, however much later, must be answered on a new connection, not 503.
"""

import os
import socket
import time

import pytest
from django.db import connection

pytestmark = pytest.mark.django_db(transaction=True)


def _backend_pid() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return cursor.fetchone()[0]


def _terminate_from_elsewhere(pid: int) -> None:
    """What a restart does to every connection it had, from a connection of another thread;
    back once this thread's connection has the server's end of it (its socket in CLOSE_WAIT)."""
    import psycopg

    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    params.pop("context", None)
    with psycopg.connect(**params, autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])
    ours = _ports()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if "08" in _tcp_states(ours):  # CLOSE_WAIT: the server closed its side
            return
        time.sleep(0.02)
    raise AssertionError(f"backend {pid} did not close its connection")


def _ports() -> tuple[int, int]:
    """(local, remote) port of this thread's connection."""
    sock = socket.socket(fileno=os.dup(connection.connection.pgconn.socket))
    try:
        return sock.getsockname()[1], sock.getpeername()[1]
    finally:
        sock.close()


def _tcp_states(ports: tuple[int, int]) -> set[str]:
    """The states of the sockets with these local and remote ports. By both: an ephemeral
    port is reused towards other servers, and a socket of a finished connection of the same
    local port (TIME_WAIT) may be listed before ours."""
    states = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                local = int(fields[1].rsplit(":", 1)[1], 16)
                remote = int(fields[2].rsplit(":", 1)[1], 16)
                if (local, remote) == ports:
                    states.add(fields[3])
    return states


@pytest.fixture
def api(alice):
    """GET through the production WSGI application, as gunicorn calls it: Django's test client
    would skip the request signals that let a kept connection be checked and replaced."""
    if connection.vendor != "postgresql":
        pytest.skip("a PostgreSQL server's connections")
    from wsgiref.util import setup_testing_defaults

    from controlplane.tenancy.models import ApiToken
    from controlplane.wsgi import application

    token = ApiToken.issue(alice, "tests")[1]

    def get(path: str) -> tuple[int, bytes]:
        environ = {"PATH_INFO": path, "HTTP_AUTHORIZATION": f"Bearer {token}"}
        setup_testing_defaults(environ)
        environ["HTTP_HOST"] = "testserver"
        status: list[str] = []
        body = b"".join(application(environ, lambda s, headers: status.append(s)))
        return int(status[0].split()[0]), body

    yield get
    # A test that failed between terminating this thread's backend and its next request
    # leaves the connection dead: closed here, the database's teardown opens a new one
    # instead of failing, and every later test on this worker with it.
    connection.close()


@pytest.mark.parametrize("path", ["/api/v1/jobs/", "/api/v1/tenants/"])
def test_the_request_after_the_server_closed_an_idle_connection_is_answered(api, path):
    assert api(path)[0] == 200
    before = _backend_pid()  # the connection the request used, kept for the next one
    assert api(path)[0] == 200 and _backend_pid() == before

    _terminate_from_elsewhere(before)

    status, body = api(path)
    assert status == 200, body
    assert _backend_pid() != before


def test_a_kept_connection_costs_no_round_trip_before_a_request(api, monkeypatch):
    # Django's own check would find the same with a SELECT 1 before each request's first
    # statement; this one reads what the server sent without asking it anything.
    import psycopg

    api("/api/v1/jobs/")
    sent: list[str] = []
    execute = psycopg.Cursor.execute

    def recording(self, query, *args, **kwargs):
        sent.append(query if isinstance(query, str) else repr(query))
        return execute(self, query, *args, **kwargs)

    monkeypatch.setattr(psycopg.Cursor, "execute", recording)
    assert api("/api/v1/jobs/")[0] == 200
    assert sent, "the request sent no statement at all: nothing was measured"
    assert "SELECT 1" not in [q.strip().upper() for q in sent]
