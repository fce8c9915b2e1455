"""Attempts as containers on any Docker-compatible engine (Docker, or Podman's Docker API).

Containers carry labels naming the node and the attempt, so an agent restarted while they run
finds them again (`adopt`) instead of starting them twice. Output is followed into a local file
per attempt, rewritten from the engine's full log on adoption, so byte offsets stay the same
across restarts. GPUs are handed over by device request only where the node has real NVIDIA
GPUs; the visible-devices variables are always set.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, TypedDict

import docker
import docker.errors
import docker.types
import requests

from agents.logcontext import bound
from agents.runtime.base import (
    ATTEMPT_LABEL,
    DEFAULT_STOP_SIGNAL,
    GPUS_LABEL,
    JOB_LABEL,
    NODE_LABEL,
    AttemptSpec,
    AttemptState,
    AttemptStatus,
    Runtime,
    StartError,
    check_paths,
    ensure_checkpoint_dir,
    read_file_range,
    rendezvous_env,
    stop_env,
    visible_devices_env,
    write_json_atomic,
)

log = logging.getLogger(__name__)

MANAGED_LABEL = "gpucp.managed"
RUNNING_STATES = {"running", "paused", "restarting", "stopping"}
NOT_STARTED_STATES = {"created", "configured", "initialized"}
# Pinned rather than negotiated: asking the engine (GET /version) costs Podman seconds, and 1.41
# (Docker 20.10, Podman 3+) has everything used here, device requests included.
API_VERSION = "1.41"
# How soon a stop signal the engine failed to deliver is sent again (DockerRuntime._notify).
NOTIFY_RETRY_S = 1.0
# The container vanished (removed behind the agent's back): its exit code is unknown.
LOST_EXIT_CODE = 255
# The job's checkpoint dir is writable by any uid: the container's user may be any (an image's
# USER, or rootless Podman's subordinate ids for it), and the agent cannot know which. Its
# parents are the agent's alone, so no other user of the host reaches it.
CHECKPOINT_DIR_MODE = 0o777

_TIME = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:?\d\d)?$")


def parse_engine_time(value: str | None) -> float | None:
    """An engine timestamp (RFC 3339 with nanoseconds) as Unix seconds; None for "never"."""
    if not value or value.startswith("0001-"):
        return None
    match = _TIME.match(value.strip())
    if match is None:
        return None
    zone = match[3] or "Z"
    moment = datetime.fromisoformat(match[1] + ("+00:00" if zone == "Z" else zone))
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp() + (float(match[2]) if match[2] else 0.0)


def container_name(node_name: str, attempt_id: int) -> str:
    """A name unique per node and attempt, within what engines accept."""
    safe = re.sub(r"[^a-zA-Z0-9_.-]", "-", node_name).strip(".-") or "node"
    return f"gpucp-{safe}-{attempt_id}"


class _Common(TypedDict):
    """The fields of an AttemptStatus that every state of one attempt reports alike."""

    attempt_id: int
    job_id: int | None
    gpu_uuids: tuple[str, ...]
    stop_signal_at: float | None
    killed_after_grace: bool | None


@dataclass(slots=True)
class _Entry:
    attempt_id: int
    job_id: int | None
    gpu_uuids: tuple[str, ...]
    container: Any = None
    log_thread: threading.Thread | None = None
    logs_done: threading.Event = field(default_factory=threading.Event)
    stopping: bool = False
    failed: str = ""  # why it could not start (reported as failed_to_start)
    finished_at: float | None = None
    stop_record: dict[str, Any] | None = None
    # The engine answered its create or start with an error, or not at all, and could not
    # say yet whether the container runs: polls find out (_settle) before anything is reported.
    unsure: str = ""
    pending_stop: tuple[float, str] | None = None  # asked while unsure: applied once it runs


class DockerRuntime(Runtime):
    """Runs attempts as containers of node ``node_name`` on the engine at ``base_url``.

    ``base_url`` None means the environment's engine (DOCKER_HOST, else the default socket).
    """

    name = "docker"

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        *,
        node_name: str,
        base_url: str | None = None,
        gpu_device_requests: bool = False,
        timeout_s: float = 60.0,
    ) -> None:
        self._node = node_name
        self._root = Path(state_dir) / "docker"
        self._root.mkdir(parents=True, exist_ok=True)
        self._gpu_device_requests = gpu_device_requests
        try:
            if base_url:
                # docker-py hands the timeout to requests, which takes float seconds; the stubs
                # say int.
                self._client = docker.DockerClient(
                    base_url=base_url,
                    version=API_VERSION,
                    timeout=timeout_s,  # type: ignore[arg-type]
                )
            else:
                self._client = docker.from_env(
                    version=API_VERSION,
                    timeout=timeout_s,  # type: ignore[arg-type]
                )
            self._client.ping()
        except (docker.errors.DockerException, requests.RequestException) as exc:
            raise RuntimeError(
                f"no container engine answers at {base_url or os.environ.get('DOCKER_HOST') or 'the default socket'}: {exc}"
            ) from exc
        self._entries: dict[int, _Entry] = {}
        self._lock = threading.Lock()

    def log_path(self, attempt_id: int) -> Path:
        """The local copy of the attempt's output."""
        return self._root / f"{attempt_id}.log"

    # -- starting --------------------------------------------------------------------------------

    def _labels(self, spec: AttemptSpec) -> dict[str, str]:
        return {
            MANAGED_LABEL: "true",
            NODE_LABEL: self._node,
            ATTEMPT_LABEL: str(spec.attempt_id),
            JOB_LABEL: "" if spec.job_id is None else str(spec.job_id),
            GPUS_LABEL: ",".join(spec.gpu_uuids),
        }

    def _mounts(self, spec: AttemptSpec) -> list[docker.types.Mount]:
        """The attempt's volumes as engine mounts; nothing is created on the host for them."""
        check_paths(spec)
        mounts = []
        for mount in spec.mounts:
            kind: Literal["bind", "volume"]
            if mount.kind == "host_path":
                # A bind mount of a missing folder would have the engine create it (as root):
                # a node without the volume refuses instead.
                if not os.path.isdir(mount.source):
                    raise StartError(f"mount {mount.name!r}: {mount.source} is not on this node")
                kind = "bind"
            else:
                if not self.has_volume(mount.source):
                    # The engine would create an empty one, and the job would read nothing.
                    raise StartError(
                        f"mount {mount.name!r}: the engine has no volume {mount.source!r}"
                    )
                kind = "volume"
            mounts.append(
                docker.types.Mount(mount.target, mount.source, type=kind, read_only=mount.read_only)
            )
        if spec.checkpoint is not None:
            ensure_checkpoint_dir(spec.checkpoint.host_path, CHECKPOINT_DIR_MODE)
            mounts.append(
                docker.types.Mount(
                    spec.checkpoint.target,
                    spec.checkpoint.host_path,
                    type="bind",
                    read_only=spec.checkpoint.read_only,
                )
            )
        return mounts

    def has_volume(self, name: str) -> bool:
        try:
            self._client.volumes.get(name)
        except docker.errors.NotFound:
            return False
        except (docker.errors.DockerException, requests.RequestException) as exc:
            log.warning("cannot look up volume %s: %s", name, exc)
            return False
        return True

    def start(self, spec: AttemptSpec, extra_env: dict[str, str] | None = None) -> AttemptStatus:
        if not spec.image:
            raise StartError("the docker runtime needs an image")
        mounts = self._mounts(spec)
        env = dict(spec.env)
        env.update(visible_devices_env(spec.gpu_uuids))
        env.update(rendezvous_env(spec))
        env.update(extra_env or {})
        env.update(
            stop_env(
                spec,
                spec.checkpoint.target if spec.checkpoint is not None else None,
                {m.name: m.target for m in spec.mounts},
            )
        )
        env["GPUCP_ATTEMPT_ID"] = str(spec.attempt_id)
        if spec.job_id is not None:
            env["GPUCP_JOB_ID"] = str(spec.job_id)
        kwargs: dict[str, Any] = {
            "command": list(spec.command) or None,
            "environment": env,
            "labels": self._labels(spec),
            "name": container_name(self._node, spec.attempt_id),
            "detach": True,
            # The engine's own stop (docker stop) sends the job's signal too.
            "stop_signal": spec.stop_signal,
        }
        if mounts:
            kwargs["mounts"] = mounts
        if spec.rendezvous is not None and spec.rendezvous.num_nodes > 1:
            # Its members reach each other at their nodes' addresses, on ports the job opens:
            # the host's network, as for any multi-node job on bare hosts.
            kwargs["network_mode"] = "host"
        if spec.cpus > 0:
            kwargs["nano_cpus"] = int(spec.cpus * 1e9)
        if spec.memory_mib > 0:
            kwargs["mem_limit"] = f"{spec.memory_mib}m"
        if self._gpu_device_requests and spec.gpu_uuids:
            kwargs["device_requests"] = [
                docker.types.DeviceRequest(
                    driver="nvidia", device_ids=list(spec.gpu_uuids), capabilities=[["gpu"]]
                )
            ]
        self._ensure_image(spec.image)
        entry = _Entry(spec.attempt_id, spec.job_id, spec.gpu_uuids)
        container: Any
        try:
            container = self._client.containers.create(spec.image, **kwargs)
            container.start()
        except (docker.errors.DockerException, requests.RequestException) as exc:
            # An error answer, or none (a timeout), does not say that nothing runs: Podman
            # answers 500 to a start whose process ended at once, and a timed-out request may
            # still be carried out. Reporting a failed start for a container that runs would
            # run the job twice once it is requeued. So the engine is asked what it made.
            try:
                container = self._started_anyway(spec.attempt_id)
            except (docker.errors.DockerException, requests.RequestException) as unsure:
                log.warning(
                    "attempt %d: the engine answered %s, and cannot say yet whether the "
                    "container runs: %s",
                    spec.attempt_id,
                    _explain(exc),
                    unsure,
                )
                entry.unsure = _explain(exc)
                with self._lock:
                    self._entries[spec.attempt_id] = entry
                return AttemptStatus(
                    attempt_id=spec.attempt_id,
                    state=AttemptState.RUNNING,
                    job_id=spec.job_id,
                    gpu_uuids=spec.gpu_uuids,
                )
            if container is None:
                raise StartError(_explain(exc)) from exc
            log.warning(
                "attempt %d: the engine answered %s, but the container started",
                spec.attempt_id,
                _explain(exc),
            )
        entry.container = container
        with self._lock:
            self._entries[spec.attempt_id] = entry
        self._follow_logs(entry)
        try:
            return self._status(entry)
        except (docker.errors.DockerException, requests.RequestException) as exc:
            # The container started and is followed: an engine that cannot inspect it right
            # after (Podman reading the /proc of a process that had just ended: "read
            # /proc/N/cgroup: no such process") has not failed the start. Raising here made the
            # agent report a job that ran as one that never started. The next poll reads it.
            log.warning("attempt %d: started, but cannot inspect it yet: %s", spec.attempt_id, exc)
            return AttemptStatus(
                attempt_id=spec.attempt_id,
                state=AttemptState.RUNNING,
                job_id=spec.job_id,
                gpu_uuids=spec.gpu_uuids,
            )

    def _started_anyway(self, attempt_id: int) -> Any | None:
        """The attempt's container if it started despite an error from the engine; None once
        none can run: never made, or made and not started (then removed here). Raises the
        engine's error while the engine cannot tell."""
        try:
            container = self._client.containers.get(container_name(self._node, attempt_id))
        except docker.errors.NotFound:
            return None
        state = container.attrs.get("State") or {}
        status = str(state.get("Status") or container.status or "").lower()
        if status in RUNNING_STATES or parse_engine_time(state.get("StartedAt")) is not None:
            return container
        # Made, never started (an exec that failed leaves it so): removed before the start is
        # reported failed, or an agent restart would adopt and start it (adopt()).
        try:
            container.remove(force=True)
        except docker.errors.NotFound:
            pass
        return None

    def _settle(self, entry: _Entry) -> None:
        """An unsure start (see _Entry.unsure) made sure: followed if it runs, failed if not.
        Raises while the engine cannot tell (statuses() then reports nothing of it)."""
        container = self._started_anyway(entry.attempt_id)
        if container is None:
            entry.failed = entry.unsure
            entry.finished_at = time.time()
        else:
            entry.container = container
            self._follow_logs(entry)
        entry.unsure = ""
        pending, entry.pending_stop = entry.pending_stop, None
        if container is not None and pending is not None:
            self.stop(entry.attempt_id, *pending)

    def _ensure_image(self, image: str) -> None:
        try:
            self._client.images.get(image)
            return
        except docker.errors.ImageNotFound:
            pass
        except docker.errors.DockerException as exc:
            raise StartError(_explain(exc)) from exc
        log.info("pulling %s", image)
        try:
            self._client.images.pull(image)
        except docker.errors.DockerException as exc:
            raise StartError(
                f"image {image} is not here and cannot be pulled: {_explain(exc)}"
            ) from exc

    # -- following output ------------------------------------------------------------------------

    def _follow_logs(self, entry: _Entry) -> None:
        """Copy the container's whole output into the local file, from the start, until it ends."""

        def follow() -> None:
            path = self.log_path(entry.attempt_id)
            try:
                with open(path, "wb") as out:
                    for chunk in entry.container.logs(
                        stream=True, follow=True, stdout=True, stderr=True
                    ):
                        out.write(chunk)
                        out.flush()
                entry.logs_done.set()
            except (docker.errors.DockerException, requests.RequestException, OSError) as exc:
                # Retried from the start by the next statuses(): the engine may be restarting.
                log.warning("attempt %d: following logs failed: %s", entry.attempt_id, exc)

        entry.logs_done.clear()
        entry.log_thread = threading.Thread(
            target=follow, name=f"logs-{entry.attempt_id}", daemon=True
        )
        entry.log_thread.start()

    # -- observing -------------------------------------------------------------------------------

    def _status(self, entry: _Entry) -> AttemptStatus:
        stop = entry.stop_record or {}
        common: _Common = {
            "attempt_id": entry.attempt_id,
            "job_id": entry.job_id,
            "gpu_uuids": entry.gpu_uuids,
            "stop_signal_at": stop.get("at"),
            "killed_after_grace": (stop.get("killed_at") is not None) if stop else None,
        }
        if entry.unsure:
            self._settle(entry)
        if entry.failed:
            return AttemptStatus(
                state=AttemptState.FAILED_TO_START,
                message=entry.failed,
                finished_at=entry.finished_at,
                logs_complete=True,
                **common,
            )
        try:
            entry.container.reload()
        except docker.errors.NotFound:
            entry.logs_done.set()
            return AttemptStatus(
                state=AttemptState.EXITED,
                exit_code=LOST_EXIT_CODE,
                finished_at=entry.finished_at or time.time(),
                message="the container was removed behind the agent's back",
                logs_complete=True,
                **common,
            )
        state = entry.container.attrs.get("State") or {}
        status = str(state.get("Status") or entry.container.status or "").lower()
        started_at = parse_engine_time(state.get("StartedAt"))
        if status in RUNNING_STATES or status in NOT_STARTED_STATES:
            return AttemptStatus(state=AttemptState.RUNNING, started_at=started_at, **common)
        if entry.stop_record is not None:
            # Its stop as recorded on disk, not as this runtime last wrote or read it: the
            # runtime that began the grace (one this agent adopted it from, when it had not
            # quite died) may have been the one that killed it at its end.
            stop = _read_record(self._stop_path(entry.attempt_id)) or entry.stop_record
            common["killed_after_grace"] = stop.get("killed_at") is not None
        if entry.log_thread is not None and not entry.log_thread.is_alive():
            if not entry.logs_done.is_set():
                self._follow_logs(entry)
        else:
            # The output stream ends right after the container: give it a moment to drain.
            entry.logs_done.wait(0.5)
        message = "out of memory (OOMKilled)" if state.get("OOMKilled") else ""
        if state.get("Error"):
            message = str(state["Error"])
        finished_at = parse_engine_time(state.get("FinishedAt"))
        if finished_at is not None and started_at is not None:
            # Podman stamps StartedAt once the process runs, which a short one may outlive.
            finished_at = max(finished_at, started_at)
        return AttemptStatus(
            state=AttemptState.EXITED,
            started_at=started_at,
            finished_at=finished_at,
            exit_code=int(state.get("ExitCode", LOST_EXIT_CODE)),
            message=message,
            logs_complete=entry.logs_done.is_set(),
            **common,
        )

    def statuses(self) -> list[AttemptStatus]:
        with self._lock:
            entries = list(self._entries.values())
        found = []
        for entry in entries:
            try:
                found.append(self._status(entry))
            except (docker.errors.DockerException, requests.RequestException) as exc:
                # The engine is briefly away: say nothing about this attempt rather than a lie.
                log.warning("attempt %d: cannot inspect: %s", entry.attempt_id, exc)
        return found

    def adopt(self) -> list[AttemptStatus]:
        containers = self._client.containers.list(
            all=True, filters={"label": [f"{NODE_LABEL}={self._node}"]}
        )
        for container in containers:
            labels = container.labels or {}
            try:
                attempt_id = int(labels[ATTEMPT_LABEL])
            except (KeyError, ValueError):
                continue
            with self._lock:
                if attempt_id in self._entries:
                    continue
            job = labels.get(JOB_LABEL) or ""
            entry = _Entry(
                attempt_id,
                int(job) if job.isdigit() else None,
                tuple(u for u in (labels.get(GPUS_LABEL) or "").split(",") if u),
                container=container,
            )
            if container.status in NOT_STARTED_STATES:
                # Created, then the agent died before starting it: finish what it began.
                try:
                    container.start()
                except (docker.errors.DockerException, requests.RequestException) as exc:
                    # As in start(): the error alone does not say that it did not start.
                    entry.container, entry.unsure = None, _explain(exc)
                    try:
                        self._settle(entry)
                    except (docker.errors.DockerException, requests.RequestException) as unsure:
                        log.warning(
                            "attempt %d: cannot tell yet whether it runs: %s", attempt_id, unsure
                        )
            entry.stop_record = _read_record(self._stop_path(attempt_id))
            with self._lock:
                self._entries[attempt_id] = entry
            if entry.container is not None and not entry.failed and entry.log_thread is None:
                self._follow_logs(entry)
            stop = entry.stop_record
            if stop is not None:
                # Stopped by the agent before its restart: the grace ends when it was to.
                entry.stopping = True
                if stop.get("killed_at") is None:
                    ends_at = float(stop.get("at") or 0) + float(stop.get("grace_s") or 0)
                    self._escalate_after(entry, ends_at - time.time())
            with bound(attempt_id=attempt_id):
                log.info("adopted container %s (attempt %d)", container.name, attempt_id)
        return self.statuses()

    # -- stopping and removing -------------------------------------------------------------------

    def _stop_path(self, attempt_id: int) -> Path:
        return self._root / f"{attempt_id}.stop.json"

    def stop(self, attempt_id: int, grace_s: float, signal: str = DEFAULT_STOP_SIGNAL) -> None:
        with self._lock:
            entry = self._entries.get(attempt_id)
            if entry is not None and entry.unsure:
                entry.pending_stop = (grace_s, signal)
            if entry is None or entry.stopping or entry.container is None:
                return
            entry.stopping = True
        log.info("attempt %d: %s, SIGKILL in %.0f s", attempt_id, signal, grace_s)
        self._save_stop(entry, {"signal": signal, "grace_s": grace_s, "at": time.time()})
        self._notify(entry, signal, time.time() + grace_s)
        self._escalate_after(entry, grace_s)

    def _save_stop(self, entry: _Entry, record: dict[str, Any]) -> None:
        entry.stop_record = record
        try:
            write_json_atomic(self._stop_path(entry.attempt_id), record)
        except OSError as exc:
            log.error("attempt %d: cannot record its stop: %s", entry.attempt_id, exc)

    def _escalate_after(self, entry: _Entry, delay_s: float) -> None:
        def escalate() -> None:
            if entry.container is None:
                return  # never found running (an unsure start that did not start)
            try:
                entry.container.reload()
            except (docker.errors.DockerException, requests.RequestException):
                pass
            if entry.container.status in RUNNING_STATES:
                log.info(
                    "attempt %d: still running at the end of its grace: SIGKILL", entry.attempt_id
                )
                self._save_stop(entry, {**(entry.stop_record or {}), "killed_at": time.time()})
                self._kill(entry, "SIGKILL")

        # A timer, not a wait: stop() returns at once, whatever the grace. Its thread logs with
        # the ids of the stop that set it (agents.logcontext).
        timer = threading.Timer(max(0.0, delay_s), contextvars.copy_context().run, (escalate,))
        timer.daemon = True
        timer.start()

    def _notify(self, entry: _Entry, sig: str, until: float) -> None:
        """The job's stop signal, sent again every second until its grace ends while the
        engine fails to deliver it to a container that runs: a job that never gets its notice
        cannot checkpoint, and is killed at the end of its grace with its work lost."""
        if self._kill(entry, sig) or time.time() + NOTIFY_RETRY_S >= until:
            return

        def again() -> None:
            try:
                entry.container.reload()
            except (docker.errors.DockerException, requests.RequestException):
                pass  # still away: try the signal anyway
            else:
                if entry.container.status not in RUNNING_STATES:
                    return
            self._notify(entry, sig, until)

        timer = threading.Timer(NOTIFY_RETRY_S, contextvars.copy_context().run, (again,))
        timer.daemon = True
        timer.start()

    @staticmethod
    def _kill(entry: _Entry, sig: str) -> bool:
        """Whether the engine took the signal."""
        try:
            entry.container.kill(signal=sig)
        except (docker.errors.DockerException, requests.RequestException) as exc:
            # Most often it has just exited; a real failure shows as a still-running attempt.
            log.info("attempt %d: kill %s: %s", entry.attempt_id, sig, exc)
            return False
        return True

    def read_logs(self, attempt_id: int, offset: int, max_bytes: int) -> bytes:
        return read_file_range(self.log_path(attempt_id), offset, max_bytes)

    def _containers_of_node(self, *labels: str, **filters: Any) -> list[Any]:
        # Sparse: the list's own labels and ids, without an inspect of each container. The fence
        # lists while the agent removes exited containers, and an inspect of one removed since
        # the list fails the whole call (Podman answers it with a 500).
        ours = [f"{NODE_LABEL}={self._node}", f"{MANAGED_LABEL}=true", *labels]
        return self._client.containers.list(sparse=True, filters={"label": ours, **filters})

    def running_attempts(self) -> list[int]:
        running = []
        for container in self._containers_of_node(status="running"):
            attempt = (container.attrs.get("Labels") or {}).get(ATTEMPT_LABEL, "")
            if attempt.isdigit():
                running.append(int(attempt))
        return sorted(running)

    def signal_attempt(self, attempt_id: int, sig: int) -> None:
        for container in self._containers_of_node(f"{ATTEMPT_LABEL}={attempt_id}"):
            try:
                container.kill(signal=int(sig))
            except (docker.errors.DockerException, requests.RequestException) as exc:
                log.info("attempt %d: kill %s: %s", attempt_id, sig, exc)

    @staticmethod
    def _remove_quietly(container: Any) -> None:
        try:
            container.remove(force=True)
        except docker.errors.NotFound:
            pass
        except (docker.errors.DockerException, requests.RequestException) as exc:
            log.warning("cannot remove container %s: %s", container.name, exc)

    def remove(self, attempt_id: int) -> None:
        with self._lock:
            entry = self._entries.pop(attempt_id, None)
        if entry is not None and entry.container is not None:
            self._remove_quietly(entry.container)
        elif entry is not None and entry.unsure:
            # Whatever the engine made of its start, nothing of it may stay.
            try:
                self._remove_quietly(
                    self._client.containers.get(container_name(self._node, attempt_id))
                )
            except docker.errors.NotFound:
                pass
            except (docker.errors.DockerException, requests.RequestException) as exc:
                log.warning("attempt %d: cannot remove its container: %s", attempt_id, exc)
        for path in (self.log_path(attempt_id), self._stop_path(attempt_id)):
            try:
                path.unlink()
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self._client.close()


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        record: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record


def _explain(exc: Exception) -> str:
    """The engine's own words (e.g. "executable file not found in $PATH"), not the HTTP dress."""
    explanation = getattr(exc, "explanation", None)
    return str(explanation or exc)
