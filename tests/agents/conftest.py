"""Fixtures for the agent's tests: a real Podman engine, and a tiny control plane over HTTP.

The tiny control plane speaks docs/agent-protocol.md just far enough to drive the agent through
edge cases (a control plane that goes away, a log chunk it loses); the real control plane and
the end-to-end runs are tested in tests/controlplane.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests import ports
from tests.engine import docker_host

REPO = Path(__file__).resolve().parents[2]
# This suite's share of the ports the helpers of this project may use.
PORTS = range(18300, 18400)


def wait_until(predicate: Callable[[], object], timeout_s: float = 20.0, what: str = "") -> object:
    """Poll ``predicate`` until it returns something truthy; fail after a generous timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what or predicate}")
        time.sleep(0.05)


def kept_records(state_dir: Path) -> dict[int, dict]:
    """The attempt records an agent restarted on this state dir would find (agents.journal)."""
    from agents.journal import AttemptJournal

    return AttemptJournal(state_dir / "attempts.log").load()


def free_port() -> int:
    return ports.free_port(PORTS)


class TinyControlPlane:
    """The agent API of docs/agent-protocol.md with state in memory, on 127.0.0.1."""

    JOIN_TOKEN = "gcpj_test-join-token"

    def __init__(self) -> None:
        self.port = free_port()
        self.lock = threading.Condition()
        self.node_tokens: dict[str, str] = {}  # token -> node name
        self.registrations: list[dict] = []
        self.lost_register_answers = 0  # registrations done whose answer is then dropped
        self.heartbeats: list[dict] = []
        self.heartbeat_tokens: list[str] = []
        self.desired_attempts: list[dict] = []
        self.power_caps_w: dict[str, float] = {}
        self.heartbeat_interval_s = 60.0
        self.connections_opened = 0
        self.lease_s: float | None = None  # granted in every answer when set
        self.degraded = False  # answer like a control plane whose database is out of reach
        # An HTTP status every heartbeat gets instead of its answer (a control plane whose web
        # tier fails), or None; such a heartbeat counts in heartbeats_refused and changes nothing.
        self.failing_heartbeat_status: int | None = None
        self.heartbeats_refused = 0
        self.logs: dict[int, bytes] = {}
        self.log_posts: list[tuple[int, int, int]] = []  # (attempt, offset, bytes)
        self.fail_next_log_posts = 0
        self.version = 0
        self.watches = 0
        # As the real control plane does: a watch answers "changed" at once while the node's
        # last heartbeat answer is older than the desired state (not only on a later change).
        self.watch_against_last_answer = False
        self.answered_version = 0
        # The volumes endpoint: None answers 404, like a control plane from before volumes.
        self.volumes: list[dict] | None = None
        self.checkpoint_deletions: list[dict] = []
        self.volume_reports: list[dict] = []
        self._server: ThreadingHTTPServer | None = None
        self._connections: set[socket.socket] = set()
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- what a test changes -------------------------------------------------------------------

    def set_desired(self, attempts: list[dict] | None = None, caps_w: dict | None = None) -> None:
        with self.lock:
            if attempts is not None:
                self.desired_attempts = attempts
            if caps_w is not None:
                self.power_caps_w = caps_w
            self.version += 1
            self.lock.notify_all()

    def reported(self, attempt_id: int) -> list[dict]:
        """Every report of this attempt, oldest first."""
        with self.lock:
            return [
                a for hb in self.heartbeats for a in hb["attempts"] if a["attempt_id"] == attempt_id
            ]

    def last_heartbeat(self) -> dict | None:
        with self.lock:
            return self.heartbeats[-1] if self.heartbeats else None

    # -- the server ------------------------------------------------------------------------------

    def start(self) -> None:
        cp = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                with cp.lock:
                    cp._connections.add(self.connection)
                    cp.connections_opened += 1

            def finish(self) -> None:
                with cp.lock:
                    cp._connections.discard(self.connection)
                try:
                    super().finish()
                except OSError:
                    pass  # the connection was cut by stop()

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
                path = self.path.removeprefix("/api/agent/v1")
                if token not in cp.node_tokens:
                    return self._answer(401, {"detail": "bad node token"})
                if path == "/volumes" and cp.volumes is not None:
                    with cp.lock:
                        return self._answer(
                            200,
                            {
                                "volumes": list(cp.volumes),
                                "checkpoint_deletions": list(cp.checkpoint_deletions),
                            },
                        )
                return self._answer(404, {"detail": "no such endpoint"})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
                path = self.path.removeprefix("/api/agent/v1")
                if path == "/register":
                    if token != cp.JOIN_TOKEN:
                        return self._answer(401, {"detail": "bad join token"})
                    status, answer = cp._register(body)
                    if cp.lost_register_answers:
                        # Registered, but the answer never reaches the agent.
                        cp.lost_register_answers -= 1
                        self.close_connection = True
                        return None
                    return self._answer(status, answer)
                if token not in cp.node_tokens:
                    return self._answer(401, {"detail": "bad node token"})
                if path == "/heartbeat":
                    failing = cp.failing_heartbeat_status
                    if failing is not None:
                        with cp.lock:
                            cp.heartbeats_refused += 1
                        return self._answer(failing, {"detail": "the web tier is failing"})
                    return self._answer(200, cp._heartbeat(body, token))
                if path == "/watch":
                    return self._answer(200, cp._watch(body))
                if path == "/logs":
                    return self._answer(*cp._logs(body))
                if path == "/volumes" and cp.volumes is not None:
                    with cp.lock:
                        cp.volume_reports.append(body)
                        done = set(body["deleted_checkpoints"])
                        cp.checkpoint_deletions = [
                            d for d in cp.checkpoint_deletions if d["job_id"] not in done
                        ]
                    return self._answer(200, {"ok": True})
                return self._answer(404, {"detail": "no such endpoint"})

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address) -> None:
                pass  # a connection cut by stop() is what the test wanted

        self._server = Server(("127.0.0.1", self.port), Handler)
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    def stop(self) -> None:
        """Go away: open connections are cut, new ones refused until start() (same port)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self.lock:
            for connection in self._connections:
                try:
                    connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._connections.clear()
            self.lock.notify_all()

    def _register(self, body: dict) -> tuple[int, dict]:
        with self.lock:
            self.registrations.append(body)
            token = f"gcpn_{body['name']}_{len(self.registrations)}"
            # Registering again rotates the token: the old one stops working.
            self.node_tokens = {t: n for t, n in self.node_tokens.items() if n != body["name"]}
            self.node_tokens[token] = body["name"]
            return 201, {
                "node": body["name"],
                "node_token": token,
                "heartbeat_interval_s": self.heartbeat_interval_s,
            }

    def _heartbeat(self, body: dict, token: str) -> dict:
        with self.lock:
            self.heartbeats.append(body)
            self.heartbeat_tokens.append(token)
            self.lock.notify_all()
            lease = {} if self.lease_s is None else {"lease_s": self.lease_s}
            if self.degraded:
                return {
                    "degraded": True,
                    "heartbeat_interval_s": self.heartbeat_interval_s,
                    **lease,
                }
            self.answered_version = self.version
            return {
                "attempts": list(self.desired_attempts),
                "power_caps_w": dict(self.power_caps_w),
                "heartbeat_interval_s": self.heartbeat_interval_s,
                **lease,
            }

    def _watch(self, body: dict) -> dict:
        with self.lock:
            self.watches += 1
            seen = self.answered_version if self.watch_against_last_answer else self.version
            self.lock.wait_for(
                lambda: self.version != seen or self._server is None,
                timeout=float(body["timeout_s"]),
            )
            return {"changed": self.version != seen}

    def _logs(self, body: dict) -> tuple[int, dict]:
        with self.lock:
            if self.fail_next_log_posts > 0:
                self.fail_next_log_posts -= 1
                return 503, {"detail": "try again"}
            attempt_id, offset = body["attempt_id"], body["offset"]
            if "data_b64" in body:
                data = base64.b64decode(body["data_b64"])
            else:
                data = body["data"].encode()
            stored = self.logs.get(attempt_id, b"")
            self.log_posts.append((attempt_id, offset, len(data)))
            if offset <= len(stored) < offset + len(data):
                stored += data[len(stored) - offset :]
                self.logs[attempt_id] = stored
            return 200, {"next_offset": len(stored)}


@pytest.fixture
def control_plane():
    cp = TinyControlPlane()
    yield cp
    cp.stop()


@pytest.fixture(scope="session")
def engine_url() -> str:
    """DOCKER_HOST of a real engine (Podman's Docker API)."""
    return docker_host()


@pytest.fixture(params=["served", "compiled", "bash"])
def every_supervisor(request, monkeypatch) -> str:
    """Runs the test once with each job supervisor (agents/runtime/supervisor.py): runtimes
    made without naming one get it. "served": the compiled one forked by its fork server (the
    default); "compiled": the compiled one exec'd for each attempt."""
    from agents.runtime import process

    monkeypatch.setattr(
        process, "SUPERVISOR_KIND", "bash" if request.param == "bash" else "compiled"
    )
    monkeypatch.setattr(process, "SERVE", request.param == "served")
    return request.param


@pytest.fixture
def state_dir(tmp_path) -> Path:
    """An agent state dir; jobs a failed test left running there are killed afterwards."""
    path = tmp_path / "state"
    path.mkdir()
    os.chmod(path, 0o700)
    yield path
    from agents.runtime.process import ProcessRuntime

    process_dirs = []
    # os.walk, not glob("**/process"): a runtime's trash thread may be deleting folders of
    # process-trash/ meanwhile, which glob does not survive (walk skips what vanished).
    for root, dirs, _ in os.walk(path):
        if "process" in dirs:
            process_dirs.append(Path(root) / "process")
        dirs[:] = [d for d in dirs if d not in ("process", "process-trash")]
    for process_dir in process_dirs:
        runtime = ProcessRuntime(process_dir.parent)
        for attempt_id in runtime.running_attempts():
            runtime.signal_attempt(attempt_id, signal.SIGKILL)
