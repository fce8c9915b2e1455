"""Database rows to a frozen scheduler.model.Snapshot, in a fixed number of queries.

The query count does not grow with the number of nodes, GPUs, jobs or tenants (a test counts
it): every table is read once with values_list and the rows are joined in Python. Times are
Unix seconds, the clock scheduler.model asks for in production.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import itemgetter

from django.db import connection
from django.db.models import F, OuterRef, Q, Subquery, Sum

from controlplane.accounting.budgets import budget_states, scheduler_view
from controlplane.cluster.models import GPU, Node, NodeState, Pool
from controlplane.jobs.models import (
    ACTIVE_ATTEMPT_STATES,
    PRIORITY_VALUE,
    Allocation,
    AttemptState,
    Job,
    JobAttempt,
    JobState,
)
from controlplane.scheduling.profiles import with_learned_profiles
from controlplane.scheduling.rows import (
    AnyOf,
    RowVersion,
    UnixSeconds,
    fixed_rows,
    from_unix_s,
    raw_rows,
    unix_s,
)
from controlplane.tenancy.models import Quota, Tenant
from scheduler import model as m

log = logging.getLogger(__name__)

# Duration prediction needs recent history, not all of it: teams change what they run, and the
# query must stay bounded however long the cluster has been up.
HISTORY_WINDOW_S = 30 * 86400.0
HISTORY_MAX_RECORDS = 5000
# Between full reads of the history, a cycle reads only the attempts that ended since the newest
# one it has (less this much, for exits recorded a little out of order): in a flood of short
# jobs the cycle ran several times a second and re-read 5,000 rows each time. An exit reported
# later than that (a node back from a partition) joins at the next full read.
HISTORY_FULL_READ_EVERY_S = 60.0
HISTORY_LATE_EXITS_S = 2.0
# Between full reads of the waiting jobs, a cycle on PostgreSQL reads only the rows that changed
# (_load_pending). The full read now and then bounds what a version that came round again (a
# transaction id reused after four billion) could hide from a process that kept a row so long.
PENDING_FULL_READ_EVERY_S = 60.0
# With more jobs new or changed than this, one read of every row costs no more than by id.
PENDING_FETCH_MAX = 5000


@dataclass(frozen=True, slots=True)
class PendingRow:
    """A pending job's row as it was when the snapshot was read, for the applier to compare."""

    attempt_count: int
    reason_code: str
    reason: str
    queue_position: int | None
    estimated_start_s: float | None
    predicted_duration_s: float | None


@dataclass(frozen=True)
class LoadedSnapshot:
    """The snapshot for plan(), and what the applier needs to compare the plan with."""

    snapshot: m.Snapshot
    pending_rows: dict[int, PendingRow] = field(default_factory=dict)  # job id -> row
    # job id -> the version of its row that was read (RowVersion; PostgreSQL only)
    pending_versions: dict[int, str] = field(default_factory=dict)
    gpu_node: dict[str, str] = field(default_factory=dict)  # GPU uuid -> node name
    desired_power_cap_w: dict[str, float | None] = field(default_factory=dict)  # GPU uuid -> W
    running_gpus: dict[int, tuple[str, ...]] = field(default_factory=dict)  # attempt id -> uuids


def load_snapshot(now_s: float | None = None) -> LoadedSnapshot:
    """Read the cluster as the scheduler must see it. A fixed number of queries whatever the row counts (ten, plus one for budgets, one per budget period in use, two when running attempts are due for a power-profile look, and on PostgreSQL between full reads of the waiting jobs, three instead of their one: their versions, the names those refer to, and the rows of those new or changed)."""
    now_s = time.time() if now_s is None else now_s
    pool_rows = fixed_rows(_pool_rows)
    pools = tuple(m.Pool(name=name, power_budget_w=budget) for _, name, budget in pool_rows)
    pool_names = {pk: name for pk, name, _ in pool_rows}

    gpu_node: dict[str, str] = {}
    desired_caps: dict[str, float | None] = {}
    earlier = _earlier_service_s()
    running, running_gpus, held_uuids = _load_running(now_s, earlier)
    running = with_learned_profiles(running, now_s)
    nodes = load_nodes(pool_names, gpu_node, desired_caps)
    orphans = held_uuids - {u for uuids in running_gpus.values() for u in uuids}
    if orphans:
        # An active allocation of an attempt that is no longer active should not exist; while it
        # does, the database refuses the GPU to anyone else, so the plan must not use it.
        log.warning("GPUs held by allocations of inactive attempts: %s", sorted(orphans))
        nodes = tuple(_without_gpus(node, orphans) for node in nodes)
    pending, pending_rows, pending_versions = _load_pending(earlier, now_s)
    snapshot = m.Snapshot(
        now_s=now_s,
        nodes=nodes,
        running=running,
        pending=pending,
        tenants=load_tenants(now_s),
        pools=pools,
        history=_load_history(now_s),
    )
    return LoadedSnapshot(
        snapshot=snapshot,
        pending_rows=pending_rows,
        pending_versions=pending_versions,
        gpu_node=gpu_node,
        desired_power_cap_w=desired_caps,
        running_gpus=running_gpus,
    )


# The nodes of the last load, by node id, with the rows they were built from: an unchanged
# node is handed out as the same frozen object, and when none changed the same tuple is, so the
# indexes the core builds from it (the cycle's PlanMemo, keyed on that tuple) hold across
# cycles. One per process.
_last_nodes: dict = {"by_id": {}, "nodes": ()}


def load_nodes(
    pool_names: dict[int, str], gpu_node: dict[str, str], desired_caps: dict[str, float | None]
) -> tuple[m.Node, ...]:
    node_rows = list(
        Node.objects.order_by("name").values_list(
            "id", "name", "pool_id", "ready", "state", "cpus", "memory_mib", "volumes"
        )
    )
    node_names = {row[0]: row[1] for row in node_rows}
    gpu_rows: dict[int, list[tuple]] = defaultdict(list)
    for row in fixed_rows(_gpu_rows):
        node_id, uuid = row[0], row[1]
        name = node_names.get(node_id)
        if name is None:
            # Its node registered after the node rows were read (each read of the snapshot is
            # a statement of its own): the cycle its registration asks for sees it whole.
            continue
        gpu_rows[node_id].append(row[1:9])
        gpu_node[uuid] = name
        desired_caps[uuid] = row[9]
    last_by_id, last_nodes = _last_nodes["by_id"], _last_nodes["nodes"]
    same = len(last_nodes) == len(node_rows)
    by_id = {}
    nodes = []
    for i, (node_id, name, pool_id, ready, state, cpus, memory_mib, volumes) in enumerate(
        node_rows
    ):
        key = (
            name,
            pool_names.get(pool_id, ""),
            ready,
            state,
            cpus,
            memory_mib,
            tuple(gpu_rows.get(node_id, ())),
            frozenset(v for v in volumes or () if isinstance(v, str)),
        )
        last = last_by_id.get(node_id)
        node = last[1] if last is not None and last[0] == key else _node(key)
        by_id[node_id] = (key, node)
        nodes.append(node)
        same = same and last_nodes[i] is node
    out = last_nodes if same else tuple(nodes)
    _last_nodes["by_id"], _last_nodes["nodes"] = by_id, out
    return out


def _pool_rows():
    return Pool.objects.order_by("name").values_list("id", "name", "power_budget_w")


def _gpu_rows():
    return GPU.objects.order_by("node_id", "index").values_list(
        "node_id",
        "uuid",
        "index",
        "model",
        "power_min_w",
        "power_max_w",
        "power_default_w",
        "power_cap_w",
        "healthy",
        "desired_power_cap_w",
    )


def _node(key: tuple) -> m.Node:
    name, pool, ready, state, cpus, memory_mib, gpu_rows, volumes = key
    return m.Node(
        name=name,
        pool=pool,
        gpus=tuple(
            m.Gpu(
                uuid=uuid,
                index=index,
                gpu_type=model,
                power_min_w=power_min_w,
                power_max_w=power_max_w,
                power_default_w=power_default_w,
                power_cap_w=power_cap_w,
                healthy=bool(healthy),
            )
            for (
                uuid,
                index,
                model,
                power_min_w,
                power_max_w,
                power_default_w,
                power_cap_w,
                healthy,
            ) in gpu_rows
        ),
        # Liveness and the admin's wish must both allow new work.
        schedulable=bool(ready) and state == NodeState.READY,
        draining=state == NodeState.DRAINING,
        cpus=float(cpus),
        memory_mib=int(memory_mib),
        volumes=volumes,
    )


def _without_gpus(node: m.Node, uuids: set[str]) -> m.Node:
    if not any(g.uuid in uuids for g in node.gpus):
        return node
    gpus = tuple(
        m.Gpu(
            uuid=g.uuid,
            index=g.index,
            gpu_type=g.gpu_type,
            power_min_w=g.power_min_w,
            power_max_w=g.power_max_w,
            power_default_w=g.power_default_w,
            power_cap_w=g.power_cap_w,
            healthy=g.healthy and g.uuid not in uuids,
        )
        for g in node.gpus
    )
    return m.Node(
        name=node.name,
        pool=node.pool,
        gpus=gpus,
        schedulable=node.schedulable,
        draining=node.draining,
        cpus=node.cpus,
        memory_mib=node.memory_mib,
        volumes=node.volumes,
    )


def _earlier_service_s() -> dict[int, float]:
    """GPU-seconds each live job received in attempts that have ended (preempted, lost)."""
    return dict(fixed_rows(_earlier_service_rows))


def _earlier_service_rows():
    # A waiting job with an attempt behind it, or a running one with more than its current
    # one: exactly the condition of the partial index job_with_earlier_attempts, so that the
    # read stays small however many attempts the database keeps.
    jobs = Job.objects.filter(
        Q(state=JobState.PENDING, attempt_count__gt=0)
        | Q(state__in=[JobState.ADMITTED, JobState.RUNNING], attempt_count__gt=1)
    )
    return (
        JobAttempt.objects.filter(job__in=jobs.values("id"))
        .exclude(state__in=ACTIVE_ATTEMPT_STATES)
        .values("job_id")
        .annotate(service_s=Sum("gpu_seconds"))
        .values_list("job_id", "service_s")
    )


def _load_running(
    now_s: float, earlier: dict[int, float]
) -> tuple[tuple[m.Running, ...], dict[int, tuple[str, ...]], set[str]]:
    gpus_by_attempt: dict[int, list[tuple[str, str]]] = defaultdict(list)
    held: set[str] = set()
    for attempt_id, uuid, model in fixed_rows(_allocation_rows):
        gpus_by_attempt[attempt_id].append((uuid, model))
        held.add(uuid)
    running = []
    running_gpus: dict[int, tuple[str, ...]] = {}
    for (
        attempt_id,
        job_id,
        tenant,
        user,
        priority,
        preemptible,
        started_at,
        created_at,
        stop_requested_at,
        submitted_at,
        predicted_s,
        estimated_s,
        max_runtime_s,
        cpus,
        memory_mib,
        grace_s,
        checkpoint_interval_s,
        last_checkpoint_s,
        preemptions,
    ) in fixed_rows(_running_rows):
        held_gpus = gpus_by_attempt.get(attempt_id, [])
        uuids = tuple(u for u, _ in held_gpus)
        running_gpus[attempt_id] = uuids
        # An admitted attempt whose container has not started yet holds its GPUs all the same.
        started_s = started_at if started_at is not None else created_at
        # The end a backfill reservation can count on: the prediction the cycle stored when it
        # admitted the job, else what the user said, else the runtime limit that kills it.
        duration_s = predicted_s or estimated_s or max_runtime_s
        running.append(
            m.Running(
                attempt_id=attempt_id,
                job_id=job_id,
                tenant=tenant,
                user=user,
                priority=PRIORITY_VALUE.get(priority, PRIORITY_VALUE["normal"]),
                preemptible=bool(preemptible),
                started_at_s=started_s,
                gpus=uuids,
                gpu_type=held_gpus[0][1] if held_gpus else m.ANY_GPU_TYPE,
                predicted_end_s=started_s + duration_s if duration_s else None,
                stopping=stop_requested_at is not None,
                submitted_at_s=submitted_at,
                attained_service_s=earlier.get(job_id, 0.0)
                + max(0.0, now_s - started_s) * len(uuids),
                cpus=float(cpus),
                memory_mib=int(memory_mib),
                grace_s=float(grace_s),
                stop_by_s=stop_requested_at + grace_s if stop_requested_at is not None else None,
                last_checkpoint_s=last_checkpoint_s,
                checkpoint_interval_s=(
                    float(checkpoint_interval_s) if checkpoint_interval_s else None
                ),
                preemptions=preemptions,
            )
        )
    return tuple(running), running_gpus, held


def _allocation_rows():
    return Allocation.objects.filter(active=True).values_list(
        "attempt_id", "gpu__uuid", "gpu__model"
    )


def _running_rows():
    return (
        JobAttempt.objects.filter(state__in=ACTIVE_ATTEMPT_STATES)
        .order_by("id")
        .values_list(
            "id",
            "job_id",
            "job__tenant__slug",
            "job__submitted_by__username",
            "job__priority",
            "job__preemptible",
            unix_s("started_at"),
            unix_s("created_at"),
            unix_s("stop_requested_at"),
            unix_s("job__submitted_at"),
            "job__predicted_duration_s",
            "job__estimated_duration_s",
            "job__max_runtime_s",
            "job__cpus",
            "job__memory_mib",
            "job__preemption_grace_s",
            "job__checkpoint_interval_s",
            # The job's latest checkpoint over all its attempts (it keeps one directory): a
            # correlated subquery of the same statement, through the (job, number) index.
            UnixSeconds(_latest_checkpoint_at()),
            "job__preemptions",
        )
    )


def _latest_checkpoint_at() -> Subquery:
    return Subquery(
        JobAttempt.objects.filter(job_id=OuterRef("job_id"), last_checkpoint_at__isnull=False)
        .order_by("-last_checkpoint_at")
        .values("last_checkpoint_at")[:1]
    )


@dataclass(frozen=True, slots=True)
class _PendingCache:
    """The waiting jobs of the last load, kept by this process between cycles; replaced whole
    (see _HistoryCache).

    entries: job id -> (job_key, job, row_key, stored, version): the columns the Pending was
    built from, the Pending (a frozen object, handed out again while its row is the same),
    the columns the applier compares, their PendingRow, and the row's version with the names
    joined to it (what _pending_versions reads).
    """

    entries: dict[int, tuple] = field(default_factory=dict)
    order: tuple[int, ...] = ()  # job ids in submit order
    full_read_at_s: float = -math.inf


_pending_cache = _PendingCache()


def forget_pending() -> None:
    """Drop the kept waiting jobs: the next cycle reads every row whole (tests, benchmarks)."""
    global _pending_cache
    _pending_cache = _PendingCache()


def _load_pending(
    earlier: dict[int, float], now_s: float
) -> tuple[tuple[m.Pending, ...], dict[int, PendingRow], dict[int, str]]:
    """The waiting jobs in submit order, their rows as stored, and the versions of those rows
    (PostgreSQL only).

    On PostgreSQL, between full reads, only each waiting job's id and row version are read
    (RowVersion), and whole rows only for the jobs that are new or whose row changed since
    the last load: a queue of thousands behind a full cluster is nearly the same from one
    cycle to the next, and reading and comparing every row of it was most of a quiet cycle.
    """
    global _pending_cache
    cache = _pending_cache
    entries = cache.entries
    versions: dict[int, tuple] | None = None
    changed: list[int] = []
    if connection.vendor == "postgresql" and 0 <= now_s - cache.full_read_at_s < (
        PENDING_FULL_READ_EVERY_S
    ):
        versions = _named_versions(fixed_rows(_pending_versions))
        for job_id, version in versions.items():
            entry = entries.get(job_id)
            if entry is None or entry[4] != version:
                changed.append(job_id)
        if len(changed) > PENDING_FETCH_MAX:
            versions = None  # a flood of new jobs: one read of every row costs no more
    full_read_at_s = cache.full_read_at_s
    if versions is None:
        rows = fixed_rows(_pending_rows)
        full_read_at_s = now_s
    else:
        rows = raw_rows(_pending_by_id(changed)) if changed else []
    by_id: dict[int, tuple] = {}
    resort = False
    for row in rows:
        job_id = row[0]
        # The mounts as the driver gave them (text): decoded only when the job is new or changed.
        job_key = (*row[:16], earlier.get(job_id, 0.0), row[22], row[24])
        row_key = row[16:22]
        last = entries.get(job_id)
        job = last[1] if last is not None and last[0] == job_key else _pending(job_key)
        stored = last[3] if last is not None and last[2] == row_key else PendingRow(*row_key)
        by_id[job_id] = (job_key, job, row_key, stored, (row[23], row[1], row[2], row[14]))
        resort = resort or last is None or last[0][8] != job_key[8]
    if versions is not None:
        fetched = set(changed)
        for job_id in versions:
            if job_id in fetched:
                # In by_id as read, or not there: no longer waiting by the time it was read.
                continue
            entry = entries[job_id]
            job_key = entry[0]
            attained_s = earlier.get(job_id, 0.0)
            if job_key[16] != attained_s:
                # An attempt of it that ended is counted in another table than its row.
                job_key = (*job_key[:16], attained_s, *job_key[17:])
                entry = (job_key, _pending(job_key), *entry[2:])
            by_id[job_id] = entry
    if versions is None:
        order = tuple(row[0] for row in rows)  # read in submit order
    elif resort:
        order = tuple(sorted(by_id, key=lambda job_id: (by_id[job_id][0][8], job_id)))
    else:
        # The same jobs or fewer, none moved in the order: the last order without the gone.
        order = tuple(job_id for job_id in cache.order if job_id in by_id)
    _pending_cache = _PendingCache(by_id, order, full_read_at_s)
    pending = tuple(by_id[job_id][1] for job_id in order)
    versions_read = (
        {job_id: by_id[job_id][4][0] for job_id in order}
        if connection.vendor == "postgresql"
        else {}
    )
    return pending, {job_id: by_id[job_id][3] for job_id in order}, versions_read


def note_pending_written(written: dict[int, tuple[str, str, PendingRow]]) -> None:
    """Keep what a committed cycle wrote onto waiting jobs' rows: job id -> (the version it
    wrote over, the version it made, the row as it now is).

    Without it the next load finds those rows changed and reads them again, though it wrote
    them itself: in a flood of short jobs that was every job near the head, every cycle. An
    entry is replaced only while it still holds the version written over, so the pair it keeps
    (what the row holds, its version) is always one the database had.
    """
    global _pending_cache
    cache = _pending_cache
    entries: dict[int, tuple] | None = None
    for job_id, (old, new, stored) in written.items():
        entry = cache.entries.get(job_id)
        if entry is None or entry[4][0] != old:
            continue
        if entries is None:
            entries = dict(cache.entries)
        row_key = (
            stored.attempt_count,
            stored.reason_code,
            stored.reason,
            stored.queue_position,
            stored.estimated_start_s,
            stored.predicted_duration_s,
        )
        entries[job_id] = (entry[0], entry[1], row_key, stored, (new, *entry[4][1:]))
    if entries is not None:
        _pending_cache = _PendingCache(entries, cache.order, cache.full_read_at_s)


def _pending_query():
    # A deactivated tenant's jobs stay queued but are not offered to the scheduler, nor are held
    # ones (controlplane.jobs.holds): the job_schedulable index skips them.
    return Job.objects.filter(state=JobState.PENDING, hold="", tenant__active=True)


def _pending_by_id(ids: list[int]):
    # One statement whatever the number of ids (an array, not a parameter per id), so that it
    # is prepared once; the id's index finds each row.
    return _pending_rows().order_by().filter(AnyOf(F("id"), ids))


def _pending_versions():
    # What tells a kept waiting job from a changed one: its row's version, and the ids of the
    # rows the full read joins names from (a renamed user, tenant or volume changes another
    # table): _named_versions puts the names to them. No join here: this runs every cycle over
    # every waiting job, and joined row by row to three tables it cost three times the scan.
    return (
        Job.objects.filter(state=JobState.PENDING, hold="")
        .order_by()
        .annotate(version=RowVersion(Job))
        .values_list("id", "version", "tenant_id", "submitted_by_id", "checkpoint_volume_id")
    )


# The names of the active tenants, and of the users and volumes of the waiting jobs, in one
# round trip: a few rows, however long the queue. The tables are the ones the job's foreign
# keys name.
_USERS_TABLE = Job._meta.get_field("submitted_by").related_model._meta.db_table
_VOLUMES_TABLE = Job._meta.get_field("checkpoint_volume").related_model._meta.db_table
_NAMES_SQL = (
    f'SELECT 0, "id", "slug" FROM {Tenant._meta.db_table} WHERE "active" '
    f'UNION ALL SELECT 1, "id", "username" FROM {_USERS_TABLE} WHERE "id" = ANY(%s) '
    f'UNION ALL SELECT 2, "id", "name" FROM {_VOLUMES_TABLE} WHERE "id" = ANY(%s)'
)


def _named_versions(rows: list[tuple]) -> dict[int, tuple]:
    """job id -> (row version, tenant slug, username, checkpoint volume name) of each waiting
    job of an active tenant (those _pending_query offers), from _pending_versions' rows: the
    same tuple the full read keeps for it (_load_pending). A user gone by the time its name is
    read had a job gone with it: a version with no name matches no kept job, and the job,
    read by id, is not found."""
    if not rows:
        return {}
    users = sorted({row[3] for row in rows})
    volumes = sorted({row[4] for row in rows if row[4] is not None})
    names: tuple[dict, dict, dict] = ({}, {}, {})
    with connection.cursor() as cursor:
        cursor.execute(_NAMES_SQL, [users, volumes])
        for kind, pk, name in cursor.fetchall():
            names[kind][pk] = name
    tenants, usernames, volume_names = names
    return {
        job_id: (version, tenants[tenant_id], usernames.get(user_id), volume_names.get(volume_id))
        for job_id, version, tenant_id, user_id, volume_id in rows
        if tenant_id in tenants
    }


def _pending_rows():
    return (
        _pending_query()
        .order_by("submitted_at", "id")
        .annotate(version=RowVersion(Job))
        .values_list(
            "id",
            "tenant__slug",
            "submitted_by__username",
            "name",
            "gpus",
            "gpu_type",
            "priority",
            "preemptible",
            unix_s("submitted_at"),
            "estimated_duration_s",
            "max_runtime_s",
            "cpus",
            "memory_mib",
            "mounts",
            "checkpoint_volume__name",
            "preemption_grace_s",
            "attempt_count",
            "pending_reason_code",
            "pending_reason",
            "queue_position",
            unix_s("estimated_start_at"),
            "predicted_duration_s",
            "array_id",
            "version",
            "preemptions",
        )
    )


def _pending(key: tuple) -> m.Pending:
    (
        job_id,
        tenant,
        user,
        name,
        gpus,
        gpu_type,
        priority,
        preemptible,
        submitted_at,
        estimated_s,
        max_runtime_s,
        cpus,
        memory_mib,
        mounts,
        checkpoint_volume,
        grace_s,
        attained_s,
        array_id,
        preemptions,
    ) = key
    return m.Pending(
        job_id=job_id,
        tenant=tenant,
        user=user,
        name=name,
        gpus=gpus,
        gpu_type=gpu_type,
        priority=PRIORITY_VALUE.get(priority, PRIORITY_VALUE["normal"]),
        preemptible=bool(preemptible),
        submitted_at_s=submitted_at,
        estimated_duration_s=float(estimated_s) if estimated_s else None,
        max_runtime_s=float(max_runtime_s) if max_runtime_s else None,
        attained_service_s=attained_s,
        cpus=float(cpus),
        memory_mib=int(memory_mib),
        volumes=_volumes(mounts, checkpoint_volume),
        grace_s=float(grace_s),
        group=array_id,
        preemptions=preemptions,
    )


def _volumes(mounts, checkpoint_volume: str | None) -> tuple[str, ...]:
    """The volumes a pending job needs on its node: its mounts' and its checkpoint volume."""
    if isinstance(mounts, str | bytes):
        mounts = json.loads(mounts)  # raw rows: jsonb may come as text
    names = [mount.get("volume") for mount in mounts or () if isinstance(mount, dict)]
    if checkpoint_volume:
        names.append(checkpoint_volume)
    return tuple(sorted({n for n in names if isinstance(n, str)}))


def load_tenants(now_s: float | None = None) -> tuple[m.Tenant, ...]:
    now = from_unix_s(time.time() if now_s is None else now_s)
    # Energy and GPU-hour budgets become, per tenant, the action of a spent budget and the power
    # pace of its energy budget (at most one query per budget period, three in all).
    budgets = scheduler_view(budget_states(now), now)
    quotas: dict[int, list[tuple[str, int, int, int | None]]] = defaultdict(list)
    for tenant_id, gpu_type, guaranteed, limit, max_jobs in fixed_rows(_quota_rows):
        quotas[tenant_id].append((gpu_type, guaranteed, limit, max_jobs))
    tenants = []
    # Inactive tenants are listed too: their running attempts still hold GPUs and count.
    for tenant_id, slug, weight in fixed_rows(_tenant_rows):
        rows = quotas.get(tenant_id, [])
        # The core has one running-jobs cap per tenant; the tightest of its quotas' caps holds.
        caps = [max_jobs for *_, max_jobs in rows if max_jobs is not None]
        tenants.append(
            m.Tenant(
                name=slug,
                weight=weight,
                quotas=tuple(
                    m.Quota(gpu_type=gpu_type, guaranteed_gpus=guaranteed, limit_gpus=limit)
                    for gpu_type, guaranteed, limit, _ in rows
                ),
                max_running_jobs=min(caps) if caps else None,
                budget_action=budgets[tenant_id].budget_action if tenant_id in budgets else None,
                power_pace_w=budgets[tenant_id].power_pace_w if tenant_id in budgets else None,
            )
        )
    return tuple(tenants)


def _quota_rows():
    return Quota.objects.order_by("tenant_id", "gpu_type").values_list(
        "tenant_id", "gpu_type", "guaranteed_gpus", "limit_gpus", "max_running_jobs"
    )


def _tenant_rows():
    return Tenant.objects.order_by("slug").values_list("id", "slug", "weight")


@dataclass(frozen=True, slots=True)
class _HistoryCache:
    """The last history read, kept by this process between cycles (see _load_history); replaced
    whole, so that two threads loading snapshots (the embedded loop and a what-if replay) never
    see the rows of one read with the records of another."""

    rows: dict[int, tuple] = field(default_factory=dict)  # attempt id -> row
    full_read_at_s: float = -math.inf
    history: tuple[m.HistoryRecord, ...] = ()  # newest first
    records: dict[int, m.HistoryRecord] = field(default_factory=dict)  # attempt id -> its record


_history_cache = _HistoryCache()


def forget_history() -> None:
    """Drop the kept history: the next cycle reads it whole (tests; a restored database)."""
    global _history_cache
    _history_cache = _HistoryCache()


def _history_rows(since_s: float, kept: Sequence[int] = ()) -> list[tuple]:
    """The successful attempts that ended at since_s or later, newest first, but for those
    `kept` (their rows are already known: only the others are joined and sent)."""
    attempts = JobAttempt.objects.filter(
        state=AttemptState.SUCCEEDED,
        finished_at__gte=from_unix_s(since_s),
        started_at__isnull=False,
    )
    if kept:
        attempts = (
            attempts.exclude(AnyOf(F("id"), list(kept)))
            if connection.vendor == "postgresql"
            else attempts.exclude(id__in=kept)
        )
    return raw_rows(
        attempts.order_by("-finished_at", "-id").values_list(
            "id",
            unix_s("finished_at"),
            "job__tenant__slug",
            "job__submitted_by__username",
            "job__name",
            "job__gpus",
            unix_s("started_at"),
            "job__array_id",
        )[:HISTORY_MAX_RECORDS]
    )


def _load_history(now_s: float) -> tuple[m.HistoryRecord, ...]:
    """The most recent successful attempts: how long a job of that kind really ran."""
    global _history_cache
    cache = _history_cache
    cutoff_s = now_s - HISTORY_WINDOW_S
    full_read_at_s = cache.full_read_at_s
    if not 0 <= now_s - full_read_at_s < HISTORY_FULL_READ_EVERY_S:
        rows = {row[0]: row for row in _history_rows(cutoff_s)}
        full_read_at_s = now_s
    else:
        newest_s = max((row[1] for row in cache.rows.values()), default=cutoff_s)
        since_s = max(cutoff_s, newest_s - HISTORY_LATE_EXITS_S)
        rows = {k: row for k, row in cache.rows.items() if row[1] >= cutoff_s}
        # In a flood of short jobs the window holds a couple of seconds of exits, most of them
        # read by the cycle before: only the new ones are read again.
        held = [k for k, row in rows.items() if row[1] >= since_s]
        rows.update((row[0], row) for row in _history_rows(since_s, held))
    # The same rows as last time give the same tuple, which the core's duration-prediction
    # index is cached on; it changes only when a job finishes (or leaves the window).
    history, records = cache.history, cache.records
    if rows.keys() != cache.rows.keys():
        ordered = sorted(rows.values(), key=itemgetter(1, 0), reverse=True)
        ordered = ordered[:HISTORY_MAX_RECORDS]
        rows = {row[0]: row for row in ordered}
        # A flood of short jobs changes the history every cycle by a few records: those kept
        # are handed out again, and only the new ones built.
        kept, records = records, {}
        for row in ordered:
            record = kept.get(row[0])
            if record is None or cache.rows.get(row[0]) != row:
                _, finished_at, tenant, user, name, gpus, started_at, array_id = row
                record = m.HistoryRecord(
                    tenant=tenant,
                    user=user,
                    name=name,
                    gpus=gpus,
                    duration_s=max(0.0, finished_at - started_at),
                    group=array_id,
                )
            records[row[0]] = record
        history = tuple(records.values())
    _history_cache = _HistoryCache(rows, full_read_at_s, history, records)
    return history
