"""`make run`: the whole system on one machine (SQLite, in-process loop, simulated agents).

One process serves the web UI, the REST API and the agent API (threaded runserver) and runs the
scheduling loop and the liveness sweep in a thread; the agents are child processes with
simulated GPUs and the `process` runtime, joined with a fresh join token, and are stopped
when the server stops.
"""

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand
from django.db import connections
from django.utils import timezone

# The demo tenants have quotas on both types: every third node has A100s, the others H100s.
AGENT_GPU_MODELS = ("H100-SXM-80GB", "H100-SXM-80GB", "A100-SXM4-80GB")
AGENT_GPUS = 8
SERVER_WAIT_S = 60.0


def agent_command(*, name: str, server_url: str, state_dir: str, gpus: int, model: str):
    """The command line of one simulated agent (see agents/__main__.py for its flags)."""
    return [
        sys.executable,
        "-m",
        "agents",
        "--server",
        server_url,
        "--name",
        name,
        "--state-dir",
        state_dir,
        "--gpu-backend",
        f"simulated:{model}:{gpus}",
        "--runtime",
        "process",
        # One build of the job supervisor for the demo's agents, beside their state folders.
        "--supervisor-dir",
        os.path.join(os.path.dirname(os.path.abspath(state_dir)), "supervisor"),
        # A laptop demo: stopping `make run` stops its jobs too, instead of leaving them behind.
        "--stop-jobs-on-exit",
        # Demo jobs run `python -m agents.simjob` (a stand-in that slows down under a power cap):
        # the venv's interpreter must come first on their PATH. Not resolved: that would be the
        # system Python the venv links to.
        "--job-path-prepend",
        os.path.dirname(sys.executable),
    ]


def _wait_for_port(host: str, port: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return True
        except OSError:
            time.sleep(0.2)
    return False


class QuietAgentRequests(logging.Filter):
    """Leaves the agent API's successful requests out of runserver's access log."""

    def filter(self, record: logging.LogRecord) -> bool:
        status = getattr(record, "status_code", None)
        ok = isinstance(status, int) and status < 400
        return not (ok and "/api/agent/" in record.getMessage())


class Command(BaseCommand):
    help = "Migrate, seed a demo, and serve the control plane with its scheduling loop and simulated agents."

    def add_arguments(self, parser):
        parser.add_argument("--addr", default="127.0.0.1:8000")
        parser.add_argument("--agents", type=int, default=3, help="simulated GPU nodes to start")
        parser.add_argument(
            "--agents-dir",
            default=None,
            help="where the agents keep their state and logs (default: var/agents)",
        )

    def handle(self, *args, addr: str, agents: int, agents_dir: str | None, **options):
        # Before anything can ask for a cycle: requests wake the loop below, not a Celery worker.
        settings.SCHEDULER_EMBEDDED = True
        os.environ["SCHEDULER_EMBEDDED"] = "1"
        (settings.BASE_DIR / "var").mkdir(exist_ok=True)
        call_command("migrate", interactive=False, verbosity=0)
        from controlplane.demo import seed_demo

        created = seed_demo(storage_root=settings.BASE_DIR / "var" / "storage")
        self.stdout.write(
            self.style.SUCCESS(
                f"Control plane on http://{addr}/  (API docs: http://{addr}/api/docs/)"
            )
        )
        if created:
            self.stdout.write("Demo accounts (passwords shown once; kept only as hashes):")
            for username, password in created.items():
                self.stdout.write(f"  {username:20s} {password}")
        else:
            self.stdout.write(
                "Demo accounts exist already (admin, vision-researcher, nlp-researcher, ...); "
                "their passwords were shown when they were made. New ones: "
                ".venv/bin/python manage.py reset_demo_passwords"
            )

        from controlplane.scheduling.embedded import SchedulingLoop

        loop = SchedulingLoop().start()
        children: list[subprocess.Popen] = []
        launcher = threading.Thread(
            target=self._launch_agents,
            args=(addr, agents, agents_dir, children),
            daemon=True,
        )
        launcher.start()
        # A plain `kill` must stop the agents too, not only Ctrl-C.
        previous = signal.signal(signal.SIGTERM, self._raise_interrupt)
        # Three agents heartbeat every second or so: their lines would bury the accounts above
        # and every request a person makes. Errors of the agent API still show.
        logging.getLogger("django.server").addFilter(QuietAgentRequests())
        try:
            call_command("runserver", addr, use_reloader=False)
        finally:
            signal.signal(signal.SIGTERM, previous)
            launcher.join(timeout=1.0)
            self._stop_agents(children)
            loop.stop()

    @staticmethod
    def _raise_interrupt(signum, frame):
        raise KeyboardInterrupt

    def _launch_agents(self, addr: str, count: int, agents_dir: str | None, children: list) -> None:
        if count <= 0:
            return
        host, _, port = addr.rpartition(":")
        host = host or "127.0.0.1"
        if not _wait_for_port(host, int(port), SERVER_WAIT_S):
            self.stderr.write(f"The server did not come up on {addr}; no agents started.")
            return
        from controlplane.cluster.agent_auth import issue_join_token
        from controlplane.cluster.models import Pool

        pool = Pool.objects.get(name="default")
        # A fresh token per start, good for this many registrations and for a day.
        _, raw = issue_join_token(
            pool, expires_at=timezone.now() + timedelta(days=1), max_uses=count
        )
        connections.close_all()
        # The agents log as the server does (LOG_FORMAT=json makes every line of `make run` JSON).
        env = {**os.environ, "GPUCP_JOIN_TOKEN": raw, "GPUCP_LOG_FORMAT": settings.LOG_FORMAT}
        root = Path(agents_dir) if agents_dir else settings.BASE_DIR / "var" / "agents"
        for i in range(1, count + 1):
            name = f"sim-node-{i}"
            state_dir = root / name
            state_dir.mkdir(parents=True, exist_ok=True)
            cmd = agent_command(
                name=name,
                server_url=f"http://{host}:{port}",
                state_dir=str(state_dir),
                gpus=AGENT_GPUS,
                model=AGENT_GPU_MODELS[(i - 1) % len(AGENT_GPU_MODELS)],
            )
            with open(state_dir / "agent.log", "ab") as log_file:
                children.append(
                    subprocess.Popen(
                        cmd,
                        env=env,
                        cwd=settings.BASE_DIR,
                        stdout=log_file,
                        stderr=subprocess.STDOUT,
                    )
                )
            self.stdout.write(f"Started simulated agent {name} (log: {state_dir / 'agent.log'})")
        self._seed_history([f"sim-node-{i}" for i in range(1, count + 1)])

    def _seed_history(self, names: list[str]) -> None:
        """A fresh demo gets a generated past week on its nodes, once they have registered
        (the history's attempts ran on them): what-if, usage, charts and predictions then have
        something to show. Once only: a later start finds it and writes nothing."""
        from controlplane.cluster.models import Node
        from controlplane.demo import history_seeded, seed_history

        try:
            if history_seeded():
                return
            deadline = time.monotonic() + SERVER_WAIT_S
            while time.monotonic() < deadline:
                if Node.objects.filter(
                    name__in=names, gpus__isnull=False
                ).distinct().count() == len(names):
                    break
                time.sleep(0.5)
            jobs = seed_history()
        finally:
            connections.close_all()
        if jobs:
            self.stdout.write(
                f"Seeded a generated past week of {jobs} finished jobs "
                "(what-if, usage and charts have history to show)"
            )

    def _stop_agents(self, children: list) -> None:
        for child in children:
            if child.poll() is None:
                child.terminate()
        deadline = time.monotonic() + 10.0
        for child in children:
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
