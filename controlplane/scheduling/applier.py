"""Write a scheduler.model.Plan to the database, in one transaction, without trusting it blindly.

The plan was computed from a snapshot that is already a little old. Every write is
conditional, so whatever changed meanwhile wins: a job cancelled since the snapshot is not
started, an attempt that ended is not stopped, a GPU somebody holds is not given out twice (the
partial unique index on active allocations refuses it). Each refused row is logged and
counted, never silently dropped. State changes go through controlplane.jobs.actions; the
pending reasons, positions, estimates and power caps written here are not state.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from django.db import connection, transaction
from django.db.models import Q, Sum, TextField
from django.db.models.functions import Coalesce

from agents import logcontext
from controlplane import bulk, wakeups
from controlplane.cluster.models import GPU, Node
from controlplane.jobs import actions
from controlplane.jobs.models import ACTIVE_ATTEMPT_STATES, Job, JobAttempt, JobState
from controlplane.jobs.transitions import PENDING_ONLY_FIELDS
from controlplane.scheduling.loader import (
    LoadedSnapshot,
    PendingRow,
    from_unix_s,
    note_pending_written,
)
from controlplane.scheduling.rows import row_version_sql
from controlplane.tenancy.models import Tenant
from scheduler import model as m

log = logging.getLogger(__name__)

# Stays well below PostgreSQL's 65,535 bind parameters per statement.
CHUNK = 5000
# What the cycle writes on a waiting job: what it shows only while it waits, and its prediction.
PENDING_FIELDS = [*PENDING_ONLY_FIELDS, "predicted_duration_s"]
# Positions and start estimates move a little every cycle for nearly every waiting job, and
# rewriting 10,000 rows each cycle for that costs more than the rest of the cycle. Near the head
# of the queue, where people watch, a position is kept exact; further back it is rewritten when
# it is off by more than a few percent, as is an estimated start relative to the wait left.
EXACT_POSITIONS = 20
POSITION_TOLERANCE = 0.05
ESTIMATE_TOLERANCE = 0.05
ESTIMATE_TOLERANCE_S = 1.0
# Even within those tolerances, a flood of short jobs moves the head by dozens each cycle (by
# 17 a cycle, every row up to position 340 is more than 5 % off), and cycles come several times
# a second: rewriting those rows cost PostgreSQL more than the rest of the cycle. So beyond
# EXACT_POSITIONS a position or estimate that only drifted (its reason unchanged) is refreshed
# at most once every DEEP_REFRESH_S: a job a thousand places back shows where it was up to ten
# seconds ago, one near the head where it is now.
DEEP_REFRESH_S = 10.0
POWER_TOLERANCE_W = 0.5


@dataclass(frozen=True, slots=True)
class Skipped:
    kind: str  # "start" or "preemption"
    id: int  # job id for a start, attempt id for a preemption
    why: str


@dataclass
class ApplyResult:
    started: list[int] = field(default_factory=list)  # job ids
    preempted: list[int] = field(default_factory=list)  # attempt ids
    pending_rows_written: int = 0
    power_caps_written: int = 0
    skipped: list[Skipped] = field(default_factory=list)
    nodes_changed: set[str] = field(default_factory=set)

    @property
    def skipped_rows(self) -> int:
        return len(self.skipped)


def apply_plan(plan: m.Plan, loaded: LoadedSnapshot) -> ApplyResult:
    """Apply the plan atomically; once committed, signal every node whose desired state changed."""
    result = ApplyResult()
    with transaction.atomic():
        _apply_preemptions(plan.preemptions, loaded, result)
        _apply_starts(plan.starts, loaded, result)
        _write_pending(plan, loaded, result)
        _write_power_caps(plan.power_caps_w or _uncapped(loaded), loaded, result)
        changed = sorted(result.nodes_changed)
        if changed:
            transaction.on_commit(lambda: wakeups.notify_nodes(changed))
    return result


def _chunks(items: Sequence, size: int = CHUNK) -> Iterator[Sequence]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _skip(result: ApplyResult, kind: str, pk: int, why: str) -> None:
    with logcontext.bound(**({"job_id": pk} if kind == "start" else {"attempt_id": pk})):
        log.info("scheduling plan: skipped %s %s: %s", kind, pk, why)
    result.skipped.append(Skipped(kind=kind, id=pk, why=why))


def _apply_preemptions(
    preemptions: Iterable[m.Preemption], loaded: LoadedSnapshot, result: ApplyResult
) -> None:
    preemptions = list(preemptions)
    if not preemptions:
        return
    ids = [p.attempt_id for p in preemptions]
    attempts = {}
    for chunk in _chunks(ids):
        attempts.update(JobAttempt.objects.select_related("node").in_bulk(chunk))
    live = []
    for p in preemptions:
        attempt = attempts.get(p.attempt_id)
        if attempt is None or attempt.state not in ACTIVE_ATTEMPT_STATES:
            _skip(result, "preemption", p.attempt_id, "the attempt has ended since the snapshot")
            continue
        live.append((p, attempt))
    # One batch for the whole plan, guarded per attempt as request_stop is.
    asked = actions.request_stops([(attempt, p.reason) for p, attempt in live], reason="preempted")
    stopped: list[tuple[m.Preemption, str]] = []
    for p, attempt in live:
        if p.attempt_id not in asked:
            _skip(result, "preemption", p.attempt_id, "the attempt was already told to stop")
            continue
        asked.discard(p.attempt_id)  # a plan naming an attempt twice stops it once
        result.preempted.append(p.attempt_id)
        stopped.append((p, attempt.node.name))
        # A gang spans nodes: every node holding one of its GPUs must kill its part.
        result.nodes_changed.add(attempt.node.name)
        result.nodes_changed.update(
            loaded.gpu_node[u]
            for u in loaded.running_gpus.get(p.attempt_id, ())
            if u in loaded.gpu_node
        )
    if stopped and log.isEnabledFor(logging.INFO):
        transaction.on_commit(lambda: _log_preemptions(stopped, loaded))


def _log_preemptions(stopped: list[tuple[m.Preemption, str]], loaded: LoadedSnapshot) -> None:
    """A line per preempted attempt, with its ids (agents.logcontext); after the commit, so
    that it reports only what the database kept."""
    tenants = {r.attempt_id: r.tenant for r in loaded.snapshot.running}
    for p, node in stopped:
        with logcontext.bound(
            job_id=p.job_id, attempt_id=p.attempt_id, node=node, tenant=tenants.get(p.attempt_id)
        ):
            log.info("preempted (for job %s): %s", p.for_job_id, p.reason)


def _apply_starts(starts: Iterable[m.Start], loaded: LoadedSnapshot, result: ApplyResult) -> None:
    starts = list(starts)
    if not starts:
        return
    # Only the columns the checks and the admission read: a cold start admits thousands of jobs,
    # and whole rows (commands, environments) cost more to turn into objects than to fetch.
    jobs: dict[int, Job] = {}
    for chunk in _chunks([s.job_id for s in starts]):
        jobs.update(
            Job.objects.only(
                "id", "state", "attempt_count", "tenant_id", "checkpoint_volume_id"
            ).in_bulk(chunk)
        )
    node_names = sorted({name for s in starts for name, _ in s.placements})
    nodes: dict[str, Node] = {}
    for chunk in _chunks(node_names):
        nodes.update(Node.objects.in_bulk(chunk, field_name="name"))
    # The GPUs of the nodes the starts land on, by node id: a few hundred integers to match
    # instead of one text parameter per GPU. A GPU that left its node is then not found.
    wanted = {u for s in starts for u in s.gpu_uuids}
    gpus: dict[str, GPU] = {}
    for chunk in _chunks(sorted(node.pk for node in nodes.values())):
        for g in GPU.objects.filter(node_id__in=chunk).only("id", "uuid", "node_id"):
            if g.uuid in wanted:
                gpus[g.uuid] = g

    admissions: list[actions.Admission] = []
    planned: dict[int, m.Start] = {}
    for start in starts:
        why = _why_not_startable(start, jobs.get(start.job_id), loaded.pending_rows, nodes, gpus)
        if why:
            _skip(result, "start", start.job_id, why)
            continue
        where = ", ".join(f"{name} ({len(uuids)})" for name, uuids in start.placements)
        admissions.append(
            actions.Admission(
                job=jobs[start.job_id],
                node=nodes[start.node],
                gpus=[gpus[u] for u in start.gpu_uuids],
                borrowed=start.borrowed,
                reason=f"Admitted to {where}" + (" on borrowed GPUs" if start.borrowed else ""),
            )
        )
        planned[start.job_id] = start
    # One batch for the whole plan: per job it is guarded as admit_job is (a job that changed
    # is left alone, a GPU already held refuses that job only), at a few statements in all.
    outcome = actions.admit_jobs(admissions)
    admitted: list[JobAttempt] = []
    for job_id, start in planned.items():
        attempt = outcome.get(job_id, actions.JOB_CHANGED)
        if isinstance(attempt, str):
            _skip(result, "start", job_id, attempt)
            continue
        admitted.append(attempt)
        result.started.append(job_id)
        result.nodes_changed.update(name for name, _ in start.placements)
    if admitted and log.isEnabledFor(logging.INFO):
        transaction.on_commit(lambda: _log_admissions(admitted, planned, loaded))
    _limit_checkpoints(admitted, jobs)


def _log_admissions(
    admitted: list[JobAttempt], planned: dict[int, m.Start], loaded: LoadedSnapshot
) -> None:
    """A line per admitted job, with its ids (agents.logcontext): where a job went, and when,
    is what an operator looks up first. After the commit: only what the database kept, and
    outside the cycle's lock (a cold start admits thousands, at tens of microseconds a line)."""
    tenants = {p.job_id: p.tenant for p in loaded.snapshot.pending}
    for attempt in admitted:
        start = planned[attempt.job_id]
        with logcontext.bound(
            job_id=attempt.job_id,
            attempt_id=attempt.pk,
            node=start.node,
            tenant=tenants.get(attempt.job_id),
        ):
            log.info(
                "admitted to %s%s",
                ", ".join(f"{name} ({len(uuids)} GPUs)" for name, uuids in start.placements),
                " on borrowed GPUs" if start.borrowed else "",
            )


def _limit_checkpoints(admitted: list[JobAttempt], jobs: dict[int, Job]) -> None:
    """New attempts of a tenant at or past its checkpoint storage limit get their checkpoint
    directory read-only (nothing is deleted: the tenant frees space, or an admin raises the
    limit). One query, and only when a started job has a checkpoint directory."""
    with_checkpoints = [a for a in admitted if jobs[a.job_id].checkpoint_volume_id is not None]
    if not with_checkpoints:
        return
    over = checkpoint_usage_over_limit({jobs[a.job_id].tenant_id for a in with_checkpoints})
    limited = []
    for attempt in with_checkpoints:
        usage = over.get(jobs[attempt.job_id].tenant_id)
        if usage is not None:
            used, limit = usage
            limited.append(
                (
                    attempt,
                    f"Tenant over its checkpoint storage limit: {_size(used)} of {_size(limit)} "
                    "used; this attempt's checkpoint directory is read-only",
                )
            )
    if limited:
        actions.make_checkpoints_read_only(limited)


def checkpoint_usage_over_limit(tenant_ids: Iterable[int]) -> dict[int, tuple[int, int]]:
    """Of these tenants, those whose checkpoint directories (not yet deleted) hold at least
    their limit: tenant id -> (bytes used, limit in bytes)."""
    rows = (
        Tenant.objects.filter(pk__in=list(tenant_ids), checkpoint_limit_bytes__isnull=False)
        .annotate(
            used=Coalesce(
                Sum(
                    "jobs__checkpoint_bytes",
                    filter=Q(
                        jobs__checkpoint_volume__isnull=False,
                        jobs__checkpoint_deleted_at__isnull=True,
                    ),
                ),
                0,
            )
        )
        .values_list("pk", "used", "checkpoint_limit_bytes")
    )
    return {pk: (used, limit) for pk, used, limit in rows if limit is not None and used >= limit}


def _size(n_bytes: int) -> str:
    """Bytes for a person: 1.5 GiB."""
    size = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            return f"{n_bytes} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} PiB"


def _why_not_startable(
    start: m.Start,
    job: Job | None,
    pending_rows: dict[int, PendingRow],
    nodes: dict[str, Node],
    gpus: dict[str, GPU],
) -> str:
    if job is None:
        return "the job no longer exists"
    row = pending_rows.get(start.job_id)
    if job.state != JobState.PENDING:
        return f"the job is {job.state} now"
    if row is None or job.attempt_count != row.attempt_count:
        return "the job changed since the snapshot"
    if not start.gpu_uuids:
        return "the plan gave it no GPUs"
    for name, uuids in start.placements:
        node = nodes.get(name)
        if node is None:
            return f"node {name} no longer exists"
        if not node.schedulable:
            return f"node {name} stopped taking new work"
        for uuid in uuids:
            gpu = gpus.get(uuid)
            if gpu is None or gpu.node_id != node.pk:
                return f"GPU {uuid} is not on node {name}"
    return ""


def _same(a: float | None, b: float | None, tolerance: float) -> bool:
    if a is None or b is None:
        return a is b
    return a == b or abs(a - b) <= tolerance


def _close_position(stored: int | None, planned: int) -> bool:
    if stored is None or min(stored, planned) <= EXACT_POSITIONS:
        return stored == planned
    return abs(stored - planned) <= POSITION_TOLERANCE * planned


def _close_estimate(stored_s: float | None, planned_s: float | None, now_s: float) -> bool:
    if stored_s is None or planned_s is None:
        return stored_s is planned_s
    wait_s = max(0.0, planned_s - now_s)
    return abs(stored_s - planned_s) <= max(ESTIMATE_TOLERANCE_S, ESTIMATE_TOLERANCE * wait_s)


# When this process last refreshed the drifted rows deep in the queue (snapshot time, s).
_deep_refreshed_at_s = [-math.inf]


def _close_prediction(stored_s: float | None, predicted_s: float | None) -> bool:
    # Every job that ends adds to the history, which moves every waiting job's prediction a
    # little; shown rounded, a change of a few percent is not worth a write.
    if stored_s is None or predicted_s is None or math.isinf(stored_s) or math.isinf(predicted_s):
        return stored_s == predicted_s
    return abs(stored_s - predicted_s) <= max(
        ESTIMATE_TOLERANCE_S, ESTIMATE_TOLERANCE * predicted_s
    )


def _write_pending(plan: m.Plan, loaded: LoadedSnapshot, result: ApplyResult) -> None:
    """Store each waiting job's reason, position and estimates; only the rows that changed."""
    changed: list[tuple] = []
    now_s = loaded.snapshot.now_s
    # A clock that went back counts as due: better one refresh too many than none for long.
    deep_due = not 0 <= now_s - _deep_refreshed_at_s[0] < DEEP_REFRESH_S
    for decision in plan.pending:
        row = loaded.pending_rows.get(decision.job_id)
        if row is None:
            continue
        predicted_s = plan.predicted_duration_s.get(decision.job_id, row.predicted_duration_s)
        estimate_s = (
            round(decision.estimated_start_s) if decision.estimated_start_s is not None else None
        )
        if row.reason_code == decision.reason_code and row.reason == decision.reason:
            if (
                _close_position(row.queue_position, decision.queue_position)
                and _close_estimate(row.estimated_start_s, estimate_s, now_s)
                and _close_prediction(row.predicted_duration_s, predicted_s)
            ):
                continue
            deep = row.queue_position is not None and (
                min(row.queue_position, decision.queue_position) > EXACT_POSITIONS
            )
            if deep and not deep_due:
                continue
        changed.append(
            (
                decision.job_id,
                str(decision.reason_code),
                decision.reason,
                decision.queue_position,
                from_unix_s(estimate_s),
                predicted_s,
            )
        )
    if deep_due:
        _deep_refreshed_at_s[0] = now_s
    # A job that left the queue since the snapshot (cancelled) keeps what its transition wrote.
    if loaded.pending_versions:
        result.pending_rows_written += _write_versioned(changed, loaded)
    else:
        result.pending_rows_written += _update_jobs(changed, PENDING_FIELDS, JobState.PENDING)
    started = set(result.started)
    rows = loaded.pending_rows
    # Most jobs had their prediction stored while they waited; only a new one is written.
    admitted = [
        (job_id, predicted_s)
        for job_id, predicted_s in plan.predicted_duration_s.items()
        if job_id in started
        and not (job_id in rows and _same(rows[job_id].predicted_duration_s, predicted_s, 1e-6))
    ]
    # What the backfill of later cycles counts on for the end of a running job.
    result.pending_rows_written += _update_jobs(
        admitted, ["predicted_duration_s"], JobState.ADMITTED
    )


def _write_versioned(changed: list[tuple], loaded: LoadedSnapshot) -> int:
    """_update_jobs for the waiting jobs' rows on PostgreSQL, each written only over the version
    the snapshot read, returning the version it makes: once committed, the loader keeps these
    rows as written (loader.note_pending_written) instead of reading them again next cycle.

    A row changed since it was read (a new priority, a hold, a cancel) is left alone: what the
    plan says of it came from the row as it was, and the next cycle reads it anew. Raw over
    controlplane.bulk's rows rather than its update_rows, for the version's guard and RETURNING.
    """
    if not changed:
        return 0
    versions = loaded.pending_versions
    rows = sorted(changed, key=lambda row: row[0])  # in key order, as update_rows writes
    table = connection.ops.quote_name(Job._meta.db_table)
    version = row_version_sql(table)
    targets = [bulk.field(Job, name) for name in PENDING_FIELDS]
    columns: list[bulk.Column] = [
        ("k", Job._meta.pk),
        *((f"c{i}", f) for i, f in enumerate(targets)),
        ("old", TextField()),  # the version read, text as RowVersion is
    ]
    source, params = bulk.rows_from("v", columns, [(*row, versions[row[0]]) for row in rows])
    assignments = ", ".join(f"{bulk.column(Job, f.name)} = v.c{i}" for i, f in enumerate(targets))
    sql = (
        f"UPDATE {table} SET {assignments} FROM {source} "
        f"WHERE {table}.{bulk.column(Job, 'id')} = v.k AND {table}.{bulk.column(Job, 'state')} = %s "
        f"AND {version} = v.old RETURNING {table}.{bulk.column(Job, 'id')}, {version}"
    )
    by_id = {row[0]: row for row in rows}
    stored = loaded.pending_rows
    written: dict[int, tuple[str, str, PendingRow]] = {}
    with bulk.cursor() as cur:
        bulk.execute(cur, sql, [*params, JobState.PENDING])
        for job_id, new_version in cur.fetchall():
            _, code, reason, position, estimate, predicted_s = by_id[job_id]
            written[job_id] = (
                versions[job_id],
                new_version,
                PendingRow(
                    attempt_count=stored[job_id].attempt_count,
                    reason_code=code,
                    reason=reason,
                    queue_position=position,
                    estimated_start_s=None if estimate is None else estimate.timestamp(),
                    predicted_duration_s=None if predicted_s is None else float(predicted_s),
                ),
            )
    if written:
        transaction.on_commit(lambda: note_pending_written(written))
    return len(written)


def _update_jobs(rows: list[tuple], fields: list[str], state: str) -> int:
    """Write (id, *values) rows onto Job columns, only where the job is still in `state`.

    Every cycle moves the queue position of most waiting jobs, so this may be tens of thousands
    of rows: one statement (controlplane.bulk), where bulk_update's CASE per row and field
    grows quadratically.
    """
    return bulk.update_rows(Job, fields, rows, only_if={"state": state})


def _uncapped(loaded: LoadedSnapshot) -> dict[str, float]:
    """A plan with no caps means "uncapped": GPUs an earlier budget capped go back to default."""
    return {
        gpu.uuid: gpu.power_default_w
        for node in loaded.snapshot.nodes
        for gpu in node.gpus
        if loaded.desired_power_cap_w.get(gpu.uuid) is not None
    }


def _write_power_caps(
    caps_w: dict[str, float], loaded: LoadedSnapshot, result: ApplyResult
) -> None:
    """Set GPU.desired_power_cap_w where the plan moved it; one UPDATE per distinct cap."""
    by_cap: dict[float, list[str]] = defaultdict(list)
    for uuid, cap_w in caps_w.items():
        if uuid not in loaded.desired_power_cap_w:
            continue
        if _same(loaded.desired_power_cap_w[uuid], cap_w, POWER_TOLERANCE_W):
            continue
        by_cap[float(cap_w)].append(uuid)
    for cap_w, uuids in sorted(by_cap.items()):
        for chunk in _chunks(sorted(uuids)):
            result.power_caps_written += GPU.objects.filter(uuid__in=chunk).update(
                desired_power_cap_w=cap_w
            )
        result.nodes_changed.update(loaded.gpu_node[u] for u in uuids)
