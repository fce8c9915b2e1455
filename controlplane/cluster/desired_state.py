"""What a heartbeat answers, and every column that answer is read from.

The answer (docs/agent-protocol.md) tells a node which attempts to run, with what, on which of
its GPUs, and at which power caps. controlplane.cluster.heartbeat serves it from a per-process
cache keyed by the node's desired-state generation, which PostgreSQL triggers bump in the
writer's own transaction (cluster migrations 0002 and 0007). The cache is right only while
every column the answer reads is one whose change the triggers count: READS below declares
them, the two statements are built from it, and tests/controlplane/agent/test_desired_state.py
changes each declared column on a node with work and fails if the node's generation stays put,
and fails if the statements read a column READS does not declare.

A new field in the answer: add its Read here (with its Work attribute), its key in
desired_state(), and its value in the test's table of changes; when the test then fails, the
column needs a trigger (a new cluster migration in the style of 0007).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from django.db import connection, models

from controlplane.cluster import lease
from controlplane.cluster.agent_auth import db_datetime
from controlplane.cluster.models import GPU, Node
from controlplane.jobs.models import (
    ACTIVE_ATTEMPT_STATES,
    Allocation,
    AttemptMember,
    AttemptState,
    Job,
    JobAttempt,
)
from controlplane.storage.models import Volume
from controlplane.storage.paths import CHECKPOINT_TARGET, checkpoint_host_path, mount_source
from controlplane.tenancy.models import Tenant

# The tables the statements read, by the alias every column reference is qualified with.
TABLES: dict[str, type[models.Model]] = {
    "a": JobAttempt,
    "j": Job,
    "al": Allocation,
    "g": GPU,
    "t": Tenant,
    "cv": Volume,  # the job's checkpoint volume
    "v": Volume,  # the volumes its mounts name
    "m": AttemptMember,  # the attempt's member on this node
}


@dataclass(frozen=True, slots=True)
class Read:
    """One column the answer's statements read."""

    alias: str  # its table, as a key of TABLES
    column: str  # the Django field's attname, which is its column name
    # The Work attribute it fills (work statement only); None: joined, filtered or sorted on.
    attr: str | None = None
    # False: read with the work for the full heartbeat path's decisions, which reads it afresh
    # under the node lock, but in no answer and never looked at on the cached (steady) path; a
    # change of it need not move the generation.
    in_answer: bool = True

    @property
    def model(self) -> type[models.Model]:
        return TABLES[self.alias]


# The work statement: the node's active attempts and their GPUs here. In SELECT order first
# (attempt id leading: the rows are grouped on it), then what the joins and filters read.
WORK_READS: tuple[Read, ...] = (
    Read("a", "id", "attempt_id"),
    Read("a", "job_id", "job_id"),
    Read("a", "state", "state"),
    Read("a", "stop_requested_at", "stop_requested_at"),
    # When it started, and its energy so far: the full path's loss and energy bookkeeping.
    # energy_j is rewritten by every telemetry batch: a trigger counting it would empty every
    # node's cached answer once a second.
    Read("a", "started_at", "started_at", in_answer=False),
    Read("a", "energy_j", "energy_j", in_answer=False),
    Read("j", "gpus", "job_gpus"),
    Read("j", "image", "image"),
    Read("j", "command", "command"),
    Read("j", "env", "env"),
    Read("j", "cpus", "cpus"),
    Read("j", "memory_mib", "memory_mib"),
    Read("j", "max_runtime_s", "max_runtime_s"),
    Read("j", "stop_signal", "stop_signal"),
    Read("j", "preemption_grace_s", "grace_s"),
    Read("j", "mounts", "mounts"),
    Read("a", "checkpoint_read_only", "checkpoint_read_only"),
    Read("t", "slug", "tenant_slug"),
    Read("cv", "source", "checkpoint_source"),
    # What the node last reported of its checkpoints, for the steady path to tell news from a
    # repeat (heartbeat.is_steady): in no answer, and rewritten by every checkpoint.
    Read("a", "last_checkpoint_at", "last_checkpoint_at", in_answer=False),
    Read("j", "checkpoint_bytes", "checkpoint_bytes", in_answer=False),
    # The rendezvous (docs/job-contract.md): fixed at admission, the member's rank here, and
    # (full path only) how the member stands, for a gang whose members move one by one.
    Read("a", "master_port", "master_port"),
    Read("a", "node_addrs", "node_addrs"),
    Read("m", "rank", "node_rank"),
    Read("m", "state", "member_state", in_answer=False),
    Read("m", "started_at", "member_started_at", in_answer=False),
    Read("g", "uuid", "gpu_uuids"),
    Read("m", "attempt_id"),
    Read("m", "node_id"),
    Read("a", "node_id"),
    Read("j", "id"),
    Read("j", "tenant_id"),
    Read("t", "id"),
    Read("j", "checkpoint_volume_id"),
    Read("cv", "id"),
    Read("al", "attempt_id"),
    Read("al", "gpu_id"),
    Read("al", "active"),
    Read("g", "id"),
    Read("g", "node_id"),
    Read("g", "index"),
)
# The caps statement: the GPUs of the node that have a desired cap.
CAPS_READS: tuple[Read, ...] = (
    Read("g", "uuid"),
    Read("g", "desired_power_cap_w"),
    Read("g", "node_id"),
    Read("g", "index"),
)
# The volumes statement: every volume (an admin's short list), read only when some work here
# mounts one.
VOLUME_READS: tuple[Read, ...] = (
    Read("v", "name"),
    Read("v", "kind"),
    Read("v", "source"),
    Read("v", "read_only"),
    Read("v", "per_tenant_subdir"),
)
READS: tuple[Read, ...] = WORK_READS + CAPS_READS + VOLUME_READS
# The answer also carries the node's heartbeat interval: read with the node on every heartbeat,
# it is part of the cache's key (heartbeat.prepared_answer), not of the generation.
NODE_KEYED: tuple[tuple[type[models.Model], str], ...] = ((Node, "heartbeat_interval_s"),)


@dataclass(slots=True)
class Work:
    """An active attempt that holds GPUs on this node (or, needing none, was placed on it)."""

    attempt_id: int
    job_id: int
    state: str
    stop_requested_at: dt.datetime | None
    started_at: dt.datetime | None
    energy_j: float
    job_gpus: int
    image: str
    command: list
    env: dict
    cpus: float
    memory_mib: int
    max_runtime_s: int
    stop_signal: str
    grace_s: int
    mounts: list
    checkpoint_read_only: bool
    tenant_slug: str
    checkpoint_source: str | None
    last_checkpoint_at: dt.datetime | None
    checkpoint_bytes: int
    master_port: int | None = None
    node_addrs: list[str] = field(default_factory=list)
    node_rank: int | None = None
    member_state: str | None = None
    member_started_at: dt.datetime | None = None
    gpu_uuids: list[str] = field(default_factory=list)
    # The mounts resolved against the volumes, as the answer gives them (load_work fills it).
    resolved_mounts: list[dict] = field(default_factory=list)

    @property
    def stop_requested(self) -> bool:
        return self.stop_requested_at is not None

    @property
    def wanted(self) -> bool:
        return self.state in ACTIVE_ATTEMPT_STATES and not self.stop_requested

    @property
    def is_gang(self) -> bool:
        """Its members are on several nodes, each reporting its own (record_member_report)."""
        return len(self.node_addrs) > 1

    @property
    def all_gpus_here(self) -> bool:
        return len(self.gpu_uuids) >= self.job_gpus


def _json(value):
    # jsonb arrives as text through Django's PostgreSQL backend, as does SQLite's JSON.
    return json.loads(value) if isinstance(value, str | bytes) else value


def _converter(read: Read):
    """How a raw value of this column becomes its Work attribute."""
    kind = read.model._meta.get_field(read.column)
    if isinstance(kind, models.DateTimeField):
        return db_datetime
    if isinstance(kind, models.JSONField):
        return _json
    if isinstance(kind, models.BooleanField):
        return bool  # SQLite gives 0 and 1
    return None


def _ref(read: Read) -> str:
    return f"{read.alias}.{connection.ops.quote_name(read.column)}"


def _table(alias: str) -> str:
    return f"{connection.ops.quote_name(TABLES[alias]._meta.db_table)} {alias}"


# Work attributes filled from one row's leading columns, with their converters; the GPU's UUID
# (gpu_uuids) is the last column, one per row.
_SCALARS = tuple(r for r in WORK_READS if r.attr is not None and r.attr != "gpu_uuids")
_CONVERT: tuple[tuple[str, Callable | None], ...] = tuple(
    (r.attr, _converter(r)) for r in _SCALARS if r.attr is not None
)
(_GPU_UUID,) = (r for r in WORK_READS if r.attr == "gpu_uuids")


def work_sql() -> str:
    """The node's active attempts with their GPUs here, one row per attempt and allocation.

    Parameters: node id, four times.
    """
    selected = ", ".join(_ref(r) for r in (*_SCALARS, _GPU_UUID))
    # The attempts holding a GPU of the node (found from its GPUs: node index, then the
    # partial index of active allocations) and those placed on it (the (node, state) index,
    # for jobs that need no GPU). Written as a UNION of two index lookups because the
    # equivalent OR across the joins makes PostgreSQL scan every active attempt of the
    # cluster, on every heartbeat.
    # The states are literals, not parameters: the statement is prepared, and a plan made for
    # any state cannot tell that few attempts are active. With few nodes PostgreSQL kept one
    # that read every attempt the database ever kept (a sequential scan) or, once that looked
    # dear, planned the statement anew at every heartbeat (2.4-2.9 ms per call with 2,000 to
    # 100,000 finished jobs, against 0.5 ms now: benchmarks/bench_hot_reads.py).
    active = ", ".join(_quoted(s.value) for s in (AttemptState.ADMITTED, AttemptState.RUNNING))
    return f"""
        WITH here(aid) AS (
            SELECT al.attempt_id FROM {_table("al")} JOIN {_table("g")} ON g.id = al.gpu_id
            WHERE al.active AND g.node_id = %s
            UNION
            SELECT a.id FROM {_table("a")} WHERE a.node_id = %s AND a.state IN ({active})
        )
        SELECT {selected}
        FROM here
        JOIN {_table("a")} ON a.id = here.aid
        JOIN {_table("j")} ON j.id = a.job_id
        JOIN {_table("t")} ON t.id = j.tenant_id
        LEFT JOIN {_table("cv")} ON cv.id = j.checkpoint_volume_id
        LEFT JOIN {_table("m")} ON m.attempt_id = a.id AND m.node_id = %s
        LEFT JOIN {_table("al")} ON al.attempt_id = a.id AND al.active
        LEFT JOIN {_table("g")} ON g.id = al.gpu_id AND g.node_id = %s
        WHERE a.state IN ({active})
        ORDER BY a.id, g."index"
    """


def _quoted(state: str) -> str:
    """A state as an SQL literal. States are identifiers of ours (letters and underscores):
    checked, so that none could ever close the quote."""
    if not state.replace("_", "").isalpha():
        raise ValueError(f"not a state: {state!r}")
    return f"'{state}'"


def caps_sql() -> str:
    """The desired caps of the node's GPUs that have one, by UUID. Parameter: node id."""
    return (
        f"SELECT g.uuid, g.desired_power_cap_w FROM {_table('g')} "
        'WHERE g.node_id = %s AND g.desired_power_cap_w IS NOT NULL ORDER BY g."index"'
    )


def volumes_sql() -> str:
    """Every volume, as a mount resolves it. No parameter."""
    return f"SELECT {', '.join(_ref(r) for r in VOLUME_READS)} FROM {_table('v')} ORDER BY v.name"


_sql: dict[str, str] = {}


def _statement(name: str, build) -> str:
    sql = _sql.get(name)
    if sql is None:
        sql = _sql[name] = build()
    return sql


def load_work(node_id: int) -> dict[int, Work]:
    """The node's active attempts with their local GPUs: one query, whatever their number.

    One row per attempt and allocation; a gang's GPUs on other nodes come back without a UUID.
    Attempts placed on this node that hold none of its GPUs count only when their job needs no
    GPU at all.
    """
    with connection.cursor() as cursor:
        cursor.execute(_statement("work", work_sql), [node_id] * 4)
        rows = cursor.fetchall()
    work: dict[int, Work] = {}
    for row in rows:
        aid, uuid = row[0], row[-1]
        w = work.get(aid)
        if w is None:
            w = work[aid] = Work(
                **{
                    attr: value if convert is None else convert(value)
                    for (attr, convert), value in zip(_CONVERT, row, strict=False)
                }
            )
        if uuid is not None:
            w.gpu_uuids.append(uuid)
    here = {aid: w for aid, w in work.items() if w.gpu_uuids or w.job_gpus == 0}
    if any(w.mounts for w in here.values()):
        _resolve_mounts(here.values())
    return here


def _resolve_mounts(work) -> None:
    """Each attempt's mounts as the agent takes them. One more statement, only for a node whose
    work mounts volumes. A mount whose volume is gone is left out: no node reports a volume that
    does not exist, so no new attempt of such a job is placed; one already running keeps going
    without it rather than be killed by a rename."""
    with connection.cursor() as cursor:
        cursor.execute(_statement("volumes", volumes_sql))
        names = [r.column for r in VOLUME_READS]
        volumes = {row[0]: Volume(**dict(zip(names, row, strict=True))) for row in cursor}
    for w in work:
        w.resolved_mounts = [
            {
                "name": volume.name,
                "kind": volume.kind,
                "source": mount_source(volume, w.tenant_slug),
                "target": m["path"],
                "read_only": bool(m.get("read_only") or volume.read_only),
            }
            for m in w.mounts
            if isinstance(m, dict) and (volume := volumes.get(m.get("volume"))) is not None
        ]


def _checkpoint(w: Work) -> dict | None:
    if w.checkpoint_source is None:
        return None
    volume = Volume(source=w.checkpoint_source)
    return {
        "host_path": checkpoint_host_path(volume, w.tenant_slug, w.job_id),
        "target": CHECKPOINT_TARGET,
        "read_only": w.checkpoint_read_only,
    }


def _rendezvous(w: Work) -> dict | None:
    """Where the attempt's members meet, as this node's member sees it (None: an attempt
    admitted before members existed)."""
    if not w.node_addrs or w.node_rank is None:
        return None
    return {
        "node_rank": w.node_rank,
        "num_nodes": len(w.node_addrs),
        "node_addrs": w.node_addrs,
        "master_addr": w.node_addrs[0],
        "master_port": w.master_port,
        "gpus_per_node": len(w.gpu_uuids),
    }


def desired_caps(node_id: int) -> dict[str, float]:
    with connection.cursor() as cursor:
        cursor.execute(_statement("caps", caps_sql), [node_id])
        return dict(cursor.fetchall())


def desired_state(
    work: dict[int, Work], caps: dict[str, float], heartbeat_interval_s: float
) -> dict:
    """The answer of docs/agent-protocol.md: what should run here, and at which caps."""
    return {
        "attempts": [
            {
                "attempt_id": w.attempt_id,
                "job_id": w.job_id,
                "image": w.image,
                "command": w.command,
                "env": w.env,
                "gpu_uuids": w.gpu_uuids,
                "cpus": w.cpus,
                "memory_mib": w.memory_mib,
                "max_runtime_s": w.max_runtime_s,
                "stop_signal": w.stop_signal,
                "grace_s": float(w.grace_s),
                "mounts": w.resolved_mounts,
                "checkpoint": _checkpoint(w),
                "rendezvous": _rendezvous(w),
            }
            for w in work.values()
            if w.wanted
        ],
        "power_caps_w": caps,
        "heartbeat_interval_s": heartbeat_interval_s,
        # The agent counts it from when it sent the heartbeat this answers (lease.py).
        **lease.grant(),
    }


def current_desired_state(node: Node) -> dict:
    """The desired state as a heartbeat would answer it now (two reads, no writes)."""
    return desired_state(load_work(node.pk), desired_caps(node.pk), node.heartbeat_interval_s)


def digest(answer: dict) -> str:
    """A fingerprint of the part of an answer the agent acts on."""
    acted_on = {"attempts": answer["attempts"], "power_caps_w": answer["power_caps_w"]}
    return hashlib.sha1(json.dumps(acted_on, sort_keys=True).encode()).hexdigest()
