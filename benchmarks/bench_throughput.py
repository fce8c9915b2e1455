"""Job throughput on the production path, and what each server-side process spends per job.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/gpucp REDIS_URL=redis://127.0.0.1:6379/15 \
      .venv/bin/python benchmarks/bench_throughput.py [--jobs 2000] [--clients 4] [--agents 4]

The shape issue 14 compares with Slurm: 4 nodes x 8 simulated GPUs, one-GPU jobs that run
`true`, submitted through POST /api/v1/jobs/ by --clients client processes. It creates its own
database (DATABASE_URL's name + "_bench_tp"), starts gunicorn, a Celery worker, Celery beat
and --agents `python -m agents` processes (process runtime) on 127.0.0.1, and measures:

1. idle submit -> start: --idle-jobs jobs one at a time on the idle cluster (the next once the
   previous one ended): p50 / p99 of submit -> process started (the agent's report) and
   submit -> RUNNING recorded;
2. end to end: --jobs jobs submitted by the clients at once, from the first submit to the
   last job ended: jobs per second, and the CPU milliseconds per job of each process group
   (web, worker, beat, agents with their job supervisors and the jobs, the whole PostgreSQL
   instance, the whole Redis server), each read from /proc before and after;
3. submit only: --jobs more with every node cordoned, so nothing starts, twice: one job per
   POST, then lists of --submit-batch jobs per POST (batch submit): jobs per second accepted
   (201) by the API, and the web's and PostgreSQL's CPU per job. Before them, the floor under
   a submit: --jobs GETs of /favicon.ico (a redirect: gunicorn and the middleware) and of the
   API's root (DRF, the token, the rate counts, the root's links), with the web's CPU per
   request.

--batch N makes the end-to-end run's clients submit lists of N jobs per POST; --array submits
the end-to-end run's jobs as one job array instead. --history N puts N finished jobs (one
attempt each) in the database first, as a cluster in use for months has: the reads of a
heartbeat and of a cycle must not grow with them.

Every process group of ours runs under a small reaper (this script with --reap): a Linux
child subreaper, so that the job supervisors the agents detach, and the jobs, are reaped by
it and their CPU time lands in its children's time instead of vanishing when they exit.
PostgreSQL and Redis are the machine's own servers: measure on a quiet machine, where their
CPU is ours. The load average is printed beside every figure, and before and after the end-to-end
run what an exec, a few files made and deleted, and a loop of Python cost the machine at that
moment (machine_costs): on a shared virtual machine they drift within hours, and every job pays
all three.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing
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

from bench_heartbeat import (  # noqa: E402 - after the path set-up
    add_history,
    bench_database_url,
    ensure_free,
    percentile,
    recreate_database,
    setup_django,
    stop,
)
from bench_submit_to_running import _answers, _kill_leftover_jobs, agent_command, wait_for  # noqa: E402

BIN = Path(sys.executable).parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
PR_SET_CHILD_SUBREAPER = 36
FINAL_STATES = ("SUCCEEDED", "FAILED", "CANCELLED")


# --- the reaper: a process group's CPU, exited descendants included --------------------------


def reap(command: list[str]) -> int:
    """Run `command` as a child subreaper; reap every descendant until all are gone."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    child = subprocess.Popen(command)

    def forward(signum, _frame):
        # The group leader is this reaper (start_new_session); pass the stop on to the command.
        if child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    status = 0
    while True:
        try:
            pid, wait_status = os.wait()
        except ChildProcessError:
            return status
        except InterruptedError:
            continue
        if pid == child.pid:
            status = os.waitstatus_to_exitcode(wait_status)
            child.returncode = status


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds of the process and of its reaped children)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    ppid = int(fields[1])
    utime, stime, cutime, cstime = (int(v) for v in fields[11:15])
    return ppid, (utime + stime + cutime + cstime) / CLK_TCK


def tree_cpu_s(root_pid: int) -> float:
    """CPU seconds of a process and every descendant, alive or reaped by one of them."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(int(entry))
            if stat is not None:
                stats[int(entry)] = stat
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root_pid]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += stats[pid][1]
            todo.extend(children.get(pid, ()))
    return total


def _pids_named(name: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                comm = Path(f"/proc/{entry}/comm").read_text().strip()
            except OSError:
                continue
            if comm == name:
                found.append(int(entry))
    return found


def _postmaster_of_this_database() -> list[int]:
    """The postmaster serving DATABASE_URL (the first line of postmaster.pid in its data
    directory), so that another PostgreSQL instance on the machine does not count; where that
    file cannot be read (no superuser, another host's container), every postmaster here."""
    from django.db import connection

    try:
        with connection.cursor() as cursor:
            cursor.execute("SHOW data_directory")
            data_dir = cursor.fetchone()[0]
        return [int((Path(data_dir) / "postmaster.pid").read_text().split()[0])]
    except Exception:  # noqa: BLE001 - any failure falls back to the whole machine's
        postgres = set(_pids_named("postgres") + _pids_named("postmaster"))
        # The postmaster is the postgres process whose parent is not one: backends,
        # autovacuum and the WAL writer are its children, so its tree is the whole instance.
        return [pid for pid in postgres if (_stat(pid) or (0, 0.0))[0] not in postgres]


def server_roots() -> dict[str, list[int]]:
    """The PostgreSQL instance of the benchmark's database and the machine's Redis server(s):
    their whole trees count."""
    return {"postgresql": _postmaster_of_this_database(), "redis": _pids_named("redis-server")}


class CpuMeter:
    """CPU seconds per group, between two readings."""

    def __init__(self, groups: dict[str, list[int]]):
        self.groups = groups

    def read(self) -> dict[str, float]:
        return {g: sum(tree_cpu_s(p) for p in pids) for g, pids in self.groups.items()}


# --- clients ---------------------------------------------------------------------------------


JOB = {"image": "localhost/bench:1", "command": ["true"], "gpus": 1}


def _client(url: str, token: str, count: int, batch: int, start_at: float, out) -> None:
    """POST `count` jobs: one per request (batch 1), or as lists of `batch` (batch submit)."""
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {token}"
    while time.time() < start_at:
        time.sleep(0.001)
    ids, failures = [], 0
    left = count
    while left > 0:
        size = min(batch, left)
        left -= size
        body = JOB if batch == 1 else [JOB] * size
        response = session.post(f"{url}/api/v1/jobs/", json=body, timeout=120)
        if response.status_code != 201:
            failures += size
        elif batch == 1:
            ids.append(response.json()["id"])
        else:
            ids += [job["id"] for job in response.json()]
    out.put((ids, failures, time.time()))


def submit_all(
    url: str, token: str, jobs: int, clients: int, batch: int = 1
) -> tuple[list[int], int, float, float]:
    """Submit `jobs` jobs from `clients` processes at once, `batch` per request;
    (ids, failures, start, last 201)."""
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    start_at = time.time() + 0.5
    shares = [jobs // clients + (1 if i < jobs % clients else 0) for i in range(clients)]
    procs = [
        ctx.Process(target=_client, args=(url, token, n, batch, start_at, out)) for n in shares
    ]
    for p in procs:
        p.start()
    ids, failures, last = [], 0, start_at
    for _ in procs:
        got, failed, ended = out.get()
        ids += got
        failures += failed
        last = max(last, ended)
    for p in procs:
        p.join()
    return ids, failures, start_at, last


def _get_client(url: str, token: str, count: int, start_at: float, out) -> None:
    """GET `url` `count` times on one connection (the token sent as a submitting client does)."""
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {token}"
    while time.time() < start_at:
        time.sleep(0.001)
    failures = 0
    for _ in range(count):
        # Not followed: /favicon.ico answers a redirect to the icon's static file.
        if session.get(url, timeout=60, allow_redirects=False).status_code not in (200, 302):
            failures += 1
    out.put((failures, time.time()))


def request_floor(
    meter: CpuMeter, url: str, token: str, count: int, clients: int
) -> tuple[float, float, int]:
    """What a request that does (almost) nothing costs the web: `count` GETs of `url` from
    `clients` processes at once; (requests per second, web CPU ms per request, failures)."""
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    start_at = time.time() + 0.5
    shares = [count // clients + (1 if i < count % clients else 0) for i in range(clients)]
    procs = [ctx.Process(target=_get_client, args=(url, token, n, start_at, out)) for n in shares]
    before = meter.read()
    for p in procs:
        p.start()
    failures, last = 0, start_at
    for _ in procs:
        failed, ended = out.get()
        failures += failed
        last = max(last, ended)
    for p in procs:
        p.join()
    after = meter.read()
    web_ms = (after["web"] - before["web"]) * 1000 / max(count, 1)
    return count / max(last - start_at, 1e-9), web_ms, failures


def loadavg() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


# The loop machine_costs times.
PYTHON_PROBE_ADDITIONS = 1_000_000


def machine_costs(folder: Path, rounds: int = 200) -> str:
    """What two kernel operations every job pays cost on this machine now, in CPU ms.

    A start of /bin/true (the job itself; the supervisor is one more exec), and a folder with
    four files made and deleted on the agents' filesystem (an attempt makes two folders and
    four files). Both drift on a shared virtual machine (ext4 without a journal scans for
    recently deleted inodes at every new one): runs of a session are comparable only beside
    these figures.
    """
    before = os.times()
    for _ in range(rounds):
        subprocess.run(["/bin/true"], check=True)
    after = os.times()
    exec_ms = (
        (
            (after.children_user + after.children_system)
            - (before.children_user + before.children_system)
        )
        * 1000
        / rounds
    )
    folder.mkdir(parents=True, exist_ok=True)
    before = os.times()
    for i in range(rounds):
        made = folder / str(i)
        made.mkdir()
        for name in ("a", "b", "c", "d"):
            (made / name).write_bytes(b"x")
        shutil.rmtree(made)
    after = os.times()
    files_ms = ((after.user + after.system) - (before.user + before.system)) * 1000 / rounds
    shutil.rmtree(folder, ignore_errors=True)
    # Interpreted Python's speed, which every process of ours but the jobs runs at: the same
    # host gave this from one hour to the next anywhere between 1x and 2x, and the figures
    # per job moved with it.
    started_s = time.process_time()
    total = 0
    for i in range(PYTHON_PROBE_ADDITIONS):
        total += i
    python_ms = (time.process_time() - started_s) * 1000
    return (
        f"machine now: exec of /bin/true {exec_ms:.2f} ms CPU; a folder with 4 files made and "
        f"deleted {files_ms:.2f} ms CPU; {PYTHON_PROBE_ADDITIONS:,} additions in a Python loop "
        f"{python_ms:.0f} ms CPU  (load {loadavg()})"
    )


# --- the run ---------------------------------------------------------------------------------


def spawn_reaped(command: list[str], env: dict, log_path: Path) -> subprocess.Popen:
    log = open(log_path, "ab")  # noqa: SIM115 - open as long as the process runs
    return subprocess.Popen(
        [sys.executable, __file__, "--reap", "--", *command],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def end_to_end(args, url: str, user_token: str, meter: CpuMeter) -> None:
    """1. idle submit -> start, then 2. the end-to-end run, printed as they finish."""
    import datetime as dt

    from django.db.models import Avg, Count

    from controlplane.jobs.models import Job, JobState
    from controlplane.scheduling.models import SchedulingCycle

    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {user_token}"
    idle_ids = []
    for _ in range(args.idle_jobs):
        response = session.post(
            f"{url}/api/v1/jobs/",
            json={"image": "localhost/bench:1", "command": ["true"], "gpus": 1},
            timeout=30,
        )
        if response.status_code != 201:
            sys.exit(f"submit failed: {response.status_code} {response.text[:300]}")
        job_id = response.json()["id"]
        idle_ids.append(job_id)
        wait_for(
            lambda job_id=job_id: Job.objects.filter(pk=job_id, state__in=FINAL_STATES).exists(),
            120,
            f"job {job_id} to end",
        )
    started, running = [], []
    for job in Job.objects.filter(pk__in=idle_ids).prefetch_related("attempts", "events"):
        attempt = job.attempts.order_by("number").first()
        if attempt is not None and attempt.started_at is not None:
            started.append((attempt.started_at - job.submitted_at).total_seconds())
        ran = [e.at for e in job.events.all() if e.kind == "running"]
        if ran:
            running.append((min(ran) - job.submitted_at).total_seconds())
    started.sort()
    running.sort()
    print(machine_costs(Path(args.log_dir) / "machine-costs"), flush=True)
    print(f"1. idle submit -> start, {len(idle_ids)} jobs one at a time (load {loadavg()})")
    print(
        f"   submit -> process started  p50 {percentile(started, 0.5):.3f} s  "
        f"p99 {percentile(started, 0.99):.3f} s  (n={len(started)})"
    )
    print(
        f"   submit -> RUNNING recorded  p50 {percentile(running, 0.5):.3f} s  "
        f"p99 {percentile(running, 0.99):.3f} s  (n={len(running)})",
        flush=True,
    )

    # 2. end to end
    time.sleep(2)
    before = meter.read()
    if args.array:
        t0 = time.time()
        response = session.post(
            f"{url}/api/v1/arrays/", json={**JOB, "array": f"0-{args.jobs - 1}"}, timeout=120
        )
        last_201 = time.time()
        if response.status_code != 201:
            sys.exit(f"array submit failed: {response.status_code} {response.text[:300]}")
        ids = list(Job.objects.filter(array_id=response.json()["id"]).values_list("pk", flat=True))
        failures = 0
    else:
        ids, failures, t0, last_201 = submit_all(
            url, user_token, args.jobs, args.clients, args.batch
        )
    deadline = time.monotonic() + args.timeout_s
    # Polled on the state index and the id range of this run's jobs: a list of 2,000 ids
    # four times a second cost PostgreSQL more than half a millisecond per job.
    live = Job.objects.filter(pk__gte=min(ids), pk__lte=max(ids)).exclude(state__in=FINAL_STATES)
    while live.exists():
        if time.monotonic() > deadline:
            sys.exit(f"timed out after {args.timeout_s:.0f} s waiting for the jobs to end")
        time.sleep(0.25)
    t_end = time.time()
    after = meter.read()
    wall = t_end - t0
    failed = Job.objects.filter(pk__in=ids).exclude(state=JobState.SUCCEEDED).count()
    how = "one per POST" if args.batch == 1 else f"{args.batch} per POST"
    if args.array:
        how = "one array"
    print(
        f"2. end to end: {len(ids)} jobs ({how}) from {1 if args.array else args.clients} "
        f"client(s) in {wall:.1f} s -> "
        f"{len(ids) / wall:.1f} jobs/s ({failures} refused submits, {failed} not "
        f"SUCCEEDED); submits took {last_201 - t0:.1f} s ({len(ids) / (last_201 - t0):.1f}/s "
        f"while jobs ran)  (load {loadavg()})"
    )
    total_ms = 0.0
    for group in before:
        ms = (after[group] - before[group]) * 1000 / max(len(ids), 1)
        total_ms += ms
        print(f"   CPU per job  {group:36s} {ms:7.1f} ms")
    print(f"   CPU per job  {'all server-side processes and the job':36s} {total_ms:7.1f} ms")
    available_ms = wall * (os.cpu_count() or 1) * 1000 / max(len(ids), 1)
    print(f"   (the machine had {available_ms:.1f} CPU-ms per job in that time)")
    # The worker's share scales with how many cycles ran: cheaper cycles may run more often
    # (requests are spaced by what cycles take, controlplane/wakeups.py).
    cycles = SchedulingCycle.objects.filter(
        started_at__gte=dt.datetime.fromtimestamp(t0, dt.UTC),
        started_at__lte=dt.datetime.fromtimestamp(t_end, dt.UTC),
    ).aggregate(n=Count("id"), ms=Avg("duration_ms"))
    print(
        f"   {cycles['n']} scheduling cycles, {len(ids) / max(cycles['n'], 1):.1f} jobs and "
        f"{cycles['ms'] or 0:.1f} ms each on average",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--idle-jobs", type=int, default=100)
    parser.add_argument(
        "--batch",
        type=int,
        default=1,
        help="jobs per POST in the end-to-end run (1: one job per request, like sbatch)",
    )
    parser.add_argument(
        "--array",
        action="store_true",
        help="the end-to-end run as one job array of --jobs tasks (POST /api/v1/arrays/)",
    )
    parser.add_argument(
        "--submit-batch",
        type=int,
        default=100,
        help="jobs per POST in the batch submit-only run (the single one is always run too)",
    )
    parser.add_argument("--web-workers", type=int, default=2, help="gunicorn worker processes")
    parser.add_argument(
        "--web-threads",
        type=int,
        default=16,
        help="threads per gunicorn worker (each agent's watch long-poll holds one)",
    )
    parser.add_argument(
        "--web-pool",
        type=int,
        default=0,
        help="database connections per gunicorn process (DB_POOL_MAX_SIZE; 0: one per thread)",
    )
    parser.add_argument(
        "--history",
        type=int,
        default=0,
        help="finished jobs (one attempt each, spread over the nodes) in the database first",
    )
    parser.add_argument(
        "--submit-only",
        action="store_true",
        help="only the submit-only runs (3.): the API's own cost, for comparing builds of it",
    )
    parser.add_argument("--port", type=int, default=18470)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--log-dir", default=str(ROOT / "benchmarks" / "out" / "throughput"))
    parser.add_argument("--reap", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("command", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reap:
        raise SystemExit(reap(args.command))

    base_url = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/gpucp")
    if not os.environ.get("REDIS_URL"):
        sys.exit("bench_throughput needs REDIS_URL (the production signalling path)")
    database_url, name = bench_database_url(base_url, "_bench_tp")
    # Before the database is dropped: a run still going would lose it under its feet.
    ensure_free(args.port)
    recreate_database(base_url, name)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "DEBUG": "0",
        "LOG_LEVEL": "WARNING",
        "CELERY_QUEUE": os.environ.get("CELERY_QUEUE", "gpucp") + "_bench_tp",
        # Static files read once at start, as production serves them, not looked up on disk
        # at every request as the embedded mode does to pick up edits.
        "WHITENOISE_AUTOREFRESH": "0",
        # A benchmark's clients are not abusers: the API's rate limits stay out of the figure.
        "API_THROTTLE_USER_RATE": "1000000/minute",
        "API_THROTTLE_ANON_RATE": "1000000/minute",
    }
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True
    )
    # This script's own actions (the set-up, the cordons) ask the worker for cycles too.
    os.environ["CELERY_QUEUE"] = env["CELERY_QUEUE"]
    setup_django(database_url)
    import datetime as dt

    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from controlplane.cluster import actions as cluster_actions
    from controlplane.cluster.models import Node
    from controlplane.tenancy import actions as tenancy_actions
    from controlplane.tenancy.models import ApiToken

    admin = get_user_model().objects.create_superuser("bench-admin", "b@example.org", "x" * 16)
    # An array run submits all the jobs as one array.
    tenant = tenancy_actions.create_tenant(
        actor=admin, slug="bench", name="Bench", max_array_size=max(1000, args.jobs)
    )
    tenancy_actions.create_quota(
        tenant, actor=admin, gpu_type="", guaranteed_gpus=10_000, limit_gpus=10_000
    )
    user = get_user_model().objects.create_user("bench", password="bench-password-1")
    tenancy_actions.add_member(tenant, user, "member", actor=admin)
    _, user_token = ApiToken.issue(user, "bench")
    pool = cluster_actions.create_pool(actor=admin, name="bench")
    _, join_token = cluster_actions.create_join_token(
        pool, actor=admin, expires_at=timezone.now() + dt.timedelta(hours=2), max_uses=args.agents
    )

    url = f"http://127.0.0.1:{args.port}"
    celery = [str(BIN / "celery"), "-A", "controlplane"]
    groups = {
        "web": spawn_reaped(
            [
                str(BIN / "gunicorn"),
                "controlplane.wsgi:application",
                f"--bind=127.0.0.1:{args.port}",
                "--worker-class=gthread",
                f"--workers={args.web_workers}",
                f"--threads={args.web_threads}",
            ],
            # The web processes' connection pool (docker-compose.yml's default: none).
            {**env, "DB_POOL_MAX_SIZE": str(args.web_pool)},
            log_dir / "web.log",
        ),
        "worker": spawn_reaped(
            [*celery, "worker", "-Q", env["CELERY_QUEUE"], "--pool=solo", "--loglevel=WARNING"],
            env,
            log_dir / "worker.log",
        ),
        "beat": spawn_reaped(
            [*celery, "beat", f"--schedule={log_dir / 'beat-schedule'}", "--loglevel=WARNING"],
            env,
            log_dir / "beat.log",
        ),
    }
    state_root = log_dir / "agents"
    # A fresh database restarts attempt ids; agents must not remember the last run's attempts.
    shutil.rmtree(state_root, ignore_errors=True)
    agents: list[subprocess.Popen] = []
    try:
        wait_for(lambda: _answers(url), 60, f"gunicorn on {url} (see {log_dir})")
        for i in range(args.agents):
            agents.append(
                spawn_reaped(
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
        if args.history:
            print(f"adding {args.history} finished jobs of history ...", flush=True)
            add_history(args.history)
        time.sleep(3)  # the first heartbeats and watches settle
        print(
            f"throughput benchmark: {args.agents} nodes x 8 simulated GPUs, {args.history} "
            "finished jobs of history, process runtime, "
            f"gunicorn {args.web_workers}x{args.web_threads} (DB_POOL_MAX_SIZE={args.web_pool}) + Celery worker + beat + Redis + "
            f"PostgreSQL, {os.cpu_count()} CPUs; "
            f"SCHEDULER_DEBOUNCE_S={settings.SCHEDULER_DEBOUNCE_S}, "
            f"SCHEDULER_CYCLE_INTERVAL_S={settings.SCHEDULER_CYCLE_INTERVAL_S}",
            flush=True,
        )

        meter = CpuMeter(
            {
                "web": [groups["web"].pid],
                "worker": [groups["worker"].pid],
                "beat": [groups["beat"].pid],
                "agents (with supervisors and jobs)": [a.pid for a in agents],
                **server_roots(),
            }
        )
        if not args.submit_only:
            end_to_end(args, url, user_token, meter)
        # 3. submit only: no node takes work, so the figure is the API's alone.
        for node in Node.objects.all():
            cluster_actions.set_node_state(node, "cordoned", actor=admin)
        time.sleep(2)
        # The floor under a submit's cost: gunicorn and Django's middleware alone (a redirect
        # answered by a plain view), then DRF with the bearer token and the rate counts (the
        # API's root, which also reverses the URL of each of its 15 collections).
        for path in ("/favicon.ico", "/api/v1/"):
            rate, web_ms, failures = request_floor(
                meter, url + path, user_token, args.jobs, args.clients
            )
            print(
                f"3. request floor, GET {path}: {args.jobs} requests from {args.clients} clients "
                f"-> {rate:.0f}/s ({failures} failed); CPU per request web {web_ms:.2f} ms  "
                f"(load {loadavg()})",
                flush=True,
            )
        for batch in (1, args.submit_batch):
            before = meter.read()
            ids, failures, t0, last_201 = submit_all(
                url, user_token, args.jobs, args.clients, batch
            )
            wall = last_201 - t0
            after = meter.read()
            how = "one per POST" if batch == 1 else f"{batch} per POST"
            cpu_ms = {g: (after[g] - before[g]) * 1000 / max(len(ids), 1) for g in before}
            print(
                f"3. submit only (every node cordoned), {how}: {len(ids)} jobs from "
                f"{args.clients} clients in {wall:.1f} s -> {len(ids) / wall:.1f} jobs/s "
                f"({failures} refused); CPU per job web {cpu_ms['web']:.1f} ms, "
                f"PostgreSQL {cpu_ms['postgresql']:.1f} ms, worker {cpu_ms['worker']:.1f} ms  "
                f"(load {loadavg()})",
                flush=True,
            )
        print(machine_costs(log_dir / "machine-costs"), flush=True)
    finally:
        for proc in [*agents, *reversed(list(groups.values()))]:
            stop(proc)
        _kill_leftover_jobs(state_root)


if __name__ == "__main__":
    main()
