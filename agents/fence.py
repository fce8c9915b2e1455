"""The node's fence: stops every attempt before the node's lease runs out. `python -m agents.fence`.

A process of its own, apart from the agent, so that it acts when the agent cannot: an agent
that is dead, paused (SIGSTOP, a stuck NFS read) or cut off from the control plane keeps its
jobs running, while the control plane may give their GPUs away once the lease it granted ran out
(docs/agent-protocol.md, "Leases"). The fence reads `<state-dir>/lease.json`, which the agent
rewrites after answered heartbeats (agents.lease.rewrite_lag_s), and for every attempt
still running:

- at `term_at` (the lease's end, less the safety margin, less the attempt's grace) it notes the
  attempt as fenced (`<state-dir>/fenced/<id>.json`) and sends the attempt's stop signal
  (SIGTERM unless the lease names another for it): the job's notice;
- at `kill_at` (the lease's end less the margin) it sends SIGKILL, again at every poll while
  the process lives.

A renewed lease moves both times out, so the fence never touches a node that keeps talking to
its control plane. Without a lease file (an agent that has not been answered yet, or an older
agent's state) it does nothing. One fence per state directory (an flock); the agent starts one
when none runs (`ensure_fence`), and a deployment may run it as a separate service instead. It
exits by itself once no agent holds the state directory and no attempt runs.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from agents.lease import Lease, boottime, mark_fenced, read_lease
from agents.logcontext import bound, format_option
from agents.logcontext import configure as configure_logging
from agents.runtime.base import Runtime

log = logging.getLogger(__name__)

FENCE_LOCK = "fence.lock"
AGENT_LOCK = "agent.lock"
POLL_S = 0.25
# With no agent and nothing running for this long, the fence has nothing left to guard.
IDLE_EXIT_S = 5.0


def _try_lock(path: Path) -> int | None:
    """An exclusive flock on path, or None when another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def is_held(path: Path) -> bool:
    """True while some process holds the flock on path."""
    fd = _try_lock(path)
    if fd is None:
        return True
    os.close(fd)
    return False


@contextlib.contextmanager
def holding(path: Path) -> Iterator[None]:
    """Hold the flock on path for the block; raises BlockingIOError if another holds it."""
    fd = _try_lock(path)
    if fd is None:
        raise BlockingIOError(f"{path} is held by another process")
    try:
        yield
    finally:
        os.close(fd)


class Fence:
    """The fencing rules, one look at a time (`check`); `run` loops over it."""

    def __init__(self, state_dir: Path, runtime: Runtime) -> None:
        self.state_dir = Path(state_dir)
        self.runtime = runtime
        self._termed: set[int] = set()

    def check(self, now: float | None = None) -> dict[int, str]:
        """Act on the lease once; returns what was done to which attempt ("term" or "kill")."""
        lease = read_lease(self.state_dir)
        if lease is None:
            return {}
        now = boottime() if now is None else now
        running = self.runtime.running_attempts()
        self._termed &= set(running)
        done: dict[int, str] = {}
        for attempt_id in running:
            action = self._due(lease, attempt_id, now)
            if action is None:
                continue
            if attempt_id not in self._termed or action == "kill":
                name = "SIGKILL" if action == "kill" else lease.signal_of(attempt_id)
                mark_fenced(
                    self.state_dir, attempt_id, self._why(lease), name, killed=action == "kill"
                )
                sig = signal.Signals[name]
                with bound(attempt_id=attempt_id):
                    log.warning(
                        "attempt %d: %s: the node's lease runs out (last renewed at %s)",
                        attempt_id,
                        name,
                        time.strftime("%H:%M:%S", time.localtime(lease.renewed_at_unix)),
                    )
                    self.runtime.signal_attempt(attempt_id, sig)
                self._termed.add(attempt_id)
                done[attempt_id] = action
        return done

    @staticmethod
    def _due(lease: Lease, attempt_id: int, now: float) -> str | None:
        if not lease.of_this_boot or now >= lease.kill_at:
            return "kill"
        if now >= lease.term_at(attempt_id):
            return "term"
        return None

    @staticmethod
    def _why(lease: Lease) -> str:
        return (
            f"no heartbeat answered for its lease of {lease.lease_s:.0f} s "
            f"(last renewed {time.time() - lease.renewed_at_unix:.0f} s ago)"
        )

    def run(self, *, stay: bool = False) -> None:
        """Loop until no agent holds the state directory and nothing runs for a while (or, with
        `stay`, for good: a fence run as a service of its own)."""
        idle_since: float | None = None
        while True:
            try:
                self.check()
                busy = bool(self.runtime.running_attempts())
            except Exception:  # an engine hiccup must never end the fence
                log.exception("fence check failed; trying again")
                busy = True
            if stay or busy or is_held(self.state_dir / AGENT_LOCK):
                idle_since = None
            elif idle_since is None:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > IDLE_EXIT_S:
                log.info("no agent and no attempt left: the fence stops")
                return
            time.sleep(POLL_S)


def fence_command(
    state_dir: Path,
    runtime: str,
    node_name: str,
    docker_url: str | None,
    *,
    log_format: str = "plain",
) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "agents.fence",
        f"--state-dir={state_dir}",
        f"--runtime={runtime}",
        f"--node-name={node_name}",
        f"--log-format={log_format}",
    ]
    if docker_url:
        command.append(f"--docker-url={docker_url}")
    return command


def ensure_fence(
    state_dir: Path,
    runtime: str,
    node_name: str,
    docker_url: str | None,
    *,
    log_format: str = "plain",
) -> subprocess.Popen[bytes] | None:
    """Start a fence for this state directory unless one runs; returns the one started.

    Started in a session of its own, so that a signal to the agent's group (a Ctrl-C, a
    service manager stopping the agent) does not reach it: it must outlive the agent.
    """
    if is_held(Path(state_dir) / FENCE_LOCK):
        return None
    with open(Path(state_dir) / "fence.log", "ab") as out:
        process = subprocess.Popen(
            fence_command(state_dir, runtime, node_name, docker_url, log_format=log_format),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    log.info("started the node's fence (pid %d)", process.pid)
    return process


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="gpucp-fence",
        description="Stop this node's attempts before its lease runs out (see agents/fence.py).",
    )
    env = os.environ.get
    p.add_argument("--state-dir", default=env("GPUCP_STATE_DIR") or "/var/lib/gpucp-agent")
    p.add_argument(
        "--runtime", choices=("docker", "process"), default=env("GPUCP_RUNTIME") or "docker"
    )
    p.add_argument("--node-name", default=env("GPUCP_NODE_NAME") or socket.gethostname())
    p.add_argument("--docker-url", default=env("GPUCP_DOCKER_URL") or None)
    p.add_argument("--log-level", default=env("GPUCP_LOG_LEVEL") or "INFO")
    p.add_argument("--log-format", type=format_option, default=env("GPUCP_LOG_FORMAT") or "plain")
    p.add_argument(
        "--stay",
        action="store_true",
        help="keep guarding when no agent runs (a fence run as a service of its own)",
    )
    args = p.parse_args(argv)
    configure_logging(
        args.log_format,
        getattr(logging, args.log_level.upper(), logging.INFO),
        static_fields={"node": args.node_name},
        plain_format="%(asctime)s %(levelname)s fence: %(message)s",
    )
    state_dir = Path(args.state_dir)
    from agents.runtime import make_runtime

    try:
        with holding(state_dir / FENCE_LOCK):
            runtime = make_runtime(
                args.runtime,
                state_dir=state_dir,
                node_name=args.node_name,
                docker_url=args.docker_url,
            )
            log.info("guarding the attempts of %s (%s runtime)", args.node_name, args.runtime)
            # SIGTERM (a service manager, the agent's demo shutdown) ends the fence cleanly.
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            try:
                Fence(state_dir, runtime).run(stay=args.stay)
            finally:
                runtime.close()
    except BlockingIOError:
        log.info("another fence guards %s already", state_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
