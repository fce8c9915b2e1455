"""Retries: only where sending a request twice cannot do a thing twice.

A tiny HTTP server on 127.0.0.1 answers from a script (503s, then 200) and counts requests.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from gpucp import errors
from gpucp.client import Client


class Scripted:
    def __init__(self, statuses: list[int]):
        self.statuses = statuses
        self.requests: list[tuple[str, str, dict]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                outer.requests.append((self.command, self.path, dict(self.headers)))
                status = outer.statuses.pop(0) if outer.statuses else 200
                body = json.dumps(
                    {"id": 7, "state": "PENDING"} if status < 400 else {"detail": "Busy."}
                ).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PATCH = do_DELETE = _answer

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def client(self, **kwargs) -> Client:
        return Client(self.url, "t0ken", backoff_s=0.001, **kwargs)


@pytest.fixture
def scripted():
    servers: list[Scripted] = []

    def make(*statuses: int) -> Scripted:
        servers.append(Scripted(list(statuses)))
        return servers[-1]

    yield make
    for server in servers:
        server.server.shutdown()
        server.server.server_close()


def test_a_read_is_retried_through_503s(scripted):
    server = scripted(503, 503, 200)
    assert server.client().job(7)["id"] == 7
    assert [r[0] for r in server.requests] == ["GET", "GET", "GET"]


def test_a_submit_is_retried_with_the_same_idempotency_key(scripted):
    server = scripted(503, 200)
    server.client().submit(image="x", command=["true"])
    keys = [r[2].get("Idempotency-Key") for r in server.requests]
    assert len(keys) == 2 and keys[0] and keys[0] == keys[1]


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.cancel(7),
        lambda c: c.quotas.create(tenant="vision", limit_gpus=4),
        lambda c: c.budgets.update(3, amount=10),
        lambda c: c.post("/api/v1/jobs/", {"image": "x"}),
    ],
)
def test_a_write_without_an_idempotency_key_is_sent_once(scripted, call):
    server = scripted(503, 200)
    with pytest.raises(errors.ServerError) as raised:
        call(server.client())
    assert raised.value.status == 503 and len(server.requests) == 1


def test_retries_stop_after_the_most_allowed(scripted):
    server = scripted(*[503] * 10)
    with pytest.raises(errors.ServerError):
        server.client(max_retries=2).job(7)
    assert len(server.requests) == 3


@pytest.mark.parametrize("status", [500, 502, 429, 400])
def test_other_failures_are_not_retried(scripted, status):
    server = scripted(status, 200)
    with pytest.raises(errors.ApiError):
        server.client().job(7)
    assert len(server.requests) == 1


def test_a_refused_connection_is_retried_then_reported(scripted):
    server = scripted()
    url = server.url
    server.server.shutdown()
    server.server.server_close()
    attempts = []
    client = Client(url, "t0ken", backoff_s=0.001, max_retries=2)
    real = client._http.request

    def counting(*args, **kwargs):
        attempts.append(args[0])
        return real(*args, **kwargs)

    client._http.request = counting
    with pytest.raises(errors.ConnectionFailed, match="cannot reach"):
        client.job(7)
    assert attempts == ["GET"] * 3
    attempts.clear()
    with pytest.raises(errors.ConnectionFailed):
        client.cancel(7)
    assert attempts == ["POST"]
