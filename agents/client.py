"""The agent's side of the agent protocol (docs/agent-protocol.md), over HTTP with requests.

Every call is one attempt that either answers or raises one of three errors, so the daemon
decides what to do: ControlPlaneUnavailable (retry later with backoff; never a reason to touch
the jobs), Unauthorized (the node token is no longer valid: register again) and Rejected (the
control plane refused what we sent).
"""

from __future__ import annotations

import base64
import logging
import os
import random
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

log = logging.getLogger(__name__)

API_PREFIX = "/api/agent/v1"
TOKEN_FILE = "node-token"
# The key of a registration under way, kept until its answer (the node token) is: a retry of
# it, by this process or by the next after a restart, sends the same key, so that a control
# plane that registered the node but whose answer was lost gives a node token again instead of
# refusing the join token the first try spent (docs/agent-protocol.md, "Registration").
REGISTRATION_KEY_FILE = "registration-key"


class ControlPlaneError(Exception):
    """A call to the control plane did not succeed."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ControlPlaneUnavailable(ControlPlaneError):
    """Unreachable, timed out, or a 5xx / 429: worth retrying later."""


class Unauthorized(ControlPlaneError):
    """401/403: the token is unknown, revoked or expired."""


class Rejected(ControlPlaneError):
    """Another 4xx: the request itself is at fault (the message says which field)."""


class Backoff:
    """Exponential backoff with jitter, so agents that lost the control plane together do not
    all come back in the same second. Each delay is drawn from [d/2, d] with d doubling from
    ``base_s`` up to ``max_s``.
    """

    def __init__(
        self,
        base_s: float = 0.5,
        max_s: float = 30.0,
        factor: float = 2.0,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.base_s = base_s
        self.max_s = max_s
        self.factor = factor
        self._rng = rng
        self.failures = 0

    def next_delay_s(self) -> float:
        """The wait before the next try; each call counts one more failure."""
        ceiling_s = min(self.max_s, self.base_s * self.factor**self.failures)
        self.failures += 1
        return ceiling_s / 2 + self._rng() * ceiling_s / 2

    def reset(self) -> None:
        """A call succeeded: the next failure starts again from ``base_s``."""
        self.failures = 0


def _write_secret(path: Path, text: str, *, durable: bool = False) -> None:
    """Replace `path` with `text`, readable by this user alone, in one rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.chmod(tmp, 0o600)  # in case the file was there with looser bits
    os.replace(tmp, path)


class ControlPlaneClient:
    """Talks to the control plane at ``base_url``; keeps the node token in ``state_dir``."""

    def __init__(
        self,
        base_url: str,
        *,
        state_dir: str | os.PathLike[str],
        join_token: str | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.join_token = join_token
        self.timeout_s = timeout_s
        self._token_path = Path(state_dir) / TOKEN_FILE
        # requests.Session is not safe to share between threads (the watch runs in its own).
        self._local = threading.local()
        self.node_token = self._load_token()

    # -- the node token --------------------------------------------------------------------------

    @property
    def token_path(self) -> Path:
        """Where the node token is kept (mode 0600)."""
        return self._token_path

    def _load_token(self) -> str | None:
        try:
            token = self._token_path.read_text().strip()
        except FileNotFoundError:
            return None
        if os.stat(self._token_path).st_mode & 0o077:
            os.chmod(self._token_path, 0o600)
        return token or None

    def _save_token(self, token: str) -> None:
        _write_secret(self._token_path, token + "\n")
        self.node_token = token

    def forget_token(self) -> None:
        """Drop a node token the control plane refused, so the next start registers again."""
        self.node_token = None
        try:
            self._token_path.unlink()
        except FileNotFoundError:
            pass

    # -- calls -----------------------------------------------------------------------------------

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            session.headers["User-Agent"] = "gpucp-agent"
            # What requests reads from the environment for every request (the proxy for this
            # address, NO_PROXY, a CA bundle) is read once: the agent talks to one address,
            # and the look cost it about 2 ms of CPU per call, several calls per job.
            session.trust_env = False
            session.proxies = requests.utils.get_environ_proxies(self.base_url)
            ca_bundle = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
            if ca_bundle:
                session.verify = ca_bundle
            self._local.session = session
        return session

    def _post(
        self, path: str, body: dict[str, Any] | None, token: str | None, timeout_s: float
    ) -> dict[str, Any]:
        return self._call("POST", path, body, token, timeout_s)

    def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        token: str | None,
        timeout_s: float,
    ) -> dict[str, Any]:
        if not token:
            raise Unauthorized(f"no token for {path}")
        url = self.base_url + API_PREFIX + path
        try:
            response = self._session().request(
                method,
                url,
                json=body,
                headers={"Authorization": f"Bearer {token}"},
                timeout=timeout_s,
            )
        except requests.RequestException as exc:
            self._drop_connection()
            raise ControlPlaneUnavailable(f"{url}: {exc}") from exc
        status = response.status_code
        if status >= 500 or status == 429:
            if status != 429:
                # The next try on a new connection: behind a load balancer, or among a
                # server's worker processes, it may reach one that can answer.
                self._drop_connection()
            raise ControlPlaneUnavailable(f"{url}: HTTP {status}", status)
        if status in (401, 403):
            raise Unauthorized(f"{url}: HTTP {status} {response.text[:200]}", status)
        if status >= 400:
            raise Rejected(f"{url}: HTTP {status} {response.text[:500]}", status)
        try:
            answer: dict[str, Any] = response.json()  # every endpoint answers an object
        except ValueError as exc:
            raise ControlPlaneUnavailable(f"{url}: answer is not JSON", status) from exc
        return answer

    def register(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Register with the join token; keeps the node token it gets. Returns the answer."""
        if not self.join_token:
            raise Unauthorized("no join token to register with (set GPUCP_JOIN_TOKEN)")
        key_path = self._token_path.with_name(REGISTRATION_KEY_FILE)
        key, try_number = self._next_registration_try(key_path)
        payload = {**payload, "registration_key": key, "registration_try": try_number}
        answer = self._post("/register", payload, self.join_token, self.timeout_s)
        token = answer.get("node_token")
        if not token:
            raise Rejected("register answered without a node_token")
        self._save_token(token)
        key_path.unlink(missing_ok=True)  # the next registration is another one
        return answer

    @staticmethod
    def _next_registration_try(path: Path) -> tuple[str, int]:
        """The key of the registration under way and the number of this try of it: the key
        kept with the last try's number, or a new key; kept (0600, fsynced) before it is sent,
        so that a retry after a restart goes on from there."""
        try:
            key, number = path.read_text().split()
            try_number = int(number) + 1
        except (FileNotFoundError, ValueError):
            key, try_number = "", 1
        if len(key) < 32:
            key, try_number = secrets.token_urlsafe(32), 1
        _write_secret(path, f"{key} {try_number}\n", durable=True)
        return key, try_number

    def heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
        """Send what the node observes; returns the desired state."""
        return self._post("/heartbeat", body, self.node_token, self.timeout_s)

    def watch(self, timeout_s: float) -> bool:
        """Long-poll: True as soon as this node's desired state changed, False at the timeout."""
        answer = self._post(
            "/watch", {"timeout_s": timeout_s}, self.node_token, timeout_s + self.timeout_s
        )
        return bool(answer.get("changed"))

    def send_logs(self, attempt_id: int, offset: int, data: bytes | str) -> int:
        """Ship a chunk of output at byte ``offset``; returns the offset the control plane has.

        Output is bytes: plain UTF-8 text travels as ``data`` (readable, and what control
        planes before base64 understood); anything else (a NUL, invalid UTF-8, a character cut
        at the chunk's end) as ``data_b64``, so no byte is lost or altered.
        """
        body: dict[str, Any] = {"attempt_id": attempt_id, "offset": offset}
        if isinstance(data, str):
            body["data"] = data
        else:
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                text = None
            if text is not None and "\x00" not in text:
                body["data"] = text
            else:
                body["data_b64"] = base64.b64encode(data).decode("ascii")
        answer = self._post("/logs", body, self.node_token, self.timeout_s)
        return int(answer["next_offset"])

    def volumes(self) -> dict[str, Any]:
        """The volumes that apply to this node and the checkpoint dirs due for deletion.

        A control plane without volumes answers 404 (Rejected with status 404)."""
        return self._call("GET", "/volumes", None, self.node_token, self.timeout_s)

    def report_volumes(self, present: list[str], deleted_checkpoints: list[int]) -> None:
        """Say which volumes this node has, and which jobs' checkpoint dirs it deleted."""
        self._post(
            "/volumes",
            {"present": present, "deleted_checkpoints": deleted_checkpoints},
            self.node_token,
            self.timeout_s,
        )

    def _drop_connection(self) -> None:
        session = getattr(self._local, "session", None)
        if session is not None:
            session.close()
            self._local.session = None

    def close(self) -> None:
        """Close this thread's connection."""
        session = getattr(self._local, "session", None)
        if session is not None:
            session.close()
