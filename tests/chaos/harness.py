"""A complete private deployment on 127.0.0.1 that a chaos run may break at will.

PostgreSQL (its own cluster, initdb'd into a temporary folder), Redis, gunicorn, a Celery
worker, Celery beat and N node agents with simulated GPUs and the `process` runtime: every
piece the production compose file runs, each one a process this harness started and may kill
with SIGKILL, stop with SIGSTOP, and start again. Nothing here touches the machine's shared
PostgreSQL or Redis: those serve other sessions and CI, and must never see a fault.

No pytest in its core (the CLI `python -m tests.chaos.run` and the pytest module both drive
it). The generic process helpers come from the end-to-end suite's conftest, so the two suites
find and end their processes the same way.

Finding exactly our processes: every process started here carries RUN_MARKER=<run id> in its
environment, and so does every job the agents start (the process runtime passes the agent's
environment on, less its GPUCP_* variables, which is why the marker is not named GPUCP_*).
Teardown SIGKILLs whatever carries it, repeatedly until nothing does; an atexit hook and a tiny
reaper process (which outlives a SIGKILLed harness) make that happen however the run ends.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as dt
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import requests

from tests import ports as shared_ports
from tests.e2e.conftest import BIN, REPO, kill_pids, processes_with_env

# This harness's ports, a range of its own (the e2e suite has 18400-18499).
PORTS = range(18700, 18800)
RUN_MARKER = "CHAOS_RUN"
# Which component a process belongs to: leftovers of a killed component (gunicorn workers of a
# dead master, pool children of a dead Celery worker, backends of a dead postmaster) are found
# by it and ended before that component starts again, as a container restart would end them.
PROC_MARKER = "CHAOS_PROC"
GPU_MODEL = "H100-SXM-80GB"
POSTGRES_USER = "postgres"
READY_TIMEOUT_S = 120.0


class HarnessError(RuntimeError):
    """The deployment could not be brought up (a missing binary, a port, a process that died)."""


@dataclass(frozen=True)
class Timings:
    """The control plane's clocks, shortened so that a run of minutes exercises every rule."""

    heartbeat_s: float = 1.0
    cycle_s: float = 1.0
    debounce_s: float = 0.2
    lease_s: float = 20.0
    lease_margin_s: float = 3.0
    # None: the production default (settings.py: 60 s persistent connections).
    db_conn_max_age_s: int | None = None

    @property
    def loss_window_s(self) -> float:
        """How far back a node's silence may explain the loss of its attempts: the lease and its
        margin (L + m), plus two heartbeats for the sweep's own period."""
        return self.lease_s + self.lease_margin_s + 2 * self.heartbeat_s

    def env(self) -> dict[str, str]:
        env = {
            "AGENT_HEARTBEAT_INTERVAL_S": str(self.heartbeat_s),
            "SCHEDULER_CYCLE_INTERVAL_S": str(self.cycle_s),
            "SCHEDULER_DEBOUNCE_S": str(self.debounce_s),
            "NODE_LEASE_S": str(self.lease_s),
            "NODE_LEASE_MARGIN_S": str(self.lease_margin_s),
        }
        if self.db_conn_max_age_s is not None:
            env["DB_CONN_MAX_AGE"] = str(self.db_conn_max_age_s)
        return env


def free_ports(count: int, ports: range = PORTS) -> list[int]:
    """`count` ports of the range that nobody listens on (another run may hold some)."""
    try:
        return shared_ports.free_ports(count, ports)
    except RuntimeError as exc:
        raise HarnessError(str(exc)) from None


def spawn(name: str, cmd: list[str], env: dict, log_dir: Path, cwd: Path) -> subprocess.Popen:
    """Start a process in a session of its own, appending to log_dir/<name>.log.

    Like the e2e suite's _spawn, but in the code folder under test: gunicorn and celery put their
    working folder first on sys.path, so the folder decides which code runs.
    """
    with open(log_dir / f"{name}.log", "ab") as log:
        return subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def child_pids(pid: int) -> list[int]:
    """Direct children of pid (from /proc; no psutil in the project's dependencies)."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid:
            children.append(int(entry.name))
    return children


def process_state(pid: int) -> str | None:
    """The state letter of /proc/<pid>/stat (R, S, T for stopped, Z for zombie); None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def log_tail(path: Path, lines: int = 30) -> str:
    if not path.exists():
        return ""
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - 64 * 1024))
        text = f.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class ProcessExit:
    """A process that ended without a fault injected into it: a product finding."""

    component: str
    at: float
    returncode: int | None
    log_tail: str


class Component:
    """One restartable part of the deployment, kept down while any fault holds it.

    Faults overlap (a 40 s PostgreSQL outage spans several other faults; "everything at once"
    takes down parts already down), so a component is held by a set of holders, not a flag:
    it comes back when the last one lets go. A component nobody holds that is found dead died
    by itself: the watchdog records that and starts it again, as a restart policy would.
    """

    name: str
    reap_leftovers = True

    def __init__(self, deployment: Deployment, name: str) -> None:
        self.d = deployment
        self.name = name
        self.holders: set[str] = set()
        self.starts = 0
        self.up_callbacks: list[Callable[[str], None]] = []

    @property
    def log_path(self) -> Path:
        return self.d.log_dir / f"{self.name}.log"

    def start(self) -> None:
        if self.reap_leftovers:
            self.reap()
        self.starts += 1
        self._start()
        for callback in self.up_callbacks:
            callback(self.name)

    def reap(self) -> None:
        """SIGKILL what is left of an earlier instance (never the agents' jobs: not reaped)."""
        for _ in range(5):
            pids = processes_with_env(f"{PROC_MARKER}={self.d.run_id}:{self.name}")
            if not pids:
                return
            kill_pids(pids)
            time.sleep(0.2)

    def alive(self) -> bool:
        raise NotImplementedError

    def _start(self) -> None:
        raise NotImplementedError

    def kill(self) -> None:
        raise NotImplementedError

    def hold(self, holder: str) -> None:
        """Take the component down (SIGKILL) and keep it down until holder lets go."""
        with self.d.lock:
            self.holders.add(holder)
            if self.alive():
                self.kill()

    def release(self, holder: str) -> bool:
        """holder lets go; the component starts again when nobody holds it. True if started."""
        with self.d.lock:
            self.holders.discard(holder)
            if self.holders:
                return False
            if self.alive():  # a holder that did not kill it (or it was started meanwhile)
                for callback in self.up_callbacks:
                    callback(self.name)
                return False
            self.start()
            return True

    def env(self) -> dict[str, str]:
        return {**self.d.cp_env, PROC_MARKER: f"{self.d.run_id}:{self.name}"}


class Proc(Component):
    """A component that is one foreground process (its children, if any, go with it)."""

    def __init__(
        self,
        deployment: Deployment,
        name: str,
        cmd: list[str],
        extra_env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(deployment, name)
        self.cmd = cmd
        self.extra_env = extra_env or {}
        self.proc: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        return {**super().env(), **self.extra_env}

    def _start(self) -> None:
        self.proc = spawn(self.name, self.cmd, self.env(), self.d.log_dir, self.d.code_dir)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the main process alone: what it leaves behind is the point of the fault."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def children(self) -> list[int]:
        return child_pids(self.proc.pid) if self.alive() else []

    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None


class Agent(Proc):
    """A node agent: its jobs outlive it by design, so its leftovers are never reaped."""

    reap_leftovers = False

    def __init__(self, deployment: Deployment, name: str, cmd: list[str], env: dict) -> None:
        super().__init__(deployment, name, cmd)
        self._env = env
        self.paused_at: float | None = None

    def env(self) -> dict[str, str]:
        return self._env

    def pause(self, holder: str) -> None:
        """SIGSTOP: the agent hangs (its jobs, in sessions of their own, keep running)."""
        with self.d.lock:
            self.holders.add(holder)
            if self.alive():
                os.kill(self.proc.pid, signal.SIGSTOP)
                self.paused_at = time.time()

    def release(self, holder: str) -> bool:
        with self.d.lock:
            self.holders.discard(holder)
            if self.holders:
                return False
            if self.alive():
                if process_state(self.proc.pid) == "T":
                    os.kill(self.proc.pid, signal.SIGCONT)
                self.paused_at = None
                for callback in self.up_callbacks:
                    callback(self.name)
                return False
            self.paused_at = None
            self.start()
            return True


class Postgres(Component):
    """A private PostgreSQL cluster, run as the postgres OS user (initdb refuses root)."""

    def __init__(self, deployment: Deployment, port: int, root: Path) -> None:
        super().__init__(deployment, "postgres")
        self.port = port
        bindir = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
        if not bindir:
            raise HarnessError(
                "no PostgreSQL under /usr/lib/postgresql (apt-get install postgresql)"
            )
        self.bin = bindir[-1].parent
        self.root = root
        self.data = self.root / "data"
        self.socket_dir = self.root / "socket"
        self.pg_log = self.root / "postgres.log"

    def _as_postgres(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        result = subprocess.run(
            ["runuser", "-u", POSTGRES_USER, "--", *args],
            env=self.env(),
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise HarnessError(f"{' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result.stdout + result.stderr

    def init(self) -> None:
        self.socket_dir.mkdir()
        self.pg_log.touch()
        shutil.chown(self.root, POSTGRES_USER)
        shutil.chown(self.socket_dir, POSTGRES_USER)
        shutil.chown(self.pg_log, POSTGRES_USER)
        self._as_postgres(
            str(self.bin / "initdb"), "-D", str(self.data), "-U", POSTGRES_USER, "-A", "trust"
        )
        with open(self.data / "postgresql.conf", "a") as conf:
            # fsync off: a process crash (all this run does) keeps what the kernel has; an
            # immediate stop then recovers from WAL like any crash. synchronous_commit stays on,
            # so a commit the control plane saw is never lost by a fault we injected.
            conf.write(
                f"\nport = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                f"unix_socket_directories = '{self.socket_dir}'\nfsync = off\n"
                "max_connections = 200\nlog_min_messages = warning\n"
            )

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def alive(self) -> bool:
        pid = self.postmaster_pid()
        if pid is None or process_state(pid) in (None, "Z"):
            return False
        # A stale postmaster.pid (after a SIGKILL) may name a pid since reused by another program.
        try:
            return Path(f"/proc/{pid}/comm").read_text().strip() in ("postgres", "postmaster")
        except OSError:
            return False

    def _start(self) -> None:
        self._as_postgres(
            str(self.bin / "pg_ctl"), "start", "-w", "-t", "90", "-D", str(self.data),
            "-l", str(self.pg_log),
        )  # fmt: skip

    def kill(self, mode: str = "immediate") -> None:
        """Stop abruptly: `pg_ctl stop -m immediate`, or SIGKILL of every postgres process."""
        if mode == "immediate":
            self._as_postgres(
                str(self.bin / "pg_ctl"), "stop", "-m", "immediate", "-D", str(self.data),
                check=False,
            )  # fmt: skip
        # Whatever is left (all of it in kill9 mode: the host died) is SIGKILLed.
        self.reap()

    def hold(self, holder: str, mode: str = "immediate") -> None:
        with self.d.lock:
            self.holders.add(holder)
            if self.alive():
                self.kill(mode)

    def createdb(self, name: str) -> None:
        self._as_postgres(
            str(self.bin / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U",
            POSTGRES_USER, name,
        )  # fmt: skip

    def cleanup(self) -> None:
        with contextlib.suppress(OSError):
            shutil.copy(self.pg_log, self.d.log_dir / "postgres.log")
        shutil.rmtree(self.root, ignore_errors=True)


# Runs in its own session, with no marker in its environment: it outlives a harness killed
# with SIGKILL (no atexit, no finally) and then ends every marked process.
_REAPER = r"""
import os, shutil, signal, sys, time
parent, needle, scratch = int(sys.argv[1]), sys.argv[2].encode(), sys.argv[3]
def alive(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
while alive(parent):
    time.sleep(2)
for _ in range(20):
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                env = open(f"/proc/{name}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if needle in env:
                found.append(int(name))
    if not found:
        break
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    time.sleep(0.3)
shutil.rmtree(scratch, ignore_errors=True)
"""


@dataclass
class Deployment:
    """The whole private deployment of one chaos run, logging into run_dir/logs."""

    run_dir: Path
    agents_count: int = 4
    gpus_per_agent: int = 2
    timings: Timings = field(default_factory=Timings)
    web_threads: int = 16
    # The web processes' connection pool (DB_POOL_MAX_SIZE): 0, docker-compose.yml's default,
    # is one persistent connection per thread; N > 0 runs the storm against pooled connections.
    web_db_pool_max_size: int = 0
    # The code that runs: this checkout by default, or another tree of the project (e.g. a
    # `git archive` of a commit) to measure it with this harness.
    code_dir: Path = REPO

    def __post_init__(self) -> None:
        self.run_id = uuid.uuid4().hex
        self.run_dir = Path(self.run_dir)
        self.code_dir = Path(self.code_dir).resolve()
        self.log_dir = self.run_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.lock = threading.RLock()
        self.exits: list[ProcessExit] = []
        self.url = ""
        self.cp_env: dict[str, str] = {}
        self.components: dict[str, Component] = {}
        self.agents: list[Agent] = []
        self.ops_token = ""
        self.join_token = ""
        self._reaper: subprocess.Popen | None = None
        self._torn_down = False
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._timer_seq = 0
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None
        self.postgres: Postgres | None = None
        self.pg_root: Path | None = None

    # --- bring-up ------------------------------------------------------------------------------

    def start(self) -> Deployment:
        """Bring everything up and wait until every node heartbeats; tear down on failure."""
        atexit.register(self.teardown)
        # PostgreSQL's own temporary folder, readable by the postgres user wherever the run
        # folder is; the reaper removes it too.
        self.pg_root = Path(tempfile.mkdtemp(prefix=f"gpucp-chaos-pg-{self.run_id[:8]}-"))
        self._reaper = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _REAPER,
                str(os.getpid()),
                f"{RUN_MARKER}={self.run_id}",
                str(self.pg_root),
            ],
            env={k: v for k, v in os.environ.items() if k != RUN_MARKER},
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            self._start()
        except BaseException:
            self.teardown()
            raise
        return self

    def _start(self) -> None:
        if os.geteuid() != 0 or not shutil.which("runuser") or not shutil.which("redis-server"):
            raise HarnessError("the chaos harness needs root, runuser and redis-server")
        pg_port, redis_port, web_port = free_ports(3)
        self.url = f"http://127.0.0.1:{web_port}"
        self.database_url = f"postgres://{POSTGRES_USER}@127.0.0.1:{pg_port}/gpucp"
        self.redis_url = f"redis://127.0.0.1:{redis_port}/0"
        self.queue = f"chaos-{self.run_id[:12]}"
        base = {k: v for k, v in os.environ.items() if not k.startswith(("GPUCP_", "PYTEST_"))}
        self.cp_env = {
            **base,
            "DJANGO_SETTINGS_MODULE": "controlplane.settings",
            "GPUCP_ENV": "production",
            "SECRET_KEY": secrets.token_hex(32),
            "DATABASE_URL": self.database_url,
            "REDIS_URL": self.redis_url,
            "CELERY_QUEUE": self.queue,
            "ALLOWED_HOSTS": "127.0.0.1,localhost",
            # Plain HTTP on loopback with no TLS proxy in front: production's redirect to HTTPS
            # would answer every agent and client with a 301.
            "SECURE_SSL_REDIRECT": "0",
            "SCHEDULER_EMBEDDED": "0",
            "LOG_LEVEL": "INFO",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(self.code_dir),
            **self.timings.env(),
            RUN_MARKER: self.run_id,
        }
        self._write_run_info(pg_port=pg_port, redis_port=redis_port, web_port=web_port)

        self.postgres = Postgres(self, pg_port, self.pg_root)
        self.postgres.init()
        self.postgres.start()
        self.postgres.createdb("gpucp")
        self._run_logged(
            "migrate",
            [str(BIN / "python"), str(self.code_dir / "manage.py"), "migrate", "--noinput"],
            timeout=900,
        )

        redis = Proc(
            self,
            "redis",
            [
                shutil.which("redis-server") or "redis-server",
                "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.run_dir), "--protected-mode", "no",
                # Redis rewrites its title over its environment, where the run's marker is:
                # without this, teardown cannot find it, and it outlives the run.
                "--set-proc-title", "no",
            ],
        )  # fmt: skip
        web = Proc(
            self,
            "web",
            [
                str(BIN / "gunicorn"),
                "controlplane.wsgi:application",
                f"--bind=127.0.0.1:{web_port}",
                "--worker-class=gthread",
                "--workers=2",
                f"--threads={self.web_threads}",
                "--timeout=60",
                "--keep-alive=75",
                "--graceful-timeout=30",
                # Its default control socket is one path for every gunicorn of the machine
                # (~/.gunicorn/gunicorn.ctl): a run must not take it from another's server.
                "--no-control-socket",
                f"--access-logfile={self.log_dir / 'web-access.log'}",
                "--access-logformat=%(t)s %(m)s %(U)s %(s)s %(M)sms",
            ],
            extra_env={"DB_POOL_MAX_SIZE": str(self.web_db_pool_max_size)},
        )
        worker = Proc(
            self,
            "worker",
            [
                str(BIN / "celery"), "-A", "controlplane", "worker", "-Q", self.queue,
                "-n", f"{self.queue}@%h", "--concurrency=2", "--loglevel=INFO",
            ],
        )  # fmt: skip
        beat = Proc(
            self,
            "beat",
            [
                str(BIN / "celery"), "-A", "controlplane", "beat", "--loglevel=INFO",
                f"--schedule={self.run_dir / 'beat-schedule'}",
            ],
        )  # fmt: skip
        self.components = {c.name: c for c in (self.postgres, redis, web, worker, beat)}
        for component in (redis, web, worker, beat):
            component.start()
        self.wait_for(self.web_answers, "gunicorn to answer", self.log_dir / "web.log")
        self.wait_for(
            lambda: b" ready." in (self.log_dir / "worker.log").read_bytes(),
            "the Celery worker to be ready",
            self.log_dir / "worker.log",
        )
        self.ops_token, self.join_token = self._provision()
        for i in range(self.agents_count):
            self.agents.append(self._make_agent(f"chaos-node-{i}"))
        for agent in self.agents:
            self.components[agent.name] = agent
            agent.start()
        self.wait_for(self.nodes_ready, f"{self.agents_count} nodes to heartbeat", None)
        self._supervisor = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
        self._supervisor.start()

    def _write_run_info(self, **ports: int) -> None:
        info = {
            "run_id": self.run_id,
            "marker": f"{RUN_MARKER}={self.run_id}",
            "url": self.url,
            "database_url": self.database_url,
            "redis_url": self.redis_url,
            "queue": self.queue,
            "ports": ports,
            "timings": self.timings.env(),
            "code_dir": str(self.code_dir),
            "started_at": dt.datetime.now(dt.UTC).isoformat(),
        }
        (self.run_dir / "deployment.json").write_text(json.dumps(info, indent=2) + "\n")

    def _run_logged(self, name: str, cmd: list[str], timeout: float) -> None:
        with open(self.log_dir / f"{name}.log", "ab") as log:
            result = subprocess.run(
                cmd,
                cwd=self.code_dir,
                env=self.cp_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
        if result.returncode != 0:
            raise HarnessError(f"{name} failed:\n{log_tail(self.log_dir / f'{name}.log')}")

    def manage_shell(self, code: str, timeout: float = 120) -> str:
        """Run Python with Django set up on the private database (`manage.py shell -c`).

        A subprocess, not this process's ORM: under pytest this process's Django belongs to
        pytest-django and its test database.
        """
        result = subprocess.run(
            [str(BIN / "python"), str(self.code_dir / "manage.py"), "shell", "-c", code],
            cwd=self.code_dir,
            env=self.cp_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if result.returncode != 0:
            raise HarnessError(f"manage.py shell failed:\n{result.stdout}\n{result.stderr}")
        return result.stdout

    def _provision(self) -> tuple[str, str]:
        """A pool, a join token for the agents, and a cluster admin's API token for the harness."""
        out = self.manage_shell(
            "import datetime as dt, json\n"
            "from django.contrib.auth import get_user_model\n"
            "from django.utils import timezone\n"
            "from controlplane.cluster.agent_auth import issue_join_token\n"
            "from controlplane.cluster.models import Pool\n"
            "from controlplane.tenancy.models import ApiToken\n"
            "ops = get_user_model().objects.create_user(\n"
            "    'chaos-ops', password=None, is_staff=True, is_superuser=True)\n"
            "_, ops_token = ApiToken.issue(ops, 'chaos harness')\n"
            "pool = Pool.objects.create(name='default')\n"
            "_, join = issue_join_token(pool, expires_at=timezone.now() + dt.timedelta(days=2),\n"
            f"    max_uses={self.agents_count + 1})\n"
            "print(json.dumps({'ops': ops_token, 'join': join}))\n"
        )
        data = json.loads(out.strip().splitlines()[-1])
        return data["ops"], data["join"]

    def _make_agent(self, name: str) -> Agent:
        cmd = [
            sys.executable,
            "-m",
            "agents",
            f"--url={self.url}",
            f"--node-name={name}",
            f"--state-dir={self.run_dir / 'agents' / name}",
            "--runtime=process",
            f"--gpu-backend=simulated:{GPU_MODEL}:{self.gpus_per_agent}",
            "--cpus=16",
            "--memory-mib=65536",
            "--stop-grace-s=2",
        ]
        # Agents get the plain environment plus the markers: their jobs inherit it, and have
        # no business seeing the control plane's secret key or database URL.
        base = {k: v for k, v in os.environ.items() if not k.startswith(("GPUCP_", "PYTEST_"))}
        env = {
            **base,
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(self.code_dir),
            "GPUCP_JOIN_TOKEN": self.join_token,
            RUN_MARKER: self.run_id,
            PROC_MARKER: f"{self.run_id}:{name}",
        }
        return Agent(self, name, cmd, env)

    # --- probes --------------------------------------------------------------------------------

    def wait_for(self, predicate: Callable[[], object], what: str, log: Path | None) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not predicate():
            if time.monotonic() > deadline:
                tail = f":\n{log_tail(log)}" if log is not None else ""
                raise HarnessError(f"timed out waiting for {what}{tail}")
            time.sleep(0.5)

    def web_answers(self) -> bool:
        web = self.components["web"]
        if not web.alive():
            raise HarnessError(f"gunicorn exited:\n{log_tail(web.log_path)}")
        try:
            # Without a token the agent API answers 401: the server is up.
            response = requests.post(f"{self.url}/api/agent/v1/heartbeat", json={}, timeout=2)
        except requests.RequestException:
            return False
        return response.status_code == 401

    def nodes_ready(self) -> bool:
        try:
            response = requests.get(
                f"{self.url}/api/v1/nodes/",
                params={"limit": 1000},
                headers={"Authorization": f"Bearer {self.ops_token}"},
                timeout=5,
            )
        except requests.RequestException:
            return False
        if response.status_code != 200:
            return False
        ready = {n["name"] for n in response.json()["results"] if n["ready"]}
        return ready >= {a.name for a in self.agents}

    # --- faults --------------------------------------------------------------------------------

    def web(self) -> Proc:
        return self.components["web"]  # type: ignore[return-value]

    def worker(self) -> Proc:
        return self.components["worker"]  # type: ignore[return-value]

    def kill_child(self, name: str, rng) -> int | None:
        """SIGKILL one child of a component's main process (a gunicorn worker, a pool child)."""
        with self.lock:
            proc = self.components[name]
            assert isinstance(proc, Proc)
            children = proc.children()
            if not children:
                return None
            pid = rng.choice(sorted(children))
            kill_pids([pid])
            return pid

    def later(self, delay_s: float, action: Callable[[], None]) -> None:
        """Run action after delay_s on the supervisor thread (restarts, SIGCONTs)."""
        with self.lock:
            self._timer_seq += 1
            self._timers.append((time.monotonic() + delay_s, self._timer_seq, action))
            self._timers.sort()

    def _supervise(self) -> None:
        """Due restarts first, then the watchdog: a component nobody holds must be running."""
        while not self._stop.wait(0.5):
            with self.lock:
                now = time.monotonic()
                due = [t for t in self._timers if t[0] <= now]
                self._timers = [t for t in self._timers if t[0] > now]
            for _, _, action in due:
                try:
                    action()
                except Exception as exc:  # a failed restart must not end the supervision
                    self._record_exit("harness", None, f"restart action failed: {exc!r}")
            self.watchdog()

    def watchdog(self) -> None:
        with self.lock:
            if self._stop.is_set():
                return
            for component in self.components.values():
                if component.holders or component.alive():
                    continue
                code = component.returncode() if isinstance(component, Proc) else None
                self._record_exit(component.name, code, log_tail(component.log_path, 25))
                try:
                    component.start()
                except HarnessError as exc:
                    self._record_exit(component.name, None, f"could not restart: {exc}")

    def _record_exit(self, name: str, code: int | None, tail: str) -> None:
        self.exits.append(ProcessExit(name, time.time(), code, tail))

    # --- teardown ------------------------------------------------------------------------------

    def stop_supervision(self) -> None:
        """No more restarts: what is down stays down (the run is over)."""
        self._stop.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=10)
        with self.lock:
            self._timers.clear()

    def job_processes(self) -> list[int]:
        """Pids of jobs still running: processes with the run's marker and an attempt id."""
        pids = []
        for pid in processes_with_env(f"{RUN_MARKER}={self.run_id}"):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(item.startswith(b"GPUCP_ATTEMPT_ID=") for item in env):
                pids.append(pid)
        return pids

    def teardown(self) -> None:
        """SIGKILL every process of the run (and its jobs) until none is left. Idempotent."""
        if self._torn_down:
            return
        self._torn_down = True
        self._stop.set()
        needle = f"{RUN_MARKER}={self.run_id}"
        # The processes this harness started itself, first: their marker is the second line.
        for component in self.components.values():
            if isinstance(component, Proc) and component.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(component.proc.pid, signal.SIGKILL)
        for _ in range(30):
            pids = processes_with_env(needle)
            if not pids:
                break
            kill_pids(pids)
            time.sleep(0.3)
        for component in self.components.values():
            if isinstance(component, Proc) and component.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    component.proc.wait(timeout=5)
        if self.postgres is not None:
            self.postgres.cleanup()
        if self.pg_root is not None:
            shutil.rmtree(self.pg_root, ignore_errors=True)
        if self._reaper is not None and self._reaper.poll() is None:
            self._reaper.kill()
            self._reaper.wait(timeout=5)
        with contextlib.suppress(ValueError):
            atexit.unregister(self.teardown)
