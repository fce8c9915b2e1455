"""GPU telemetry from heartbeats: the latest values on the GPU rows, and a downsampled history.

Written in batches: a heartbeat leaves its readings (and its attempts' energy so far) in this
process's buffer, and a background thread writes everything buffered every
TELEMETRY_FLUSH_INTERVAL_S (1 s) in three statements, however many nodes reported. So 10,000
nodes heartbeating every 10 s cost PostgreSQL a few statements a second per web process, not
five per heartbeat. A reading lost with a crashed process is replaced by the next heartbeat's;
nothing that decides a job's fate travels this way (starts and exits are written at once, by
controlplane.jobs.actions). TELEMETRY_FLUSH_INTERVAL_S = 0 writes inline instead, in the
heartbeat's own transaction.

The history keeps one GpuTelemetry row per GPU per bucket (TELEMETRY_BUCKET_S, a minute by
default): each batch folds its samples into the buckets' running means with one upsert. Rows
older than TELEMETRY_RETENTION_S are deleted by the liveness sweep.
"""

from __future__ import annotations

import atexit
import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import KW_ONLY, dataclass

from django.conf import settings
from django.db import connection, models

from controlplane import bulk
from controlplane.cluster.models import GPU, GpuTelemetry

log = logging.getLogger(__name__)

TELEMETRY_BUCKET_S = float(getattr(settings, "TELEMETRY_BUCKET_S", 60.0))
TELEMETRY_RETENTION_S = float(getattr(settings, "TELEMETRY_RETENTION_S", 24 * 3600.0))
# The retention DELETE scans the history table, so it runs at most this often, not every sweep.
TELEMETRY_PRUNE_EVERY_S = float(getattr(settings, "TELEMETRY_PRUNE_EVERY_S", 600.0))

# GPU row fields a heartbeat rewrites. Absent readings are written as null: "not reported"
# must replace an old value, or a GPU whose sensor died would show its last reading forever.
LATEST_FIELDS = (
    "healthy",
    "power_cap_w",
    "utilization_pct",
    "memory_used_mib",
    "power_draw_w",
    "energy_j",
    "temperature_c",
    "sm_clock_mhz",
    "throttle_reasons",
    "ecc_errors",
    "telemetry_at",
)
# Written apart from the numbers: a JSON list of names and an integer count.
HEALTH_FIELDS = ("throttle_reasons", "ecc_errors")
_NUMBERS = tuple(f for f in LATEST_FIELDS if f not in (*HEALTH_FIELDS, "healthy", "telemetry_at"))
# History fields averaged over the bucket; power_cap_w keeps the highest value instead, since a
# cap is a setting, and its mean over a change would be a cap nobody ever set. The highest, not
# the latest: a bucket in which the cap came down from 700 W to 200 W averages draws made under
# both, and its mean draw (say 380 W) must not read as drawing above a 200 W cap.
MEAN_FIELDS = ("utilization_pct", "memory_used_mib", "power_draw_w", "temperature_c")


@dataclass(frozen=True, slots=True)
class GpuSample:
    """What one heartbeat says about one GPU. None: the agent could not read it."""

    uuid: str
    healthy: bool = True
    utilization_pct: float | None = None
    memory_used_mib: float | None = None
    power_draw_w: float | None = None
    power_cap_w: float | None = None
    energy_j: float | None = None
    temperature_c: float | None = None
    sm_clock_mhz: float | None = None
    # Named only: a heartbeat's numbers fill the fields above in order (agent_api.gpu_sample).
    _: KW_ONLY
    throttle_reasons: tuple[str, ...] | None = None
    ecc_errors: int | None = None


def bucket_start(at: dt.datetime, bucket_s: float = TELEMETRY_BUCKET_S) -> dt.datetime:
    ts = at.timestamp()
    return dt.datetime.fromtimestamp(ts - ts % bucket_s, tz=dt.UTC)


def write_latest(
    readings: dict[int, tuple[dt.datetime, dict[str, GpuSample]]],
) -> list[tuple[int, int, str]]:
    """Write every GPU row of these nodes in one UPDATE; returns (gpu id, node id, uuid) of each.

    `readings` maps a node id to the time of its heartbeat and its samples by GPU UUID. A GPU
    its node no longer lists is unhealthy with no readings (and keeps its last reading time).

    Raw over controlplane.bulk's rows rather than its update_rows: the rows are keyed by (node,
    UUID), as the agent knows its GPUs, and the GPUs of these nodes that no row names must be
    written too (unhealthy); one statement does both, where an id look-up first would cost a
    round trip per batch.
    """
    if not readings:
        return []
    table = connection.ops.quote_name(GPU._meta.db_table)
    rows = [
        (
            node_id,
            s.uuid,
            at,
            s.healthy,
            *(getattr(s, f) for f in _NUMBERS),
            None if s.throttle_reasons is None else list(s.throttle_reasons),
            s.ecc_errors,
        )
        for node_id, (at, samples) in readings.items()
        for s in samples.values()
    ]

    def gpu(name: str) -> models.Field:
        return bulk.field(GPU, name)

    readings_source, params = bulk.rows_from(
        "v",
        [
            ("node", gpu("node")),
            ("u", gpu("uuid")),
            ("at", gpu("telemetry_at")),
            ("healthy", gpu("healthy")),
            *((f, gpu(f)) for f in _NUMBERS),
            ("throttle_reasons", gpu("throttle_reasons")),
            ("ecc_errors", gpu("ecc_errors")),
        ],
        rows,
    )
    nodes_source, node_params = bulk.rows_from("n", [("id", gpu("node"))], [(n,) for n in readings])
    assignments = ", ".join(
        [
            "healthy = CASE WHEN x.u IS NULL THEN FALSE ELSE x.healthy END",
            *(f"{f} = x.{f}" for f in (*_NUMBERS, *HEALTH_FIELDS)),
            f"telemetry_at = CASE WHEN x.u IS NULL THEN {table}.telemetry_at ELSE x.at END",
        ]
    )
    sql = (
        f"UPDATE {table} SET {assignments} "
        f"FROM (SELECT g.id AS gid, v.* FROM {table} g JOIN {nodes_source} ON n.id = g.node_id "
        f"LEFT JOIN {readings_source} ON v.node = g.node_id AND v.u = g.uuid) x "
        f"WHERE {table}.id = x.gid "
        f"RETURNING {table}.id, {table}.node_id, {table}.uuid"
    )
    with bulk.cursor() as cursor:
        bulk.execute(cursor, sql, node_params + params)
        return list(cursor.fetchall())


def record_history(
    samples: Iterable[tuple[int, dt.datetime, GpuSample]], bucket_s: float = TELEMETRY_BUCKET_S
) -> int:
    """Fold (gpu id, time, sample) into the GPUs' buckets with a single upsert; returns the count.

    Raw over controlplane.bulk's rows because an upsert through the ORM (or bulk.insert_rows)
    can only overwrite, and a bucket keeps a running mean:
    new = (old * samples + sample) / (samples + 1). A null sample leaves the mean alone.
    """
    rows = [
        (
            gpu_id,
            bucket_start(at, bucket_s),
            *(getattr(sample, f) for f in MEAN_FIELDS),
            sample.power_cap_w,
        )
        for gpu_id, at, sample in samples
    ]
    if not rows:
        return 0
    table = connection.ops.quote_name(GpuTelemetry._meta.db_table)
    values = ("gpu_id", "bucket_at", *MEAN_FIELDS, "power_cap_w")
    source, params = bulk.rows_from("v", [(f, bulk.field(GpuTelemetry, f)) for f in values], rows)
    mean_updates = ", ".join(
        f"{f} = CASE WHEN excluded.{f} IS NULL THEN {table}.{f} "
        f"WHEN {table}.{f} IS NULL THEN excluded.{f} "
        f"ELSE ({table}.{f} * {table}.samples + excluded.{f}) / ({table}.samples + 1) END"
        for f in MEAN_FIELDS
    )
    # SQLite's two-argument MAX is PostgreSQL's GREATEST.
    highest = "GREATEST" if connection.vendor == "postgresql" else "MAX"
    # "WHERE true": SQLite needs it to tell the upsert's ON CONFLICT from a join's ON.
    sql = (
        f"INSERT INTO {table} (samples, {', '.join(values)}) "
        f"SELECT 1, {', '.join(values)} FROM {source} WHERE true "
        f"ON CONFLICT (gpu_id, bucket_at) DO UPDATE SET {mean_updates}, "
        f"power_cap_w = {highest}("
        f"COALESCE(excluded.power_cap_w, {table}.power_cap_w), "
        f"COALESCE({table}.power_cap_w, excluded.power_cap_w)), "
        f"samples = {table}.samples + 1"
    )
    with bulk.cursor() as cursor:
        bulk.execute(cursor, sql, params)
    return len(rows)


# --- batching --------------------------------------------------------------------------------

ENERGY_FIELDS = ("energy_j", "energy_estimated", "energy_last_j")


def write_batch(
    readings: dict[int, tuple[dt.datetime, dict[str, GpuSample]]], energy: dict[int, tuple]
) -> None:
    """Write one batch: energy of running attempts, GPU rows, history. At most three statements.

    `energy` maps an attempt id to (energy_j, energy_estimated, GPU counters by UUID); an
    attempt that ended meanwhile keeps its final figures (the state condition).
    """
    from controlplane.jobs.models import AttemptState, JobAttempt

    # Attempt rows before GPU rows: the order the scheduler's plan applier takes them in.
    bulk.update_rows(
        JobAttempt,
        ENERGY_FIELDS,
        [(aid, *row) for aid, row in energy.items()],
        only_if={"state": AttemptState.RUNNING},
    )
    gpus = write_latest(readings)
    record_history(
        (gpu_id, readings[node_id][0], readings[node_id][1][uuid])
        for gpu_id, node_id, uuid in gpus
        if uuid in readings[node_id][1]
    )


class TelemetryBuffer:
    """What this process's heartbeats reported since the last flush, latest per node."""

    def __init__(self, *, background: bool = True) -> None:
        # background=False: nothing is written until flush() is called.
        self._background = background
        self._lock = threading.Lock()
        self._readings: dict[int, tuple[dt.datetime, dict[str, GpuSample]]] = {}
        self._energy: dict[int, tuple] = {}
        self._alive: dict[int, dt.datetime] = {}
        # When the oldest liveness not yet in the database was buffered (monotonic), or None;
        # and the same for the batch being written right now.
        self._alive_since: float | None = None
        self._writing_since: float | None = None
        self._answers: dict[str, tuple[str, int]] = {}
        self._refreshes: dict[str, Refresh] = {}
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()

    def add(
        self,
        node_id: int,
        at: dt.datetime,
        samples: dict[str, GpuSample],
        energy: dict[int, tuple],
        *,
        alive: bool = False,
    ) -> None:
        with self._lock:
            self._readings[node_id] = (at, samples)
            self._energy.update(energy)
            if alive:
                self._alive[node_id] = at
                if self._alive_since is None:
                    self._alive_since = time.monotonic()
            self._start_thread()

    def add_answer(self, key: str, answer_digest: str, ttl_s: int) -> None:
        """A Redis key (what a node was last told) to set with the next batch."""
        with self._lock:
            self._answers[key] = (answer_digest, ttl_s)
            self._start_thread()

    def add_refresh(self, key: str, value: str, ttl_s: int, on_other: Callable[[], None]) -> None:
        """Renew the expiry of a Redis key with the next batch, if it still holds `value`;
        `on_other()` is called when it holds something else or nothing."""
        with self._lock:
            self._refreshes[key] = Refresh(value, ttl_s, on_other)
            self._start_thread()

    def _start_thread(self) -> None:
        if self._background and (self._thread is None or not self._thread.is_alive()):
            self._thread = threading.Thread(target=self._run, name="telemetry-flush", daemon=True)
            self._thread.start()

    def pending(self) -> int:
        with self._lock:
            return len(self._readings)

    def alive_backlog_s(self) -> float:
        """How long the oldest buffered liveness has waited for the database (0: none waits).

        Heartbeats answered from the buffer renew leases on the strength of it; past a few
        seconds (a database that does not take the batches) they must write it themselves.
        """
        waiting = [t for t in (self._alive_since, self._writing_since) if t is not None]
        return time.monotonic() - min(waiting) if waiting else 0.0

    def flush(self) -> int:
        """Write what is buffered now; returns how many nodes' readings were written."""
        from django.db import transaction

        with self._lock:
            readings, self._readings = self._readings, {}
            energy, self._energy = self._energy, {}
            alive, self._alive = self._alive, {}
            alive_since, self._alive_since = self._alive_since, None
            self._writing_since = alive_since
            answers, self._answers = self._answers, {}
            refreshes, self._refreshes = self._refreshes, {}
        if answers or refreshes:
            write_answers(answers, refreshes)
        if alive:
            try:
                # On its own, before the batch's transaction: node rows are locked for as long
                # as one statement, never while attempt or GPU rows wait.
                write_alive(alive)
            except Exception:
                # Kept for the next batch, and its age with it: while it grows, heartbeats of
                # this process stop renewing leases from the buffer (alive_backlog_s).
                log.exception("could not record liveness of %d nodes", len(alive))
                with self._lock:
                    for node_id, at in alive.items():
                        if node_id not in self._alive or self._alive[node_id] < at:
                            self._alive[node_id] = at
                    if alive_since is not None:
                        self._alive_since = min(alive_since, self._alive_since or alive_since)
            finally:
                self._writing_since = None
        if not readings and not energy:
            return 0
        try:
            with transaction.atomic():
                write_batch(readings, energy)
        except Exception:
            # Telemetry only: the next heartbeats bring fresh readings, so drop, don't pile up.
            log.exception("could not write telemetry of %d nodes; dropped", len(readings))
            return 0
        return len(readings)

    def _run(self) -> None:
        from django.db import connection as thread_connection

        try:
            while True:
                self._wake.wait(flush_interval_s() or 1.0)
                self._wake.clear()
                try:
                    self.flush()
                    # This thread's own connection: let Django recycle it like a request's.
                    thread_connection.close_if_unusable_or_obsolete()
                except Exception:
                    # Liveness rides these batches: the thread must outlive a database or Redis
                    # outage, or every node would look silent once it is over.
                    log.exception("telemetry flush failed; retrying at the next interval")
        finally:
            thread_connection.close()


def flush_interval_s() -> float:
    return float(getattr(settings, "TELEMETRY_FLUSH_INTERVAL_S", 1.0))


buffer = TelemetryBuffer()
atexit.register(buffer.flush)


def record(
    node_id: int,
    at: dt.datetime,
    samples: dict[str, GpuSample],
    energy: dict[int, tuple],
    *,
    alive: bool = False,
) -> None:
    """A heartbeat's readings: buffered for the next batch, or written now (interval 0).

    alive: the node's last_heartbeat_at moves to `at` with them (the heartbeat wrote nothing).
    """
    if flush_interval_s() > 0:
        buffer.add(node_id, at, samples, energy, alive=alive)
    else:
        if alive:
            write_alive({node_id: at})
        write_batch({node_id: (at, samples)}, energy)


def write_alive(alive: dict[int, dt.datetime]) -> int:
    """Move these nodes' last_heartbeat_at forward (never back) in one statement.

    Only the time: a node the liveness sweep declared not ready is made ready again by the
    full heartbeat path, under its lock (controlplane.cluster.heartbeat). Raw over
    controlplane.bulk's rows rather than its update_rows for the "never back" condition, which
    compares each row with its own new value.
    """
    from controlplane.cluster.models import Node

    if not alive:
        return 0
    table = connection.ops.quote_name(Node._meta.db_table)
    # Sorted, so that two processes' batches lock the rows they share in the same order.
    source, params = bulk.rows_from(
        "v",
        [("k", Node._meta.pk), ("at", bulk.field(Node, "last_heartbeat_at"))],
        sorted(alive.items()),
    )
    sql = (
        f"UPDATE {table} SET last_heartbeat_at = v.at FROM {source} "
        f"WHERE {table}.id = v.k AND ({table}.last_heartbeat_at IS NULL "
        f"OR {table}.last_heartbeat_at < v.at)"
    )
    with bulk.cursor() as cursor:
        bulk.execute(cursor, sql, params)
        return cursor.rowcount


@dataclass(frozen=True, slots=True)
class Refresh:
    value: str
    ttl_s: int
    on_other: Callable[[], None]


# Renews the key's expiry only while it holds the value: a refresh that set the value instead
# could land after another process's newer answer and bring back one the node was told before.
_REFRESH_IF_SAME = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then "
    "return redis.call('EXPIRE', KEYS[1], ARGV[2]) end return 0"
)


def write_answers(
    answers: dict[str, tuple[str, int]], refreshes: dict[str, Refresh] | None = None
) -> None:
    """Set these Redis keys and renew those (what each node was last told) in one round trip."""
    if not settings.REDIS_URL:
        return
    refreshes = refreshes or {}
    try:
        from controlplane.redis_client import get_redis

        pipe = get_redis().pipeline(transaction=False)
        for key, (value, ttl_s) in answers.items():
            pipe.set(key, value, ex=ttl_s)
        for key, refresh in refreshes.items():
            pipe.eval(_REFRESH_IF_SAME, 1, key, refresh.value, refresh.ttl_s)
        results = pipe.execute()
    except Exception:
        # Kept as they are: once Redis is back, the next refresh of each tells what it holds.
        log.warning(
            "could not refresh %d answers in Redis", len(answers) + len(refreshes), exc_info=True
        )
        return
    for refresh, renewed in zip(refreshes.values(), results[len(answers) :], strict=True):
        if not renewed:
            refresh.on_other()


_last_prune_lock = threading.Lock()
_last_prune_monotonic: float | None = None


def prune_history(now: dt.datetime, *, force: bool = False) -> int:
    """Delete history older than the retention; at most once per TELEMETRY_PRUNE_EVERY_S.

    Several workers may run the sweep; the Redis key (or, without Redis, this process's clock)
    keeps them from each scanning the table. Deleting twice would be harmless, only wasteful.
    """
    global _last_prune_monotonic
    if not force and not _prune_is_due():
        return 0
    cutoff = now - dt.timedelta(seconds=TELEMETRY_RETENTION_S)
    deleted, _ = GpuTelemetry.objects.filter(bucket_at__lt=cutoff).delete()
    with _last_prune_lock:
        _last_prune_monotonic = time.monotonic()
    if deleted:
        log.info("pruned %d telemetry rows older than %s", deleted, cutoff.isoformat())
    return deleted


def _prune_is_due() -> bool:
    if settings.REDIS_URL:
        try:
            from controlplane.redis_client import deployment_key, get_redis

            ttl_ms = max(1, int(TELEMETRY_PRUNE_EVERY_S * 1000))
            key = deployment_key("telemetry-pruned")  # another deployment prunes its own rows
            return bool(get_redis().set(key, "1", nx=True, px=ttl_ms))
        except Exception:
            log.warning("Redis unavailable; deciding on telemetry pruning locally", exc_info=True)
    with _last_prune_lock:
        last = _last_prune_monotonic
    return last is None or time.monotonic() - last >= TELEMETRY_PRUNE_EVERY_S
