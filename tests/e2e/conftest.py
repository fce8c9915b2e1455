"""End to end: the real processes of a deployment, on this machine.

gunicorn serves the control plane over HTTP, a Celery worker with embedded beat runs the
scheduling cycle and the liveness sweep, and `python -m agents` processes with simulated GPUs
run the jobs (the `process` runtime, or the `docker` runtime against Podman). They all use
pytest-django's test database; each test writes its users, tenant and join token with
`transactional_db`, so the other processes see them, and the database is emptied afterwards.

Timings are shortened (1 s heartbeats and ticks, a few seconds of grace) so that a node's death
takes seconds, not minutes; no assertion depends on them, every wait has a generous timeout.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

from tests import ports
from tests.engine import docker_host

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# This suite's ports, inside the range given to it (18400-18499; the benchmarks use 184[5-9]x).
E2E_PORTS = range(18400, 18450)
HEARTBEAT_INTERVAL_S = 1.0
# A node's lease and the control plane's margin: its attempts are lost 14 s after it was last
# heard, and its fence gives them notice 9 s after (12 - a 1 s margin - the 2 s stop grace).
NODE_LEASE_S = 12.0
NODE_LEASE_MARGIN_S = 2.0
IMAGE = "localhost/busybox:latest"
# Every process this suite starts, and every job those start, carries these in its environment
# (the session's, and the test's for agents), so the clean-up can find and end exactly them:
# the process runtime passes them on to the jobs it starts.
RUN_MARKER = "H4_E2E_RUN"
TEST_MARKER = "H4_E2E_TEST"


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str) -> object:
    """Poll until predicate() is truthy; fail naming what was awaited after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)


def processes_with_env(needle: str) -> list[int]:
    """Pids whose environment contains needle (NAME=value)."""
    pids = []
    raw = needle.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if raw in env.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def free_port() -> int:
    """A port of E2E_PORTS nobody listens on (two sessions may run this suite at once)."""
    return ports.free_port(E2E_PORTS)


def kill_pids(pids: list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def database_url_of_test_db() -> str:
    from django.db import connection

    s = connection.settings_dict
    if connection.vendor != "postgresql":
        pytest.skip("the end-to-end suite runs on PostgreSQL (DATABASE_URL=postgres://...)")
    auth = s["USER"] or "postgres"
    if s.get("PASSWORD"):
        auth += f":{s['PASSWORD']}"
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


@dataclass
class ControlPlane:
    url: str
    env: dict
    log_dir: Path
    procs: list[subprocess.Popen] = field(default_factory=list)

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.log_dir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _spawn(name: str, cmd: list[str], env: dict, log_dir: Path) -> subprocess.Popen:
    log = open(log_dir / f"{name}.log", "ab")  # noqa: SIM115 - lives as long as the process
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=5)


@pytest.fixture(scope="package")
def control_plane(django_db_setup, django_db_blocker, tmp_path_factory):
    """gunicorn and a Celery worker with beat, on the test database, for the e2e suite: gone
    before the tests that run after it on the same database (and Redis) in this process,
    which its beat ticks and its consumers would disturb."""
    from django.conf import settings

    if not settings.REDIS_URL:
        pytest.skip("the end-to-end suite needs Redis (REDIS_URL=redis://...)")
    with django_db_blocker.unblock():
        database_url = database_url_of_test_db()
    log_dir = tmp_path_factory.mktemp("e2e-logs")
    run_id = uuid.uuid4().hex
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "AGENT_HEARTBEAT_INTERVAL_S": str(HEARTBEAT_INTERVAL_S),
        "NODE_LEASE_S": str(NODE_LEASE_S),
        "NODE_LEASE_MARGIN_S": str(NODE_LEASE_MARGIN_S),
        # The solo worker runs cycles and sweeps in turn; a slow cycle must not read as the
        # control plane having stopped listening (which only delays losses, but by a lease).
        "LIVENESS_SWEEP_GAP_S": "6",
        "SCHEDULER_CYCLE_INTERVAL_S": "1",
        "SCHEDULER_DEBOUNCE_S": "0.2",
        "SCHEDULER_EMBEDDED": "0",
        # A job's notice as short as the agents' own (--stop-grace-s=2), and preemption allowed
        # after 3 s of running, so that a preemption's life takes seconds.
        "PREEMPTION_GRACE_DEFAULT_S": "2",
        "SCHEDULER_MIN_RUNTIME_S": "3",
        # The suites here drive the API far faster than a person; the rates have their own tests.
        "API_THROTTLE_USER_RATE": "1000000/minute",
        "API_THROTTLE_ANON_RATE": "1000000/minute",
        "API_THROTTLE_BEARER_FAILURE_RATE": "1000000/minute",
        "DB_CONN_MAX_AGE": "0",
        RUN_MARKER: run_id,
    }
    web_port = free_port()
    cp = ControlPlane(url=f"http://127.0.0.1:{web_port}", env=env, log_dir=log_dir)
    cp.procs.append(
        _spawn(
            "web",
            [
                str(BIN / "gunicorn"),
                "controlplane.wsgi:application",
                f"--bind=127.0.0.1:{web_port}",
                "--worker-class=gthread",
                "--workers=2",
                "--threads=16",
                "--timeout=60",
            ],
            env,
            log_dir,
        )
    )
    cp.procs.append(
        _spawn(
            "worker",
            [
                str(BIN / "celery"),
                "-A",
                "controlplane",
                "worker",
                "-B",
                f"--schedule={log_dir / 'beat-schedule'}",
                "-Q",
                settings.CELERY_TASK_DEFAULT_QUEUE,
                "--pool=solo",
                "--loglevel=INFO",
            ],
            env,
            log_dir,
        )
    )
    try:

        def web_answers():
            if cp.procs[0].poll() is not None:
                pytest.fail(f"gunicorn exited:\n{cp.log_tail('web')}")
            try:
                # Without a token the agent API answers 401: the server is up.
                response = requests.post(f"{cp.url}/api/agent/v1/heartbeat", json={}, timeout=2)
                return response.status_code == 401
            except requests.RequestException:
                return False

        wait_until(web_answers, 60, f"gunicorn on {cp.url}:\n{cp.log_tail('web')}")
        yield cp
    finally:
        for proc in cp.procs:
            _stop(proc)
        kill_pids(processes_with_env(f"{RUN_MARKER}={run_id}"))
        # What the stack wrote after the last test's flush (its beat's ticks, its liveness
        # sweeps, cycle requests queued in Redis) must not be found by the tests that run next
        # in this process, on the same database and Redis.
        from django.core.management import call_command

        from controlplane.redis_client import get_redis

        with django_db_blocker.unblock():
            call_command("flush", interactive=False, verbosity=0)
        get_redis().flushdb()


@dataclass
class Agent:
    """One `python -m agents` process; restartable with the same state directory."""

    name: str
    args: list[str]
    env: dict
    log_dir: Path
    proc: subprocess.Popen | None = None

    def start(self) -> Agent:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.proc = _spawn(f"agent-{self.name}", self.args, self.env, self.log_dir)
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the agent alone: its jobs live in process groups of their own and survive."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)

    def log_tail(self, lines: int = 40) -> str:
        path = self.log_dir / f"agent-{self.name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Cluster:
    """A tenant with a person and her API token, a join token, and the agents of one test."""

    cp: ControlPlane
    user_token: str
    join_token: str
    tmp_path: Path
    marker: str
    agents: list[Agent] = field(default_factory=list)

    @property
    def api(self) -> str:
        return f"{self.cp.url}/api/v1"

    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.user_token}"}

    def start_agent(
        self,
        name: str,
        *,
        runtime: str = "process",
        gpus: int = 1,
        extra_env: dict | None = None,
        wait: bool = True,
    ) -> Agent:
        """Start an agent; by default, wait until its node is registered and heartbeating."""
        args = [
            sys.executable,
            "-m",
            "agents",
            f"--url={self.cp.url}",
            f"--node-name={name}",
            f"--state-dir={self.tmp_path / 'agents' / name}",
            f"--runtime={runtime}",
            f"--gpu-backend=simulated:H100-SXM-80GB:{gpus}",
            "--cpus=16",
            "--stop-grace-s=2",
            "--watch-timeout-s=10",
        ]
        env = {
            **self.cp.env,
            TEST_MARKER: self.marker,
            "GPUCP_JOIN_TOKEN": self.join_token,
            **(extra_env or {}),
        }
        agent = Agent(name=name, args=args, env=env, log_dir=self.cp.log_dir).start()
        self.agents.append(agent)
        if wait:
            self.wait_for_node(name, agent)
        return agent

    def wait_for_node(self, name: str, agent: Agent, timeout_s: float = 60) -> None:
        from controlplane.cluster.models import Node

        def heartbeating():
            if agent.proc.poll() is not None:
                pytest.fail(f"agent {name} exited:\n{agent.log_tail()}")
            node = Node.objects.filter(name=name, ready=True).first()
            return node is not None and node.gpus.filter(telemetry_at__isnull=False).exists()

        wait_until(heartbeating, timeout_s, f"node {name} to register and heartbeat")

    def submit(self, command: list[str], **fields) -> int:
        body = {"image": IMAGE, "command": command, "gpus": 1, **fields}
        response = requests.post(
            f"{self.api}/jobs/", json=body, headers=self._headers(), timeout=30
        )
        assert response.status_code == 201, response.text
        return response.json()["id"]

    def job(self, job_id: int) -> dict:
        response = requests.get(f"{self.api}/jobs/{job_id}/", headers=self._headers(), timeout=30)
        assert response.status_code == 200, response.text
        return response.json()

    def cancel(self, job_id: int) -> dict:
        response = requests.post(
            f"{self.api}/jobs/{job_id}/cancel/", headers=self._headers(), timeout=30
        )
        assert response.status_code == 200, response.text
        return response.json()

    def logs(self, job_id: int, **params) -> dict:
        response = requests.get(
            f"{self.api}/jobs/{job_id}/logs/", params=params, headers=self._headers(), timeout=30
        )
        assert response.status_code == 200, response.text
        return response.json()

    def wait_for_job(self, job_id: int, predicate, what: str, timeout_s: float = 90) -> dict:
        def check():
            job = self.job(job_id)
            return job if predicate(job) else None

        try:
            return wait_until(check, timeout_s, f"job {job_id}: {what}")
        except pytest.fail.Exception:
            job = self.job(job_id)
            events = [(e["kind"], e["message"]) for e in job["events"]]
            agent_logs = "\n---\n".join(f"{a.name}:\n{a.log_tail(15)}" for a in self.agents)
            pytest.fail(
                f"job {job_id} never got to {what}: state {job['state']}, events {events}\n"
                f"agents:\n{agent_logs}\nworker:\n{self.cp.log_tail('worker', 15)}"
            )

    def wait_for_state(self, job_id: int, *states: str, timeout_s: float = 90) -> dict:
        return self.wait_for_job(
            job_id, lambda j: j["state"] in states, " or ".join(states), timeout_s
        )


def job_processes(attempt_id: int) -> list[int]:
    """Pids of the process-runtime job (and its supervisor) of one attempt."""
    return processes_with_env(f"GPUCP_ATTEMPT_ID={attempt_id}")


@pytest.fixture
def cluster(control_plane, transactional_db, tmp_path, django_user_model):
    from django.utils import timezone

    from controlplane.cluster.agent_auth import issue_join_token
    from controlplane.cluster.models import Pool
    from controlplane.tenancy.models import ApiToken, Membership, Quota, Tenant

    tenant = Tenant.objects.create(slug="vision", name="Vision lab")
    Quota.objects.create(tenant=tenant, gpu_type="", guaranteed_gpus=8, limit_gpus=16)
    Quota.objects.create(tenant=tenant, gpu_type="H100-SXM-80GB", guaranteed_gpus=8, limit_gpus=16)
    alice = django_user_model.objects.create_user("alice", password="pw-for-tests-1")
    Membership.objects.create(user=alice, tenant=tenant, role="member")
    _, user_token = ApiToken.issue(alice, "e2e")
    pool = Pool.objects.create(name="default")
    _, join_token = issue_join_token(
        pool, expires_at=timezone.now() + dt.timedelta(hours=1), max_uses=20
    )
    cluster = Cluster(
        cp=control_plane,
        user_token=user_token,
        join_token=join_token,
        tmp_path=tmp_path,
        marker=uuid.uuid4().hex,
    )
    try:
        yield cluster
    finally:
        for agent in cluster.agents:
            agent.kill()
        # Jobs of the process runtime outlive their agent by design; this test's must not.
        kill_pids(processes_with_env(f"{TEST_MARKER}={cluster.marker}"))
        # Let the worker finish a cycle that still reads this test's rows before the flush.
        time.sleep(0.5)


@pytest.fixture(scope="module")
def engine_url() -> str:
    """DOCKER_HOST of a real engine (Podman's Docker API)."""
    return docker_host()


@pytest.fixture
def engine(engine_url):
    import docker

    client = docker.DockerClient(base_url=engine_url, version="1.41", timeout=60)
    yield client
    client.close()
