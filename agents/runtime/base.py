"""What the agent needs of a runtime: start, observe, stop, read the output of attempts, and find
again after a restart the attempts it started before.
"""

from __future__ import annotations

import abc
import codecs
import enum
import json
import logging
import math
import os
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ATTEMPT_LABEL = "gpucp.attempt-id"
JOB_LABEL = "gpucp.job-id"
NODE_LABEL = "gpucp.node"
GPUS_LABEL = "gpucp.gpu-uuids"


class AttemptState(enum.StrEnum):
    RUNNING = "running"
    EXITED = "exited"
    FAILED_TO_START = "failed_to_start"


class StartError(Exception):
    """The attempt could not be started (no such image, no such command, bad resources)."""


# The signals a job may ask to be stopped with (Job.stop_signal); anything else means SIGTERM.
STOP_SIGNAL_NAMES = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")
DEFAULT_STOP_SIGNAL = "SIGTERM"
# A grace beyond this from the wire is taken for a bug, not a wish: the control plane caps it
# far lower (PREEMPTION_GRACE_MAX_S), and a node must not hold GPUs for an hour on a typo.
MAX_GRACE_S = 3600.0
CHECKPOINT_TARGET = "/gpucp/checkpoint"
# A checkpoint is complete once the job touches this file in its checkpoint dir (its mtime is
# the checkpoint's time), or prints a line that starts with CHECKPOINT_LINE.
CHECKPOINT_MARKER = ".checkpoint"
CHECKPOINT_LINE = b"gpucp:checkpoint"
MOUNT_KINDS = ("host_path", "engine_volume")
# Mount targets a job must never cover: the container's own system (or, with a bind, the
# engine's view of the host's) would be replaced by a tenant's files.
SYSTEM_PATHS = ("/proc", "/sys", "/dev", "/etc", "/usr", "/bin", "/sbin", "/boot", "/run")
_ENGINE_VOLUME_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,254}")


@dataclass(frozen=True, slots=True)
class MountSpec:
    """A volume the attempt gets (the answer's `mounts[]`)."""

    name: str
    kind: str  # host_path | engine_volume
    source: str  # an absolute host path, or the engine volume's name
    target: str  # where the job sees it (containers; the process runtime cannot remap)
    read_only: bool = False

    @property
    def env_name(self) -> str:
        """GPUCP_MOUNT_<NAME>: the volume name upper-cased, every other character an underscore."""
        return "GPUCP_MOUNT_" + re.sub(r"[^A-Z0-9]", "_", self.name.upper())


@dataclass(frozen=True, slots=True)
class CheckpointSpec:
    """The job's checkpoint dir (the answer's `checkpoint`), the same for all its attempts."""

    host_path: str
    target: str = CHECKPOINT_TARGET
    read_only: bool = False


@dataclass(frozen=True, slots=True)
class RendezvousSpec:
    """Where a job's nodes meet (the answer's `rendezvous`, docs/job-contract.md): this node's
    rank, every node's address in rank order (rank 0's is the master address), the master port
    on rank 0's node, and this node's GPU count."""

    node_rank: int
    node_addrs: tuple[str, ...]
    master_port: int
    gpus_per_node: int

    @property
    def num_nodes(self) -> int:
        return len(self.node_addrs)

    @property
    def master_addr(self) -> str:
        return self.node_addrs[0]


def _parse_rendezvous(raw: Any) -> RendezvousSpec | None:
    """The answer's rendezvous, or None (an attempt admitted before there was one). Raises
    ValueError when it is there but unreadable: a job of several nodes cannot start without."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError("rendezvous is not an object")
    addrs = raw.get("node_addrs")
    if not isinstance(addrs, list) or not addrs or not all(isinstance(a, str) for a in addrs):
        raise ValueError("rendezvous.node_addrs is not a list of addresses")
    rank, port, gpus = raw.get("node_rank"), raw.get("master_port"), raw.get("gpus_per_node")
    for name, value, high in (
        ("node_rank", rank, len(addrs) - 1),
        ("master_port", port, 65535),
        ("gpus_per_node", gpus, 1 << 16),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
            raise ValueError(f"rendezvous.{name} is not a whole number from 0 to {high}")
    assert isinstance(rank, int) and isinstance(port, int) and isinstance(gpus, int)
    return RendezvousSpec(rank, tuple(addrs), port, gpus)


def rendezvous_env(spec: AttemptSpec) -> dict[str, str]:
    """The multi-node contract's variables (docs/job-contract.md), torchrun's among them so
    that a plain `torchrun train.py` needs no flags. torchrun reads PET_<FLAG> for each of
    its flags, and sets MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK for its own
    workers, so the platform sets none of those. A PET_ variable the job sets itself wins."""
    r = spec.rendezvous
    if r is None:
        return {}
    nproc = str(max(1, r.gpus_per_node))
    values = {
        "GPUCP_NUM_NODES": str(r.num_nodes),
        "GPUCP_NODE_RANK": str(r.node_rank),
        "GPUCP_GPUS_PER_NODE": str(r.gpus_per_node),
        "GPUCP_NODE_ADDRS": ",".join(r.node_addrs),
        "GPUCP_MASTER_ADDR": r.master_addr,
        "GPUCP_MASTER_PORT": str(r.master_port),
        "PET_NNODES": str(r.num_nodes),
        "PET_NODE_RANK": str(r.node_rank),
        "PET_NPROC_PER_NODE": nproc,
        "PET_MASTER_ADDR": r.master_addr,
        "PET_MASTER_PORT": str(r.master_port),
    }
    # torchrun's own flags stay the job's to set (e.g. more processes per node than GPUs).
    return {k: v for k, v in values.items() if not (k.startswith("PET_") and k in spec.env)}


def stop_signal_number(name: str) -> int:
    """The number of an allowed stop signal name (SIGTERM for any other)."""
    import signal

    if name not in STOP_SIGNAL_NAMES:
        name = DEFAULT_STOP_SIGNAL
    return int(getattr(signal, name))


def _parse_stop_signal(value: Any) -> str:
    if value is None:
        return DEFAULT_STOP_SIGNAL
    name = str(value).strip().upper() if isinstance(value, str) else ""
    if name and not name.startswith("SIG"):
        name = "SIG" + name
    if name not in STOP_SIGNAL_NAMES:
        log.warning("stop_signal %r is not one of %s: SIGTERM instead", value, STOP_SIGNAL_NAMES)
        return DEFAULT_STOP_SIGNAL
    return name


def _parse_grace_s(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        log.warning("grace_s %r is not a number: the agent's own grace instead", value)
        return None
    try:
        grace_s = float(value)
    except ValueError:
        log.warning("grace_s %r is not a number: the agent's own grace instead", value)
        return None
    if not math.isfinite(grace_s) or not 0.0 <= grace_s <= MAX_GRACE_S:
        log.warning(
            "grace_s %r is outside 0..%.0f s: the agent's own grace instead", value, MAX_GRACE_S
        )
        return None
    return grace_s


def _wire_bool(value: Any, what: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ValueError(f"{what} must be true or false, not {value!r}")
    return value


def _wire_str(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or "\x00" in value:
        raise ValueError(f"{what} must be a non-empty string, not {value!r}")
    return value


def _parse_mounts(raw: Any) -> tuple[MountSpec, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ValueError(f"mounts must be a list, not {type(raw).__name__}")
    mounts = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ValueError(f"mounts[{i}] must be an object")
        kind = _wire_str(item.get("kind"), f"mounts[{i}].kind")
        if kind not in MOUNT_KINDS:
            raise ValueError(f"mounts[{i}].kind {kind!r} is not one of {', '.join(MOUNT_KINDS)}")
        mounts.append(
            MountSpec(
                name=_wire_str(item.get("name"), f"mounts[{i}].name"),
                kind=kind,
                source=_wire_str(item.get("source"), f"mounts[{i}].source"),
                target=_wire_str(item.get("target"), f"mounts[{i}].target"),
                read_only=_wire_bool(item.get("read_only"), f"mounts[{i}].read_only"),
            )
        )
    return tuple(mounts)


def _parse_checkpoint(raw: Any) -> CheckpointSpec | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError("checkpoint must be an object or null")
    return CheckpointSpec(
        host_path=_wire_str(raw.get("host_path"), "checkpoint.host_path"),
        target=_wire_str(raw.get("target") or CHECKPOINT_TARGET, "checkpoint.target"),
        read_only=_wire_bool(raw.get("read_only"), "checkpoint.read_only"),
    )


def _unsafe_target(target: str) -> str:
    """Why a mount target must be refused ("" when it is fine)."""
    if not target.startswith("/"):
        return "is not an absolute path"
    if ".." in target.split("/"):
        return 'contains ".."'
    path = posixpath.normpath(target)
    if path.startswith("//"):
        path = "/" + path.lstrip("/")
    if path == "/":
        return "is the root of the file system"
    if path == "/var/run" or path.startswith("/var/run/"):
        return "is a system path"
    for system in SYSTEM_PATHS:
        if path == system or path.startswith(system + "/"):
            return "is a system path"
    if path.split("/")[1].startswith("lib"):
        return "is a system path"
    return ""


def _unsafe_source(source: str) -> str:
    """Why a host source path must be refused ("" when it is fine)."""
    if not source.startswith("/"):
        return "is not an absolute path"
    if ".." in source.split("/"):
        return 'contains ".."'
    return ""


def check_paths(spec: AttemptSpec) -> None:
    """Refuse (StartError) a spec whose mounts could reach outside what was granted.

    The control plane validates mounts at submit; this is the node's own check, so that a bug
    or a forged answer there cannot make a job cover /etc or read a host path through "..".
    """
    if spec.refused:
        raise StartError(spec.refused)
    targets: set[str] = set()
    for mount in spec.mounts:
        why = _unsafe_target(mount.target)
        if why:
            raise StartError(f"mount {mount.name!r}: target {mount.target!r} {why}")
        if mount.kind == "host_path":
            why = _unsafe_source(mount.source)
            if why:
                raise StartError(f"mount {mount.name!r}: host path {mount.source!r} {why}")
        elif not _ENGINE_VOLUME_NAME.fullmatch(mount.source):
            raise StartError(f"mount {mount.name!r}: {mount.source!r} is not a volume name")
        target = posixpath.normpath(mount.target)
        if target in targets:
            raise StartError(f"mount {mount.name!r}: target {mount.target!r} is used twice")
        targets.add(target)
    if spec.checkpoint is not None:
        why = _unsafe_source(spec.checkpoint.host_path)
        if why:
            raise StartError(f"checkpoint dir {spec.checkpoint.host_path!r} {why}")
        why = _unsafe_target(spec.checkpoint.target)
        if why:
            raise StartError(f"checkpoint target {spec.checkpoint.target!r} {why}")
        if posixpath.normpath(spec.checkpoint.target) in targets:
            raise StartError(f"checkpoint target {spec.checkpoint.target!r} is a mount's too")


def ensure_checkpoint_dir(path: str, mode: int) -> None:
    """Create the job's checkpoint dir (kept for the job's next attempts; never removed here).

    Its parents are the agent's alone (0700): a bind mount reaches the dir itself whatever its
    parents' modes, and other users of the host have no business in them. The dir's own mode
    is the runtime's: who writes into it is the job's user, which a container may map to
    another uid than the agent's.
    """
    parent = os.path.dirname(path)
    os.makedirs(parent, mode=0o700, exist_ok=True)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        if not os.path.isdir(path) or os.path.islink(path):
            raise StartError(f"checkpoint dir {path} exists and is not a directory") from None
        return
    except OSError as exc:
        raise StartError(f"cannot create the checkpoint dir {path}: {exc}") from exc
    os.chmod(path, mode)  # the umask cut the bits mkdir was given


def stop_env(
    spec: AttemptSpec, checkpoint_dir: str | None, mount_paths: dict[str, str]
) -> dict[str, str]:
    """The GPUCP_* variables of the job contract: its notice, its mounts, its checkpoint dir."""
    env = {"GPUCP_STOP_SIGNAL": spec.stop_signal}
    if spec.grace_s is not None:
        env["GPUCP_GRACE_S"] = f"{spec.grace_s:g}"
    for mount in spec.mounts:
        env[mount.env_name] = mount_paths[mount.name]
    if checkpoint_dir is not None:
        env["GPUCP_CHECKPOINT_DIR"] = checkpoint_dir
    return env


@dataclass(frozen=True, slots=True)
class AttemptSpec:
    """One entry of the heartbeat answer's `attempts[]`: what should run."""

    attempt_id: int
    job_id: int | None = None
    image: str = ""
    command: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    gpu_uuids: tuple[str, ...] = ()
    cpus: float = 0.0
    memory_mib: int = 0
    max_runtime_s: float | None = None
    stop_signal: str = DEFAULT_STOP_SIGNAL
    grace_s: float | None = None  # None: the agent's own --stop-grace
    mounts: tuple[MountSpec, ...] = ()
    checkpoint: CheckpointSpec | None = None
    rendezvous: RendezvousSpec | None = None
    # Why it must not start (mounts or checkpoint the agent cannot read): it fails to start with
    # this message instead of being dropped, which would leave the control plane waiting.
    refused: str = ""

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> AttemptSpec:
        """Parse one desired attempt; unknown keys are ignored so the protocol can grow.

        A stop signal or grace the agent cannot use falls back to SIGTERM and the agent's own
        grace; mounts or a checkpoint it cannot read make the attempt refused (it fails to
        start, saying why), since running it without them would lose the job's data.
        """
        refused = ""
        try:
            mounts = _parse_mounts(data.get("mounts"))
            checkpoint = _parse_checkpoint(data.get("checkpoint"))
        except ValueError as exc:
            mounts, checkpoint, refused = (), None, f"the node cannot read its volumes: {exc}"
        try:
            rendezvous = _parse_rendezvous(data.get("rendezvous"))
        except ValueError as exc:
            rendezvous, refused = None, refused or f"the node cannot read its rendezvous: {exc}"
        return cls(
            rendezvous=rendezvous,
            stop_signal=_parse_stop_signal(data.get("stop_signal")),
            grace_s=_parse_grace_s(data.get("grace_s")),
            mounts=mounts,
            checkpoint=checkpoint,
            refused=refused,
            attempt_id=int(data["attempt_id"]),
            job_id=int(data["job_id"]) if data.get("job_id") is not None else None,
            image=str(data.get("image") or ""),
            command=tuple(str(part) for part in data.get("command") or ()),
            env={str(k): str(v) for k, v in (data.get("env") or {}).items()},
            gpu_uuids=tuple(str(u) for u in data.get("gpu_uuids") or ()),
            cpus=float(data.get("cpus") or 0.0),
            memory_mib=int(data.get("memory_mib") or 0),
            max_runtime_s=(
                float(data["max_runtime_s"]) if data.get("max_runtime_s") is not None else None
            ),
        )


@dataclass(frozen=True, slots=True)
class AttemptStatus:
    """What the runtime observes of one attempt now."""

    attempt_id: int
    state: AttemptState
    job_id: int | None = None
    gpu_uuids: tuple[str, ...] = ()
    started_at: float | None = None  # Unix seconds
    finished_at: float | None = None
    exit_code: int | None = None
    message: str = ""
    # True once every byte of output is in the log the runtime serves (the attempt has ended and
    # its output has been drained), so the agent may forget it after shipping them.
    logs_complete: bool = False
    # It never started because the node's lease had run out when it was to (the runtime's own
    # last check before the job's process): the node's doing, not the job's.
    fenced: bool = False
    # The runtime's stop (not the fence's: its note is on disk): when the stop signal went out,
    # and whether the attempt had to be killed at the end of its grace.
    stop_signal_at: float | None = None
    killed_after_grace: bool | None = None


def visible_devices_env(gpu_uuids: tuple[str, ...]) -> dict[str, str]:
    """The variables that restrict CUDA (and NVIDIA's container hook) to these GPUs.

    An empty list must hide every GPU, not show all of them: "" for CUDA, "void" for NVIDIA.
    """
    joined = ",".join(gpu_uuids)
    return {"CUDA_VISIBLE_DEVICES": joined, "NVIDIA_VISIBLE_DEVICES": joined or "void"}


def _replace_each_byte(exc: UnicodeError) -> tuple[str, int]:
    # One "?" per undecodable byte keeps the text's UTF-8 length equal to the bytes' length, so
    # byte offsets of the output and of what is shipped stay the same.
    if not isinstance(exc, UnicodeDecodeError):
        raise exc
    return "?" * (exc.end - exc.start), exc.end


codecs.register_error("gpucp-replace-bytes", _replace_each_byte)


def decode_log_chunk(data: bytes, *, final: bool) -> tuple[str, int]:
    """Decode output bytes for shipping: (text, how many bytes it covers).

    A multi-byte character cut at the end of ``data`` is left for the next chunk unless the
    output is ``final``; invalid bytes become "?" one for one, so the UTF-8 length of the text
    always equals the bytes it covers.
    """
    decoder = codecs.getincrementaldecoder("utf-8")(errors="gpucp-replace-bytes")
    text = decoder.decode(data, final=final)
    pending, _ = decoder.getstate()
    return text, len(data) - len(pending)


def read_file_range(path: Path, offset: int, max_bytes: int) -> bytes:
    """Bytes ``offset .. offset+max_bytes`` of a log file (b"" where it does not exist yet)."""
    try:
        # Most jobs of a flood print nothing, and the log is looked at every heartbeat and once
        # more before the attempt is forgotten: a stat is one system call where an open, a seek,
        # a read and a close are four. What a writer adds after it is read next time.
        if os.stat(path).st_size <= offset:
            return b""
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(max_bytes)
    except FileNotFoundError:
        return b""


# Records are a few hundred bytes: one read takes the whole of one.
_READ_CHUNK = 65536


def read_small(path: str | os.PathLike[str], *, durable: bool = False) -> bytes | None:
    """The whole of a small file (a record, a lease note, a /proc file); None while it does not
    exist.

    os.open and os.read, not open(): a buffered file object costs six more system calls (a
    stat, a terminal check, seeks, a read to find the end) per record, and the agent reads a
    few records of every job it runs. A short read of a regular file is its end. durable:
    fsync it too, through the same descriptor."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        chunks = []
        while True:
            chunk = os.read(fd, _READ_CHUNK)
            chunks.append(chunk)
            if len(chunk) < _READ_CHUNK:
                break
        if durable:
            os.fsync(fd)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """All of `data` to a descriptor (os.write may take only part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_json_atomic(path: Path, data: dict[str, Any], *, durable: bool = True) -> None:
    """Write a small record so that a crash leaves the old or the new one, never half of one.

    `durable=False` skips the fsync: a crash of the process still leaves the old or the new
    record (the kernel has the write), a crash of the host may leave the old one. For records
    whose loss the next look at the host makes good again; an fsync costs milliseconds."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


class Runtime(abc.ABC):
    """Runs attempts. Implementations keep enough on disk (or in labels) to survive a restart."""

    name: str = ""

    @abc.abstractmethod
    def adopt(self) -> list[AttemptStatus]:
        """Find the attempts started before a restart of the agent, running or ended since."""

    @abc.abstractmethod
    def start(self, spec: AttemptSpec, extra_env: dict[str, str] | None = None) -> AttemptStatus:
        """Start ``spec``; raises StartError where it cannot start."""

    @abc.abstractmethod
    def statuses(self) -> list[AttemptStatus]:
        """Every attempt the runtime knows of (started or adopted, not yet removed)."""

    @abc.abstractmethod
    def stop(self, attempt_id: int, grace_s: float, signal: str = DEFAULT_STOP_SIGNAL) -> None:
        """``signal`` now, SIGKILL after ``grace_s`` if it still runs. Returns at once.

        The runtime keeps when it sent the signal and whether it had to kill (the attempt's
        AttemptStatus), across a restart of the agent too.
        """

    def has_volume(self, name: str) -> bool:
        """Whether the engine has this named volume (a runtime without volumes: never)."""
        return False

    @abc.abstractmethod
    def read_logs(self, attempt_id: int, offset: int, max_bytes: int) -> bytes:
        """Output bytes of the attempt from ``offset`` (stdout and stderr interleaved)."""

    @abc.abstractmethod
    def remove(self, attempt_id: int) -> None:
        """Forget an ended attempt and free what it left (its container, its files)."""

    # -- for the fence (agents.fence), a process of its own ----------------------------------------
    #
    # The fence must act when the agent cannot (dead, paused), so these look at the host afresh
    # (the attempt folders, the engine's labels) instead of this object's memory, and change
    # nothing but the processes' fate.

    @abc.abstractmethod
    def running_attempts(self) -> list[int]:
        """Ids of the attempts whose processes run on this host now."""

    @abc.abstractmethod
    def signal_attempt(self, attempt_id: int, sig: int) -> None:
        """Send ``sig`` to everything of the attempt now (no grace, no bookkeeping)."""

    def notify_exits(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from any thread) as soon as an attempt's process ends, so that the
        agent reports the exit at once instead of at its next look. A runtime that cannot tell
        keeps this default: the agent's poll still sees every exit, only later."""
        return None

    def close(self) -> None:
        """Release connections; running attempts keep running."""
        return None
