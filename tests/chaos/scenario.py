"""The chaos run itself: a stream of jobs, a stream of faults, a drain, then the evidence.

Three threads besides the harness's supervisor: a submitter keeps about 1.5x the cluster's GPUs
of jobs submitted and unfinished (through the REST API, retrying with the same Idempotency-Key
after a connection error or a 5xx), a poller watches which jobs finished (every 1.5 s, one list
request: the machine has 2 shared cores), and an injector breaks one thing every few seconds
(seeded). Every HTTP answer and every fault is recorded with its times, so that the invariant
checks (tests.chaos.invariants) can tell a product bug from the consequence of a fault.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import requests

from tests.chaos import invariants
from tests.chaos.harness import Agent, Deployment, Postgres, Proc, Timings

LEDGER_JOB = Path(__file__).resolve().with_name("ledger_job.py")
IMAGE = "localhost/busybox:latest"
FINAL_STATES = ("SUCCEEDED", "FAILED", "CANCELLED")
UNFINISHED_STATES = ("PENDING", "ADMITTED", "RUNNING", "PREEMPTED", "LOST")

# Every kind of fault, with how often it is drawn relative to the others and, for the faults
# that take something down, how long it stays down (seconds, uniform).
KIND_WEIGHTS = {
    "web_worker": 1.0,
    "web_master": 1.0,
    "worker_main": 1.0,
    "worker_child": 1.0,
    "beat": 1.0,
    "agent_kill": 1.5,
    "agent_stop": 1.5,
    "redis": 1.0,
    "postgres": 1.0,
    # "Rarely everything at once": and only from a whole deployment (see _applicable), which
    # long outages make rarer still.
    "all": 0.6,
}
DOWN_S = {
    "web_master": (1.0, 5.0),
    "worker_main": (1.0, 5.0),
    "beat": (1.0, 5.0),
    "agent_kill": (0.0, 20.0),
    "agent_stop": (2.0, 40.0),
    "redis": (1.0, 10.0),
    # Up to 40 s: some outages outlast the lost-node threshold (L + m), the case the node lease
    # must survive without declaring healthy nodes lost.
    "postgres": (2.0, 40.0),
    "all": (5.0, 15.0),
}


@dataclass
class Config:
    """One chaos run. The defaults are the CLI's; the pytest module shortens them."""

    minutes: float = 20.0
    seed: int = 1
    agents: int = 4
    gpus_per_agent: int = 2
    injections_every_s: tuple[float, float] = (5.0, 15.0)
    out: Path | None = None
    timings: Timings = field(default_factory=Timings)
    down_s: dict[str, tuple[float, float]] = field(default_factory=lambda: dict(DOWN_S))
    kinds: tuple[str, ...] = tuple(KIND_WEIGHTS)
    # Every kind once (in a seeded order) before the random draws, the first PostgreSQL outage
    # and agent stop at their longest: a short run covers every fault, and outages past L + m.
    each_kind_first: bool = False
    job_duration_s: tuple[float, float] = (3.0, 30.0)
    restartable_share: float = 0.7
    failing_share: float = 0.1
    backlog_factor: float = 1.5
    drain_timeout_s: float = 300.0
    # After a web, PostgreSQL or Redis outage ends, 5xx answers this long after are forgiven.
    recovery_allowance_s: float = 5.0
    poll_interval_s: float = 1.5
    # The code under test (None: this checkout).
    code_dir: Path | None = None
    # The web processes' connection pool (DB_POOL_MAX_SIZE; 0: none, docker-compose's default).
    web_pool: int = 0

    @property
    def total_gpus(self) -> int:
        return self.agents * self.gpus_per_agent


# --- records ------------------------------------------------------------------------------------


class HttpLog:
    """Every request the run made to the API: who, when sent, when answered, status or error."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.entries: list[dict] = []

    def add(self, who: str, method: str, path: str, sent: float, status: int | None, error: str):
        with self._lock:
            self.entries.append(
                {
                    "who": who,
                    "method": method,
                    "path": path,
                    "sent": sent,
                    "answered": time.time(),
                    "status": status,
                    "error": error,
                }
            )


@dataclass
class Injection:
    id: int
    kind: str
    start: float
    targets: list[str]
    detail: dict = field(default_factory=dict)
    end: float | None = None
    pending: set[str] = field(default_factory=set)

    def as_dict(self) -> dict:
        data = asdict(self)
        data.pop("pending")
        return data


class Tracker:
    """Which accepted jobs are known to have finished, for the submitter's backlog and the drain."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.accepted: dict[int, dict] = {}
        self.final: set[int] = set()
        self.refused: list[dict] = []
        self.abandoned: list[dict] = []
        self.last_unfinished: set[int] | None = None

    def accept(self, job_id: int, info: dict) -> None:
        with self._lock:
            self.accepted[job_id] = info

    def unfinished(self) -> int:
        with self._lock:
            return len(set(self.accepted) - self.final)

    def polled(self, sent: float, unfinished_ids: set[int]) -> None:
        """A list of unfinished jobs read at `sent`: accepted before it and absent are final."""
        with self._lock:
            self.last_unfinished = unfinished_ids
            for job_id, info in self.accepted.items():
                if info["accepted_at"] < sent and job_id not in unfinished_ids:
                    self.final.add(job_id)


# --- API client ---------------------------------------------------------------------------------


class Api:
    """The REST API as one researcher sees it, recording every answer in the HTTP log."""

    def __init__(self, url: str, token: str, http: HttpLog, who: str) -> None:
        self.base = f"{url}/api/v1"
        self.http = http
        self.who = who
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"
        self.session.headers["Accept"] = "application/json"

    def request(self, method: str, path: str, **kwargs) -> requests.Response | None:
        """One request; None on a connection error or timeout (recorded either way)."""
        sent = time.time()
        try:
            response = self.session.request(method, f"{self.base}{path}", timeout=15, **kwargs)
        except requests.RequestException as exc:
            self.http.add(self.who, method, path.split("?")[0], sent, None, type(exc).__name__)
            return None
        self.http.add(self.who, method, path.split("?")[0], sent, response.status_code, "")
        return response

    def get_json(self, path: str, tries: int = 20, **kwargs) -> dict | None:
        """GET with retries through outages; None for a 404 or when every try failed."""
        for attempt in range(tries):
            response = self.request("GET", path, **kwargs)
            if response is not None and response.status_code == 200:
                return response.json()
            if response is not None and response.status_code == 404:
                return None
            time.sleep(min(5.0, 0.5 * 2**attempt))
        return None


# --- the three threads --------------------------------------------------------------------------


class Submitter(threading.Thread):
    def __init__(self, cfg: Config, api: Api, tracker: Tracker, ledger_dir: Path) -> None:
        super().__init__(name="submitter", daemon=True)
        self.cfg = cfg
        self.api = api
        self.tracker = tracker
        self.ledger_dir = ledger_dir
        self.rng = random.Random(cfg.seed * 7919 + 1)
        self.stop = threading.Event()
        self.submitted = 0
        self.retries = 0

    def run(self) -> None:
        target = max(1, round(self.cfg.backlog_factor * self.cfg.total_gpus))
        seq = 0
        while not self.stop.is_set():
            if self.tracker.unfinished() >= target:
                self.stop.wait(1.0)
                continue
            seq += 1
            self.submit(seq)
            # A breath between submits: the burst at start must not starve the 2 cores.
            self.stop.wait(0.1)

    def submit(self, seq: int) -> None:
        """POST one job until a 201 or a 4xx, the same Idempotency-Key on every try."""
        duration = round(self.rng.uniform(*self.cfg.job_duration_s), 1)
        exit_code = (
            self.rng.choice([1, 2, 3, 42]) if self.rng.random() < self.cfg.failing_share else 0
        )
        restartable = self.rng.random() < self.cfg.restartable_share
        name = f"chaos-{seq:05d}"
        body = {
            "name": name,
            "image": IMAGE,
            "command": [
                sys.executable,
                "-I",
                str(LEDGER_JOB),
                str(self.ledger_dir),
                str(duration),
                str(exit_code),
            ],
            "gpus": 1,
            "cpus": 0.5,
            "memory_mib": 1024,
            "restartable": restartable,
            "max_runtime_s": 3600,
        }
        key = str(uuid.uuid4())
        tries = 0
        self.submitted += 1
        while True:
            tries += 1
            response = self.api.request(
                "POST", "/jobs/", json=body, headers={"Idempotency-Key": key}
            )
            if response is not None and response.status_code == 201:
                self.tracker.accept(
                    response.json()["id"],
                    {
                        "name": name,
                        "key": key,
                        "accepted_at": time.time(),
                        "tries": tries,
                        "duration_s": duration,
                        "exit_code": exit_code,
                        "restartable": restartable,
                    },
                )
                return
            if response is not None and response.status_code < 500 and response.status_code != 429:
                self.tracker.refused.append(
                    {
                        "name": name,
                        "at": time.time(),
                        "status": response.status_code,
                        "body": response.text[:500],
                    }
                )
                # Refused for the state of the cluster (e.g. no node ready): do not hammer it.
                self.stop.wait(2.0)
                return
            if self.stop.is_set():
                self.tracker.abandoned.append({"name": name, "key": key, "tries": tries})
                return
            self.retries += 1
            self.stop.wait(min(5.0, 0.5 * tries))


class Poller(threading.Thread):
    def __init__(self, cfg: Config, api: Api, tracker: Tracker) -> None:
        super().__init__(name="poller", daemon=True)
        self.cfg = cfg
        self.api = api
        self.tracker = tracker
        self.stop = threading.Event()

    def run(self) -> None:
        params = [("state", s) for s in UNFINISHED_STATES] + [("limit", "1000")]
        while not self.stop.is_set():
            sent = time.time()
            response = self.api.request("GET", "/jobs/", params=params)
            if response is not None and response.status_code == 200:
                self.tracker.polled(sent, {j["id"] for j in response.json()["results"]})
            self.stop.wait(self.cfg.poll_interval_s)


class Injector(threading.Thread):
    """One fault every few seconds, drawn with a seeded generator; each one logged."""

    def __init__(self, cfg: Config, d: Deployment) -> None:
        super().__init__(name="injector", daemon=True)
        self.cfg = cfg
        self.d = d
        self.rng = random.Random(cfg.seed)
        self.stop = threading.Event()
        self.injections: list[Injection] = []
        self._lock = threading.Lock()
        for component in d.components.values():
            component.up_callbacks.append(self._came_up)

    def _came_up(self, name: str) -> None:
        """A component is back: faults that were waiting for it end now."""
        now = time.time()
        with self._lock:
            for injection in self.injections:
                if name in injection.pending and name not in self._holding(injection):
                    injection.pending.discard(name)
                    if not injection.pending and injection.end is None:
                        injection.end = now

    def _holding(self, injection: Injection) -> set[str]:
        holder = f"inj-{injection.id}"
        return {c.name for c in self.d.components.values() if holder in c.holders}

    def run(self) -> None:
        first = list(self.cfg.kinds) if self.cfg.each_kind_first else []
        self.rng.shuffle(first)
        while not self.stop.wait(self.rng.uniform(*self.cfg.injections_every_s)):
            kind = None
            longest = False
            for candidate in first:
                if self._applicable(candidate):
                    kind, longest = candidate, True
                    first.remove(candidate)
                    break
            if kind is None:
                options = [k for k in self.cfg.kinds if self._applicable(k)]
                if not options:
                    continue
                kind = self.rng.choices(options, [KIND_WEIGHTS[k] for k in options])[0]
            try:
                self.inject(kind, longest=longest)
            except Exception as exc:  # a fault that could not be injected must not end the run
                self._new(kind, [], {"error": repr(exc)}).end = time.time()

    def _free(self, name: str) -> bool:
        component = self.d.components[name]
        return not component.holders and component.alive()

    def _free_agents(self) -> list[Agent]:
        return [a for a in self.d.agents if self._free(a.name)]

    def _applicable(self, kind: str) -> bool:
        if kind == "all":
            # Only from a whole deployment: stacked on other faults it would keep everything
            # down for as long as faults keep coming, which is no longer "at once".
            return not any(c.holders for c in self.d.components.values())
        if kind in ("agent_kill", "agent_stop"):
            return bool(self._free_agents())
        name = {
            "web_worker": "web",
            "web_master": "web",
            "worker_main": "worker",
            "worker_child": "worker",
        }.get(kind, kind)
        return self._free(name)

    def _new(self, kind: str, targets: list[str], detail: dict) -> Injection:
        with self._lock:
            injection = Injection(len(self.injections) + 1, kind, time.time(), targets, detail)
            injection.pending = set(targets)
            self.injections.append(injection)
        return injection

    def _down_s(self, kind: str, longest: bool = False) -> float:
        low, high = self.cfg.down_s[kind]
        if longest and kind in ("postgres", "agent_stop"):
            return high
        return round(self.rng.uniform(low, high), 1)

    def inject(self, kind: str, *, longest: bool = False) -> None:
        """Break one thing now; what takes something down schedules its restoration."""
        d, rng = self.d, self.rng
        if kind in ("web_worker", "worker_child"):
            name = "web" if kind == "web_worker" else "worker"
            pid = d.kill_child(name, rng)
            injection = self._new(kind, [], {"pid": pid, "component": name})
            injection.end = injection.start
            return
        if kind == "agent_stop":
            agent = rng.choice(self._free_agents())
            down = self._down_s(kind, longest)
            injection = self._new(kind, [agent.name], {"down_s": down, "pid": agent.pid})
            agent.pause(f"inj-{injection.id}")
            d.later(down, lambda: agent.release(f"inj-{injection.id}"))
            return
        if kind == "all":
            targets = list(d.components)
        elif kind == "agent_kill":
            targets = [rng.choice(self._free_agents()).name]
        else:
            targets = [{"web_master": "web", "worker_main": "worker"}.get(kind, kind)]
        down = self._down_s(kind, longest)
        detail: dict = {"down_s": down}
        injection = self._new(kind, targets, detail)
        holder = f"inj-{injection.id}"
        if "postgres" in targets:
            # Both ways PostgreSQL dies abruptly: an immediate shutdown, or its host gone.
            detail["postgres_mode"] = (
                "kill9" if kind == "all" else rng.choice(["immediate", "kill9"])
            )
        for name in targets:
            component = d.components[name]
            if isinstance(component, Proc):
                detail.setdefault("pids", {})[name] = component.pid
            if isinstance(component, Postgres):
                component.hold(holder, mode=detail["postgres_mode"])
            else:
                component.hold(holder)

        def restore() -> None:
            # Dependencies first, as compose's depends_on would order them.
            for name in targets:
                d.components[name].release(holder)

        d.later(down, restore)


# --- the run ------------------------------------------------------------------------------------


@dataclass
class RunResult:
    report: invariants.Report
    run_dir: Path
    summary: str
    wall_s: float
    injections: list[dict]


def provision_tenant(d: Deployment, gpus: int) -> str:
    """A tenant guaranteed every GPU, a member of it, and her API token (ORM, private DB)."""
    out = d.manage_shell(
        "import json\n"
        "from django.contrib.auth import get_user_model\n"
        "from controlplane.tenancy.models import ApiToken, Membership, Quota, Tenant\n"
        "tenant = Tenant.objects.create(slug='chaos', name='Chaos lab')\n"
        f"Quota.objects.create(tenant=tenant, gpu_type='', guaranteed_gpus={gpus},"
        f" limit_gpus={gpus})\n"
        f"Quota.objects.create(tenant=tenant, gpu_type='H100-SXM-80GB', guaranteed_gpus={gpus},"
        f" limit_gpus={gpus})\n"
        "user = get_user_model().objects.create_user('chaos-researcher', password=None)\n"
        "Membership.objects.create(user=user, tenant=tenant, role='member')\n"
        "print(json.dumps({'token': ApiToken.issue(user, 'chaos run')[1]}))\n"
    )
    return json.loads(out.strip().splitlines()[-1])["token"]


def run(cfg: Config, log=print) -> RunResult:
    """Start the deployment, run the storm, drain, collect the evidence, tear down, check."""
    started = time.monotonic()
    run_dir = Path(cfg.out) if cfg.out else Path(tempfile.mkdtemp(prefix="gpucp-chaos-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    ledger_dir = run_dir / "ledger"
    ledger_dir.mkdir(exist_ok=True)
    d = Deployment(
        run_dir,
        agents_count=cfg.agents,
        gpus_per_agent=cfg.gpus_per_agent,
        timings=cfg.timings,
        web_db_pool_max_size=cfg.web_pool,
        **({"code_dir": cfg.code_dir} if cfg.code_dir else {}),
    )
    log(f"chaos: run folder {run_dir}")
    http = HttpLog()
    tracker = Tracker()
    injector: Injector | None = None
    phases: dict[str, float] = {}
    try:
        d.start()
        phases["up"] = time.monotonic() - started
        log(f"chaos: deployment up in {phases['up']:.0f} s at {d.url} (marker {d.run_id})")
        token = provision_tenant(d, cfg.total_gpus)
        submitter = Submitter(cfg, Api(d.url, token, http, "submitter"), tracker, ledger_dir)
        poller = Poller(cfg, Api(d.url, token, http, "poller"), tracker)
        injector = Injector(cfg, d)
        storm_start = time.time()
        for thread in (submitter, poller, injector):
            thread.start()
        deadline = time.monotonic() + cfg.minutes * 60
        reported_exits = 0
        while time.monotonic() < deadline:
            time.sleep(min(30.0, max(0.1, deadline - time.monotonic())))
            log(
                f"chaos: {time.time() - storm_start:5.0f} s: {len(tracker.accepted)} accepted, "
                f"{tracker.unfinished()} unfinished, {len(injector.injections)} faults, "
                f"{len(d.exits)} unexpected exits"
            )
            for e in d.exits[reported_exits:]:
                log(f"chaos: {e.component} exited by itself (rc={e.returncode}); restarted")
            reported_exits = len(d.exits)
        injector.stop.set()
        submitter.stop.set()
        injector.join(timeout=60)
        submitter.join(timeout=60)
        phases["storm"] = time.monotonic() - started - phases["up"]
        drained = drain(cfg, d, tracker, log)
        phases["drain"] = time.monotonic() - started - phases["up"] - phases["storm"]
        poller.stop.set()
        poller.join(timeout=10)
        leftovers = wait_for_job_processes(d, 60.0)
        jobs = collect_jobs(Api(d.url, token, http, "collector"), set(tracker.accepted))
    finally:
        d.stop_supervision()
        d.teardown()
        # Written however the run ended, so an interrupted one still shows what happened.
        faults = [i.as_dict() for i in (injector.injections if injector else [])]
        (run_dir / "injections.json").write_text(json.dumps(faults, indent=1) + "\n")
        (run_dir / "exits.json").write_text(
            json.dumps([asdict(e) for e in d.exits], indent=1) + "\n"
        )
    evidence = invariants.Evidence(
        accepted=tracker.accepted,
        jobs=jobs,
        ledger=invariants.read_ledger(ledger_dir),
        injections=[i.as_dict() for i in (injector.injections if injector else [])],
        http=http.entries,
        exits=[asdict(e) for e in d.exits],
        refused=tracker.refused,
        abandoned=tracker.abandoned,
        leftover_job_pids=leftovers,
        drained=drained,
        loss_window_s=cfg.timings.loss_window_s,
        recovery_allowance_s=cfg.recovery_allowance_s,
        log_dir=d.log_dir,
        restarts={name: c.starts - 1 for name, c in d.components.items()},
    )
    report = invariants.check(evidence)
    wall_s = time.monotonic() - started
    phases["total"] = wall_s
    summary = invariants.summarize(report, run_dir, phases)
    (run_dir / "summary.txt").write_text(summary + "\n")
    (run_dir / "report.json").write_text(
        json.dumps(
            {
                "config": {k: v for k, v in asdict(cfg).items() if k != "out"},
                "phases_s": phases,
                **report.as_dict(),
                "injections": evidence.injections,
                "exits": evidence.exits,
                "accepted": {str(k): v for k, v in tracker.accepted.items()},
            },
            indent=1,
            default=str,
        )
        + "\n"
    )
    (run_dir / "jobs.json").write_text(json.dumps(jobs, indent=1) + "\n")
    (run_dir / "http.jsonl").write_text("".join(json.dumps(e) + "\n" for e in http.entries))
    return RunResult(report, run_dir, summary, wall_s, evidence.injections)


def drain(cfg: Config, d: Deployment, tracker: Tracker, log) -> bool:
    """Wait (bounded) until every job of the tenant is final; pending restarts still happen."""
    deadline = time.monotonic() + cfg.drain_timeout_s
    log(
        f"chaos: draining {tracker.unfinished()} unfinished jobs (at most {cfg.drain_timeout_s:.0f} s)"
    )
    while time.monotonic() < deadline:
        last = tracker.last_unfinished
        if tracker.unfinished() == 0 and last is not None and not last:
            return True
        time.sleep(2.0)
    log(f"chaos: drain timed out with {tracker.unfinished()} accepted jobs unfinished")
    return False


def wait_for_job_processes(d: Deployment, timeout_s: float) -> list[int]:
    """Jobs the control plane calls final may still run (a fenced attempt, a lost node's job)."""
    deadline = time.monotonic() + timeout_s
    while True:
        pids = d.job_processes()
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(2.0)


def collect_jobs(api: Api, accepted: set[int]) -> dict[int, dict]:
    """Every job of the tenant (and every accepted one, listed or not), in detail."""
    ids: list[int] = []
    offset = 0
    while True:
        page = api.get_json("/jobs/", params={"limit": 500, "offset": offset, "ordering": "id"})
        if page is None:
            break
        ids.extend(j["id"] for j in page["results"])
        if not page.get("next"):
            break
        offset += 500
    jobs = {}
    for job_id in sorted(set(ids) | accepted):
        detail = api.get_json(f"/jobs/{job_id}/")
        if detail is not None:
            jobs[job_id] = detail
    return jobs
