"""The job contract's promises, checked against what really happened in a chaos run.

The witnesses are independent of the control plane's own bookkeeping where they can be: the
ledger (what each attempt's process wrote while it really ran, on which GPUs), the injection
log (what the harness broke, when, for how long) and the HTTP log (what clients were answered).
The API supplies what the control plane decided (states, attempts, losses, reasons).

Each promise is one violation count; the informative lines say how hard the run pushed and
what else looked wrong, without failing the run.
"""

from __future__ import annotations

import datetime as dt
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

TICK_S = 0.2
FINAL_STATES = ("SUCCEEDED", "FAILED", "CANCELLED")
# Faults after which the API itself may answer 5xx for a moment.
OUTAGE_KINDS = ("web_worker", "web_master", "postgres", "redis", "all")
# Faults that really make a node's agent silent: only these may justify declaring it lost.
NODE_FAULT_KINDS = ("agent_kill", "agent_stop", "all")

VIOLATIONS = (
    "jobs lost",
    "jobs run twice",
    "GPU overlaps",
    "healthy-node losses",
    "non-restartable jobs failed for a node loss that did not happen",
    "5xx outside outage windows",
)


@dataclass
class AttemptRun:
    """One attempt as its own process told it: when it ran, on which GPUs, how it ended."""

    attempt_id: int
    job_id: int
    gpus: tuple[str, ...]
    start: float
    last: float
    ends: list[float] = field(default_factory=list)
    terms: list[float] = field(default_factory=list)
    pids: set[int] = field(default_factory=set)


def read_ledger(ledger_dir: Path) -> dict[int, AttemptRun]:
    runs: dict[int, AttemptRun] = {}
    for path in sorted(Path(ledger_dir).glob("job-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            parts = line.split()
            if len(parts) < 6:
                continue
            try:
                at = float(parts[0])
                kv = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
                attempt_id, job_id = int(kv["attempt"]), int(kv["job"])
            except (ValueError, KeyError):
                continue
            run = runs.get(attempt_id)
            if run is None:
                gpus = tuple(g for g in kv.get("gpus", "").split(",") if g)
                run = runs[attempt_id] = AttemptRun(attempt_id, job_id, gpus, at, at)
            run.start = min(run.start, at)
            run.last = max(run.last, at)
            run.pids.add(int(kv.get("pid", "0")))
            if kv.get("event") == "end":
                run.ends.append(at)
            elif kv.get("event") == "term":
                run.terms.append(at)
    return runs


@dataclass
class Evidence:
    accepted: dict[int, dict]
    jobs: dict[int, dict]
    ledger: dict[int, AttemptRun]
    injections: list[dict]
    http: list[dict]
    exits: list[dict]
    refused: list[dict]
    abandoned: list[dict]
    leftover_job_pids: list[int]
    drained: bool
    loss_window_s: float
    recovery_allowance_s: float
    log_dir: Path | None = None
    # How many times each component was started after the first (by faults or the watchdog).
    restarts: dict[str, int] = field(default_factory=dict)
    # Filled by check(): jobs run again after a node whose agent really was silenced (killed,
    # or stopped past its lease) could not report that their first run had ended.
    reruns_after_real_silence: list[str] = field(default_factory=list)


@dataclass
class Report:
    violations: dict[str, list[str]]
    info: list[str]
    details: dict

    @property
    def failed(self) -> bool:
        return any(self.violations.values())

    def as_dict(self) -> dict:
        return {
            "violations": {k: {"count": len(v), "details": v} for k, v in self.violations.items()},
            "info": self.info,
            "details": self.details,
        }


def ts(value: str | None) -> float | None:
    """An API timestamp (ISO 8601) as Unix seconds."""
    if not value:
        return None
    return dt.datetime.fromisoformat(value).timestamp()


def clock(t: float | None) -> str:
    if t is None:
        return "never"
    return dt.datetime.fromtimestamp(t).strftime("%H:%M:%S.%f")[:-5]


def overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return min(a1, b1) - max(a0, b0)


def outage_windows(injections: list[dict], allowance_s: float) -> list[tuple[float, float, str]]:
    windows = []
    for inj in injections:
        if inj["kind"] in OUTAGE_KINDS:
            end = inj["end"] if inj["end"] is not None else float("inf")
            windows.append((inj["start"] - 0.5, end + allowance_s, f"#{inj['id']} {inj['kind']}"))
    return windows


def in_window(t0: float, t1: float, windows: list[tuple[float, float, str]]) -> bool:
    return any(overlap(t0, t1, w0, w1) >= 0 for w0, w1, _ in windows)


def node_faults(injections: list[dict], node: str, t0: float, t1: float) -> list[dict]:
    """Faults that silenced node's agent at some time within [t0, t1]."""
    found = []
    for inj in injections:
        if inj["kind"] in NODE_FAULT_KINDS and node in inj["targets"]:
            end = inj["end"] if inj["end"] is not None else float("inf")
            if overlap(inj["start"], end, t0, t1) >= 0:
                found.append(inj)
    return found


def describe(inj: dict) -> str:
    return f"#{inj['id']} {inj['kind']} {clock(inj['start'])}-{clock(inj['end'])}"


def loss_time(job: dict, attempt: dict) -> float | None:
    finished = ts(attempt.get("finished_at"))
    if finished is not None:
        return finished
    lost = [ts(e["at"]) for e in job["events"] if e["kind"] == "lost"]
    return lost[-1] if lost else None


def check(ev: Evidence) -> Report:
    v: dict[str, list[str]] = {name: [] for name in VIOLATIONS}
    runs_by_job: dict[int, list[AttemptRun]] = defaultdict(list)
    for run in ev.ledger.values():
        runs_by_job[run.job_id].append(run)
    attempts = {a["id"]: (job, a) for job in ev.jobs.values() for a in job["attempts"]}

    # Jobs lost: accepted (201) and then not found, or not final after the drain.
    for job_id, info in sorted(ev.accepted.items()):
        job = ev.jobs.get(job_id)
        if job is None:
            v["jobs lost"].append(f"job {job_id} ({info['name']}): accepted, then not found")
        elif job["state"] not in FINAL_STATES:
            v["jobs lost"].append(
                f"job {job_id} ({info['name']}): {job['state']} after the drain "
                f"({job['state_reason'] or job.get('pending_reason') or 'no reason'})"
            )

    # Jobs run twice: attempts of one job alive at the same time, or more than one `end`.
    for job_id, runs in sorted(runs_by_job.items()):
        runs.sort(key=lambda r: r.start)
        for i, a in enumerate(runs):
            if len(a.pids) > 1:
                v["jobs run twice"].append(
                    f"job {job_id}: attempt {a.attempt_id} ran as {len(a.pids)} processes"
                )
            for b in runs[i + 1 :]:
                ov = overlap(a.start, a.last, b.start, b.last)
                if ov > 0:
                    v["jobs run twice"].append(
                        f"job {job_id}: attempts {a.attempt_id} ({_where(attempts, a)}) and "
                        f"{b.attempt_id} ({_where(attempts, b)}) ran together for {ov:.1f} s "
                        f"from {clock(max(a.start, b.start))}"
                    )
        ends = sorted((t, r.attempt_id) for r in runs for t in r.ends)
        if len(ends) > 1:
            line = f"job {job_id}: completed {len(ends)} times: " + ", ".join(
                f"attempt {aid} at {clock(t)}{_why_rerun(ev, attempts, aid, t)}" for t, aid in ends
            )
            # A run that ended while its node's agent was silenced (killed, or stopped past its
            # lease) could not be reported before the node was declared lost: the control
            # plane had to requeue a restartable job, as any scheduler does for a node that
            # went away. Only a rerun the control plane could have known better is a violation.
            if all(_node_was_silenced(ev, attempts, aid, t) for t, aid in ends[:-1]):
                ev.reruns_after_real_silence.append(line)
            else:
                v["jobs run twice"].append(line)

    # GPU overlaps: two attempts' processes alive at once on one GPU.
    by_gpu: dict[str, list[AttemptRun]] = defaultdict(list)
    for run in ev.ledger.values():
        for gpu in run.gpus:
            by_gpu[gpu].append(run)
    for gpu, runs in sorted(by_gpu.items()):
        runs.sort(key=lambda r: r.start)
        for i, a in enumerate(runs):
            for b in runs[i + 1 :]:
                if b.start >= a.last:
                    break
                ov = overlap(a.start, a.last, b.start, b.last)
                if ov > 0:
                    v["GPU overlaps"].append(
                        f"{gpu} ({_node_of(attempts, a) or '?'}): attempt {a.attempt_id} "
                        f"(job {a.job_id}) and attempt {b.attempt_id} (job {b.job_id}) "
                        f"overlap {ov:.1f} s from {clock(b.start)} (tick {TICK_S} s)"
                    )

    # Healthy-node losses, and what the lost attempts' processes did after being declared lost.
    lost_rows = []
    for job in ev.jobs.values():
        for a in job["attempts"]:
            if a["state"] != "LOST":
                continue
            t = loss_time(job, a)
            node = a["node"]
            faults = node_faults(ev.injections, node, t - ev.loss_window_s, t) if t else []
            run = ev.ledger.get(a["id"])
            ran_on_s = (run.last - t) if (run and t) else None
            lost_rows.append((job, a, t, faults, run, ran_on_s))
            if t is not None and not faults:
                near = [
                    describe(i)
                    for i in ev.injections
                    if i["kind"] in OUTAGE_KINDS
                    and overlap(i["start"], i["end"] or float("inf"), t - ev.loss_window_s, t) >= 0
                ]
                v["healthy-node losses"].append(
                    f"attempt {a['id']} of job {job['id']} on {node} declared lost at {clock(t)}: "
                    f"no fault of {node}'s agent in the {ev.loss_window_s:.0f} s before"
                    + (f"; control-plane outages then: {', '.join(near)}" if near else "")
                    + (
                        f"; its process ran {ran_on_s:.1f} s past that"
                        if ran_on_s is not None and ran_on_s > TICK_S
                        else ""
                    )
                )

    # Non-restartable jobs failed for a node loss that did not happen.
    for job in ev.jobs.values():
        if job["state"] != "FAILED" or job["restartable"] or "lost" not in job["state_reason"]:
            continue
        lost = [row for row in lost_rows if row[0]["id"] == job["id"]]
        if not lost:
            continue
        _, a, t, faults, run, _ = lost[-1]
        why = []
        if run is not None and run.ends:
            why.append(f"its process finished by itself at {clock(run.ends[0])}")
        if not faults:
            why.append(f"{a['node']} was healthy")
        if why:
            v["non-restartable jobs failed for a node loss that did not happen"].append(
                f"job {job['id']} (attempt {a['id']} on {a['node']}, declared lost at "
                f"{clock(t)}): " + " and ".join(why)
            )

    # 5xx outside the windows when gunicorn, PostgreSQL or Redis were down (+ recovery).
    windows = outage_windows(ev.injections, ev.recovery_allowance_s)
    for e in ev.http:
        if e["status"] is not None and e["status"] >= 500:
            if not in_window(e["sent"], e["answered"], windows):
                v["5xx outside outage windows"].append(
                    f"{e['who']} {e['method']} {e['path']} -> {e['status']} at {clock(e['sent'])}"
                )

    info, details = _informative(ev, lost_rows, windows)
    return Report(v, info, details)


def _node_was_silenced(ev: Evidence, attempts: dict, attempt_id: int, ended: float) -> bool:
    return "agent was down" in _why_rerun(ev, attempts, attempt_id, ended)


def _why_rerun(ev: Evidence, attempts: dict, attempt_id: int, ended: float) -> str:
    """For an attempt that finished and was still declared lost: was its node's agent really
    silenced then (a fault the control plane could not see past), or was the node healthy?"""
    found = attempts.get(attempt_id)
    if not found:
        return ""
    job, attempt = found
    if attempt["state"] == "LOST":
        lost_at = loss_time(job, attempt)
    else:
        # A late exit report turns a lost attempt back into a finished one; the job's events
        # still say when it was declared lost (and requeued).
        since = ts(attempt.get("started_at")) or ts(attempt.get("created_at")) or 0.0
        lost = [ts(e["at"]) for e in job["events"] if e["kind"] == "lost" and ts(e["at"]) >= since]
        lost_at = lost[0] if lost else None
    if lost_at is None:
        return ""
    # Only a silence between the process's end and the loss kept its exit report from arriving.
    faults = node_faults(ev.injections, attempt["node"], ended, lost_at)
    if faults:
        return (
            f" (declared lost at {clock(lost_at)}; {attempt['node']}'s agent was down: "
            + ", ".join(describe(f) for f in faults)
            + ")"
        )
    return f" (declared lost at {clock(lost_at)} while {attempt['node']} was healthy)"


def _node_of(attempts: dict, run: AttemptRun) -> str | None:
    found = attempts.get(run.attempt_id)
    return found[1]["node"] if found else None


def _where(attempts: dict, run: AttemptRun) -> str:
    found = attempts.get(run.attempt_id)
    if not found:
        return "unknown to the API"
    return f"{found[1]['node']}, {found[1]['state']}"


def _informative(ev: Evidence, lost_rows: list, windows) -> tuple[list[str], dict]:
    info: list[str] = []
    kinds = Counter(i["kind"] for i in ev.injections)
    info.append(
        f"injections: {len(ev.injections)} ("
        + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
        + ")"
    )
    states = Counter(j["state"] for j in ev.jobs.values())
    requeued_jobs = [
        j for j in ev.jobs.values() if any(e["kind"] == "requeued" for e in j["events"])
    ]
    requeues = sum(1 for j in ev.jobs.values() for e in j["events"] if e["kind"] == "requeued")
    accepted_names = {i["name"] for i in ev.accepted.values()}
    extra = [j for j in ev.jobs.values() if j["id"] not in ev.accepted]
    duplicates = [j for j in extra if j["name"] in accepted_names]
    info.append(
        f"jobs: submitted {len(ev.accepted) + len(ev.refused) + len(ev.abandoned)}, accepted "
        f"{len(ev.accepted)}, refused {len(ev.refused)}, abandoned at the end "
        f"{len(ev.abandoned)}; succeeded {states['SUCCEEDED']}, failed {states['FAILED']}, "
        f"cancelled {states['CANCELLED']}, unfinished "
        f"{sum(n for s, n in states.items() if s not in FINAL_STATES)}; requeued "
        f"{len(requeued_jobs)} jobs ({requeues} times); drained: {'yes' if ev.drained else 'NO'}"
    )
    info.append(
        f"jobs created by a retried submit (no 201 for them): {len(extra)}, of which "
        f"{len(duplicates)} duplicate an accepted job"
    )
    all_attempts = [a for j in ev.jobs.values() for a in j["attempts"]]
    attempt_states = Counter(a["state"] for a in all_attempts)
    stop_reasons = Counter(a["stop_reason"] for a in all_attempts if a.get("stop_reason"))
    fence_events = sum(
        1
        for j in ev.jobs.values()
        for e in j["events"]
        if "fence" in e["kind"] or "fence" in e["message"].lower()
    )
    stopped_events = sum(
        1 for j in ev.jobs.values() for e in j["events"] if e["kind"] == "attempt_stopped"
    )
    info.append(
        f"attempts: {len(all_attempts)} ("
        + ", ".join(f"{s} {n}" for s, n in sorted(attempt_states.items()))
        + "); stop reasons: "
        + (", ".join(f"{s} {n}" for s, n in sorted(stop_reasons.items())) or "none")
        + f"; fenced (events naming fencing) {fence_events}, attempt_stopped events "
        f"{stopped_events}"
    )
    ran_on = [row for row in lost_rows if row[5] is not None and row[5] > TICK_S]
    info.append(
        f"attempts lost {len(lost_rows)}, of which {len(ran_on)} kept running after being "
        f"declared lost" + (f" (longest {max(r[5] for r in ran_on):.1f} s)" if ran_on else "")
    )
    # What the control plane says against what the processes wrote.
    disagreements = []
    for job in ev.jobs.values():
        runs = [ev.ledger[a["id"]] for a in job["attempts"] if a["id"] in ev.ledger]
        if job["state"] == "SUCCEEDED" and not any(r.ends for r in runs):
            disagreements.append(f"job {job['id']} SUCCEEDED but no attempt's process finished")
        wanted = ev.accepted.get(job["id"], {}).get("exit_code")
        if wanted is not None and job["state"] in ("SUCCEEDED", "FAILED"):
            if "lost" not in job["state_reason"] and job["exit_code"] not in (wanted, None):
                last = max(runs, key=lambda r: r.start) if runs else None
                how = ""
                if last is not None and last.terms:
                    node = next(
                        (a["node"] for a in job["attempts"] if a["id"] == last.attempt_id), "?"
                    )
                    how = f"; its process got SIGTERM at {clock(last.terms[0])} on {node}"
                disagreements.append(
                    f"job {job['id']} ({'restartable' if job['restartable'] else 'not restartable'}) "
                    f"{job['state']} with exit code {job['exit_code']} ({job['state_reason']}), "
                    f"its process exits {wanted} by itself{how}"
                )
    info.append(f"final state vs ledger disagreements: {len(disagreements)}")
    http = ev.http
    statuses = Counter("error" if e["status"] is None else f"{e['status'] // 100}xx" for e in http)
    info.append(
        f"HTTP (submitter, poller, collector): {len(http)} requests ("
        + ", ".join(f"{k} {n}" for k, n in sorted(statuses.items()))
        + ")"
    )
    access = _access_log_5xx(ev.log_dir, windows) if ev.log_dir else None
    if access is not None:
        info.append(
            f"gunicorn access log (all clients, agents too): {access['total']} requests, "
            f"{access['5xx']} 5xx, {len(access['outside'])} of them outside outage windows"
        )
    if ev.restarts:
        info.append("restarts: " + ", ".join(f"{name} {n}" for name, n in ev.restarts.items() if n))
    info.append(
        f"unexpected process exits (restarted by the harness): {len(ev.exits)}"
        + (
            " (" + ", ".join(f"{e['component']} rc={e['returncode']}" for e in ev.exits) + ")"
            if ev.exits
            else ""
        )
    )
    tracebacks = _tracebacks(ev.log_dir, windows) if ev.log_dir else {}
    for name, found in sorted(tracebacks.items()):
        outside = [t for t in found if not t["in_outage"]]
        kinds_out = Counter(t["exception"].split(":")[0] for t in outside)
        info.append(
            f"tracebacks in {name}: {len(found)}, {len(outside)} outside outage windows"
            + (
                " (" + ", ".join(f"{k} x{n}" for k, n in kinds_out.most_common(5)) + ")"
                if outside
                else ""
            )
        )
    info.append(f"job processes still running after the drain: {len(ev.leftover_job_pids)}")
    info.append(
        "jobs run again after their node was really silenced before it could report their end "
        f"(restartable, requeued as for any lost node): {len(ev.reruns_after_real_silence)}"
    )
    details = {
        "reruns_after_real_silence": ev.reruns_after_real_silence,
        "disagreements": disagreements,
        "duplicates": [(j["id"], j["name"], j["state"]) for j in extra],
        "refused": ev.refused,
        "abandoned": ev.abandoned,
        "kept_running_after_lost": [
            {"attempt": r[1]["id"], "job": r[0]["id"], "node": r[1]["node"], "ran_on_s": r[5]}
            for r in ran_on
        ],
        "access_log_5xx_outside": access["outside"][:200] if access else [],
        "tracebacks_outside_outages": {
            name: [t for t in found if not t["in_outage"]][:50]
            for name, found in tracebacks.items()
        },
        "leftover_job_pids": ev.leftover_job_pids,
        "exits": ev.exits,
    }
    return info, details


_ACCESS = re.compile(r"^\[(?P<t>[^\]]+)\] (?P<m>\S+) (?P<u>\S+) (?P<s>\d{3}) ")


def _access_log_5xx(log_dir: Path, windows) -> dict | None:
    path = log_dir / "web-access.log"
    if not path.exists():
        return None
    total, five, outside = 0, 0, []
    for line in path.read_text(errors="replace").splitlines():
        m = _ACCESS.match(line)
        if not m:
            continue
        total += 1
        if m["s"].startswith("5"):
            five += 1
            t = dt.datetime.strptime(m["t"], "%d/%b/%Y:%H:%M:%S %z").timestamp()
            # One-second resolution: the whole second counts.
            if not in_window(t, t + 1.0, windows):
                outside.append(line)
    return {"total": total, "5xx": five, "outside": outside}


DJANGO_LOGS = ("web", "worker", "beat")
_STAMP = re.compile(r"^\[?(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)[,.](\d{3})")


def _tracebacks(log_dir: Path, windows) -> dict[str, list[dict]]:
    """Python tracebacks in the control plane's and agents' logs, with the time and exception."""
    found: dict[str, list[dict]] = {}
    for path in sorted(log_dir.glob("*.log")):
        if path.name in ("web-access.log", "postgres.log", "migrate.log", "redis.log"):
            continue
        items: list[dict] = []
        last_t: float | None = None
        in_tb = False
        for line in path.read_text(errors="replace").splitlines():
            m = _STAMP.match(line)
            if m:
                last_t = time_of(m[1], m[2], utc=path.stem in DJANGO_LOGS)
            if line.startswith("Traceback (most recent call last)"):
                in_tb = True
                continue
            if in_tb and line and not line.startswith((" ", "\t")):
                if line.startswith(("During handling", "The above exception")):
                    continue
                t = last_t or 0.0
                items.append(
                    {
                        "at": clock(t),
                        "exception": line[:300],
                        "in_outage": in_window(t - 2.0, t + 2.0, windows),
                    }
                )
                in_tb = False
        if items:
            found[path.stem] = items
    return found


def time_of(stamp: str, millis: str, *, utc: bool) -> float:
    """A log line's time. Python's logging writes local time without a zone; Django processes
    run with TZ set to settings.TIME_ZONE (UTC), the agents with the machine's zone."""
    parsed = dt.datetime.strptime(stamp.replace("T", " "), "%Y-%m-%d %H:%M:%S")
    if utc:
        parsed = parsed.replace(tzinfo=dt.UTC)
    return parsed.timestamp() + int(millis) / 1000


def summarize(report: Report, run_dir: Path, phases: dict[str, float]) -> str:
    width = max(len(n) for n in VIOLATIONS) + 2
    lines = ["chaos run: invariants (violations)"]
    for name in VIOLATIONS:
        lines.append(f"  {name:<{width}} {len(report.violations[name])}")
    lines.append("informative")
    lines.extend(f"  {line}" for line in report.info)
    lines.append(
        "  time: "
        + ", ".join(
            f"{k} {v / 60:.1f} min" if v >= 60 else f"{k} {v:.0f} s" for k, v in phases.items()
        )
    )
    for name in VIOLATIONS:
        items = report.violations[name]
        if items:
            lines.append(f"violations: {name} ({len(items)})")
            lines.extend(f"  - {item}" for item in items[:200])
            if len(items) > 200:
                lines.append(f"  ... {len(items) - 200} more in report.json")
    refusals = Counter(
        f"{r['status']} {r['body'][:200]}" for r in report.details.get("refused") or []
    )
    if refusals:
        lines.append("submissions refused (not retried), by answer")
        lines.extend(f"  - {n} x {answer}" for answer, n in refusals.most_common(10))
    if report.details.get("reruns_after_real_silence"):
        lines.append("jobs run again after their node was really silenced (not violations)")
        lines.extend(f"  - {d}" for d in report.details["reruns_after_real_silence"][:50])
    if report.details.get("disagreements"):
        lines.append("final state vs ledger disagreements")
        lines.extend(f"  - {d}" for d in report.details["disagreements"][:50])
    for e in report.details.get("exits") or []:
        lines.append(
            f"unexpected exit: {e['component']} at {clock(e['at'])}, rc={e['returncode']}; "
            "its log ended with:"
        )
        lines.extend(f"    | {t}" for t in e["log_tail"].splitlines()[-8:])
    tracebacks = report.details.get("tracebacks_outside_outages") or {}
    for name, items in tracebacks.items():
        if items:
            lines.append(f"tracebacks in {name} outside outage windows (first 10)")
            lines.extend(f"  - {t['at']} {t['exception']}" for t in items[:10])
    lines.append(f"run folder: {run_dir}")
    lines.append("result: " + ("VIOLATIONS" if report.failed else "all invariants hold"))
    return "\n".join(lines)
