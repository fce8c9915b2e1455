"""The GPU interface the agent talks to, with typed errors and values that carry their units.

Two implementations: `nvml.NvmlBackend` (real hardware through nvidia-ml-py) and
`simulated.SimulatedBackend` (a power model that keeps NVML's contract). A reading a device
cannot give is None, never 0: a 0 W or 0 J reading would be accounted as a real one.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


class GpuError(Exception):
    """An NVML call (or its simulated equivalent) failed."""


class GpuNotSupported(GpuError):
    """The device does not support this query or setting."""


class GpuLost(GpuError):
    """The GPU fell off the bus or stopped answering (NVML_ERROR_GPU_IS_LOST)."""


class GpuNoPermission(GpuError):
    """The agent lacks the privilege for this call (setting a power limit needs root)."""


class GpuInvalidArgument(GpuError):
    """A value outside what the device accepts, e.g. a power limit outside its constraints."""


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One GPU's inventory, as sent in `register`."""

    index: int
    uuid: str
    model: str
    memory_mib: int
    power_min_w: float
    power_max_w: float
    power_default_w: float

    def to_wire(self) -> dict[str, Any]:
        """The `gpus[]` entry of the register request."""
        return {
            "index": self.index,
            "uuid": self.uuid,
            "model": self.model,
            "memory_mib": self.memory_mib,
            "power_min_w": self.power_min_w,
            "power_max_w": self.power_max_w,
            "power_default_w": self.power_default_w,
        }


@dataclass(frozen=True, slots=True)
class GpuTelemetry:
    """One GPU's readings at one moment; None means "this device cannot tell"."""

    uuid: str
    healthy: bool
    utilization_pct: float | None = None
    memory_used_mib: float | None = None
    power_draw_w: float | None = None
    power_cap_w: float | None = None  # the enforced limit
    energy_j: float | None = None  # the device's cumulative counter
    temperature_c: float | None = None
    sm_clock_mhz: float | None = None
    throttle_reasons: tuple[str, ...] | None = None
    ecc_errors: int | None = None  # uncorrected, since the driver loaded
    xid_errors: tuple[int, ...] = field(default_factory=tuple)  # critical XIDs seen lately
    message: str = ""  # why it is unhealthy, in words

    def to_wire(self) -> dict[str, Any]:
        """The `gpus[]` entry of a heartbeat."""
        wire = {
            "uuid": self.uuid,
            "healthy": self.healthy,
            "utilization_pct": self.utilization_pct,
            "memory_used_mib": self.memory_used_mib,
            "power_draw_w": self.power_draw_w,
            "power_cap_w": self.power_cap_w,
            "energy_j": self.energy_j,
            "temperature_c": self.temperature_c,
            "sm_clock_mhz": self.sm_clock_mhz,
            "throttle_reasons": (
                list(self.throttle_reasons) if self.throttle_reasons is not None else None
            ),
            "ecc_errors": self.ecc_errors,
        }
        if self.xid_errors:
            wire["xid_errors"] = list(self.xid_errors)
        if self.message:
            wire["message"] = self.message
        return wire


class GpuBackend(abc.ABC):
    """What the agent needs of its GPUs. Every power value is in watts, energy in joules."""

    #: "nvml" or "simulated"
    kind: str = ""
    #: True when the GPUs are real devices a container engine can be given (device requests).
    real_devices: bool = False

    @abc.abstractmethod
    def inventory(self) -> list[GpuInfo]:
        """Every GPU of the node, in index order."""

    @abc.abstractmethod
    def telemetry(self) -> list[GpuTelemetry]:
        """A reading of every GPU; a lost GPU is reported unhealthy, not raised."""

    @abc.abstractmethod
    def enforced_power_limit_w(self, uuid: str) -> float:
        """The power limit the device enforces now."""

    @abc.abstractmethod
    def set_power_limit(self, uuid: str, power_limit_w: float, *, dry_run: bool = False) -> float:
        """Make ``power_limit_w`` the GPU's limit and return the limit enforced afterwards.

        Writes only when the value differs from the enforced one. Raises GpuInvalidArgument
        outside the device's constraints (also in ``dry_run``, which validates and writes
        nothing), GpuNoPermission without the privilege, GpuNotSupported, GpuLost.
        """

    @abc.abstractmethod
    def energy_j(self, uuid: str) -> float | None:
        """The device's cumulative energy counter, or None where it has none."""

    def attach_load(
        self, attempt_id: int, gpu_uuids: Iterable[str], utilization: float = 1.0
    ) -> None:
        """Tell the backend an attempt now keeps these GPUs busy (a model needs it; NVML sees it)."""
        return None

    def detach_load(self, attempt_id: int) -> None:
        """The attempt ended: its GPUs fall back to idle (for a model; hardware sees it itself)."""
        return None

    def progress_speed(self, gpu_uuids: Iterable[str]) -> float | None:
        """Modelled speed of a job on these GPUs over its uncapped speed, None on hardware.

        A data-parallel job runs at the pace of its slowest GPU, so this is the minimum.
        """
        return None

    def host_shape(self) -> tuple[int, int] | None:
        """(CPUs, memory in MiB) of the host these GPUs stand for, where that is not the machine
        the agent runs on (a simulated node); None: report the real host's."""
        return None

    def close(self) -> None:
        """Release the library (nvmlShutdown) or persist the model's state."""
        return None
