"""The reconcile loop: observe, report, do what the answer says. Level-triggered, like a kubelet.

Each heartbeat carries everything the node observes (GPU telemetry, every attempt it runs or saw
end and not yet had acknowledged); its answer is everything the node should be doing. The loop
then starts the listed attempts it does not run, stops the ones it runs that are not listed
(fencing), and applies the caps that differ. Nothing here decides anything; a lost or repeated
message changes nothing, and a control plane that cannot be reached never stops a job.

Between heartbeats the loop blocks on the watch long-poll (in a thread), so new work starts
within a second of being admitted, and polls its runtime, so an exit is reported at once.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from agents import __version__, limits
from agents import lease as leases
from agents.client import (
    Backoff,
    ControlPlaneClient,
    ControlPlaneError,
    ControlPlaneUnavailable,
    Rejected,
    Unauthorized,
)
from agents.fence import AGENT_LOCK, ensure_fence, holding
from agents.gpu.base import GpuBackend, GpuError, GpuTelemetry
from agents.journal import AttemptJournal
from agents.logcontext import bound
from agents.runtime.base import (
    DEFAULT_STOP_SIGNAL,
    AttemptSpec,
    AttemptState,
    AttemptStatus,
    Runtime,
    StartError,
    write_json_atomic,
)
from agents.volumes import StorageWorker, scan_checkpoint_lines

log = logging.getLogger(__name__)

LOG_CHUNK_BYTES = 64 * 1024
# Per attempt and cycle, so a chatty job cannot delay the heartbeat much.
LOG_CHUNKS_PER_CYCLE = 16
# Caps within this of the enforced one count as applied (NVML rounds to its own step).
CAP_TOLERANCE_W = 0.5
# Attempts the agent finished are remembered this long, so a stale answer can never start one
# of them a second time.
TOMBSTONE_TTL_S = 7 * 24 * 3600.0
# Tombstones are appended to a log, one fsync per cycle whatever the number of attempts
# forgotten, and folded into the snapshot once the log holds this many (or as many as the
# snapshot): rewriting the whole week's list at every forget cost O(n^2) in a flood of jobs.
TOMBSTONE_LOG_COMPACT_AT = 1000
# After the runtime says an attempt ended, the loop waits this long before it reports, so that
# the jobs of one flood that end together (they started together) go in one heartbeat.
EXIT_SETTLE_S = 0.02
# How often the loop makes sure the node's fence runs.
FENCE_CHECK_EVERY_S = 5.0
# Why the node ended an attempt (reported as its stop_cause; absent: it ended by itself).
FENCED = "fenced"
UNWANTED = "unwanted"
PORT_BUSY = "port_busy"  # never started: its master port was taken
# An ended attempt with a checkpoint dir is kept (reported) until the dir's size after its end
# was reported, but no longer than this: a hung file system must not keep it for ever.
FINAL_SIZE_WAIT_S = 120.0


class RegistrationRefused(Exception):
    """The control plane refused the join token or the inventory: a person must look."""


@dataclass
class AgentConfig:
    """Everything the agent is told at start (flags and environment, see __main__)."""

    url: str
    state_dir: Path
    node_name: str = field(default_factory=socket.gethostname)
    join_token: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    runtime: str = "process"
    gpu_backend: str = "auto"
    # None: use what the control plane says (register and every heartbeat answer).
    heartbeat_interval_s: float | None = None
    watch: bool = True
    watch_timeout_s: float = 20.0
    poll_interval_s: float = 0.5
    # How often new output of running jobs is shipped between heartbeats: someone following a
    # job's log (`gpucp logs -f`) sees a line about this long after it is printed, not a whole
    # heartbeat interval later. 0 ships output with the heartbeats only.
    log_flush_interval_s: float = 0.5
    stop_grace_s: float = 10.0
    power_cap_dry_run: bool = False
    # Stop every attempt when the agent stops: for a demo on a laptop, never for a real node.
    stop_jobs_on_exit: bool = False
    docker_url: str | None = None
    cpus: int | None = None
    memory_mib: int | None = None
    request_timeout_s: float = 10.0
    backoff_max_s: float = 30.0
    # Start the node's fence (agents.fence) when none runs. Off only where jobs must never be
    # stopped for lost contact, at the price of the promise that no job runs twice.
    fence: bool = True
    # The address other nodes' members of a job reach this node at (None: the source address
    # of the route to the control plane), and the ports the control plane may give a job whose
    # rank 0 runs here as its master port.
    advertise_address: str | None = None
    job_port_range: tuple[int, int] = (29500, 29999)
    # The agent's log format (agents.logcontext.FORMATS), which the fence it starts uses too.
    log_format: str = "plain"


@dataclass
class AttemptMeta:
    """What the agent keeps per attempt, in `<state-dir>/attempts.log` (agents.journal)."""

    attempt_id: int
    job_id: int | None = None
    gpu_uuids: list[str] = field(default_factory=list)
    max_runtime_s: float | None = None
    # GPU counters when it started; None per GPU where the counter is absent.
    energy_start_j: dict[str, float | None] = field(default_factory=dict)
    energy_j: float = 0.0
    energy_estimated: bool = False
    energy_at: float | None = None  # wall time of the last energy update (for integrating)
    log_offset: int = 0  # bytes of output the control plane acknowledged
    logs_rejected: bool = False  # the control plane will not take its logs (404): don't wait
    failed_message: str = ""  # set when the runtime could not start it
    failed_at: float | None = None
    message: str = ""
    ended: bool = False  # its exit has been seen (energy frozen)
    # Why the node ended it, when it did: "fenced" (its lease was running out) or "unwanted"
    # (the control plane no longer listed it). Empty: it ended by itself.
    stop_cause: str = ""
    # How it is stopped, from its desired entry (kept: an unwanted attempt is no longer in the
    # answer). grace_s None: the agent's own --stop-grace (a record of an older agent).
    stop_signal: str = DEFAULT_STOP_SIGNAL
    grace_s: float | None = None
    checkpoint_dir: str = ""  # host path; "" when the job has none
    last_checkpoint_at: float | None = None  # Unix seconds, the newest checkpoint seen
    checkpoint_bytes: int | None = None
    ended_at: float | None = None  # wall time its end was seen
    # Where the checkpoint-line scan of its output stands (agents.volumes.scan_checkpoint_lines).
    log_line_head: str | None = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AttemptMeta:
        """Read a record, ignoring keys of other versions."""
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def _unapplied_reports(warnings: dict[str, Any]) -> frozenset[int]:
    """Indexes of `attempts[]` entries the control plane could not apply (named in its
    warnings by the entry itself, or by its attempt_id, state or stop_cause)."""
    unapplied = set()
    for path in warnings:
        match = _UNAPPLIED.fullmatch(path)
        if match:
            unapplied.add(int(match.group(1)))
    return frozenset(unapplied)


_UNAPPLIED = re.compile(r"attempts\[(\d+)\](?:\.(?:attempt_id|state|stop_cause))?")


def _exit_code(attempt_id: int, exit_code: int | None) -> int | None:
    """The exit code as reported, or None (unknown) when no process could have produced it."""
    if exit_code is None or limits.MIN_EXIT_CODE <= exit_code <= limits.MAX_EXIT_CODE:
        return exit_code
    log.warning(
        "attempt %d: exit code %r is not one a process has; reported as unknown",
        attempt_id,
        exit_code,
    )
    return None


def _energy_j(energy_j: float) -> float | None:
    if limits.in_range(energy_j, 0.0, limits.MAX_ENERGY_J):
        return round(energy_j, 3)
    log.warning("attempt energy %r J is out of range; left out", energy_j)
    return None


def primary_address(url: str) -> str:
    """The source address of this host's route to the control plane at `url` (else of its
    default route; else its host name): the address its peers most likely reach it at. A UDP
    socket's connect sends nothing; it only asks the kernel for the route."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    targets = [(parts.hostname or "", parts.port or 443), ("192.0.2.1", 9)]
    for host, port in targets:
        if not host:
            continue
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0][0]
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((host, port))
                address = probe.getsockname()[0]
        except OSError:
            continue
        if address and address not in ("0.0.0.0", "::"):
            return str(address)
    return socket.gethostname()


def port_free(port: int) -> bool:
    """Whether a job on this host could listen on `port` now (the rank-0 member's master port)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            # As a server binds it (torchrun's store does): connections of an earlier job
            # lingering in TIME_WAIT do not make the port busy, a listener does.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("", port))
            probe.listen()
    except OSError:
        return False
    return True


def host_memory_mib() -> int:
    """The host's RAM in MiB."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)
    except (ValueError, OSError):
        return 0


class Agent:
    """One node's agent. `run()` blocks until `stop()` (or SIGTERM through __main__)."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        client: ControlPlaneClient,
        gpu: GpuBackend,
        runtime: Runtime,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        # Wall clock for energy and report times (a test drives it together with the GPU model).
        self._clock = clock
        self.client = client
        self.gpu = gpu
        self.runtime = runtime
        self.state_dir = Path(config.state_dir)
        # The sim speed files of running attempts, and the records of earlier agents.
        self._attempts_dir = self.state_dir / "attempts"
        self._attempts_dir.mkdir(parents=True, exist_ok=True)
        self._journal = AttemptJournal(self.state_dir / "attempts.log")
        self._tombstones_path = self.state_dir / "finished.json"
        self._tombstone_log_path = self.state_dir / "finished.log"
        self._tombstone_log_lines = 0
        self._meta: dict[int, AttemptMeta] = {}
        self._tombstones: dict[int, float] = {}
        self._conditions: dict[tuple[str, str], dict[str, Any]] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._exited = threading.Event()  # set by the runtime as an attempt's process ends
        self._seq = int(time.time() * 1000)  # grows across restarts without being stored
        self.interval_s = config.heartbeat_interval_s or 10.0
        self.backoff = Backoff(max_s=config.backoff_max_s)
        self.connected = False
        self.heartbeats_ok = 0
        # Notified as each heartbeat is answered (the watch re-arms after one, _watch_loop).
        self._answered = threading.Condition()
        self._last_reported: dict[int, str] = {}
        self._watch_thread: threading.Thread | None = None
        # The runtime's view of the attempts at the last heartbeat: whose output to ship
        # between heartbeats.
        self._statuses: dict[int, AttemptStatus] = {}
        self._speeds: dict[int, float] = {}
        # The lease the last answered heartbeat earned (None: none yet, or no lease protocol).
        self.lease: leases.Lease | None = leases.read_lease(self.state_dir)
        self._deferred: dict[int, str] = {}  # attempts not started yet, and why (logged once)
        self._degraded_logged = False
        self._telemetry_at: float | None = None
        # Checkpoints and volumes, in a thread of its own once run() starts (tests drive it
        # with storage.step()): a slow file system must never delay a heartbeat.
        self.storage = StorageWorker(client, runtime)
        self._storage_thread: threading.Thread | None = None
        self._final_sizes_in_body: set[int] = set()
        self._advertise_address: str | None = None
        # The control plane answered a heartbeat carrying this node's address and port range.
        self._address_told = False

    # -- lifecycle -------------------------------------------------------------------------------

    def stop(self) -> None:
        """Leave the loop soon. Jobs keep running; the next start adopts them."""
        self._stop.set()
        self._wake.set()
        with self._answered:
            self._answered.notify_all()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self) -> None:
        """Adopt what survived a restart, make sure the node is registered, then loop.

        The state directory is held (an flock) for the agent's lifetime: two agents on one
        directory would start every attempt twice.
        """
        try:
            with holding(self.state_dir / AGENT_LOCK):
                try:
                    # The fence first: adopted attempts of a lease that ran out while the
                    # agent was away must stop before anything else happens.
                    self.ensure_fence()
                    self.recover()
                    # An exit is reported as it happens, not at the next poll.
                    self.runtime.notify_exits(self._exit_seen)
                    self.ensure_registered()
                    if not self.stopping:
                        self._storage_thread = threading.Thread(
                            target=self.storage.run, args=(self._stop,), name="storage", daemon=True
                        )
                        self._storage_thread.start()
                    if self.config.watch and not self.stopping:
                        self._watch_thread = threading.Thread(
                            target=self._watch_loop, name="watch", daemon=True
                        )
                        self._watch_thread.start()
                    self._loop()
                finally:
                    self._shutdown()
        except BlockingIOError as exc:
            raise RuntimeError(f"another agent runs on {self.state_dir}") from exc

    def ensure_fence(self) -> None:
        """Start the node's fence unless one runs (config.fence)."""
        if not self.config.fence:
            return
        try:
            ensure_fence(
                self.state_dir,
                self.runtime.name,
                self.config.node_name,
                self.config.docker_url,
                log_format=self.config.log_format,
            )
        except OSError as exc:
            log.error("cannot start the node's fence: %s", exc)

    def _exit_seen(self) -> None:
        # While the control plane does not answer, the retry's backoff stands: the exit goes in
        # the next heartbeat that is tried anyway.
        if self.connected:
            self._exited.set()
            self._wake.set()

    def _loop(self) -> None:
        next_heartbeat = 0.0
        next_fence_check = time.monotonic() + FENCE_CHECK_EVERY_S
        flush_s = self.config.log_flush_interval_s
        next_log_flush = time.monotonic() + flush_s
        last_ok = True
        while not self.stopping:
            now = time.monotonic()
            due = now >= next_heartbeat or self._wake.is_set()
            if self._exited.is_set():
                self._exited.clear()
                self._stop.wait(EXIT_SETTLE_S)
            if due or (last_ok and self._local_change()):
                self._wake.clear()
                try:
                    last_ok = self.cycle()
                except Exception:  # a bug or an odd engine answer must never end the agent
                    log.exception("heartbeat cycle failed; trying again after a backoff")
                    last_ok = False
                delay_s = self.interval_s if last_ok else self._retry_delay_s()
                next_heartbeat = time.monotonic() + delay_s
            if now >= next_fence_check:
                self.ensure_fence()
                next_fence_check = now + FENCE_CHECK_EVERY_S
            if flush_s > 0 and last_ok and now >= next_log_flush:
                self._flush_logs()
                next_log_flush = time.monotonic() + flush_s
            wait_s = max(0.0, min(next_heartbeat - time.monotonic(), self.config.poll_interval_s))
            if flush_s > 0:
                wait_s = min(wait_s, max(0.0, next_log_flush - time.monotonic()))
            self._wake.wait(wait_s)

    def _retry_delay_s(self) -> float:
        """The backoff, but never so long that the fence acts between two tries.

        What counts is the first stop signal the fence would send (the lease's kill time less
        the longest grace of the attempts here), not the kill: a chaos run saw a node whose
        retries, spaced by a quarter of the time to the kill, missed the one window in which
        the control plane answered before the fence signalled a job."""
        delay_s = self.backoff.next_delay_s()
        lease = self.lease
        if lease is None:
            return delay_s
        remaining_s = lease.remaining_s()
        if remaining_s <= 0:
            return delay_s  # the fence has acted already: nothing to save
        longest_grace_s = max(
            (lease.grace_of(attempt_id) for attempt_id in self._meta), default=lease.grace_s
        )
        to_first_signal_s = remaining_s - longest_grace_s
        return min(delay_s, max(0.5, to_first_signal_s / 4))

    def _shutdown(self) -> None:
        if self.config.stop_jobs_on_exit:
            self._stop_all_attempts()
        self._journal.rewrite(self._records())
        self._journal.close()
        try:
            self.runtime.close()
        finally:
            self.gpu.close()
            self.client.close()
        log.info("agent stopped; its attempts keep running and are adopted at the next start")

    def _grace_s(self, attempt_id: int) -> float:
        """The attempt's own grace (from its desired entry), else the agent's --stop-grace."""
        meta = self._meta.get(attempt_id)
        if meta is None or meta.grace_s is None:
            return self.config.stop_grace_s
        return meta.grace_s

    def _stop_attempt(self, attempt_id: int) -> None:
        """Its stop signal now, SIGKILL at the end of its grace (every stop but the fence's)."""
        meta = self._meta.get(attempt_id)
        signal = meta.stop_signal if meta is not None else DEFAULT_STOP_SIGNAL
        with self._about(attempt_id):
            self.runtime.stop(attempt_id, self._grace_s(attempt_id), signal=signal)

    def _about(self, attempt_id: int, job_id: int | None = None) -> AbstractContextManager[None]:
        """Lines logged inside carry this attempt's id and its job's (agents.logcontext)."""
        if job_id is None:
            meta = self._meta.get(attempt_id)
            job_id = meta.job_id if meta is not None else None
        return bound(attempt_id=attempt_id, job_id=job_id)

    def _stop_all_attempts(self) -> None:
        running = [s.attempt_id for s in self.runtime.statuses() if s.state is AttemptState.RUNNING]
        for attempt_id in running:
            self._stop_attempt(attempt_id)
        longest_s = max((self._grace_s(a) for a in running), default=0.0)
        deadline = time.monotonic() + longest_s + 5.0
        while running and time.monotonic() < deadline:
            time.sleep(0.1)
            states = {s.attempt_id: s.state for s in self.runtime.statuses()}
            running = [a for a in running if states.get(a) is AttemptState.RUNNING]
        if running:
            log.warning("attempts %s still running after the grace period", running)
        else:
            log.info("stopped every attempt on the way out (--stop-jobs-on-exit)")

    def recover(self) -> None:
        """Re-read the state dir and adopt the runtime's attempts that outlived the last agent."""
        self._load_tombstones()
        for raw in self._journal.load().values():
            try:
                record = AttemptMeta.from_dict(raw)
            except TypeError as exc:
                log.warning("ignoring an unreadable record in %s: %s", self._journal.path, exc)
                continue
            # A tombstoned one was forgotten already: the agent died before its drop was written.
            if record.attempt_id not in self._tombstones:
                self._meta[record.attempt_id] = record
        # The records of an agent before the journal, one file each: taken over once.
        legacy = sorted(self._attempts_dir.glob("*.json"))
        for path in legacy:
            try:
                record = AttemptMeta.from_dict(json.loads(path.read_text()))
            except (OSError, ValueError, TypeError) as exc:
                log.warning("ignoring unreadable %s: %s", path, exc)
                continue
            if record.attempt_id not in self._tombstones:
                self._meta.setdefault(record.attempt_id, record)
        # Start from a log of only what is kept, synced before the files it replaces go.
        self._journal.rewrite(self._records())
        for path in legacy:
            path.unlink(missing_ok=True)
        adopted = {s.attempt_id: s for s in self.runtime.adopt()}
        for attempt_id in [a for a in adopted if a in self._tombstones]:
            self.runtime.remove(attempt_id)  # acknowledged before; only its cleanup was cut short
            del adopted[attempt_id]
        for attempt_id, status in adopted.items():
            meta = self._meta.get(attempt_id)
            if meta is None:
                # Its record is gone: count energy from now, and say that it is an estimate.
                meta = AttemptMeta(
                    attempt_id=attempt_id,
                    job_id=status.job_id,
                    gpu_uuids=list(status.gpu_uuids),
                    energy_start_j=self._counters(status.gpu_uuids),
                    energy_estimated=True,
                    energy_at=self._clock(),
                )
                self._meta[attempt_id] = meta
                self._save_meta(meta)
            if status.state is AttemptState.RUNNING:
                self.gpu.attach_load(attempt_id, meta.gpu_uuids)
            else:
                meta.ended = True  # it ended while we were away: keep the energy last recorded
        for attempt_id, meta in self._meta.items():
            if attempt_id not in adopted and not meta.failed_message:
                # The agent died between writing this record and starting the attempt.
                meta.failed_message = "the agent restarted while starting this attempt"
                meta.failed_at = self._clock()
                meta.ended = True
                self._save_meta(meta)
        if adopted:
            log.info("adopted %d attempt(s) from before the restart", len(adopted))

    def registration(self) -> dict[str, Any]:
        """The register request: the node and its GPU inventory."""
        shape = self.gpu.host_shape() or (os.cpu_count() or 0, host_memory_mib())
        return {
            "name": self.config.node_name,
            "cpus": self.config.cpus or shape[0],
            "memory_mib": self.config.memory_mib or shape[1],
            "labels": self.config.labels,
            "agent_version": __version__,
            "runtime": self.runtime.name,
            "gpus": [limits.checked_inventory(info.to_wire()) for info in self.gpu.inventory()],
            **self._address(),
        }

    def _address(self) -> dict[str, Any]:
        """Where this node's jobs are reached (registration, and heartbeats until one is
        answered: a restarted agent may have a new one)."""
        if self._advertise_address is None:
            self._advertise_address = self.config.advertise_address or primary_address(
                self.config.url
            )
        return {
            "advertise_address": self._advertise_address,
            "job_port_range": list(self.config.job_port_range),
        }

    def ensure_registered(self) -> None:
        """Register unless a node token is kept; retries while the control plane is away."""
        if self.client.node_token:
            return
        backoff = Backoff(max_s=self.config.backoff_max_s)
        while not self.stopping:
            try:
                answer = self.client.register(self.registration())
            except ControlPlaneUnavailable as exc:
                delay_s = backoff.next_delay_s()
                log.warning("cannot register yet (%s); retrying in %.1f s", exc, delay_s)
                self._stop.wait(delay_s)
                continue
            except (Unauthorized, Rejected) as exc:
                raise RegistrationRefused(str(exc)) from exc
            self._registered(answer)
            log.info("registered as %s", answer.get("node", self.config.node_name))
            return

    def _registered(self, answer: dict[str, Any]) -> None:
        # Attempt ids are unique within one control plane's database, and a registration may be
        # with a new one (a fresh demo database reuses id 1): its ids must not be refused.
        if self._tombstones:
            self._tombstones = {}
            self._compact_tombstones()
        self._take_interval(answer)

    def _take_interval(self, answer: dict[str, Any]) -> None:
        if self.config.heartbeat_interval_s is None and answer.get("heartbeat_interval_s"):
            self.interval_s = float(answer["heartbeat_interval_s"])

    # -- the watch -------------------------------------------------------------------------------

    def _watch_loop(self) -> None:
        backoff = Backoff(max_s=self.config.backoff_max_s)
        while not self.stopping:
            try:
                changed = self.client.watch(self.config.watch_timeout_s)
            except Exception as exc:  # ControlPlaneError, or an answer of the wrong shape
                delay_s = backoff.next_delay_s()
                log.debug("watch failed (%s); again in %.1f s", exc, delay_s)
                self._stop.wait(delay_s)
                continue
            backoff.reset()
            if changed:
                with self._answered:
                    seen = self.heartbeats_ok
                self._wake.set()
                # The control plane answers a watch at once while the node's last heartbeat
                # answer is older than its desired state. Re-armed before the heartbeat this
                # wake asks for is answered, the watch came straight back: a request, and the
                # desired state worked out for nothing, at every change. A heartbeat that
                # fails (or one answered before the change landed) only costs that round again.
                self._await_answer_after(seen)

    def _await_answer_after(self, seen: int) -> None:
        """Until a heartbeat after the `seen`-th was answered, the agent stops, or the request
        timeout passed (heartbeats failing)."""
        with self._answered:
            self._answered.wait_for(
                lambda: self.heartbeats_ok > seen or self.stopping,
                timeout=self.config.request_timeout_s,
            )

    # -- one cycle -------------------------------------------------------------------------------

    def _local_change(self) -> bool:
        """True when an attempt changed state since the last report (say, it exited)."""
        try:
            now = {s.attempt_id: s.state.value for s in self.runtime.statuses()}
        except Exception as exc:  # a runtime hiccup must not end the loop
            log.warning("cannot poll the runtime: %s", exc)
            return False
        return any(self._last_reported.get(k) != v for k, v in now.items())

    def cycle(self) -> bool:
        """Observe, report, reconcile. True when the control plane answered the heartbeat."""
        telemetry = self._telemetry()
        statuses = self._observe(telemetry)
        self._statuses = statuses
        self._ship_logs(statuses)
        body = self._heartbeat_body(telemetry, statuses)
        # The lease counts from here: the control plane records the heartbeat later than this.
        sent_at = leases.boottime()
        try:
            answer = self.client.heartbeat(body)
            self._address_told = True
        except Unauthorized as exc:
            self._on_unauthorized(exc)
            return False
        except Rejected as exc:
            log.error("heartbeat refused: %s", exc)
            self.connected = False
            return False
        except ControlPlaneUnavailable as exc:
            if self.connected:
                left = f"{self.lease.remaining_s():.0f} s" if self.lease else "no lease"
                log.warning(
                    "control plane unreachable (%s); jobs keep running (%s left)", exc, left
                )
            self.connected = False
            return False
        if not self.connected:
            log.info("heartbeats answered")
        self.connected = True
        self.backoff.reset()
        with self._answered:
            self.heartbeats_ok += 1
            self._answered.notify_all()
        self._take_interval(answer)
        self._renew_lease(sent_at, answer)
        if answer.get("degraded"):
            # The control plane kept our lease but could record nothing: no exit is
            # acknowledged and its answer says nothing about what should run. Carry on as we are.
            if not self._degraded_logged:
                log.warning("control plane degraded: %s", answer.get("detail", ""))
                self._degraded_logged = True
            return True
        self._degraded_logged = False
        warnings = answer.get("warnings") or {}
        if warnings:
            log.warning("the control plane left parts of the heartbeat out: %s", warnings)
        self._forget_acknowledged(body, statuses, unapplied=_unapplied_reports(warnings))
        self.reconcile(answer, statuses)
        return True

    def _renew_lease(self, sent_at: float, answer: dict[str, Any]) -> None:
        """Record the lease this answer granted, for the fence (and for what we may start)."""
        try:
            lease_s = float(answer["lease_s"])
        except (KeyError, TypeError, ValueError):
            return  # a control plane without leases: nothing to keep
        try:
            margin_s = float(answer["fence_margin_s"])
        except (KeyError, TypeError, ValueError):
            margin_s = leases.margin_for(lease_s)
        graces = {aid: self._grace_s(aid) for aid in self._meta}
        renewed = leases.Lease.renewed(
            sent_at,
            lease_s,
            self.config.stop_grace_s,
            graces,
            margin_s=margin_s,
            signals={aid: meta.stop_signal for aid, meta in self._meta.items()},
        )
        # self.lease stays the lease on disk, the one the fence and the supervisor act on:
        # a renewal only a little later is not written (leases.rewrite_lag_s), and every
        # decision here that the fence must agree with is then taken on the older one.
        if leases.renewal_worth_writing(self.lease, renewed, graces, self.config.stop_grace_s):
            self.lease = renewed
            self._write_lease()

    def _write_lease(self) -> None:
        if self.lease is None:
            return
        try:
            leases.write_lease(self.state_dir, self.lease)
        except OSError as exc:
            # The fence keeps acting on the previous lease: too early, never too late.
            log.error("cannot write the lease file: %s", exc)

    def _lease_covers(self, started: list[int]) -> None:
        """Name the attempts just started in the lease (same end), so that the fence gives
        each its own signal and grace should no renewal come."""
        if self.lease is None or not started:
            return
        changed = False
        for attempt_id in started:
            meta = self._meta.get(attempt_id)
            if meta is None:
                continue
            grace_s = self._grace_s(attempt_id)
            if grace_s > self.lease.grace_of(attempt_id):
                self.lease.graces[str(attempt_id)] = grace_s
                changed = True
            if meta.stop_signal != DEFAULT_STOP_SIGNAL:
                self.lease.signals[str(attempt_id)] = meta.stop_signal
                changed = True
        if changed:  # one with no more than the lease's grace and SIGTERM is covered already
            self._write_lease()

    def _on_unauthorized(self, exc: Unauthorized) -> None:
        self.connected = False
        if not self.client.join_token:
            log.error("the node token was refused (%s) and there is no join token", exc)
            return
        log.warning("the node token was refused (%s); registering again", exc)
        try:
            answer = self.client.register(self.registration())
        except ControlPlaneError as register_exc:
            log.error("registering again failed: %s", register_exc)
            return
        self._registered(answer)

    def _telemetry(self) -> list[GpuTelemetry]:
        # The readings' time, for the energy at an attempt's exit (interpolated between them).
        self._telemetry_at = self._clock()
        try:
            readings = self.gpu.telemetry()
        except GpuError as exc:
            self._conditions[("GpuTelemetryFailed", "")] = {
                "type": "GpuTelemetryFailed",
                "gpu_uuid": None,
                "message": str(exc),
            }
            return []
        self._conditions.pop(("GpuTelemetryFailed", ""), None)
        return readings

    def _counters(self, gpu_uuids: Iterable[str]) -> dict[str, float | None]:
        counters: dict[str, float | None] = {}
        for uuid in gpu_uuids:
            try:
                counters[uuid] = self.gpu.energy_j(uuid)
            except GpuError:
                counters[uuid] = None
        return counters

    def _observe(self, telemetry: list[GpuTelemetry]) -> dict[int, AttemptStatus]:
        """The runtime's view plus the agent's own failures; energy and limits kept up to date."""
        statuses = {s.attempt_id: s for s in self.runtime.statuses()}
        now = self._clock() if self._telemetry_at is None else self._telemetry_at
        draw_w = {t.uuid: t.power_draw_w for t in telemetry}
        counters = {t.uuid: t.energy_j for t in telemetry}
        for attempt_id, meta in list(self._meta.items()):
            if meta.failed_message:
                statuses[attempt_id] = AttemptStatus(
                    attempt_id=attempt_id,
                    state=AttemptState.FAILED_TO_START,
                    job_id=meta.job_id,
                    gpu_uuids=tuple(meta.gpu_uuids),
                    finished_at=meta.failed_at,
                    message=meta.failed_message,
                    logs_complete=True,
                )
                continue
            status = statuses.get(attempt_id)
            if status is None:
                continue
            with self._about(attempt_id):
                self._observe_attempt(meta, status, counters, draw_w, now)
        return statuses

    def _observe_attempt(
        self,
        meta: AttemptMeta,
        status: AttemptStatus,
        counters: dict[str, float | None],
        draw_w: dict[str, float | None],
        now: float,
    ) -> None:
        """One attempt's part of _observe: its energy, its limits, its end when it ended."""
        running = status.state is AttemptState.RUNNING
        if not meta.ended:
            # An ended attempt's energy is its counters' at its exit, not at this look,
            # which may come many seconds later on a busy host.
            until = None if running else status.finished_at
            self._update_energy(meta, counters, draw_w, now, until=until)
        if running:
            self._enforce_max_runtime(meta, status, now)
            self._publish_speed(meta)
        elif not meta.ended:
            meta.ended = True
            meta.ended_at = self._clock()
            self.gpu.detach_load(meta.attempt_id)
            self._speeds.pop(meta.attempt_id, None)
            # Not worth an fsync: after a crash of the host the runtime's exit record (which
            # is fsynced) shows the end again and this is worked out anew, the energy then
            # interpolated to the exit.
            self._save_meta(meta, durable=False)
            log.info("attempt %d ended: %s %s", meta.attempt_id, status.state, status.exit_code)
        self._take_checkpoints(meta, status)

    def _take_checkpoints(self, meta: AttemptMeta, status: AttemptStatus) -> None:
        """Hand the attempt's checkpoint dir to the storage thread; take what it found."""
        if not meta.checkpoint_dir:
            return
        running = status.state is AttemptState.RUNNING
        self.storage.track(meta.attempt_id, meta.checkpoint_dir, status.started_at, not running)
        seen = self.storage.seen(meta.attempt_id)
        if seen is None:
            return
        changed = False
        if seen.checkpoint_at is not None and (
            meta.last_checkpoint_at is None or seen.checkpoint_at > meta.last_checkpoint_at
        ):
            meta.last_checkpoint_at = seen.checkpoint_at
            changed = True
        if seen.checkpoint_bytes is not None and seen.checkpoint_bytes != meta.checkpoint_bytes:
            meta.checkpoint_bytes = seen.checkpoint_bytes
            changed = True
        if changed:
            self._save_meta(meta)

    def _update_energy(
        self,
        meta: AttemptMeta,
        counters: dict[str, float | None],
        draw_w: dict[str, float | None],
        now: float,
        *,
        until: float | None = None,
    ) -> None:
        """Bring the attempt's energy to `now`, or, for one that ended, to its exit `until`.

        With counters, the energy at the exit is interpolated between the last reading taken
        while it ran and this one, taken after: linear in between, so never more than the
        GPUs' maximum power allows, whatever the delay of this look.
        """
        total_j = 0.0
        for uuid in meta.gpu_uuids:
            start_j = meta.energy_start_j.get(uuid)
            counter_j = counters.get(uuid)
            if start_j is not None and counter_j is not None and counter_j >= start_j:
                total_j += counter_j - start_j
                continue
            # No counter (or it went back: the driver reloaded): integrate the draw instead.
            break
        else:
            if until is not None and meta.energy_at is not None and meta.energy_at < now:
                share = (min(max(until, meta.energy_at), now) - meta.energy_at) / (
                    now - meta.energy_at
                )
                total_j = meta.energy_j + (total_j - meta.energy_j) * share
            meta.energy_j = max(meta.energy_j, total_j)
            meta.energy_at = now if until is None else min(now, max(until, meta.energy_at or 0))
            return
        if meta.energy_at is not None:
            watts = sum(draw_w.get(uuid) or 0.0 for uuid in meta.gpu_uuids)
            end = now if until is None else min(now, until)
            meta.energy_j += watts * max(end - meta.energy_at, 0.0)
        meta.energy_estimated = True
        meta.energy_at = now if until is None else min(now, max(until, meta.energy_at or 0))

    def _enforce_max_runtime(self, meta: AttemptMeta, status: AttemptStatus, now: float) -> None:
        if meta.max_runtime_s is None or status.started_at is None:
            return
        if now - status.started_at > meta.max_runtime_s and not meta.message:
            meta.message = f"exceeded its max runtime of {meta.max_runtime_s:.0f} s"
            log.info("attempt %d %s: stopping it", meta.attempt_id, meta.message)
            self._save_meta(meta)
            self._stop_attempt(meta.attempt_id)

    def _speed_path(self, attempt_id: int) -> Path:
        return self._attempts_dir / f"{attempt_id}.speed"

    def _publish_speed(self, meta: AttemptMeta) -> None:
        """Write the modelled speed for a simulated job to read (see agents.simjob)."""
        speed = self.gpu.progress_speed(meta.gpu_uuids)
        if speed is None or self._speeds.get(meta.attempt_id) == speed:
            return
        path = self._speed_path(meta.attempt_id)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(f"{speed:.6f}\n")
        os.replace(tmp, path)
        self._speeds[meta.attempt_id] = speed

    def _heartbeat_body(
        self, telemetry: list[GpuTelemetry], statuses: dict[int, AttemptStatus]
    ) -> dict[str, Any]:
        self._seq += 1
        attempts = []
        self._final_sizes_in_body = set()
        for attempt_id, status in sorted(statuses.items()):
            meta = self._meta.get(attempt_id)
            with self._about(attempt_id, status.job_id):  # the warnings of out-of-range values
                entry = {
                    "attempt_id": attempt_id,
                    "state": status.state.value,
                    "started_at": status.started_at,
                    "exit_code": _exit_code(attempt_id, status.exit_code),
                    "finished_at": status.finished_at,
                    "energy_j": _energy_j(meta.energy_j) if meta else None,
                    "energy_estimated": meta.energy_estimated if meta else True,
                }
            message = status.message or (meta.message if meta else "")
            if message:
                entry["message"] = limits.clean_text(message)
            # Read once for both: the fence's note is looked for at every heartbeat of every
            # attempt here, and nearly always is not there.
            note = leases.fenced(self.state_dir, attempt_id)
            if status.state is not AttemptState.RUNNING:
                cause = self._stop_cause(status, meta, note)
                if cause:
                    entry["stop_cause"] = cause
            entry.update(self._stop_report(status, note))
            if meta is not None and meta.checkpoint_dir:
                entry["last_checkpoint_at"] = meta.last_checkpoint_at
                entry["checkpoint_bytes"] = meta.checkpoint_bytes
                seen = self.storage.seen(attempt_id)
                if seen is not None and seen.final:
                    self._final_sizes_in_body.add(attempt_id)
            elif meta is not None and meta.last_checkpoint_at is not None:
                entry["last_checkpoint_at"] = meta.last_checkpoint_at
            attempts.append(entry)
        self._last_reported = {k: s.state.value for k, s in statuses.items()}
        return {
            **({} if self._address_told else self._address()),
            "seq": self._seq,
            "sent_at": time.time(),
            "gpus": [limits.checked_reading(t.to_wire()) for t in telemetry],
            "attempts": attempts,
            "conditions": [
                {**c, "message": limits.clean_text(str(c.get("message") or ""))}
                for c in self._conditions.values()
            ],
        }

    @staticmethod
    def _stop_report(status: AttemptStatus, note: dict[str, Any] | None) -> dict[str, Any]:
        """stop_signal_at (the first signal, the runtime's or the fence's, whose `note` this
        is) and, once an attempt that was stopped ended, whether it had to be killed at the end
        of its grace."""
        times = [status.stop_signal_at]
        if note is not None:
            times.append(note.get("at_unix"))
        known = [float(t) for t in times if isinstance(t, int | float)]
        if not known:
            return {}
        report: dict[str, Any] = {"stop_signal_at": min(known)}
        if status.state is AttemptState.EXITED:
            report["killed_after_grace"] = bool(status.killed_after_grace) or (
                note is not None and "killed_at_unix" in note
            )
        return report

    @staticmethod
    def _stop_cause(
        status: AttemptStatus, meta: AttemptMeta | None, note: dict[str, Any] | None
    ) -> str:
        """Who ended an attempt that ended: the fence (even one that acted while this agent was
        dead: its `note` is on disk), this agent, or "" for the job itself."""
        if status.fenced or note is not None:
            return FENCED
        return meta.stop_cause if meta is not None else ""

    # -- logs ------------------------------------------------------------------------------------

    def _flush_logs(self) -> None:
        """Ship what running attempts printed since the last heartbeat (one read per attempt;
        a request only when there is something new)."""
        running = {
            attempt_id: status
            for attempt_id, status in self._statuses.items()
            if status.state is AttemptState.RUNNING
        }
        try:
            self._ship_logs(running)
        except Exception:  # shipping between heartbeats is a courtesy: never end the loop
            log.exception("shipping logs between heartbeats failed")

    def _ship_logs(self, statuses: dict[int, AttemptStatus]) -> None:
        for attempt_id, status in statuses.items():
            meta = self._meta.get(attempt_id)
            if meta is None or meta.logs_rejected:
                continue
            try:
                with self._about(attempt_id):
                    self._ship_attempt_logs(meta, status)
            except ControlPlaneUnavailable:
                return  # no point trying the others now; the offsets say where to resume
            except (Unauthorized, Rejected) as exc:
                if getattr(exc, "status", None) == 404:
                    with self._about(attempt_id):
                        log.warning("control plane refuses logs of attempt %d: %s", attempt_id, exc)
                    meta.logs_rejected = True
                    self._save_meta(meta)
                else:
                    with self._about(attempt_id):
                        log.warning("logs of attempt %d not shipped: %s", attempt_id, exc)
                    return

    def _ship_attempt_logs(self, meta: AttemptMeta, status: AttemptStatus) -> None:
        shipped = False
        for _ in range(LOG_CHUNKS_PER_CYCLE):
            data = self.runtime.read_logs(meta.attempt_id, meta.log_offset, LOG_CHUNK_BYTES)
            if not data:
                break
            # Bytes as they are (base64 when they are not plain text): nothing is lost.
            next_offset = self.client.send_logs(meta.attempt_id, meta.log_offset, data)
            self._scan_for_checkpoints(meta, data, next_offset - meta.log_offset)
            # The control plane's offset wins: it may already hold more (a resend after a
            # restart) or less (a gap it will not fill), and either way that is where to go on.
            progressed = next_offset != meta.log_offset
            meta.log_offset = next_offset
            shipped = True
            if not progressed:
                break
        if shipped:
            self._save_meta(meta)

    def _scan_for_checkpoints(self, meta: AttemptMeta, data: bytes, accepted: int) -> None:
        """Look for `gpucp:checkpoint` lines in the bytes the control plane took (the time of
        such a checkpoint is when the agent sees it)."""
        if accepted <= 0:
            return
        found, meta.log_line_head = scan_checkpoint_lines(meta.log_line_head, data[:accepted])
        if accepted > len(data):
            meta.log_line_head = None  # bytes were skipped: where a line starts is unknown
        if found:
            meta.last_checkpoint_at = max(meta.last_checkpoint_at or 0.0, self._clock())
            log.info("attempt %d reported a checkpoint in its output", meta.attempt_id)

    def _logs_shipped(self, meta: AttemptMeta, status: AttemptStatus) -> bool:
        if meta.logs_rejected:
            return True
        if not status.logs_complete:
            return False
        return not self.runtime.read_logs(meta.attempt_id, meta.log_offset, 1)

    # -- after a 200 -----------------------------------------------------------------------------

    def _forget_acknowledged(
        self,
        body: dict[str, Any],
        statuses: dict[int, AttemptStatus],
        unapplied: frozenset[int] = frozenset(),
    ) -> None:
        """An exit the control plane acknowledged is final: forget the attempt (logs first).

        `unapplied`: indexes of reports the answer's warnings say were not applied; those are
        sent again."""
        forget: list[int] = []
        for i, entry in enumerate(body["attempts"]):
            if entry["state"] == AttemptState.RUNNING.value or i in unapplied:
                continue
            attempt_id = entry["attempt_id"]
            meta = self._meta.get(attempt_id)
            status = statuses.get(attempt_id)
            if meta is not None and status is not None and not self._logs_shipped(meta, status):
                continue
            if meta is not None and self._final_size_pending(meta):
                continue
            forget.append(attempt_id)
        if not forget:
            return
        # Every tombstone is on disk before anything of its attempt is deleted: a crash in
        # between leaves an attempt both remembered and tombstoned, which recover() cleans up,
        # never one forgotten without a tombstone, which a stale answer could start again.
        self._add_tombstones(forget)
        for attempt_id in forget:
            self._forget(attempt_id)
        self._journal.drop(forget)

    def _final_size_pending(self, meta: AttemptMeta) -> bool:
        """The checkpoint dir's size after the end was not reported yet (and may still come)."""
        if meta.failed_message or not meta.checkpoint_dir:
            return False  # never ran (nothing was tracked), or has no dir
        if meta.attempt_id in self._final_sizes_in_body:
            return False
        ended_at = meta.ended_at if meta.ended_at is not None else meta.failed_at
        return ended_at is not None and self._clock() - ended_at < FINAL_SIZE_WAIT_S

    def _forget(self, attempt_id: int) -> None:
        with self._about(attempt_id):
            self.storage.forget(attempt_id)
            self.runtime.remove(attempt_id)
            self.gpu.detach_load(attempt_id)
            self._meta.pop(attempt_id, None)
            self._speeds.pop(attempt_id, None)
            self._last_reported.pop(attempt_id, None)
            leases.forget_fenced(self.state_dir, attempt_id)
            self._speed_path(attempt_id).unlink(missing_ok=True)
            log.info("attempt %d acknowledged and forgotten", attempt_id)

    def reconcile(self, answer: dict[str, Any], statuses: dict[int, AttemptStatus]) -> None:
        """Make the node match the desired state in ``answer``.

        Stops come first, and a GPU still held by a process being stopped is not given to a new
        attempt until that process is gone: a stop is a signal and a grace, not an instant, and
        two jobs must never share a GPU. Nothing starts unless the lease lasts long enough for
        it to be stopped in time, should the next renewal not come.
        """
        desired: dict[int, AttemptSpec] = {}
        for raw in answer.get("attempts") or ():
            try:
                spec = AttemptSpec.from_wire(raw)
            except (KeyError, TypeError, ValueError) as exc:
                log.error("ignoring a desired attempt I cannot read (%s): %r", exc, raw)
                continue
            if spec.grace_s is None:
                spec = replace(spec, grace_s=self.config.stop_grace_s)
            desired[spec.attempt_id] = spec
        held: dict[str, int] = {}  # GPU UUID -> the running attempt that holds it
        starting: list[AttemptSpec] = []
        for attempt_id, status in statuses.items():
            if status.state is not AttemptState.RUNNING:
                continue
            wanted = desired.get(attempt_id)
            for uuid in wanted.gpu_uuids if wanted is not None else status.gpu_uuids:
                held[uuid] = attempt_id
            if wanted is None:
                self._stop_unwanted(attempt_id)
        for attempt_id, spec in desired.items():
            if attempt_id in self._meta or attempt_id in self._tombstones:
                continue  # running, ended, or ended and forgotten: never start one twice
            busy = {held[u] for u in spec.gpu_uuids if u in held and held[u] != attempt_id}
            if busy:
                self._defer(
                    attempt_id, spec.job_id, f"its GPUs are still held by attempt(s) {sorted(busy)}"
                )
                continue
            # It must be able to get its whole grace before the lease runs out, and the
            # supervisor refuses one with less than the lease's grace for it (the node's
            # longest until the lease names it): wait rather than have it refused.
            grace_s = spec.grace_s if spec.grace_s is not None else self.config.stop_grace_s
            if self.lease is not None and self.lease.remaining_s() < max(
                grace_s, self.lease.grace_of(attempt_id)
            ):
                self._defer(attempt_id, spec.job_id, "the node's lease is about to run out")
                continue
            self._deferred.pop(attempt_id, None)
            starting.append(spec)
            for uuid in spec.gpu_uuids:
                held[uuid] = attempt_id
        self._start_all(starting)
        self._lease_covers([spec.attempt_id for spec in starting])
        for attempt_id in [a for a in self._deferred if a not in desired]:
            del self._deferred[attempt_id]
        self._apply_caps(answer.get("power_caps_w") or {})

    def _stop_unwanted(self, attempt_id: int) -> None:
        meta = self._meta.get(attempt_id)
        if meta is not None and not meta.stop_cause:
            with self._about(attempt_id):
                log.info("attempt %d is not desired any more: stopping it", attempt_id)
            meta.stop_cause = UNWANTED
            self._save_meta(meta)
        self._stop_attempt(attempt_id)

    def _defer(self, attempt_id: int, job_id: int | None, why: str) -> None:
        if self._deferred.get(attempt_id) != why:
            with self._about(attempt_id, job_id):
                log.info("attempt %d waits: %s", attempt_id, why)
            self._deferred[attempt_id] = why

    def _start_all(self, specs: list[AttemptSpec]) -> None:
        """Start these attempts. Their records are on disk before the first starts (one write,
        one fsync for all), so a crash in between cannot start one twice."""
        metas = [self._new_meta(spec) for spec in specs]
        for meta in metas:
            self._meta[meta.attempt_id] = meta
        if metas:
            try:
                self._save_metas(metas)
            except OSError:
                # Not recorded (a full disk): none of them started, and none may stay known,
                # or the next answer that lists them would take them for started.
                for meta in metas:
                    del self._meta[meta.attempt_id]
                raise
        for spec, meta in zip(specs, metas, strict=True):
            with self._about(spec.attempt_id, spec.job_id):
                self._start(spec, meta)

    def _new_meta(self, spec: AttemptSpec) -> AttemptMeta:
        meta = AttemptMeta(
            attempt_id=spec.attempt_id,
            job_id=spec.job_id,
            gpu_uuids=list(spec.gpu_uuids),
            max_runtime_s=spec.max_runtime_s,
            energy_start_j=self._counters(spec.gpu_uuids),
            energy_at=self._clock(),
            stop_signal=spec.stop_signal,
            grace_s=spec.grace_s,
            checkpoint_dir=spec.checkpoint.host_path if spec.checkpoint is not None else "",
        )
        meta.energy_estimated = any(v is None for v in meta.energy_start_j.values())
        return meta

    def _start(self, spec: AttemptSpec, meta: AttemptMeta) -> None:
        r = spec.rendezvous
        if r is not None and r.node_rank == 0 and not port_free(r.master_port):
            # Its members would meet nowhere: not the job's fault, so it is requeued and its
            # next attempt gets another port.
            meta.stop_cause = PORT_BUSY
            self._failed_to_start(meta, f"its master port {r.master_port} is already in use")
            return
        extra_env: dict[str, str] = {}
        speed = self.gpu.progress_speed(spec.gpu_uuids)
        if speed is not None:
            extra_env["GPUCP_SIM_SPEED"] = f"{speed:.6f}"
            if self.runtime.name == "process":
                extra_env["GPUCP_SIM_SPEED_FILE"] = str(self._speed_path(spec.attempt_id))
            # The job starts with this speed in its environment (agents.simjob reads it while
            # the file is missing): the file is written once the speed changes, not for every
            # start.
            self._speeds[spec.attempt_id] = speed
        self.gpu.attach_load(spec.attempt_id, spec.gpu_uuids)
        try:
            self.runtime.start(spec, extra_env)
        except StartError as exc:
            self._failed_to_start(meta, str(exc))
        except Exception as exc:  # an engine error of any kind must not end the loop
            log.exception("attempt %d: start failed", spec.attempt_id)
            self._failed_to_start(meta, f"{type(exc).__name__}: {exc}")
        else:
            log.info("attempt %d started (job %s)", spec.attempt_id, spec.job_id)

    def _failed_to_start(self, meta: AttemptMeta, message: str) -> None:
        log.warning("attempt %d failed to start: %s", meta.attempt_id, message)
        self.gpu.detach_load(meta.attempt_id)
        meta.failed_message = message
        meta.failed_at = self._clock()
        meta.ended = True
        self._save_meta(meta)
        self._wake.set()  # report it now, not at the next periodic heartbeat

    def _apply_caps(self, caps_w: dict[str, Any]) -> None:
        for uuid, cap_w in caps_w.items():
            key = ("PowerCapFailed", uuid)
            try:
                cap_w = float(cap_w)
                enforced_w = self.gpu.enforced_power_limit_w(uuid)
                if abs(enforced_w - cap_w) <= CAP_TOLERANCE_W:
                    self._conditions.pop(key, None)
                    continue
                applied_w = self.gpu.set_power_limit(
                    uuid, cap_w, dry_run=self.config.power_cap_dry_run
                )
            except (GpuError, TypeError, ValueError) as exc:
                if key not in self._conditions:
                    log.warning("GPU %s: cap %s W not applied: %s", uuid, cap_w, exc)
                self._conditions[key] = {
                    "type": "PowerCapFailed",
                    "gpu_uuid": uuid,
                    "message": str(exc),
                }
                continue
            self._conditions.pop(key, None)
            if self.config.power_cap_dry_run:
                log.info(
                    "GPU %s: would set %.1f W (dry run; enforced %.1f W)", uuid, cap_w, applied_w
                )
            else:
                log.info("GPU %s: cap %.1f W (enforced %.1f W)", uuid, cap_w, applied_w)
        # A cap that is no longer asked for cannot be failing any more.
        for key in [k for k in self._conditions if k[0] == "PowerCapFailed"]:
            if key[1] not in caps_w:
                del self._conditions[key]

    # -- persistence -----------------------------------------------------------------------------

    def _save_meta(self, meta: AttemptMeta, *, durable: bool = True) -> None:
        self._save_metas([meta], durable=durable)

    def _save_metas(self, metas: list[AttemptMeta], *, durable: bool = True) -> None:
        """Append these records to the journal in one write (and one fsync when durable)."""
        self._journal.put([asdict(meta) for meta in metas], durable=durable)
        self._journal.compact_if_due(self._records)

    def _records(self) -> list[dict[str, Any]]:
        """Every attempt the agent keeps, as the journal stores them."""
        return [asdict(meta) for meta in self._meta.values()]

    def _load_tombstones(self) -> None:
        """The snapshot, then the log appended since (a torn last line is one never synced)."""
        raw: dict[str, Any] = {}
        try:
            raw = json.loads(self._tombstones_path.read_text())
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable %s: %s", self._tombstones_path, exc)
        tombstones = {int(k): float(v) for k, v in raw.items()}
        self._tombstone_log_lines = 0
        try:
            text = self._tombstone_log_path.read_text()
        except FileNotFoundError:
            text = ""
        for line in text.splitlines():
            try:
                attempt_id, at = line.split()
                tombstones[int(attempt_id)] = float(at)
            except ValueError:
                continue
            self._tombstone_log_lines += 1
        horizon = time.time() - TOMBSTONE_TTL_S
        self._tombstones = {k: v for k, v in tombstones.items() if v > horizon}
        if text and not text.endswith("\n"):
            # Cut by a crash before its fsync (its attempts' records were never deleted): start
            # the next append on a line of its own.
            self._compact_tombstones()

    def _add_tombstones(self, attempt_ids: list[int]) -> None:
        """Remember these attempts as finished, durably, in one append and one fsync."""
        now = time.time()
        for attempt_id in attempt_ids:
            self._tombstones[attempt_id] = now
        lines = "".join(f"{attempt_id} {now:.3f}\n" for attempt_id in attempt_ids)
        fd = os.open(self._tombstone_log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, lines.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        self._tombstone_log_lines += len(attempt_ids)
        if self._tombstone_log_lines >= max(TOMBSTONE_LOG_COMPACT_AT, len(self._tombstones)):
            self._compact_tombstones()

    def _compact_tombstones(self) -> None:
        """Fold the log into a fresh snapshot (expired tombstones dropped), then empty it.

        A crash in between leaves entries in both, which loading takes once."""
        horizon = time.time() - TOMBSTONE_TTL_S
        self._tombstones = {k: v for k, v in self._tombstones.items() if v > horizon}
        write_json_atomic(self._tombstones_path, {str(k): v for k, v in self._tombstones.items()})
        try:
            os.truncate(self._tombstone_log_path, 0)
        except FileNotFoundError:
            pass
        self._tombstone_log_lines = 0
