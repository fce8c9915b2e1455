"""The real system for browser tests: a live HTTP server, the embedded scheduling loop, and node
agents with simulated GPUs running jobs as processes, all against the test database.

The server and the loop are threads of the test process (so the embedded wake-up and the
in-process watch signal work as in `make run`); each agent is a `python -m agents` child process
that registers with a join token over HTTP like a real node.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from django.contrib.staticfiles.handlers import StaticFilesHandler
from django.test.testcases import LiveServerThread
from django.utils import timezone

from tests import ports

# This session's share of ports (see the project's rules); the first free one is used.
PORTS = range(18800, 18900)
AGENT_READY_S = 60.0
IDLE_AFTER_CANCEL_S = 30.0


def start_server(host: str = "127.0.0.1") -> LiveServerThread:
    last_error: Exception | None = None
    for port in ports.in_worker_order(PORTS):
        server = LiveServerThread(host, StaticFilesHandler, port=port)
        server.daemon = True
        server.start()
        server.is_ready.wait()
        if server.error is None:
            return server
        last_error = server.error
        server.join()
    raise RuntimeError(f"no free port in {PORTS.start}..{PORTS.stop - 1}: {last_error}")


@dataclass
class LiveSystem:
    url: str
    state_root: Path
    agents: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)

    def start_agent(self, name: str, *, model: str = "H100-SXM-80GB", gpus: int = 4) -> None:
        """Start one agent and wait until its node has registered and heartbeated."""
        from controlplane.cluster.agent_auth import issue_join_token
        from controlplane.cluster.models import Node, Pool

        pool, _ = Pool.objects.get_or_create(name="default")
        _, raw = issue_join_token(pool, expires_at=timezone.now() + timedelta(hours=1))
        state_dir = self.state_root / name
        log_path = self.state_root / f"{name}.log"
        env = {**os.environ, "GPUCP_JOIN_TOKEN": raw, "PYTHONUNBUFFERED": "1"}
        command = [
            sys.executable,
            "-m",
            "agents",
            "--url",
            self.url,
            "--node-name",
            name,
            "--state-dir",
            str(state_dir),
            "--runtime",
            "process",
            "--gpu-backend",
            f"simulated:{model}:{gpus}",
            "--heartbeat-interval-s",
            "2",
            "--stop-grace-s",
            "2",
        ]
        with open(log_path, "wb") as log:
            self.agents[name] = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.logs[name] = log_path
        deadline = time.monotonic() + AGENT_READY_S
        while time.monotonic() < deadline:
            if self.agents[name].poll() is not None:
                raise RuntimeError(f"agent {name} exited:\n{log_path.read_text()[-3000:]}")
            if Node.objects.filter(name=name, last_heartbeat_at__isnull=False).exists():
                return
            time.sleep(0.3)
        raise RuntimeError(f"agent {name} did not register:\n{log_path.read_text()[-3000:]}")

    def agent_log(self, name: str) -> str:
        return self.logs[name].read_text(errors="replace")

    def stop(self) -> None:
        """Cancel what still runs (agents leave jobs running when they stop), then stop agents."""
        from controlplane.jobs import actions
        from controlplane.jobs.models import (
            ACTIVE_ATTEMPT_STATES,
            ACTIVE_JOB_STATES,
            Job,
            JobAttempt,
        )
        from controlplane.wakeups import notify_nodes

        for job in Job.objects.filter(state__in=ACTIVE_JOB_STATES):
            try:
                actions.cancel_job(job, reason="Test finished")
            except (actions.IllegalTransition, actions.ConcurrentUpdate):
                pass
        deadline = time.monotonic() + IDLE_AFTER_CANCEL_S
        while time.monotonic() < deadline and any(p.poll() is None for p in self.agents.values()):
            if not JobAttempt.objects.filter(state__in=ACTIVE_ATTEMPT_STATES).exists():
                break
            time.sleep(0.3)
        for process in self.agents.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.agents.values():
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        # Wake the watch long-polls the agents left behind, so no request thread holds a database
        # connection when the test database is flushed.
        notify_nodes(self.agents)
