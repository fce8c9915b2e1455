"""A modelled GPU that keeps NVML's contract, for laptops, CI and the embedded mode.

The power model is the scheduler's own (`scheduler.gpu_model`, fitted to the zeus measurements), so
what the DVFS planner predicts for a cap is what a simulated node then draws and how fast its
jobs progress. The contract kept from NVML: stable UUIDs, limits inside the board's constraints
(else GpuInvalidArgument, as NVML's INVALID_ARGUMENT), a draw that never exceeds the cap and
rises with load, and an energy counter that integrates the draw over monotonic time and only
grows, also across agent restarts when it has a state file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agents.gpu.base import (
    GpuBackend,
    GpuInfo,
    GpuInvalidArgument,
    GpuLost,
    GpuNoPermission,
    GpuTelemetry,
)
from scheduler.gpu_model import GPU_TYPES, GpuType, clock_ratio, gpu_utilization, power_draw_w
from scheduler.gpu_model import relative_throughput as model_relative_throughput
from scheduler.model import PowerProfile

log = logging.getLogger(__name__)

DEFAULT_COUNT = 8
# Boost SM clocks of the boards (NVML's max SM clock); the model scales them by the cap.
MAX_SM_CLOCK_MHZ = {
    "A100-SXM4-80GB": 1410.0,
    "H100-SXM-80GB": 1980.0,
    "V100-SXM2-32GB": 1530.0,
    "V100-PCIE-32GB": 1380.0,
    "A40": 1740.0,
    "P100-PCIE-16GB": 1329.0,
    "RTX6000": 1770.0,
    "H200-SXM-141GB": 1980.0,
    "A100-SXM4-40GB": 1410.0,
    "L4": 2040.0,
}
# The host a node of these boards comes in, per GPU: (CPU threads, memory MiB), from the
# vendors' 8-GPU servers (a DGX H100 has 224 threads and 2 TiB, a DGX A100 256 and 1 TiB). A
# simulated node reports this shape, not the test machine's, so that a job's CPU and memory
# requests meet what a real node of its GPUs would offer. The agent's --cpus / --memory-mib
# still override it.
HOST_SHAPE_PER_GPU = {
    "H100-SXM-80GB": (28, 256 * 1024),
    "A100-SXM4-80GB": (32, 128 * 1024),
}
DEFAULT_HOST_SHAPE_PER_GPU = (16, 128 * 1024)
IDLE_SM_CLOCK_MHZ = 345.0
IDLE_MEMORY_MIB = 4.0
# Share of the board's memory a running job holds (enough to look like a training job).
BUSY_MEMORY_SHARE = 0.6
AMBIENT_C = 30.0
# Degrees above ambient at the board's maximum power.
HEAT_C_AT_MAX = 50.0


def simulated_uuid(node_name: str, index: int) -> str:
    """A UUID in NVML's format that is the same for the same node name and index, every start."""
    digest = hashlib.sha256(f"gpucp-simulated/{node_name}/{index}".encode()).hexdigest()
    return f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


def parse_spec(spec: str) -> tuple[GpuType, int]:
    """``simulated[:<profile>[:count]]`` -> (GPU type, count); the profile name ignores case."""
    parts = spec.split(":")
    if parts[0] != "simulated" or len(parts) > 3:
        raise ValueError(f"expected simulated:<profile>[:count], got {spec!r}")
    name = parts[1] if len(parts) > 1 and parts[1] else "H100-SXM-80GB"
    by_lower = {key.lower(): gpu_type for key, gpu_type in GPU_TYPES.items()}
    gpu_type = by_lower.get(name.lower())
    if gpu_type is None:
        raise ValueError(f"unknown simulated GPU profile {name!r}; known: {', '.join(GPU_TYPES)}")
    count = int(parts[2]) if len(parts) > 2 and parts[2] else DEFAULT_COUNT
    if count < 1:
        raise ValueError(f"a simulated node needs at least one GPU, got {count}")
    return gpu_type, count


@dataclass(slots=True)
class _Gpu:
    info: GpuInfo
    gpu_type: GpuType
    cap_w: float
    energy_j: float
    last_s: float
    lost: bool = False


# The largest state written in place: one page, which a killed writer leaves whole or untouched.
_IN_PLACE_MAX_BYTES = 4096


class SimulatedBackend(GpuBackend):
    """``count`` GPUs of ``gpu_type`` on node ``node_name``, drawing what the power model says."""

    kind = "simulated"
    real_devices = False

    def __init__(
        self,
        gpu_type: GpuType,
        count: int,
        *,
        node_name: str,
        state_path: str | os.PathLike[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        power_profile: PowerProfile | None = None,
        power_limit_settable: bool = True,
    ) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._profile = power_profile or PowerProfile()
        self._state_path = Path(state_path) if state_path else None
        # The state file's length, which a shorter state is padded to (see _save_state).
        self._state_bytes = 0
        # Like a board where only root may set limits: for testing what happens when it fails.
        self.power_limit_settable = power_limit_settable
        # How many limits were written (a real board wears no counter; tests and demos read it).
        self.power_limit_writes = 0
        saved = self._load_state()
        now_s = clock()
        self._gpus: dict[str, _Gpu] = {}
        for index in range(count):
            uuid = simulated_uuid(node_name, index)
            info = GpuInfo(
                index=index,
                uuid=uuid,
                model=gpu_type.name,
                memory_mib=gpu_type.memory_mib,
                power_min_w=gpu_type.min_w,
                power_max_w=gpu_type.max_w,
                power_default_w=gpu_type.max_w,
            )
            state = saved.get(uuid, {})
            cap_w = float(state.get("cap_w", gpu_type.max_w))
            if not gpu_type.min_w <= cap_w <= gpu_type.max_w:
                cap_w = gpu_type.max_w
            self._gpus[uuid] = _Gpu(
                info=info,
                gpu_type=gpu_type,
                cap_w=cap_w,
                energy_j=float(state.get("energy_j", 0.0)),
                last_s=now_s,
            )
        # attempt id -> (its GPU uuids, the share of the time it keeps them busy)
        self._loads: dict[int, tuple[tuple[str, ...], float]] = {}

    @classmethod
    def from_spec(
        cls, spec: str, *, node_name: str, state_dir: str | os.PathLike[str] | None = None
    ) -> SimulatedBackend:
        """Build from ``simulated:<profile>[:count]``; with a state dir the counters survive."""
        gpu_type, count = parse_spec(spec)
        state_path = Path(state_dir) / "simulated-gpus.json" if state_dir else None
        return cls(gpu_type, count, node_name=node_name, state_path=state_path)

    # -- the model -----------------------------------------------------------------------------

    def _load(self, uuid: str) -> float:
        total = sum(share for uuids, share in self._loads.values() if uuid in uuids)
        return min(max(total, 0.0), 1.0)

    def _draw_w(self, gpu: _Gpu) -> float:
        if gpu.lost:
            return 0.0
        return power_draw_w(
            self._profile,
            gpu.cap_w,
            gpu.gpu_type.max_w,
            gpu.gpu_type.idle_w,
            utilization=self._load(gpu.info.uuid),
        )

    def _advance(self, gpu: _Gpu) -> None:
        """Integrate the draw since the last change: it was constant since then."""
        now_s = self._clock()
        elapsed_s = max(now_s - gpu.last_s, 0.0)
        gpu.energy_j += self._draw_w(gpu) * elapsed_s
        gpu.last_s = now_s

    def _advance_all(self) -> None:
        for gpu in self._gpus.values():
            self._advance(gpu)

    def _gpu(self, uuid: str) -> _Gpu:
        try:
            return self._gpus[uuid]
        except KeyError:
            raise GpuInvalidArgument(f"no GPU {uuid} on this node") from None

    # -- GpuBackend ----------------------------------------------------------------------------

    def inventory(self) -> list[GpuInfo]:
        return [gpu.info for gpu in self._gpus.values()]

    def telemetry(self) -> list[GpuTelemetry]:
        with self._lock:
            self._advance_all()
            readings = [self._read(gpu) for gpu in self._gpus.values()]
            self._save_state()
        return readings

    def _read(self, gpu: _Gpu) -> GpuTelemetry:
        if gpu.lost:
            return GpuTelemetry(uuid=gpu.info.uuid, healthy=False, message="GPU is lost")
        load = self._load(gpu.info.uuid)
        max_w = gpu.gpu_type.max_w
        draw_w = self._draw_w(gpu)
        if load <= 0.0:
            reasons: tuple[str, ...] = ("gpu_idle",)
            clock_mhz = IDLE_SM_CLOCK_MHZ
            utilization_pct = 0.0
        else:
            throughput = model_relative_throughput(self._profile, gpu.cap_w, max_w)
            reasons = ("sw_power_cap",) if throughput < 0.999 else ()
            max_clock_mhz = MAX_SM_CLOCK_MHZ.get(gpu.gpu_type.name, 1500.0)
            clock_mhz = max_clock_mhz * clock_ratio(self._profile, gpu.cap_w, max_w)
            utilization_pct = 100.0 * load * gpu_utilization(self._profile, gpu.cap_w, max_w)
        return GpuTelemetry(
            uuid=gpu.info.uuid,
            healthy=True,
            utilization_pct=round(min(utilization_pct, 100.0), 1),
            memory_used_mib=IDLE_MEMORY_MIB + load * BUSY_MEMORY_SHARE * gpu.info.memory_mib,
            power_draw_w=round(draw_w, 3),
            power_cap_w=gpu.cap_w,
            energy_j=gpu.energy_j,
            temperature_c=round(AMBIENT_C + HEAT_C_AT_MAX * draw_w / max_w, 1),
            sm_clock_mhz=round(clock_mhz),
            throttle_reasons=reasons,
            ecc_errors=0,
        )

    def enforced_power_limit_w(self, uuid: str) -> float:
        gpu = self._gpu(uuid)
        if gpu.lost:
            raise GpuLost(f"GPU {uuid} is lost")
        return gpu.cap_w

    def set_power_limit(self, uuid: str, power_limit_w: float, *, dry_run: bool = False) -> float:
        with self._lock:
            gpu = self._gpu(uuid)
            if gpu.lost:
                raise GpuLost(f"GPU {uuid} is lost")
            if not gpu.gpu_type.min_w <= power_limit_w <= gpu.gpu_type.max_w:
                raise GpuInvalidArgument(
                    f"power limit {power_limit_w:.1f} W outside {gpu.gpu_type.min_w:.1f}.."
                    f"{gpu.gpu_type.max_w:.1f} W of GPU {uuid}"
                )
            if dry_run or power_limit_w == gpu.cap_w:
                return gpu.cap_w
            if not self.power_limit_settable:
                raise GpuNoPermission("NVML: Insufficient Permissions")
            self._advance(gpu)
            gpu.cap_w = float(power_limit_w)
            self.power_limit_writes += 1
            self._save_state()
            return gpu.cap_w

    def energy_j(self, uuid: str) -> float | None:
        with self._lock:
            gpu = self._gpu(uuid)
            self._advance(gpu)
            return gpu.energy_j

    def attach_load(
        self, attempt_id: int, gpu_uuids: Iterable[str], utilization: float = 1.0
    ) -> None:
        with self._lock:
            uuids = tuple(u for u in gpu_uuids if u in self._gpus)
            self._advance_all()
            self._loads[attempt_id] = (uuids, min(max(utilization, 0.0), 1.0))

    def detach_load(self, attempt_id: int) -> None:
        with self._lock:
            if attempt_id in self._loads:
                self._advance_all()
                del self._loads[attempt_id]

    def progress_speed(self, gpu_uuids: Iterable[str]) -> float | None:
        speeds = []
        for uuid in gpu_uuids:
            gpu = self._gpus.get(uuid)
            if gpu is None:
                continue
            if gpu.lost:
                speeds.append(0.0)
                continue
            speeds.append(model_relative_throughput(self._profile, gpu.cap_w, gpu.gpu_type.max_w))
        return min(speeds) if speeds else 1.0

    def mark_lost(self, uuid: str) -> None:
        """Make a GPU fall off the bus, as NVML_ERROR_GPU_IS_LOST would report it."""
        with self._lock:
            gpu = self._gpu(uuid)
            self._advance(gpu)
            gpu.lost = True

    def host_shape(self) -> tuple[int, int] | None:
        cpus = memory_mib = 0
        for gpu in self._gpus.values():
            per_cpus, per_memory_mib = HOST_SHAPE_PER_GPU.get(
                gpu.info.model, DEFAULT_HOST_SHAPE_PER_GPU
            )
            cpus += per_cpus
            memory_mib += per_memory_mib
        # A node with no GPU (a CPU-only stand-in) keeps the shape of one.
        return (cpus, memory_mib) if self._gpus else DEFAULT_HOST_SHAPE_PER_GPU

    def close(self) -> None:
        with self._lock:
            self._advance_all()
            self._save_state()

    # -- persistence ---------------------------------------------------------------------------

    def _load_state(self) -> dict[str, Any]:
        if self._state_path is None or not self._state_path.exists():
            return {}
        try:
            text = self._state_path.read_bytes()
            self._state_bytes = len(text)
            state: dict[str, Any] = json.loads(text)
            return state
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable %s: %s", self._state_path, exc)
            return {}

    def _save_state(self) -> None:
        if self._state_path is None:
            return
        state = {
            uuid: {"energy_j": gpu.energy_j, "cap_w": gpu.cap_w} for uuid, gpu in self._gpus.items()
        }
        data = json.dumps(state).encode()
        if max(len(data), self._state_bytes) > _IN_PLACE_MAX_BYTES:
            tmp = self._state_path.with_suffix(".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, self._state_path)
            self._state_bytes = len(data)
            return
        # Saved at every telemetry read (every agent cycle), so written in place: a new file
        # and a rename each time cost a new inode and a freed one, which ext4 without a journal
        # pays for at every later file the agent makes. A write within one page is whole or
        # absent after a kill of the agent (the kernel stops a write cut by a fatal signal only
        # between pages); a crash of the host may tear it, and an unreadable file then starts
        # the counters at zero, as a driver reloaded at boot does. A shorter text is padded
        # with spaces, which JSON ignores, so no truncate is needed either.
        fd = os.open(self._state_path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, data.ljust(self._state_bytes), 0)
        finally:
            os.close(fd)
        self._state_bytes = max(self._state_bytes, len(data))
