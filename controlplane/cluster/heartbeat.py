"""What a heartbeat does: record what the agent sees, move attempts on, answer what should run.

A heartbeat is level-triggered: it carries everything the agent observes and the answer carries
everything the node should be doing, so a repeated or lost heartbeat changes nothing. The work
per heartbeat is a fixed handful of statements whatever the number of GPUs or attempts (the
node row, one read of its work, one of its caps; its telemetry joins a batch written for many
nodes at once); only state changes of attempts (rare: a start, an exit) cost more, through
controlplane.jobs.actions.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import random
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import partial

from django.conf import settings
from django.db import OperationalError, connection, transaction
from django.utils import timezone

from agents import limits, logcontext
from controlplane import bulk
from controlplane.cluster import actions as cluster_actions
from controlplane.cluster import lease, telemetry
from controlplane.cluster.agent_auth import node_by_token_hash
from controlplane.cluster.desired_state import (
    Work,
    current_desired_state,  # noqa: F401 - agent_api's watch asks for it here
    desired_caps,
    desired_state,
    digest,
    load_work,
)
from controlplane.cluster.models import Node, NodeGeneration
from controlplane.cluster.telemetry import GpuSample
from controlplane.jobs import actions
from controlplane.jobs.models import (
    ACTIVE_ATTEMPT_STATES,
    Allocation,
    AttemptState,
    JobAttempt,
)
from controlplane.redis_client import deployment_key

log = logging.getLogger(__name__)

RUNNING = "running"
EXITED = "exited"
FAILED_TO_START = "failed_to_start"
ATTEMPT_REPORT_STATES = (RUNNING, EXITED, FAILED_TO_START)


# Why an attempt's process ended when the agent ended it (absent: it ended by itself).
FENCED = "fenced"  # its node's lease was running out: the agent's fence stopped it
UNWANTED = "unwanted"  # the control plane's answer no longer listed it
# Never started: its master port (the rendezvous of docs/job-contract.md) was taken on the
# rank-0 node. Not the job's doing: it is requeued, and its next attempt gets another port.
PORT_BUSY = "port_busy"
STOP_CAUSES = (FENCED, UNWANTED, PORT_BUSY)


@dataclass(frozen=True, slots=True)
class AttemptReport:
    attempt_id: int
    state: str
    started_at: float | None = None
    exit_code: int | None = None
    finished_at: float | None = None
    energy_j: float | None = None
    energy_estimated: bool = False
    message: str = ""
    stop_cause: str | None = None
    # The job contract's (docs/agent-protocol.md): the latest checkpoint seen in this attempt
    # and the size of the job's checkpoint directory; on an ended attempt the node stopped,
    # when it sent the stop signal and whether it had to SIGKILL at the end of the grace.
    last_checkpoint_at: float | None = None
    checkpoint_bytes: int | None = None
    stop_signal_at: float | None = None
    killed_after_grace: bool | None = None


# The report fields of the job contract, with what each must be (contract_report_fields).
CONTRACT_TIMES = ("last_checkpoint_at", "stop_signal_at")


def contract_report_fields(entry: dict, path: str, warnings: dict[str, list[str]]) -> dict:
    """The job contract's optional fields of one `attempts[]` entry, for AttemptReport(**...).

    Each is optional; one that is unreadable (a string, a negative, NaN, a time past
    agents.limits.MAX_UNIX_TIME_S, a size past a 64-bit column) is left out and named in
    `warnings` under `path` + its name, as the other optional report fields are, and the rest
    of the report applies. A time ahead of the control plane's clock is clamped where it is
    stored (from_unix), as a start or finish time is.
    """
    fields: dict = {}
    for key in CONTRACT_TIMES:
        value = entry.get(key)
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not 0 <= value <= limits.MAX_UNIX_TIME_S  # NaN fails this too
        ):
            warnings.setdefault(path + key, []).append(
                f"Must be a Unix time between 0 and {limits.MAX_UNIX_TIME_S:g}. {LEFT_OUT}"
            )
            continue
        fields[key] = float(value)
    size = entry.get("checkpoint_bytes")
    if size is not None:
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= limits.MAX_COUNT:
            warnings.setdefault(path + "checkpoint_bytes", []).append(
                f"Must be a whole number of bytes, 0 to {limits.MAX_COUNT}. {LEFT_OUT}"
            )
        else:
            fields["checkpoint_bytes"] = size
    killed = entry.get("killed_after_grace")
    if killed is not None:
        if not isinstance(killed, bool):
            warnings.setdefault(path + "killed_after_grace", []).append(
                f"Must be true or false. {LEFT_OUT}"
            )
        else:
            fields["killed_after_grace"] = killed
    return fields


LEFT_OUT = "Left out; the rest of the heartbeat was applied."


@dataclass(frozen=True, slots=True)
class ConditionReport:
    type: str
    message: str = ""
    gpu_uuid: str | None = None


@dataclass(frozen=True, slots=True)
class Heartbeat:
    seq: int
    sent_at: float
    gpus: tuple[GpuSample, ...] = ()
    attempts: tuple[AttemptReport, ...] = ()
    conditions: tuple[ConditionReport, ...] = ()
    # What was left out as unreadable, by field path (told to the agent in the answer).
    warnings: dict[str, list[str]] = field(default_factory=dict)
    # Attempts whose report was there but could not be applied: each stays as it was, and
    # counts as reported (its absence proves nothing).
    unreadable_attempts: frozenset[int] = frozenset()
    # False when a report could not even be tied to an attempt: then no attempt's absence from
    # this heartbeat proves anything.
    reports_complete: bool = True
    # Where the node's jobs are reached, as Node fields (sent until a heartbeat is answered).
    address: dict | None = None

    def may_have_reported(self, attempt_id: int) -> bool:
        """Whether this heartbeat may have spoken of the attempt, readably or not."""
        return not self.reports_complete or attempt_id in self.unreadable_attempts


def from_unix(ts: float | None, *, not_after: dt.datetime) -> dt.datetime | None:
    """An agent's Unix time as a datetime; a clock running ahead is clamped to ours."""
    if ts is None:
        return None
    return min(dt.datetime.fromtimestamp(ts, tz=dt.UTC), not_after)


# --- what each node was last told (so a watch can tell a change it missed) -------------------

_answered_lock = threading.Lock()
_answered: dict[str, str] = {}


def _answered_key(name: str) -> str:
    # Another deployment's node of the same name must not be read as this one's: its answer
    # would wake a watch for nothing, or not at all.
    return deployment_key(f"node:{name}:answered")


# After a store of an answer failed, this long without trying Redis from a request: each try
# may wait out the client's timeout (a Redis that hangs), and the steady heartbeats, which
# otherwise touch no Redis in the request, must not start waiting on it one by one.
ANSWER_STORE_BACKOFF_S = 1.0
_store_failed_at: float | None = None


def remember_answer(node: Node | NodeInfo, answer_digest: str) -> None:
    global _store_failed_at
    with _answered_lock:
        previous = _answered.get(node.name)
        _answered[node.name] = answer_digest
    if settings.REDIS_URL:
        key = _answered_key(node.name)
        ttl_s = max(60, int(node.heartbeat_interval_s * 10))
        if previous == answer_digest and telemetry.flush_interval_s() > 0:
            # The same answer as this process stored last time: only the key's expiry needs a
            # refresh, which rides with the next telemetry batch instead of costing a round
            # trip now. The refresh renews the key only if it still holds this answer: another
            # process may have stored a newer one since (the batch must not bring back the
            # older), or Redis may have lost it (restarted); then this process's copy is
            # forgotten, and its next answer to the node is stored at once.
            telemetry.buffer.add_refresh(
                key, answer_digest, ttl_s, partial(_forget_answer, node.name, answer_digest)
            )
            return
        failed_at = _store_failed_at
        if failed_at is not None and time.monotonic() - failed_at < ANSWER_STORE_BACKOFF_S:
            # Redis failed a moment ago: not tried, and not remembered as stored, so that the
            # first answer after the back-off is stored. Not batched either: a batched store
            # could land after a newer answer and bring the older back.
            _forget_answer(node.name, answer_digest)
            return
        try:
            from controlplane.redis_client import get_redis

            get_redis().set(key, answer_digest, ex=ttl_s)
            _store_failed_at = None
        except Exception:
            # Not stored: the next answer, the same or not, must try again, not ride a batch
            # that renews only what is there.
            _forget_answer(node.name, answer_digest)
            _store_failed_at = time.monotonic()
            log.warning("could not record the answer to %s in Redis", node.name, exc_info=True)


def _forget_answer(name: str, answer_digest: str) -> None:
    with _answered_lock:
        if _answered.get(name) == answer_digest:
            del _answered[name]


def last_answer_digest(node: Node) -> str | None:
    """What the node was last told, or None when that cannot be known (a watch then waits)."""
    if settings.REDIS_URL:
        try:
            from controlplane.redis_client import get_redis

            value = get_redis().get(_answered_key(node.name))
            # bytes: the client decodes no responses (redis types a get as bytes or str).
            return value.decode() if isinstance(value, bytes) else value
        except Exception as exc:
            # Not this process's own copy: another web process may have answered the node
            # since, and a watch that compared with an older answer said "changed" at once,
            # again and again, for as long as Redis was away (the agent heartbeats and watches
            # again each time: 250 watches a second in a chaos run). Unknown, the watch waits;
            # the agent's next heartbeat comes within its interval anyway.
            log.warning("could not read the answer to %s from Redis: %s", node.name, exc)
            return None
    with _answered_lock:
        return _answered.get(node.name)


# --- the steady heartbeat: one read, no write in the request --------------------------------
#
# Nearly every heartbeat says what the previous one said: the same attempts still running, no
# new condition. Such a heartbeat moves nothing on, so it needs no lock and no transaction: one
# indexed read (the node by its token hash, with its desired-state generation) tells that it is
# steady, and the node's liveness, its GPUs' readings and its attempts' energy join the
# telemetry batch. Every other heartbeat takes the full path below, which writes in the
# request, under the node lock.
#
# The answer is cached per process by (token hash, generation). PostgreSQL triggers count every
# change of a column the answer reads (declared in controlplane.cluster.desired_state, counted
# by the triggers of cluster migrations 0002 and 0007) in its generation, in the writer's own
# transaction, so no code path can change the desired state and leave a stale answer. On a
# generation this process has not seen, one more read fetches the work and caps.


@dataclass(slots=True)
class NodeInfo:
    """The fields of a node a heartbeat reads: a Node's, without a model instance's cost."""

    pk: int
    name: str
    ready: bool
    last_heartbeat_at: dt.datetime | None
    heartbeat_interval_s: float
    conditions: list
    token_hash: str

    def as_node(self) -> Node:
        return Node(
            id=self.pk,
            name=self.name,
            ready=self.ready,
            last_heartbeat_at=self.last_heartbeat_at,
            heartbeat_interval_s=self.heartbeat_interval_s,
            conditions=self.conditions,
            token_hash=self.token_hash,
        )


@dataclass(frozen=True, slots=True)
class NodeRead:
    """A heartbeat's node, and the generation of its desired state (None: not counted here)."""

    node: NodeInfo
    generation: int | None


@dataclass(frozen=True, slots=True)
class Prepared:
    """The answer for one node's work and caps: parsed, serialized, digested; shared, read-only."""

    work: dict[int, Work]
    body: bytes
    digest: str


def _node_read_sql() -> str:
    qn = connection.ops.quote_name
    node, generation = qn(Node._meta.db_table), qn(NodeGeneration._meta.db_table)
    return f"""
        SELECT n.id, n.name, n.ready, n.last_heartbeat_at, n.heartbeat_interval_s,
               n.conditions::text, COALESCE(ng.generation, 0)
        FROM {node} n LEFT JOIN {generation} ng ON ng.node_id = n.id
        WHERE n.token_hash = %s
    """


_sql: dict[str, str] = {}


def _prepared_fetch(name: str, build, params):
    """One row of a statement PostgreSQL plans once per connection, not on every heartbeat.

    Django's own cursors bind parameters on the client side, which makes PostgreSQL parse and
    plan each execution afresh; these statements run on every heartbeat.
    """
    sql = _sql.get(name)
    if sql is None:
        sql = _sql[name] = build()
    with bulk.server_cursor() as cursor:
        cursor.execute(sql, params, prepare=True)
        return cursor.fetchone()


def read_node(token_digest: str) -> NodeRead | None:
    """The node holding this token hash, with its generation; None when no node holds it
    (rotated, revoked, never issued). The generation is None outside PostgreSQL (the embedded
    mode's SQLite has no triggers), where every heartbeat takes the full path."""
    if connection.vendor != "postgresql":
        node = node_by_token_hash(token_digest)
        if node is None:
            lease.forget_token(token_digest)
            return None
        lease.remember_checked_token(token_digest, node.pk, node.name, node.heartbeat_interval_s)
        info = NodeInfo(
            node.pk,
            node.name,
            node.ready,
            node.last_heartbeat_at,
            node.heartbeat_interval_s,
            node.conditions,
            token_digest,
        )
        return NodeRead(info, None)
    row = _prepared_fetch("node", _node_read_sql, [token_digest])
    if row is None:
        lease.forget_token(token_digest)
        return None
    node_id, name, ready, last_heartbeat_at, interval_s, conditions, generation = row
    lease.remember_checked_token(token_digest, node_id, name, interval_s)
    info = NodeInfo(
        node_id,
        name,
        bool(ready),
        last_heartbeat_at,
        interval_s,
        json.loads(conditions) if conditions else [],
        token_digest,
    )
    return NodeRead(info, generation)


# Per process, the last answer prepared for each node, by (token hash, generation, interval).
# Bounded by the number of nodes this process hears from; an entry is replaced, never patched.
_prepared: dict[int, tuple[tuple, Prepared]] = {}


def prepared_answer(read: NodeRead) -> Prepared:
    node = read.node
    key = (node.token_hash, read.generation, node.heartbeat_interval_s)
    cached = _prepared.get(node.pk)
    if cached is not None and cached[0] == key:
        return cached[1]
    # Read after the generation: the work is at least as new as it, so caching it under that
    # generation can only be ahead of it, never behind. Only a generation this process has not
    # seen pays for these two reads.
    work, caps = load_work(node.pk), desired_caps(node.pk)
    answer = desired_state(work, caps, node.heartbeat_interval_s)
    prepared = Prepared(work=work, body=json.dumps(answer).encode(), digest=digest(answer))
    _prepared[node.pk] = (key, prepared)
    return prepared


def is_steady(node: NodeInfo, work: dict[int, Work], hb: Heartbeat, now: dt.datetime) -> bool:
    """True when this heartbeat changes nothing but liveness and readings.

    Every attempt of the node runs and is reported running, the conditions are the ones on
    record, and the node is ready and well inside its liveness window. The last guards against
    a liveness sweep: it declares attempts lost only after a lease and its margin of silence,
    under the node lock, which only the full path takes; a node heard from within
    NODE_NOT_READY_AFTER_INTERVALS intervals cannot be judged lost while this heartbeat (and
    the batch carrying its liveness, at most LIVENESS_BACKLOG_MAX_S later) is in flight.
    """
    if not node.ready or node.last_heartbeat_at is None or hb.address:
        return False
    if hb.unreadable_attempts or not hb.reports_complete:
        return False
    silent_s = (now - node.last_heartbeat_at).total_seconds()
    if silent_s >= settings.NODE_NOT_READY_AFTER_INTERVALS * node.heartbeat_interval_s:
        return False
    if hb.conditions or node.conditions:
        if _merge_conditions(node.conditions, hb.conditions, 0.0) != node.conditions:
            return False
    reports = {r.attempt_id: r for r in hb.attempts}
    acked = _checkpoints_acked.get(node.pk, {})
    for aid, w in work.items():
        r = reports.get(aid)
        if r is None or r.state != RUNNING or w.state != AttemptState.RUNNING:
            return False
        if _checkpoint_news(w, r, now, acked.get(aid)):
            return False
    # A running report of an attempt that is not the node's active work changes nothing on the
    # full path either (it is left out of the answer, so the agent stops it); an exit report of
    # one may be a late report of an attempt declared lost, which the full path records.
    return all(r.state == RUNNING for r in hb.attempts if r.attempt_id not in work)


# --- checkpoints as the node reports them ------------------------------------------------------
#
# An agent may repeat its checkpoint fields in every heartbeat. Those columns move no generation
# (they are in no answer), so a node's cached work keeps the values of when it was read; what
# this process itself stored since is remembered here, per node, so that a repeat of it is
# steady and only news takes the full path (once per change and process).
# Times are kept as the agent sent them (Unix seconds): one ahead of our clock is stored clamped
# to now, and compared clamped it would be news again on every heartbeat.
_checkpoints_acked: dict[int, dict[int, tuple[float | None, int]]] = {}


def _checkpoint_news(
    w: Work, r: AttemptReport, now: dt.datetime, acked: tuple[float | None, int] | None
) -> bool:
    """Whether the report says more of the attempt's checkpoints than is stored (`acked`: what
    this process stored; None: compare with the work as read from the database)."""
    if acked is None:
        stored = w.last_checkpoint_at
        last = None if stored is None else stored.timestamp()
        size = w.checkpoint_bytes
    else:
        last, size = acked
    if r.checkpoint_bytes is not None and r.checkpoint_bytes != size:
        return True
    if r.last_checkpoint_at is None:
        return False
    if acked is None:
        reported = from_unix(r.last_checkpoint_at, not_after=now)
        return reported is not None and (last is None or reported.timestamp() > last)
    return last is None or r.last_checkpoint_at > last


def _record_checkpoints(
    node: Node, work: dict[int, Work], reports: dict[int, AttemptReport], now: dt.datetime
) -> None:
    """Store what the reports say of the attempts' checkpoints, where it is news, and remember
    what is stored for the steady path."""
    rows = [
        actions.CheckpointReport(
            attempt_id=aid,
            job_id=w.job_id,
            last_checkpoint_at=from_unix(r.last_checkpoint_at, not_after=now),
            checkpoint_bytes=r.checkpoint_bytes,
        )
        for aid, r in reports.items()
        if (w := work.get(aid)) is not None and _checkpoint_news(w, r, now, None)
    ]
    if rows:
        _surviving_deadlocks(f"checkpoints of {node.name}", actions.record_checkpoints, rows)
    acked: dict[int, tuple[float | None, int]] = {}
    for aid, w in work.items():
        last = None if w.last_checkpoint_at is None else w.last_checkpoint_at.timestamp()
        size = w.checkpoint_bytes
        r = reports.get(aid)
        if r is not None:
            if r.last_checkpoint_at is not None and (last is None or r.last_checkpoint_at > last):
                last = r.last_checkpoint_at
            if r.checkpoint_bytes is not None:
                size = r.checkpoint_bytes
        acked[aid] = (last, size)
    _checkpoints_acked[node.pk] = acked


def _reported_energy(
    work: dict[int, Work], hb: Heartbeat, samples: dict[str, GpuSample]
) -> dict[int, tuple]:
    """_energy without the comparison with the stored figure: the cached work's copy of it goes
    stale as soon as a batch writes a newer one (energy does not move the generation)."""
    rows = {}
    for r in hb.attempts:
        w = work.get(r.attempt_id)
        if w is None or r.energy_j is None:
            continue
        rows[r.attempt_id] = _energy_row(r, w, samples)
    return rows


def _energy_row(r, w: Work, samples: dict[str, GpuSample]) -> tuple:
    """(energy so far, estimated?, the attempt's GPUs' counters by UUID) for the batch."""
    counters = {
        u: samples[u].energy_j
        for u in w.gpu_uuids
        if u in samples and samples[u].energy_j is not None
    }
    return (r.energy_j, r.energy_estimated, counters)


def answer_heartbeat(read: NodeRead, hb: Heartbeat, *, now: dt.datetime | None = None) -> bytes:
    """The JSON answer to one heartbeat: the steady path when it applies, else the full one."""
    now = now or timezone.now()
    node = read.node
    # A steady answer renews the lease before its liveness reaches the database (the batch):
    # only while this process's batches get there in time, which the lease margin allows for.
    if read.generation is not None and telemetry.buffer.alive_backlog_s() < (
        settings.LIVENESS_BACKLOG_MAX_S
    ):
        prepared = prepared_answer(read)
        if is_steady(node, prepared.work, hb, now):
            samples = {s.uuid: s for s in hb.gpus}
            telemetry.record(
                node.pk, now, samples, _reported_energy(prepared.work, hb, samples), alive=True
            )
            remember_answer(node, prepared.digest)
            return prepared.body
    return json.dumps(process_heartbeat(node.as_node(), hb, now=now)).encode()


# --- the heartbeat ---------------------------------------------------------------------------


def _merge_conditions(old: list, reported: tuple[ConditionReport, ...], now_ts: float) -> list:
    """The reported conditions, each keeping the time it was first seen."""
    since = {(c.get("type"), c.get("gpu_uuid")): c.get("since", now_ts) for c in old or []}
    return [
        {
            "type": c.type,
            "gpu_uuid": c.gpu_uuid,
            "message": c.message,
            "since": since.get((c.type, c.gpu_uuid), now_ts),
        }
        for c in reported
    ]


def _record(node: Node, hb: Heartbeat, now: dt.datetime) -> tuple[dict[int, Work], dict]:
    """The node is alive; returns its work and its GPUs' desired caps.

    Its GPUs' readings and its attempts' energy go to the telemetry batch (see
    controlplane.cluster.telemetry).
    """
    conditions = _merge_conditions(node.conditions, hb.conditions, now.timestamp())
    samples = {s.uuid: s for s in hb.gpus}
    with transaction.atomic():
        # The node row first: its lock orders this heartbeat against a liveness sweep that may
        # be declaring the node lost right now (see controlplane.cluster.tasks). The work is
        # read under it: attempts the sweep declared lost before we got the lock are no longer
        # active, so they are not in the answer.
        _mark_alive(node.pk, now, conditions)
        work = load_work(node.pk)
        caps = desired_caps(node.pk)
        telemetry.record(node.pk, now, samples, _energy(work, hb, samples))
    if not node.ready:
        log.info("node %s answers again after being declared not ready", node.name)
    node.ready = True
    node.last_heartbeat_at = now
    node.conditions = conditions
    return work, caps


def _mark_alive(node_id: int, now: dt.datetime, conditions: list) -> None:
    # Raw for the same reason as the node's read in agent_auth: this runs on every heartbeat.
    qn = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {qn(Node._meta.db_table)} "
            "SET last_heartbeat_at = %s, ready = %s, conditions = %s WHERE id = %s",
            [connection.ops.adapt_datetimefield_value(now), True, json.dumps(conditions), node_id],
        )


def _energy(work: dict[int, Work], hb: Heartbeat, samples: dict[str, GpuSample]) -> dict:
    """Energy so far of the node's running attempts, and their GPUs' counters, as reported."""
    rows = {}
    for r in hb.attempts:
        w = work.get(r.attempt_id)
        if w is None or w.state != AttemptState.RUNNING or r.state != RUNNING:
            continue
        if r.energy_j is None or r.energy_j == w.energy_j:
            continue
        rows[r.attempt_id] = _energy_row(r, w, samples)
    return rows


def _full_attempt(attempt_id: int) -> JobAttempt:
    return JobAttempt.objects.select_related("node", "job").get(pk=attempt_id)


def _apply_report(
    node: Node, w: Work, r: AttemptReport, counters: dict[str, float], now: dt.datetime
) -> None:
    """Move one attempt on as its report says; the actions guard every write."""
    if w.is_gang:
        _apply_member_report(node, w, r, now)
        return
    started_at = from_unix(r.started_at, not_after=now)
    if (
        w.state == AttemptState.ADMITTED
        and r.state in (RUNNING, EXITED)
        and (r.state == RUNNING or started_at is not None)
    ):
        attempt = _full_attempt(w.attempt_id)
        actions.mark_attempt_running(
            attempt,
            started_at=started_at or now,
            energy_start_j={u: counters[u] for u in w.gpu_uuids if u in counters},
        )
        w.state = AttemptState.RUNNING
        w.started_at = started_at or now
    if r.state == RUNNING:
        return
    attempt = _full_attempt(w.attempt_id)
    finished_at = from_unix(r.finished_at, not_after=now) or now
    if r.stop_cause is not None and not w.stop_requested:
        # The node stopped it on its own (its lease was running out, or it was not in the
        # answer it had): not the job's doing, so the job is requeued (or fails, when it is
        # not restartable and had started) as for a lost node, and its GPUs are free: the
        # node says the process is gone.
        why = _node_stop(node, r)
        lost, message = True, why[0].upper() + why[1:]
    elif r.state == EXITED:
        # No code: the agent's was unreadable (the parse said so); the job fails, saying why.
        lost = False
        message = "" if r.exit_code is not None else f"Exited on {node.name}, exit code unknown"
    else:
        lost, message = False, f"Failed to start on {node.name}: {r.message or 'no reason given'}"
    actions.finish_attempt(
        attempt,
        exit_code=r.exit_code if r.state == EXITED else None,
        finished_at=finished_at,
        energy_j=r.energy_j,
        energy_estimated=r.energy_estimated,
        lost=lost,
        never_started=lost and r.state == FAILED_TO_START,
        reported=True,
        message=message,
        notice=_notice(r, now),
    )
    w.state = AttemptState.FAILED  # no longer active: left out of the answer


def _node_stop(node: Node, r: AttemptReport) -> str:
    """Why the node stopped an attempt on its own, in words."""
    if r.stop_cause == FENCED:
        return f"its node {node.name} stopped it: no heartbeat had been answered for its lease"
    if r.stop_cause == PORT_BUSY:
        return f"it could not start on {node.name}: {r.message or 'its master port is taken'}"
    return f"the agent on {node.name} stopped it: it was not in its desired state"


def _apply_member_report(node: Node, w: Work, r: AttemptReport, now: dt.datetime) -> None:
    """A gang's member on this node, as its report says (actions.record_member_report)."""
    started_at = from_unix(r.started_at, not_after=now)
    if r.state == RUNNING:
        if w.member_state == AttemptState.ADMITTED:
            actions.record_member_report(
                actions.MemberReport(w.attempt_id, node.pk, started_at=started_at or now)
            )
        return
    lost = r.stop_cause is not None and not w.stop_requested
    if lost:
        message = _node_stop(node, r)
    elif r.state == FAILED_TO_START:
        message = f"failed to start: {r.message or 'no reason given'}"
    else:
        message = "" if r.exit_code is not None else "exited, exit code unknown"
    actions.record_member_report(
        actions.MemberReport(
            w.attempt_id,
            node.pk,
            ended=True,
            exit_code=r.exit_code if r.state == EXITED else None,
            finished_at=from_unix(r.finished_at, not_after=now) or now,
            started_at=None if r.state == FAILED_TO_START else started_at,
            lost=lost,
            never_started=r.state == FAILED_TO_START,
            message=message,
            energy_j=r.energy_j,
            energy_estimated=r.energy_estimated,
            notice=_notice(r, now),
        )
    )
    w.state = AttemptState.FAILED  # its member here is gone: left out of this node's answer


def _notice(r: AttemptReport, now: dt.datetime) -> actions.StopNotice | None:
    """How the node says a stop went, when it says (only of an ended attempt)."""
    if r.state == RUNNING or (r.stop_signal_at is None and r.killed_after_grace is None):
        return None
    return actions.StopNotice(
        signal_at=from_unix(r.stop_signal_at, not_after=now),
        killed=r.killed_after_grace,
        cause={FENCED: "fenced", UNWANTED: "unwanted"}.get(r.stop_cause or "", ""),
    )


def _apply_late_report(node: Node, r: AttemptReport, now: dt.datetime) -> None:
    """An exit report of an attempt that is no longer active: a late one counts once.

    Only for an attempt declared lost while this node was silent, held on this node alone (a
    gang's members report for their own parts, which cannot tell how the whole ended).
    """
    if r.state == RUNNING:
        return
    attempt = (
        JobAttempt.objects.select_related("node", "job")
        .filter(pk=r.attempt_id, state=AttemptState.LOST, exit_reported_at__isnull=True)
        .first()
    )
    if attempt is None:
        return
    nodes = set(
        Allocation.objects.filter(attempt_id=attempt.pk).values_list("gpu__node_id", flat=True)
    )
    if attempt.node_id != node.pk or nodes - {node.pk}:
        return
    actions.record_late_exit(
        attempt,
        exit_code=r.exit_code,
        finished_at=from_unix(r.finished_at, not_after=now) or now,
        energy_j=r.energy_j,
        energy_estimated=r.energy_estimated,
        ended_by_itself=r.state == EXITED and r.stop_cause is None,
        notice=_notice(r, now),
        message=(
            f"was stopped by its node {node.name} as its lease ran out"
            if r.stop_cause == FENCED
            else ""
        ),
    )


def _withdraw_unstarted(
    node: Node, w: Work, previous_heard: dt.datetime | None, now: dt.datetime
) -> None:
    """An admitted attempt told to stop before its agent started it is finished, never run.

    The agent reports every attempt it started, in every heartbeat, until an exit is
    acknowledged; and it starts only what an answer lists. Once the node has been answered
    after the stop was asked (so its answers no longer list the attempt) and its next heartbeat
    does not report it, the agent never started it and never will: its GPUs are free.
    """
    if w.is_gang:
        if w.member_state != AttemptState.ADMITTED or w.stop_requested_at is None:
            return
        if previous_heard is None or previous_heard <= w.stop_requested_at:
            return
        actions.record_member_report(
            actions.MemberReport(
                w.attempt_id,
                node.pk,
                ended=True,
                finished_at=now,
                never_started=True,
                message=f"stopped on {node.name} before it started",
            )
        )
        w.state = AttemptState.STOPPED
        return
    if w.state != AttemptState.ADMITTED or w.stop_requested_at is None or not w.all_gpus_here:
        return
    if previous_heard is None or previous_heard <= w.stop_requested_at:
        return
    actions.finish_attempt(
        _full_attempt(w.attempt_id),
        exit_code=None,
        finished_at=now,
        never_started=True,
        reported=True,
        message=f"Stopped on {node.name} before it started",
    )
    w.state = AttemptState.STOPPED


def _forget_unreported(node: Node, w: Work, hb: Heartbeat, now: dt.datetime) -> None:
    """A running attempt the agent no longer reports is gone from the node (its state was wiped,
    the host rebooted). Starting it again would run the job twice; it is lost instead, and a
    restartable job gets a fresh attempt through the scheduler.

    Only when the heartbeat was sent after the attempt started (a heartbeat overtaken in flight
    does not count), and only when all its GPUs are here (a gang's other nodes report for
    themselves and may not have started their part yet); a gang's member here is lost alone.
    """
    if w.is_gang:
        started = w.member_started_at
        if w.member_state != AttemptState.RUNNING or started is None:
            return
        if hb.sent_at <= started.timestamp():
            return
        actions.record_member_report(
            actions.MemberReport(
                w.attempt_id,
                node.pk,
                ended=True,
                finished_at=now,
                lost=True,
                message=f"the agent on {node.name} no longer runs it",
            )
        )
        w.state = AttemptState.LOST
        return
    if w.state != AttemptState.RUNNING or w.started_at is None or not w.all_gpus_here:
        return
    if hb.sent_at <= w.started_at.timestamp():
        return
    actions.finish_attempt(
        _full_attempt(w.attempt_id),
        exit_code=None,
        finished_at=now,
        lost=True,
        message=f"The agent on {node.name} no longer runs it",
    )
    w.state = AttemptState.LOST


# PostgreSQL's "deadlock detected". The triggers of migration 0002 make every write of an
# attempt, allocation or cap lock its nodes' generation rows until commit. A gang's action
# locks all its nodes in one sorted statement, but a scheduling cycle's transaction locks its
# nodes over several statements (preemptions, then starts, then each cap), so the two can take
# the same rows in opposite orders; and a cancel locks the job before its attempts, where the
# actions write the attempt before they lock the job. PostgreSQL then aborts one of the two.
DEADLOCK_SQLSTATE = "40P01"
DEADLOCK_TRIES = 4
# The first pause, doubled for each further try; each is drawn from half to one and a half of
# it, so that two heartbeats that lost to the same cycle do not meet again.
DEADLOCK_PAUSE_S = 0.05


def _is_deadlock(exc: OperationalError) -> bool:
    return getattr(exc.__cause__, "sqlstate", None) == DEADLOCK_SQLSTATE


def _surviving_deadlocks(what: str, action, *args) -> None:
    """Run one action again when PostgreSQL chose its transaction as a deadlock's victim.

    The victim's transaction is rolled back whole, so nothing of it was written, and the
    actions guard every write on the state they find: running it again applies the report
    once. Only an action that is its own transaction is retried: inside a caller's, the
    caller's locks are still held and its work may be lost, so the error is theirs to handle.
    """
    for attempt in range(1, DEADLOCK_TRIES + 1):
        try:
            action(*args)
            return
        except OperationalError as exc:
            if not _is_deadlock(exc) or attempt == DEADLOCK_TRIES or connection.in_atomic_block:
                raise
            pause_s = DEADLOCK_PAUSE_S * 2 ** (attempt - 1) * random.uniform(0.5, 1.5)
            log.info(
                "%s lost a deadlock (try %d of %d), trying again in %.0f ms",
                what,
                attempt,
                DEADLOCK_TRIES,
                pause_s * 1000,
            )
            time.sleep(pause_s)


def _common_report(
    w: Work, r: AttemptReport, counters: dict[str, float], now: dt.datetime
) -> actions.Report | None:
    """The report as actions.record_reports takes it, when it is the common case: an attempt
    not told to stop, which the node started, or whose process ended by itself with a code."""
    if w.stop_requested or r.stop_cause is not None or w.state not in ACTIVE_ATTEMPT_STATES:
        return None
    if w.is_gang:
        return None  # each member moves alone (record_member_report)
    starting = w.state == AttemptState.ADMITTED
    started_at = from_unix(r.started_at, not_after=now) if starting else None
    start_j = {u: counters[u] for u in w.gpu_uuids if u in counters} if starting else None
    if r.state == EXITED and r.exit_code is not None:
        return actions.Report(
            w.attempt_id,
            started_at=started_at,
            energy_start_j=start_j,
            exit_code=r.exit_code,
            finished_at=from_unix(r.finished_at, not_after=now) or now,
            energy_j=r.energy_j,
            energy_estimated=r.energy_estimated,
            notice=_notice(r, now),
        )
    if starting and r.state == RUNNING:
        return actions.Report(w.attempt_id, started_at=started_at or now, energy_start_j=start_j)
    return None


def _record_common_reports(
    node: Node,
    work: dict[int, Work],
    reports: dict[int, AttemptReport],
    counters: dict[str, float],
    now: dt.datetime,
) -> set[int]:
    """Record the heartbeat's common starts and exits in one transaction; the ids recorded.

    The rest (and any the batch found moved on) take the one-attempt path after it."""
    batch = []
    for aid, r in reports.items():
        w = work.get(aid)
        common = _common_report(w, r, counters, now) if w is not None else None
        if common is not None:
            batch.append(common)
    if not batch:
        return set()
    recorded: set[int] = set()

    def record() -> None:
        recorded.clear()
        recorded.update(actions.record_reports(batch))

    try:
        _surviving_deadlocks(f"{len(batch)} report(s) of {node.name}", record)
    except (actions.IllegalTransition, actions.ConcurrentUpdate) as exc:
        log.info("reports of %s not applied as a batch: %s", node.name, exc)
        return set()
    for aid in recorded:
        r, w = reports[aid], work[aid]
        w.state = AttemptState.RUNNING if r.state == RUNNING else AttemptState.FAILED
        if r.state == RUNNING:
            w.started_at = from_unix(r.started_at, not_after=now) or now
    return recorded


def _about(attempt_id: int, w: Work | None) -> AbstractContextManager[None]:
    """Lines logged inside carry this attempt's ids (agents.logcontext); the node's name is
    bound around the whole heartbeat (agent_api.answer_heartbeat_request)."""
    if w is None:
        return logcontext.bound(attempt_id=attempt_id)
    return logcontext.bound(attempt_id=attempt_id, job_id=w.job_id, tenant=w.tenant_slug)


def _apply_one_report(
    node: Node,
    aid: int,
    w: Work | None,
    r: AttemptReport,
    counters: dict[str, float],
    now: dt.datetime,
) -> None:
    """A report the batch did not record: one attempt at a time."""
    if w is None:
        # Finished, lost, or not this node's: left out of the answer, so the agent stops it
        # if it still runs. An exit of one declared lost is how it really ended: recorded.
        try:
            _surviving_deadlocks(
                f"late report on attempt {aid} of {node.name}", _apply_late_report, node, r, now
            )
        except (actions.IllegalTransition, actions.ConcurrentUpdate) as exc:
            log.info("late report on attempt %s of %s not applied: %s", aid, node.name, exc)
        return
    try:
        _surviving_deadlocks(
            f"report on attempt {aid} of {node.name}", _apply_report, node, w, r, counters, now
        )
    except (actions.IllegalTransition, actions.ConcurrentUpdate) as exc:
        # Someone else moved the job on (a cancel, a sweep): the next heartbeat sees where.
        log.info("report on attempt %s of %s not applied: %s", aid, node.name, exc)


def _log_moved(node: Node, w: Work, r: AttemptReport) -> None:
    """A line for an attempt the report moved on: it started, or it ended and how."""
    if w.state == AttemptState.RUNNING:
        log.info("attempt running")
    elif r.stop_cause is not None and not w.stop_requested:
        log.warning("attempt ended: %s", _node_stop(node, r))
    elif r.state == FAILED_TO_START:
        log.info("attempt failed to start: %s", r.message or "no reason given")
    elif r.exit_code is None:
        log.info("attempt ended, exit code unknown")
    else:
        log.info("attempt exited with code %s", r.exit_code)


def process_heartbeat(node: Node, hb: Heartbeat, *, now: dt.datetime | None = None) -> dict:
    """Apply one heartbeat of `node` and return the desired state to answer with."""
    now = now or timezone.now()
    # When this node was last answered, before this heartbeat: its answers since then left out
    # whatever had been told to stop by then.
    previous_heard = node.last_heartbeat_at
    if hb.address:
        cluster_actions.record_node_address(node.pk, hb.address)
    work, caps = _record(node, hb, now)
    counters = {s.uuid: s.energy_j for s in hb.gpus if s.energy_j is not None}
    reports = {r.attempt_id: r for r in hb.attempts}
    _record_checkpoints(node, work, reports, now)
    was = {aid: w.state for aid, w in work.items()}
    recorded = _record_common_reports(node, work, reports, counters, now)
    for aid, r in reports.items():
        w = work.get(aid)
        with _about(aid, w):
            if aid not in recorded:
                _apply_one_report(node, aid, w, r, counters, now)
            if w is not None and w.state != was[aid]:
                _log_moved(node, w, r)
    for aid, w in work.items():
        if aid not in reports and not hb.may_have_reported(aid):
            with _about(aid, w):
                try:
                    _surviving_deadlocks(
                        f"loss of attempt {aid} of {node.name}",
                        _forget_unreported,
                        node,
                        w,
                        hb,
                        now,
                    )
                    _surviving_deadlocks(
                        f"withdrawal of attempt {aid} of {node.name}",
                        _withdraw_unstarted,
                        node,
                        w,
                        previous_heard,
                        now,
                    )
                except (actions.IllegalTransition, actions.ConcurrentUpdate) as exc:
                    log.info("attempt %s of %s not finished: %s", aid, node.name, exc)

    answer = desired_state(work, caps, node.heartbeat_interval_s)
    remember_answer(node, digest(answer))
    return answer
