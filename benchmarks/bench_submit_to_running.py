"""Submit -> RUNNING on an idle cluster: real REST API, Celery worker, agents, process runtime.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/gpucp REDIS_URL=redis://127.0.0.1:6379/15 \
      .venv/bin/python benchmarks/bench_submit_to_running.py [--jobs 100] [--agents 4]

It creates its own database (DATABASE_URL's name + "_bench_s2r", dropped and re-created),
starts gunicorn and a Celery worker with beat on 127.0.0.1, and --agents `python -m agents`
processes with 8 simulated GPUs each and the process runtime. Then it submits --jobs jobs
through POST /api/v1/jobs/, one at a time on the idle cluster (the next once the previous one
runs), each a short `sleep`, and reads from the database when each was admitted, when its
process started (the agent's report) and when the control plane recorded it RUNNING.

Prints p50 / p99 / max of submit -> admitted, submit -> process started, submit -> RUNNING.
The goal (issue 4): p50 < 1 s, which needs the agent to learn of new work from the watch
long-poll rather than at its next periodic heartbeat (10 s).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_heartbeat import (  # noqa: E402 - after the path set-up, like the script it reuses
    bench_database_url,
    ensure_free,
    percentile,
    recreate_database,
    setup_django,
    stop,
)

BIN = Path(sys.executable).parent


def spawn(cmd: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    log = open(log_path, "ab")  # noqa: SIM115 - open as long as the process runs
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def agent_command(url: str, name: str, state_root: Path) -> list[str]:
    """A real node agent: 8 simulated H100s, the process runtime, its own state directory."""
    return [
        sys.executable,
        "-m",
        "agents",
        f"--url={url}",
        f"--node-name={name}",
        f"--state-dir={state_root / name}",
        "--runtime=process",
        # One build of the job supervisor for the agents of this host.
        f"--supervisor-dir={state_root / 'supervisor'}",
        "--gpu-backend=simulated:H100-SXM-80GB:8",
        "--cpus=64",
        "--log-level=WARNING",
    ]


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    sys.exit(f"timed out after {timeout_s:.0f} s waiting for {what}")


def prepare_database(suffix: str, **extra_env: str) -> dict:
    """A fresh database of its own (DATABASE_URL's name + suffix), migrated, and Django set up
    on it in this process; the environment every server process of the benchmark gets."""
    base_url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/gpucp")
    if not os.environ.get("REDIS_URL"):
        sys.exit(f"{Path(sys.argv[0]).name} needs REDIS_URL (the production signalling path)")
    database_url, name = bench_database_url(base_url, suffix)
    recreate_database(base_url, name)
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "DEBUG": "0",
        "LOG_LEVEL": "WARNING",
        "CELERY_QUEUE": os.environ.get("CELERY_QUEUE", "gpucp") + suffix,
        **extra_env,
    }
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True
    )
    setup_django(database_url)
    return env


def seed_tenant(users: int = 1, join_uses: int = 1) -> tuple[list[str], str]:
    """Tenant "bench" with room for everything, `users` members with an API token each, and a
    pool's join token good for `join_uses` agents: (the users' tokens, the join token)."""
    import datetime as dt

    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from controlplane.cluster.agent_auth import issue_join_token
    from controlplane.cluster.models import Pool
    from controlplane.tenancy.models import ApiToken, Membership, Quota, Tenant

    tenant = Tenant.objects.create(slug="bench", name="Bench")
    Quota.objects.create(tenant=tenant, gpu_type="", guaranteed_gpus=1000, limit_gpus=1000)
    tokens = []
    for i in range(users):
        # No password: hashing one per user would cost a second for a hundred followers.
        user = get_user_model().objects.create_user("bench" if i == 0 else f"bench-{i}")
        Membership.objects.create(user=user, tenant=tenant, role="member")
        tokens.append(ApiToken.issue(user, "bench")[1])
    pool = Pool.objects.create(name="bench")
    _, join_token = issue_join_token(
        pool, expires_at=timezone.now() + dt.timedelta(hours=2), max_uses=join_uses
    )
    return tokens, join_token


def start_servers(
    port: int, env: dict, log_dir: Path, *, workers: int = 2, threads: int = 16
) -> list[subprocess.Popen]:
    """gunicorn (gthread) on 127.0.0.1:port and a Celery worker with beat on the benchmark's
    queue, as production runs them; the web process first."""
    ensure_free(port)
    return [
        spawn(
            [
                str(BIN / "gunicorn"),
                "controlplane.wsgi:application",
                f"--bind=127.0.0.1:{port}",
                "--worker-class=gthread",
                f"--workers={workers}",
                f"--threads={threads}",
            ],
            env,
            log_dir / "web.log",
        ),
        spawn(
            [
                str(BIN / "celery"),
                "-A",
                "controlplane",
                "worker",
                "-B",
                f"--schedule={log_dir / 'beat-schedule'}",
                "-Q",
                env["CELERY_QUEUE"],
                "--pool=solo",
                "--loglevel=WARNING",
            ],
            env,
            log_dir / "worker.log",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--port", type=int, default=18460)
    parser.add_argument("--job-sleep-s", type=float, default=0.5)
    parser.add_argument("--log-dir", default=str(ROOT / "benchmarks" / "out" / "submit_to_running"))
    args = parser.parse_args()

    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    env = prepare_database("_bench_s2r")
    from django.conf import settings

    from controlplane.cluster.models import Node
    from controlplane.jobs.models import Job, JobEvent

    (user_token,), join_token = seed_tenant(join_uses=args.agents)
    url = f"http://127.0.0.1:{args.port}"
    procs = start_servers(args.port, env, log_dir)
    state_root = log_dir / "agents"
    # A fresh database restarts attempt ids; agents must not remember the last run's attempts.
    shutil.rmtree(state_root, ignore_errors=True)
    try:
        wait_for(lambda: _answers(url), 60, f"gunicorn on {url} (see {log_dir})")
        for i in range(args.agents):
            procs.append(
                spawn(
                    agent_command(url, f"bench-{i:02d}", state_root),
                    {**env, "GPUCP_JOIN_TOKEN": join_token},
                    log_dir / f"agent-{i:02d}.log",
                )
            )
        wait_for(
            lambda: Node.objects.filter(ready=True).count() == args.agents,
            90,
            f"{args.agents} agents to register",
        )
        time.sleep(2)  # let the first heartbeats and watches settle
        session = requests.Session()
        session.headers["Authorization"] = f"Bearer {user_token}"
        job_ids = []
        print(
            f"submitting {args.jobs} jobs one at a time to {args.agents} idle nodes ...", flush=True
        )
        for _ in range(args.jobs):
            response = session.post(
                f"{url}/api/v1/jobs/",
                json={
                    "image": "localhost/bench:1",
                    "command": ["sleep", str(args.job_sleep_s)],
                    "gpus": 1,
                },
                timeout=30,
            )
            if response.status_code != 201:
                sys.exit(f"submit failed: {response.status_code} {response.text[:300]}")
            job_id = response.json()["id"]
            job_ids.append(job_id)
            wait_for(
                lambda job_id=job_id: Job.objects.filter(
                    pk=job_id, state__in=["RUNNING", "SUCCEEDED", "FAILED"]
                ).exists(),
                120,
                f"job {job_id} to run",
            )
    finally:
        for proc in reversed(procs):
            stop(proc)
        _kill_leftover_jobs(state_root)

    admitted, started, running = [], [], []
    for job in Job.objects.filter(pk__in=job_ids).prefetch_related("attempts"):
        events = {e.kind: e.at for e in JobEvent.objects.filter(job=job)}
        attempt = job.attempts.order_by("number").first()
        if "admitted" in events:
            admitted.append((events["admitted"] - job.submitted_at).total_seconds())
        if attempt is not None and attempt.started_at is not None:
            started.append((attempt.started_at - job.submitted_at).total_seconds())
        if "running" in events:
            running.append((events["running"] - job.submitted_at).total_seconds())
    print()
    print(
        f"submit -> running benchmark: {len(job_ids)} jobs, {args.agents} nodes x 8 simulated "
        f"GPUs, process runtime, gunicorn + Celery worker/beat + Redis, {os.cpu_count()} CPUs, "
        f"SCHEDULER_DEBOUNCE_S={settings.SCHEDULER_DEBOUNCE_S}"
    )
    for label, values in (
        ("submit -> admitted (scheduling cycle)", admitted),
        ("submit -> process started (agent)", started),
        ("submit -> RUNNING (recorded)", running),
    ):
        values.sort()
        print(
            f"  {label:40s} p50 {percentile(values, 0.5):6.3f} s  p99 {percentile(values, 0.99):6.3f} s"
            f"  max {values[-1] if values else float('nan'):6.3f} s  (n={len(values)})"
        )
    p50 = percentile(sorted(running), 0.5)
    print(f"  goal: p50 < 1 s -> {'met' if p50 < 1.0 else 'NOT met'}")


def _answers(url: str) -> bool:
    # The agent API answers a request without a token with 401: the server is up.
    try:
        response = requests.post(f"{url}/api/agent/v1/heartbeat", json={}, timeout=2)
    except requests.RequestException:
        return False
    return response.status_code == 401


def _kill_leftover_jobs(state_root: Path) -> None:
    """The process runtime's jobs outlive their agent by design; the benchmark's must not."""
    marker = str(state_root).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker in cmdline:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    main()
