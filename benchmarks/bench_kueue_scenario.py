"""Kueue's large-scale scheduler scenario, rebuilt on our stack (issue 3, "Benchmarks").

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/gpucp REDIS_URL=redis://127.0.0.1:6379/5 \\
        CELERY_QUEUE=gpucp_bench .venv/bin/python benchmarks/bench_kueue_scenario.py --scale 0.1

The scenario (Kueue's test/performance/scheduler large-scale config, as the issue states it):
1,000 tenants in 10 groups of 100; each group shares a pool of 2,000 GPUs; each tenant is
guaranteed 20 GPUs of its pool and may borrow up to 100 more. Per tenant 50 jobs: 35 small
(1 GPU, runs 150 ms, priority 50, one every 60 ms), 11 medium (5 GPUs, 350 ms, priority 100,
every 300 ms), 4 large (20 GPUs, 700 ms, priority 200, every 700 ms); 50,000 jobs in all.

How it maps onto our model:
- A Kueue cohort is a group here: its own Pool of nodes (8 GPUs each) whose GPUs have their own
  type (`KUEUE-G03`, ...). Our quotas are per tenant and GPU type, so a tenant's quota on its
  group's type (guaranteed 20, limit 20 + 100) is its ClusterQueue's nominal quota and
  borrowing limit, and borrowing can only happen inside the group, as inside a cohort.
- Priority 50 / 100 / 200 are our classes low / normal / high. A large job (20 GPUs) does not
  fit one node, so it runs as a gang over three nodes, which Kueue's quota-only test never has
  to place.
- Everything runs the production path: jobs go in through controlplane.jobs.actions.submit_job
  (--submitters processes, 4 by default, keeping to the per-tenant schedule; each submit is
  its own transaction and durable commit), which asks for a debounced cycle through Redis; a
  real Celery worker runs the cycles (advisory lock, load, plan, apply) on PostgreSQL; this
  script stands in for beat (a tick every SCHEDULER_CYCLE_INTERVAL_S) and for the agents: two
  processes, each the agents of half the nodes, whose nodes heartbeat through the production
  heartbeat path (controlplane.cluster.heartbeat.process_heartbeat) whenever an attempt of
  theirs started or ended; no containers.

Figures, measured like Kueue's recorder does:
- wall: from the first scheduled submit to the last job's end;
- time to admission per class: from the job's creation to its first admission;
- usage: GPUs held by admitted work (admission to end), integrated over time, over
  (all GPUs x wall). The quotas' nominal sum equals the GPU count, as in Kueue's setup. This
  is Kueue's recorder: each ClusterQueue's usage integrated between its status events, summed,
  over (nominal quota x the time from the first event to the last).
- where the time went: each role's own time in its actions, and its CPU seconds and those of
  its PostgreSQL backend (per job they are steady on a busy machine, where waits are not).

The usage bound: the scenario's work is 80.5 GPU-s per tenant (35 x 1 x 0.15 + 11 x 5 x 0.35
+ 4 x 20 x 0.7), 80,500 GPU-s at full size, which is all 20,000 GPUs for 4.0 s. A system that
holds GPUs only while jobs run cannot show more than work / (GPUs x wall): 0.7 % at a 590 s
wall. Kueue's 38.6 % at 1,179 s means its GPUs were held ~113 times as long as its jobs ran,
which is the latency of its test's finishing path, not work done. The script prints both
figures and the ratio, so the two goals can be read for what they are.
Kueue's published figures: 1,179 s wall, 38.6 % usage, 106 / 256 / 700 s mean time to admission
for large / medium / small. Goal: <= 590 s wall at >= 38.6 % usage.

--scale keeps the 10 groups and the per-tenant work but scales the tenants per group (and so
the pool sizes): --scale 0.1 is 100 tenants, 2,000 GPUs, 5,000 jobs.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _scheduling_db import REPO, bench_database, setup_django  # noqa: E402

GROUPS = 10
TENANTS_PER_GROUP = 100
GUARANTEED_GPUS = 20
BORROWABLE_GPUS = 100
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class JobClass:
    name: str
    count: int
    gpus: int
    runtime_s: float
    priority: str  # ours: low 50, normal 100, high 200, as Kueue's 50 / 100 / 200
    interval_s: float


CLASSES = (
    JobClass("small", 35, 1, 0.150, "low", 0.060),
    JobClass("medium", 11, 5, 0.350, "normal", 0.300),
    JobClass("large", 4, 20, 0.700, "high", 0.700),
)
RUNTIME_S = {c.name: c.runtime_s for c in CLASSES}
POLL_S = 0.05
KUEUE = {"wall_s": 1179.0, "usage_pct": 38.6, "large": 106.0, "medium": 256.0, "small": 700.0}


def tenants_per_group(scale: float) -> int:
    return max(1, round(TENANTS_PER_GROUP * scale))


# With real agents a group's GPU type is what its nodes' simulated boards report: ten groups,
# ten boards, so a tenant's quota (per GPU type) lends only inside its group, as a cohort does.
REAL_PROFILES = (
    "H100-SXM-80GB",
    "A100-SXM4-80GB",
    "H200-SXM-141GB",
    "A100-SXM4-40GB",
    "V100-SXM2-32GB",
    "V100-PCIE-32GB",
    "A40",
    "P100-PCIE-16GB",
    "RTX6000",
    "L4",
)


def group_type(g: int, real: bool = False) -> str:
    return REAL_PROFILES[g] if real else f"KUEUE-G{g:02d}"


def schedule(scale: float) -> list[tuple[float, int, str]]:
    """(seconds after start, tenant number, class) for every job, in time order."""
    per_group = tenants_per_group(scale)
    events = [
        (i * c.interval_s, t, c.name)
        for t in range(GROUPS * per_group)
        for c in CLASSES
        for i in range(c.count)
    ]
    events.sort()
    return events


def _cpu_s(pid: int | str = "self") -> float:
    """CPU seconds (user + system) a process has used so far, from /proc (0 where unreadable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _own_cpu() -> dict:
    """This process's CPU and that of its PostgreSQL backend (same machine), in seconds.

    Timings on a shared machine are noisy; CPU seconds per job are not, and they tell the
    client's Python from the database's work.
    """
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        backend = cursor.fetchone()[0]
    return {"cpu_s": round(_cpu_s(), 2), "db_cpu_s": round(_cpu_s(backend), 2), "db_pid": backend}


def populate(scale: float) -> dict:
    from django.contrib.auth import get_user_model

    from controlplane.cluster.models import GPU, Node, Pool
    from controlplane.tenancy.models import Quota, Tenant

    per_group = tenants_per_group(scale)
    gpus_per_pool = GUARANTEED_GPUS * per_group
    nodes_per_pool = math.ceil(gpus_per_pool / GPUS_PER_NODE)
    User = get_user_model()
    total_gpus = 0
    for g in range(GROUPS):
        pool = Pool.objects.create(name=f"group-{g:02d}")
        nodes = Node.objects.bulk_create(
            [
                Node(name=f"g{g:02d}-node-{i:04d}", pool=pool, cpus=128, memory_mib=1 << 20)
                for i in range(nodes_per_pool)
            ]
        )
        gpus = []
        for i in range(gpus_per_pool):
            node = nodes[i // GPUS_PER_NODE]
            gpus.append(
                GPU(
                    node=node,
                    index=i % GPUS_PER_NODE,
                    uuid=f"GPU-{node.name}-{i % GPUS_PER_NODE}",
                    model=group_type(g),
                    memory_mib=81559,
                    power_min_w=200.0,
                    power_max_w=700.0,
                    power_default_w=700.0,
                )
            )
        GPU.objects.bulk_create(gpus, batch_size=4000)
        total_gpus += len(gpus)
        tenants = Tenant.objects.bulk_create(
            [
                Tenant(slug=f"g{g:02d}-t{k:03d}", name=f"Group {g} tenant {k}")
                for k in range(per_group)
            ]
        )
        Quota.objects.bulk_create(
            [
                Quota(
                    tenant=t,
                    gpu_type=group_type(g),
                    guaranteed_gpus=GUARANTEED_GPUS,
                    limit_gpus=GUARANTEED_GPUS + BORROWABLE_GPUS,
                )
                for t in tenants
            ]
        )
        User.objects.bulk_create([User(username=t.slug, password="!") for t in tenants])
    return {"gpus": total_gpus, "tenants": GROUPS * per_group, "nodes": GROUPS * nodes_per_pool}


# --- roles that run as their own processes -----------------------------------------------------


def role_submit(args) -> None:
    """Submit this shard's jobs at their scheduled times (or as soon as possible when behind)."""
    from django.contrib.auth import get_user_model

    from controlplane.jobs import actions
    from controlplane.tenancy.models import Tenant

    per_group = tenants_per_group(args.scale)
    tenants = {t.slug: t for t in Tenant.objects.all()}
    users = {u.username: u for u in get_user_model().objects.all()}
    classes = {c.name: c for c in CLASSES}
    lags = []
    busy_s = 0.0
    for offset_s, t, cls in schedule(args.scale):
        if t % args.shards != args.shard:
            continue
        due = args.t0 + offset_s
        wait = due - time.time()
        if wait > 0:
            time.sleep(wait)
        lags.append(max(0.0, time.time() - due))
        g, k = divmod(t, per_group)
        slug = f"g{g:02d}-t{k:03d}"
        c = classes[cls]
        began = time.perf_counter()
        actions.submit_job(
            tenant=tenants[slug],
            user=users[slug],
            name=c.name,
            image="registry.local/kueue-bench:1",
            command=["sleep", str(c.runtime_s)],
            gpus=c.gpus,
            gpu_type=group_type(g, args.agents == "real"),
            priority=c.priority,
            cpus=1.0,
            memory_mib=1024,
        )
        busy_s += time.perf_counter() - began
    print(
        json.dumps(
            {
                "submitted": len(lags),
                "mean_lag_s": sum(lags) / max(1, len(lags)),
                "submit_busy_s": busy_s,
                **_own_cpu(),
            }
        )
    )


def role_agent(args) -> None:
    """Stand in for the agents of one shard of the nodes: run each attempt, end it on time.

    The containers are stand-ins; what they report goes the production way: a node with
    something to say (an attempt it started, one that ended, one it stopped) heartbeats through
    controlplane.cluster.heartbeat.process_heartbeat, the full path of the agent API's
    heartbeat, which applies the reports under the node's lock through the single-attempt
    actions of controlplane.jobs.actions. Like a real agent, a heartbeat reports every attempt
    the node runs and every GPU's reading, and an exit is reported until a heartbeat was
    answered. A node with nothing new does not heartbeat here (a real one would, on the steady
    path, which writes nothing in the request).
    """
    from django.db import OperationalError
    from django.db.models import F

    from controlplane.cluster import heartbeat as hb
    from controlplane.cluster.models import GPU, Node
    from controlplane.cluster.telemetry import GpuSample
    from controlplane.jobs.models import ACTIVE_ATTEMPT_STATES, AttemptState, Job, JobAttempt

    due: list[tuple[float, int]] = []  # (end time, attempt id), soonest first
    mine = JobAttempt.objects.annotate(shard=F("node_id") % args.shards).filter(shard=args.shard)
    samples: dict[int, tuple[GpuSample, ...]] = {}
    for node_id, uuid in (
        GPU.objects.annotate(shard=F("node_id") % args.shards)
        .filter(shard=args.shard)
        .order_by("node_id", "index")
        .values_list("node_id", "uuid")
    ):
        samples[node_id] = (*samples.get(node_id, ()), GpuSample(uuid, power_draw_w=300.0))
    # What each node's agent runs: attempt id -> (node id, start as Unix time).
    runs: dict[int, tuple[int, float]] = {}
    by_node: dict[int, set[int]] = {}
    # Exits each node still has to report: node id -> {attempt id: report}.
    exits: dict[int, dict[int, hb.AttemptReport]] = {}
    retry: set[int] = set()  # nodes whose last heartbeat was not answered
    # Every attempt at or below floor is known to be finished: each pass reads only the recent
    # end of the table through the primary key, as an agent reads only its own node's work.
    floor = 0
    seq = 0
    spent = {"poll_s": 0.0, "heartbeat_s": 0.0}
    counts = {"heartbeats": 0, "started": 0, "finished": 0, "stopped": 0, "deadlocks": 0}
    last_done_check = 0.0

    def start(pk: int, node_id: int, at: float) -> None:
        runs[pk] = (node_id, at)
        by_node.setdefault(node_id, set()).add(pk)

    def end(pk: int, exit_code: int, *, unwanted: bool) -> int:
        node_id, began = runs.pop(pk)
        by_node[node_id].discard(pk)
        exits.setdefault(node_id, {})[pk] = hb.AttemptReport(
            pk,
            hb.EXITED,
            started_at=began,
            exit_code=exit_code,
            finished_at=time.time(),
            stop_cause=hb.UNWANTED if unwanted else None,
        )
        return node_id

    def heartbeat(node_id: int) -> None:
        nonlocal seq
        seq += 1
        reports = [
            hb.AttemptReport(pk, hb.RUNNING, started_at=runs[pk][1])
            for pk in sorted(by_node.get(node_id, ()))
        ]
        told = exits.get(node_id, {})
        beat = hb.Heartbeat(
            seq=seq,
            sent_at=time.time(),
            gpus=samples.get(node_id, ()),
            attempts=(*reports, *told.values()),
        )
        try:
            # The node as the agent API reads it for each request.
            hb.process_heartbeat(Node.objects.get(pk=node_id), beat)
        except OperationalError:
            # Rolled back by a deadlock the heartbeat could not get past: as an agent whose
            # heartbeat was answered with an error, the same reports go again next pass.
            counts["deadlocks"] += 1
            retry.add(node_id)
            return
        retry.discard(node_id)
        counts["heartbeats"] += 1
        for report in exits.pop(node_id, {}).values():
            counts["finished" if report.stop_cause is None else "stopped"] += 1

    while True:
        t = time.perf_counter()
        rows = list(
            mine.filter(pk__gt=floor, state__in=ACTIVE_ATTEMPT_STATES).values_list(
                "pk", "state", "stop_requested_at", "job__name", "node_id"
            )
        )
        spent["poll_s"] += time.perf_counter() - t
        now = time.time()
        talk: set[int] = set()
        for pk, state, stop, name, node_id in rows:
            if stop is not None:
                if pk not in runs and state == AttemptState.ADMITTED:
                    # Its agent had it from an answer and is starting it as the stop arrives.
                    start(pk, node_id, now)
                if pk in runs:
                    # Preempted: the stand-in container dies at once, its agent says so.
                    talk.add(end(pk, 137, unwanted=True))
            elif state == AttemptState.ADMITTED and pk not in runs:
                start(pk, node_id, now)
                heapq.heappush(due, (now + RUNTIME_S[name], pk))
                counts["started"] += 1
                talk.add(node_id)
        while due and due[0][0] <= time.time():
            pk = heapq.heappop(due)[1]
            if pk in runs:
                talk.add(end(pk, 0, unwanted=False))
        talk.update(retry)  # what a failed heartbeat did not get across goes again
        t = time.perf_counter()
        for node_id in sorted(talk):
            heartbeat(node_id)
        spent["heartbeat_s"] += time.perf_counter() - t
        unfinished = set(runs) | {pk for told in exits.values() for pk in told}
        unfinished |= {pk for pk, state, *_ in rows if state == AttemptState.ADMITTED}
        if unfinished:
            floor = min(unfinished) - 1
        elif rows:
            floor = max(floor, max(pk for pk, *_ in rows))
        if not due and time.time() - last_done_check > 0.5:
            last_done_check = time.time()
            if Job.objects.filter(state="SUCCEEDED").count() >= args.total:
                break
        # An agent learns of new work at its next heartbeat or watch wake-up; 50 ms keeps the
        # stand-ins' polling from costing more CPU than the work it finds.
        time.sleep(POLL_S if not due else min(POLL_S, max(0.0, due[0][0] - time.time())))
    print(json.dumps({**{k: round(v, 2) for k, v in spent.items()}, **counts, **_own_cpu()}))


# --- the orchestrator ---------------------------------------------------------------------------


def _child(role: str, args, env: dict, extra: list[str]) -> subprocess.Popen:
    cmd = [
        sys.executable,
        __file__,
        "--role",
        role,
        "--scale",
        str(args.scale),
        "--t0",
        str(args.t0),
        "--agents",
        args.agents,
        *(["--profile-dir", args.profile_dir] if args.profile_dir else []),
        *extra,
    ]
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, text=True)


def _worker(env: dict, queue: str, log_path: Path) -> subprocess.Popen:
    celery = Path(sys.executable).with_name("celery")
    log_file = open(log_path, "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        [
            str(celery),
            "-A",
            "controlplane",
            "worker",
            "-Q",
            queue,
            "--pool=solo",
            "-n",
            f"{queue}@%h",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-l",
            "WARNING",
        ],
        env=env,
        cwd=REPO,
        stdout=log_file,
        stderr=subprocess.STDOUT,
    )


def _sample_backends(database: str, seen: dict[int, float]) -> None:
    """Note the CPU so far of every backend on the benchmark's database but our own."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            [database],
        )
        for (pid,) in cursor.fetchall():
            seen[pid] = max(seen.get(pid, 0.0), _cpu_s(pid))


def _purge(queue: str) -> None:
    from controlplane.redis_client import get_redis
    from controlplane.wakeups import request_keys

    conn = get_redis()
    for key in conn.scan_iter(match=f"{queue}*"):
        conn.delete(key)
    conn.delete(*request_keys(queue))


def report(total_gpus: int, t0: float, roles: dict) -> dict:
    from django.db.models import Avg, Count, Max, Min

    from controlplane.jobs.models import Allocation, Job, JobAttempt
    from controlplane.scheduling.models import SchedulingCycle

    gpus_of = dict(
        Allocation.objects.values("attempt_id")
        .annotate(n=Count("id"))
        .values_list("attempt_id", "n")
    )
    end = Job.objects.aggregate(end=Max("finished_at"))["end"].timestamp()
    wall_s = end - t0
    held_gpu_s = 0.0
    busy_gpu_s = 0.0
    for pk, created, started, finished in JobAttempt.objects.values_list(
        "id", "created_at", "started_at", "finished_at"
    ):
        n = gpus_of.get(pk, 0)
        finished = finished or datetime.fromtimestamp(end, tz=UTC)
        held_gpu_s += n * (finished - created).total_seconds()
        if started:
            busy_gpu_s += n * (finished - started).total_seconds()
    admission = {}
    first = {
        job_id: created
        for job_id, created in JobAttempt.objects.filter(number=1).values_list(
            "job_id", "created_at"
        )
    }
    for cls in ("large", "medium", "small"):
        waits = [
            (first[pk] - submitted).total_seconds()
            for pk, submitted in Job.objects.filter(name=cls).values_list("id", "submitted_at")
            if pk in first
        ]
        admission[cls] = sum(waits) / len(waits) if waits else float("nan")
    cycles = SchedulingCycle.objects.aggregate(
        n=Count("id"),
        mean_ms=Avg("duration_ms"),
        max_ms=Max("duration_ms"),
        first=Min("started_at"),
    )
    step_s: dict[str, float] = {}
    for steps in SchedulingCycle.objects.values_list("step_ms", flat=True):
        for name, ms in steps.items():
            step_s[name] = step_s.get(name, 0.0) + ms / 1000.0
    return {
        "wall_s": wall_s,
        "cycle_step_total_s": {k: round(v, 2) for k, v in sorted(step_s.items())},
        "starts_per_cycle_max": SchedulingCycle.objects.aggregate(m=Max("starts"))["m"],
        "usage_pct": 100.0 * held_gpu_s / (total_gpus * wall_s),
        "gpus": total_gpus,
        "held_gpu_s": held_gpu_s,
        # Every tenant brings 20 GPUs to its pool and the same 50 jobs.
        "work_gpu_s": sum(c.count * c.gpus * c.runtime_s for c in CLASSES)
        * (total_gpus // GUARANTEED_GPUS),
        "busy_pct": 100.0 * busy_gpu_s / (total_gpus * wall_s),
        "admission_s": admission,
        "cycles": cycles["n"],
        "cycle_mean_s": (cycles["mean_ms"] or 0) / 1000,
        "cycle_max_s": (cycles["max_ms"] or 0) / 1000,
        "preemptions": JobAttempt.objects.filter(stop_reason="preempted").count(),
        "attempts": JobAttempt.objects.count(),
        "cycle_total_s": (cycles["mean_ms"] or 0) * cycles["n"] / 1000,
        "mean_submit_lag_s": sum(r["mean_lag_s"] for r in roles["submitters"])
        / max(1, len(roles["submitters"])),
        "submitters": roles["submitters"],
        "agents": roles["agents"],
        "worker": roles["worker"],
    }


def orchestrate(args) -> None:
    from django.conf import settings
    from django.db import connection

    from controlplane.jobs.models import Job
    from controlplane.scheduling.tasks import run_cycle

    if not settings.REDIS_URL:
        sys.exit("This benchmark needs Redis (the Celery broker): set REDIS_URL=redis://...")
    queue = f"{settings.CELERY_TASK_DEFAULT_QUEUE}_kueue"
    settings.CELERY_TASK_DEFAULT_QUEUE = queue
    from controlplane.celery import app

    app.conf.task_default_queue = queue
    total = len(schedule(args.scale))
    with bench_database("bench_kueue") as name:
        sizes = populate(args.scale)
        print(
            f"scale {args.scale}: {GROUPS} groups x {tenants_per_group(args.scale)} tenants, "
            f"{sizes['gpus']} GPUs on {sizes['nodes']} nodes, {total} jobs"
        )
        db = connection.settings_dict
        env = {
            **os.environ,
            "DATABASE_URL": f"postgres://{db['USER'] or 'postgres'}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{name}",
            "CELERY_QUEUE": queue,
            "SCHEDULER_EMBEDDED": "0",
            "LOG_LEVEL": "WARNING",
        }
        _purge(queue)
        log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"{queue}-worker.log"
        worker = _worker(env, queue, log_path)
        children: list[subprocess.Popen] = []
        try:
            time.sleep(3.0)  # the worker's start-up; requests queue up in Redis meanwhile
            args.t0 = time.time() + 1.0
            submitters = [
                _child("submit", args, env, ["--shard", str(i), "--shards", str(args.submitters)])
                for i in range(args.submitters)
            ]
            agents = [
                _child(
                    "agent", args, env, ["--shard", str(i), "--shards", "2", "--total", str(total)]
                )
                for i in range(2)
            ]
            children = submitters + agents
            next_tick = args.t0
            last_print = time.time()
            backends_cpu: dict[int, float] = {}
            while any(a.poll() is None for a in agents):
                failed = [c.args[3] for c in children if c.poll() not in (None, 0)]
                if failed:
                    print(f"a {failed[0]} process failed: the figures below are partial")
                    break
                if time.time() > args.t0 + args.max_wall_s:
                    print(f"stopped after {args.max_wall_s} s: the figures below are partial")
                    break
                if time.time() >= next_tick:
                    # Beat's periodic cycle (beat itself would also run the liveness sweep,
                    # which would take these agentless nodes down).
                    run_cycle.delay(trigger="tick")
                    next_tick += settings.SCHEDULER_CYCLE_INTERVAL_S
                # Celery's worker may reconnect for each task: sampled at every turn of
                # this loop, its backends' CPU is a lower bound.
                _sample_backends(name, backends_cpu)
                if time.time() - last_print >= 30:
                    done = Job.objects.filter(state="SUCCEEDED").count()
                    print(
                        f"  t={time.time() - args.t0:6.0f} s: {done}/{total} jobs done", flush=True
                    )
                    last_print = time.time()
                time.sleep(0.2)
            for child in children:
                if child.poll() is None:
                    child.terminate()  # stopped early: what it measured is lost with it
            roles = {"submitters": [], "agents": []}
            for key, group in (("submitters", submitters), ("agents", agents)):
                for child in group:
                    out, _ = child.communicate(timeout=60)
                    lines = (out or "").strip().splitlines()
                    if lines:
                        roles[key].append(json.loads(lines[-1]))
            _sample_backends(name, backends_cpu)
            # The worker's backends: all the others but the roles' own.
            theirs = {r["db_pid"] for group in roles.values() for r in group}
            roles["worker"] = {
                "cpu_s": round(_cpu_s(worker.pid), 2),
                "db_cpu_s": round(
                    sum(cpu for pid, cpu in backends_cpu.items() if pid not in theirs), 2
                ),
            }
            figures = report(sizes["gpus"], args.t0, roles)
        finally:
            for child in [*children, worker]:
                if child.poll() is None:
                    child.terminate()
            for child in [*children, worker]:
                try:
                    child.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    child.kill()
            _purge(queue)
        print_figures(figures, args.scale)


# --- with real agents ---------------------------------------------------------------------------


def populate_real(scale: float) -> dict:
    """Pools, tenants, quotas and users as populate(), but no nodes: the agents register them.

    Returns the sizes and, per group, the join token its nodes join their pool with.
    """
    import datetime as dt

    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from controlplane.cluster import actions as cluster_actions
    from controlplane.tenancy.models import Quota, Tenant

    per_group = tenants_per_group(scale)
    nodes_per_pool = math.ceil(GUARANTEED_GPUS * per_group / GPUS_PER_NODE)
    User = get_user_model()
    admin = User.objects.create_superuser("kueue-admin", "k@example.org", "x" * 16)
    join_tokens = []
    for g in range(GROUPS):
        pool = cluster_actions.create_pool(actor=admin, name=f"group-{g:02d}")
        _, raw = cluster_actions.create_join_token(
            pool,
            actor=admin,
            expires_at=timezone.now() + dt.timedelta(hours=6),
            max_uses=nodes_per_pool,
        )
        join_tokens.append(raw)
        tenants = Tenant.objects.bulk_create(
            [
                Tenant(slug=f"g{g:02d}-t{k:03d}", name=f"Group {g} tenant {k}")
                for k in range(per_group)
            ]
        )
        Quota.objects.bulk_create(
            [
                Quota(
                    tenant=t,
                    gpu_type=group_type(g, real=True),
                    guaranteed_gpus=GUARANTEED_GPUS,
                    limit_gpus=GUARANTEED_GPUS + BORROWABLE_GPUS,
                )
                for t in tenants
            ]
        )
        User.objects.bulk_create([User(username=t.slug, password="!") for t in tenants])
    return {
        "gpus": GROUPS * nodes_per_pool * GPUS_PER_NODE,
        "tenants": GROUPS * per_group,
        "nodes": GROUPS * nodes_per_pool,
        "nodes_per_pool": nodes_per_pool,
        "join_tokens": join_tokens,
    }


def role_launch_agents(args) -> None:
    """Start every node's agent (`python -m agents`, as on a GPU host) and wait for them.

    One process starts them all so that one subreaper above it (bench_throughput's --reap)
    collects the CPU of the agents, of their fences, of the job supervisors they detach and of
    the jobs. A stop is passed on to every agent.
    """
    import signal

    spec = json.loads(Path(args.agents_spec).read_text())
    agents: list[subprocess.Popen] = []

    def forward(signum, _frame):
        for agent in agents:
            if agent.poll() is None:
                agent.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    log_dir = Path(spec["log_dir"])
    for node in spec["nodes"]:
        env = {**os.environ, "GPUCP_JOIN_TOKEN": node["join_token"]}
        log = open(log_dir / f"{node['name']}.log", "ab")  # noqa: SIM115 - the agent's own
        agents.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "agents",
                    f"--url={spec['url']}",
                    f"--node-name={node['name']}",
                    f"--state-dir={Path(spec['state_root']) / node['name']}",
                    "--runtime=process",
                    # One build of the job supervisor for all the agents of this host.
                    f"--supervisor-dir={Path(spec['state_root']) / 'supervisor'}",
                    f"--gpu-backend=simulated:{node['profile']}:{GPUS_PER_NODE}",
                    "--log-level=WARNING",
                ],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    for agent in agents:
        agent.wait()


def orchestrate_real(args) -> None:
    """The scenario on the production stack: gunicorn, a Celery worker and beat, and one real
    agent process per node (simulated GPUs, the process runtime: each job is a `sleep` of its
    class's run time, started and reported by its node's agent over the agent API)."""
    import shutil

    from bench_heartbeat import ensure_free, stop
    from bench_submit_to_running import _answers, _kill_leftover_jobs, wait_for
    from bench_throughput import BIN, CpuMeter, loadavg, server_roots, spawn_reaped
    from django.conf import settings
    from django.db import connection

    from controlplane.cluster.models import Node
    from controlplane.jobs.models import Job

    if not settings.REDIS_URL:
        sys.exit("This benchmark needs Redis (the Celery broker): set REDIS_URL=redis://...")
    queue = f"{settings.CELERY_TASK_DEFAULT_QUEUE}_kueue"
    total = len(schedule(args.scale))
    log_dir = Path(args.log_dir)
    shutil.rmtree(log_dir, ignore_errors=True)
    (log_dir / "agents").mkdir(parents=True)
    state_root = log_dir / "state"
    with bench_database("bench_kueue") as name:
        sizes = populate_real(args.scale)
        nodes = sizes["nodes"]
        print(
            f"scale {args.scale}, real agents: {GROUPS} groups x {tenants_per_group(args.scale)} "
            f"tenants, {sizes['gpus']} GPUs on {nodes} nodes (one agent process each, "
            f"process runtime, simulated GPUs), {total} jobs; {os.cpu_count()} CPUs",
            flush=True,
        )
        db = connection.settings_dict
        # Every agent keeps a watch (long poll) open: each web process needs a thread per
        # watch it holds and some more for heartbeats (docker-compose.yml sizes it the same way).
        watches = math.ceil(nodes / 2) + 4
        # The web processes share a pool of connections per process (DB_POOL_MAX_SIZE, as
        # docker-compose runs them): a watch holds none while it waits, so the connections are
        # the pools', the worker's, beat's, the submitters' and this script's, whatever the
        # number of agents. Refuse what max_connections cannot hold rather than fail half-way.
        with connection.cursor() as cursor:
            cursor.execute("SHOW max_connections")
            max_connections = int(cursor.fetchone()[0])
        needed = 2 * args.web_pool + args.submitters + 8
        if needed > max_connections:
            sys.exit(
                f"--web-pool {args.web_pool} needs about {needed} database connections and "
                f"PostgreSQL allows {max_connections}: lower --web-pool"
            )
        env = {
            **os.environ,
            "DATABASE_URL": f"postgres://{db['USER'] or 'postgres'}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{name}",
            "CELERY_QUEUE": queue,
            "SCHEDULER_EMBEDDED": "0",
            "DEBUG": "0",
            "LOG_LEVEL": "WARNING",
            "AGENT_WATCH_MAX_PER_PROCESS": str(watches),
            "API_THROTTLE_USER_RATE": "1000000/minute",
            "API_THROTTLE_ANON_RATE": "1000000/minute",
        }
        _purge(queue)
        url = f"http://127.0.0.1:{args.port}"
        ensure_free(args.port)
        celery = [str(BIN / "celery"), "-A", "controlplane"]
        groups = {
            "web": spawn_reaped(
                [
                    str(BIN / "gunicorn"),
                    "controlplane.wsgi:application",
                    f"--bind=127.0.0.1:{args.port}",
                    "--worker-class=gthread",
                    "--workers=2",
                    f"--threads={watches + 12}",
                    "--worker-connections=4000",
                    "--backlog=4096",
                    "--keep-alive=75",
                ],
                {**env, "DB_POOL_MAX_SIZE": str(args.web_pool)},
                log_dir / "web.log",
            ),
            "worker": spawn_reaped(
                [*celery, "worker", "-Q", queue, "--pool=solo", "--loglevel=WARNING"],
                env,
                log_dir / "worker.log",
            ),
            "beat": spawn_reaped(
                [*celery, "beat", f"--schedule={log_dir / 'beat-schedule'}", "--loglevel=WARNING"],
                env,
                log_dir / "beat.log",
            ),
        }
        children: list[subprocess.Popen] = []
        try:
            wait_for(lambda: _answers(url), 60, f"gunicorn on {url} (see {log_dir})")
            per_pool = sizes["nodes_per_pool"]
            spec = {
                "url": url,
                "log_dir": str(log_dir / "agents"),
                "state_root": str(state_root),
                "nodes": [
                    {
                        "name": f"g{g:02d}-node-{i:04d}",
                        "profile": group_type(g, real=True),
                        "join_token": sizes["join_tokens"][g],
                    }
                    for g in range(GROUPS)
                    for i in range(per_pool)
                ],
            }
            spec_path = log_dir / "agents.json"
            spec_path.write_text(json.dumps(spec))
            groups["agents"] = spawn_reaped(
                [
                    sys.executable,
                    __file__,
                    "--role",
                    "launch-agents",
                    "--agents-spec",
                    str(spec_path),
                ],
                env,
                log_dir / "launcher.log",
            )
            began = time.time()
            wait_for(
                lambda: Node.objects.filter(ready=True).count() == nodes,
                max(120.0, nodes * 2.0),
                f"{nodes} agents to register (see {log_dir / 'agents'})",
            )
            print(
                f"{nodes} agents registered in {time.time() - began:.0f} s (load {loadavg()})",
                flush=True,
            )
            time.sleep(5)  # their first heartbeats and watches settle
            meter = CpuMeter(
                {
                    **{role: [proc.pid] for role, proc in groups.items()},
                    **server_roots(),
                }
            )
            before = meter.read()
            args.t0 = time.time() + 1.0
            children = [
                _child("submit", args, env, ["--shard", str(i), "--shards", str(args.submitters)])
                for i in range(args.submitters)
            ]
            last_print = time.time()
            finished = 0
            while finished < total:
                failed = [c.args[3] for c in children if c.poll() not in (None, 0)]
                if failed:
                    print(f"a {failed[0]} process failed: the figures below are partial")
                    break
                if time.time() > args.t0 + args.max_wall_s:
                    print(f"stopped after {args.max_wall_s} s: the figures below are partial")
                    break
                time.sleep(0.5)
                finished = Job.objects.filter(
                    state__in=("SUCCEEDED", "FAILED", "CANCELLED")
                ).count()
                if time.time() - last_print >= 30:
                    print(
                        f"  t={time.time() - args.t0:6.0f} s: {finished}/{total} jobs ended "
                        f"(load {loadavg()})",
                        flush=True,
                    )
                    last_print = time.time()
            after = meter.read()
            load = loadavg()
            roles: dict = {"submitters": [], "agents": []}
            for child in children:
                out, _ = child.communicate(timeout=60)
                lines = (out or "").strip().splitlines()
                if lines:
                    roles["submitters"].append(json.loads(lines[-1]))
            submit_cpu_s = sum(r["cpu_s"] + r["db_cpu_s"] for r in roles["submitters"])
            roles["worker"] = {
                "cpu_s": round(after["worker"] - before["worker"], 2),
                "db_cpu_s": round(after["postgresql"] - before["postgresql"], 2),
            }
            figures = report(sizes["gpus"], args.t0, roles)
            not_succeeded = Job.objects.exclude(state="SUCCEEDED").count()
        finally:
            for child in children:
                if child.poll() is None:
                    child.terminate()
            for proc in [
                groups.get("agents"),
                *reversed([groups[k] for k in ("web", "worker", "beat")]),
            ]:
                if proc is not None:
                    stop(proc)
            _kill_leftover_jobs(state_root)
            _purge(queue)
        print_figures(figures, args.scale, real_agents=True)
        print(f"jobs not SUCCEEDED: {not_succeeded}; load average at the end: {load}")
        print(f"CPU per job ({total} jobs), each process group with everything it started:")
        total_ms = 0.0
        for group in before:
            ms = (after[group] - before[group]) * 1000 / total
            total_ms += ms
            print(f"  {group:12s} {ms:7.1f} ms")
        print(
            f"  submitters   {submit_cpu_s * 1000 / total:7.1f} ms (their Python and database "
            "backends, counted in postgresql too)"
        )
        print(f"  all server-side processes and the jobs: {total_ms:.1f} ms")


def print_figures(f: dict, scale: float, *, real_agents: bool = False) -> None:
    a = f["admission_s"]
    print(
        f"wall time:            {f['wall_s']:8.1f} s      (Kueue {KUEUE['wall_s']:.0f} s at full size)"
    )
    print(
        f"mean GPU usage:       {f['usage_pct']:8.1f} %      (held by admitted work; Kueue {KUEUE['usage_pct']} %)"
    )
    print(f"  of it running:      {f['busy_pct']:8.1f} %")
    work_s = f["work_gpu_s"] / f["gpus"]
    print(
        f"  the work is {f['work_gpu_s']:,.0f} GPU-s, all {f['gpus']:,} GPUs for {work_s:.1f} s: "
        f"{KUEUE['usage_pct']} % usage needs a wall under {work_s / KUEUE['usage_pct'] * 100:.0f} s,"
        f" or GPUs held longer than jobs run; here held / ran = "
        f"{f['held_gpu_s'] / max(1e-9, f['work_gpu_s']):.2f}"
    )
    for cls in ("large", "medium", "small"):
        print(f"time to admission, {cls:6s} {a[cls]:7.1f} s  (Kueue {KUEUE[cls]:.0f} s)")
    print(
        f"cycles: {f['cycles']} (mean {f['cycle_mean_s']:.2f} s, max {f['cycle_max_s']:.2f} s); "
        f"{f['attempts']} attempts, {f['preemptions']} preempted; "
        f"submitters were {f['mean_submit_lag_s']:.1f} s behind schedule on average"
    )
    print(
        "time spent in cycle steps (s, all cycles): "
        + ", ".join(f"{k} {v}" for k, v in f["cycle_step_total_s"].items())
    )
    print(f"where the time went (s, each process on its own clock; wall {f['wall_s']:.1f} s):")
    w = f["worker"]
    backends = "all database backends" if real_agents else "its database backends >="
    print(
        f"  Celery worker, cycles:  {f['cycle_total_s']:8.1f}  "
        f"(CPU: worker {w['cpu_s']} s, {backends} {w['db_cpu_s']} s)"
    )
    for i, r in enumerate(f["submitters"]):
        print(
            f"  submitter {i}:           {r['submit_busy_s']:8.1f}  in submit_job "
            f"({1000 * r['submit_busy_s'] / max(1, r['submitted']):.1f} ms per job; CPU "
            f"{1000 * r['cpu_s'] / max(1, r['submitted']):.1f} ms + database "
            f"{1000 * r['db_cpu_s'] / max(1, r['submitted']):.1f} ms per job)"
        )
    for i, r in enumerate(f["agents"]):
        print(
            f"  agent stand-in {i}:      {r['poll_s'] + r['heartbeat_s']:8.1f}  "
            f"(poll {r['poll_s']}, {r['heartbeats']} heartbeats {r['heartbeat_s']}; "
            f"{r['started']} started, {r['finished']} ended, {r['stopped']} stopped, "
            f"{r['deadlocks']} heartbeats lost a deadlock; CPU {r['cpu_s']} s + database "
            f"{r['db_cpu_s']} s)"
        )
    print(json.dumps({"scale": scale, **f}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="fraction of the tenants (1.0 = 1,000)"
    )
    parser.add_argument("--max-wall-s", type=float, default=3600.0)
    parser.add_argument(
        "--submitters",
        type=int,
        default=4,
        help="submitter processes; each submit waits for its own durable commit, so several "
        "overlap those waits as independent tenants do",
    )
    parser.add_argument(
        "--profile-dir",
        default="",
        help="write a cProfile of each submitter and agent process here (<role>-<shard>.pstats)",
    )
    parser.add_argument(
        "--agents",
        choices=("stand-in", "real"),
        default="stand-in",
        help="stand-in: two processes heartbeat for all nodes through the production heartbeat "
        "function (scale 1 fits this machine); real: one `python -m agents` process per node "
        "(8 simulated GPUs, process runtime) behind gunicorn, with Celery beat, as deployed "
        "(about 50 MiB of memory per node: use a scale like 0.05)",
    )
    parser.add_argument("--port", type=int, default=18490, help="gunicorn's port (--agents real)")
    parser.add_argument(
        "--web-pool",
        type=int,
        default=16,
        help="database connections per gunicorn process, DB_POOL_MAX_SIZE (--agents real)",
    )
    parser.add_argument(
        "--log-dir",
        default=str(REPO / "benchmarks" / "out" / "kueue"),
        help="logs and agent state of a --agents real run",
    )
    parser.add_argument(
        "--role",
        choices=("main", "submit", "agent", "launch-agents"),
        default="main",
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--agents-spec", default="", help=argparse.SUPPRESS)
    parser.add_argument("--shard", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--shards", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--total", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--t0", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "launch-agents":
        role_launch_agents(args)
        return
    setup_django()
    main_role = orchestrate_real if args.agents == "real" else orchestrate
    run = {"main": main_role, "submit": role_submit, "agent": role_agent}[args.role]
    if args.profile_dir and args.role != "main":
        import cProfile

        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
        profile = cProfile.Profile()
        profile.runcall(run, args)
        profile.dump_stats(Path(args.profile_dir) / f"{args.role}-{args.shard}.pstats")
    else:
        run(args)


if __name__ == "__main__":
    main()
