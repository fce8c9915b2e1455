"""What the agent needs of a runtime: start, observe, stop, read the output of attempts, and find
again after a restart the attempts it started before.
"""

from __future__ import annotations

import abc
import codecs
import enum
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> AttemptSpec:
        """Parse one desired attempt; unknown keys are ignored so the protocol can grow."""
        return cls(
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
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(max_bytes)
    except FileNotFoundError:
        return b""


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write a small record so that a crash leaves the old or the new one, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
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
    def stop(self, attempt_id: int, grace_s: float) -> None:
        """SIGTERM now, SIGKILL after ``grace_s`` if it still runs. Returns at once."""

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

    def close(self) -> None:
        """Release connections; running attempts keep running."""
        return None
