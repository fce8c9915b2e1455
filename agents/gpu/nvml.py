"""Real GPUs through NVML (nvidia-ml-py, imported as pynvml).

NVML speaks milliwatts and millijoules and signals every failure with an NVMLError code; this
module turns both into the agent's terms: watts, joules and the typed errors of `base`. A query a
board does not support becomes None (never 0), and a GPU that fell off the bus is reported
unhealthy instead of taking the whole heartbeat down with it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pynvml

from agents.gpu.base import (
    GpuBackend,
    GpuError,
    GpuInfo,
    GpuInvalidArgument,
    GpuLost,
    GpuNoPermission,
    GpuNotSupported,
    GpuTelemetry,
)

log = logging.getLogger(__name__)

MIB = 1024 * 1024
# A written limit is "the same" as the current one within this much: NVML rounds to its own step.
LIMIT_TOLERANCE_W = 0.5

# NVML's clock-event (throttle) reason bits, by the names the heartbeat carries.
THROTTLE_REASONS: tuple[tuple[int, str], ...] = (
    (0x0001, "gpu_idle"),
    (0x0002, "applications_clocks_setting"),
    (0x0004, "sw_power_cap"),
    (0x0008, "hw_slowdown"),
    (0x0010, "sync_boost"),
    (0x0020, "sw_thermal_slowdown"),
    (0x0040, "hw_thermal_slowdown"),
    (0x0080, "hw_power_brake_slowdown"),
    (0x0100, "display_clock_setting"),
    (0x0200, "board_limit"),
    (0x0400, "reliability"),
)

# XIDs after which NVIDIA's own tooling treats a GPU as needing a reset (double-bit ECC error,
# fallen off the bus, uncontained ECC, GSP errors, row-remap failure): such a GPU gets no work.
FATAL_XIDS = frozenset({48, 62, 64, 74, 79, 92, 94, 95, 119, 120})
XIDS_KEPT = 10

_ERROR_TYPES: dict[int, type[GpuError]] = {
    pynvml.NVML_ERROR_NOT_SUPPORTED: GpuNotSupported,
    pynvml.NVML_ERROR_GPU_IS_LOST: GpuLost,
    pynvml.NVML_ERROR_NO_PERMISSION: GpuNoPermission,
    pynvml.NVML_ERROR_INVALID_ARGUMENT: GpuInvalidArgument,
}


def decode_throttle_reasons(mask: int) -> tuple[str, ...]:
    """NVML's reason bit mask as names, lowest bit first; unknown bits are named by value."""
    names = [name for bit, name in THROTTLE_REASONS if mask & bit]
    known = 0
    for bit, _ in THROTTLE_REASONS:
        known |= bit
    if mask & ~known:
        names.append(f"unknown_0x{mask & ~known:x}")
    return tuple(names)


def _typed(exc: pynvml.NVMLError) -> GpuError:
    code: int | None = getattr(exc, "value", None)
    kind = _ERROR_TYPES.get(code, GpuError) if code is not None else GpuError
    return kind(f"NVML: {exc}")


def _call(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except pynvml.NVMLError as exc:
        raise _typed(exc) from exc


def _optional(fn: Callable[..., Any], *args: Any) -> Any:
    """The reading, or None where the board cannot give it. A lost GPU still raises."""
    try:
        return _call(fn, *args)
    except GpuLost:
        raise
    except GpuError as exc:
        if not isinstance(exc, GpuNotSupported):
            log.debug("NVML %s failed: %s", getattr(fn, "__name__", fn), exc)
        return None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class NvmlBackend(GpuBackend):
    """The node's NVIDIA GPUs. Construction calls nvmlInit() and raises GpuError where it fails."""

    kind = "nvml"
    real_devices = True

    def __init__(self) -> None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise GpuError(f"NVML unavailable: {exc}") from exc
        self._handles: dict[str, Any] = {}
        self._inventory: list[GpuInfo] = []
        self._xids: dict[str, list[int]] = {}
        self._fatal: dict[str, str] = {}
        for index in range(_call(pynvml.nvmlDeviceGetCount)):
            handle = _call(pynvml.nvmlDeviceGetHandleByIndex, index)
            info = self._describe(index, handle)
            self._handles[info.uuid] = handle
            self._xids[info.uuid] = []
            self._inventory.append(info)
        self._events = self._register_xid_events()

    def _describe(self, index: int, handle: Any) -> GpuInfo:
        uuid = _text(_call(pynvml.nvmlDeviceGetUUID, handle))
        name = _text(_call(pynvml.nvmlDeviceGetName, handle))
        memory_mib = int(_call(pynvml.nvmlDeviceGetMemoryInfo, handle).total // MIB)
        constraints = _optional(pynvml.nvmlDeviceGetPowerManagementLimitConstraints, handle)
        default_mw = _optional(pynvml.nvmlDeviceGetPowerManagementDefaultLimit, handle)
        enforced_mw = _optional(pynvml.nvmlDeviceGetEnforcedPowerLimit, handle)
        # A board without settable limits still has one it enforces: report that as its range,
        # so the scheduler sees a GPU whose cap cannot move.
        fixed_mw = default_mw if default_mw is not None else enforced_mw
        if constraints is not None:
            min_mw, max_mw = constraints
        elif fixed_mw is not None:
            min_mw = max_mw = fixed_mw
        else:
            log.warning("GPU %s reports no power limits at all", uuid)
            min_mw = max_mw = 0
        if default_mw is None:
            default_mw = max_mw
        return GpuInfo(
            index=index,
            uuid=uuid,
            model=name,
            memory_mib=memory_mib,
            power_min_w=min_mw / 1000.0,
            power_max_w=max_mw / 1000.0,
            power_default_w=default_mw / 1000.0,
        )

    def _register_xid_events(self) -> Any:
        try:
            events = pynvml.nvmlEventSetCreate()
        except (pynvml.NVMLError, AttributeError) as exc:
            log.info("NVML events unavailable (%s): no XID health", exc)
            return None
        registered = 0
        for uuid, handle in self._handles.items():
            try:
                pynvml.nvmlDeviceRegisterEvents(
                    handle, pynvml.nvmlEventTypeXidCriticalError, events
                )
                registered += 1
            except pynvml.NVMLError as exc:
                log.info("GPU %s: no XID events (%s)", uuid, exc)
        return events if registered else None

    def _drain_xid_events(self) -> None:
        if self._events is None:
            return
        for _ in range(100):  # a storm of events must not stall the heartbeat
            try:
                data = pynvml.nvmlEventSetWait(self._events, 0)
            except pynvml.NVMLError:
                return  # NVML_ERROR_TIMEOUT: nothing pending
            try:
                uuid = _text(pynvml.nvmlDeviceGetUUID(data.device))
            except pynvml.NVMLError:
                continue
            xid = int(data.eventData)
            kept = self._xids.setdefault(uuid, [])
            kept.append(xid)
            del kept[:-XIDS_KEPT]
            if xid in FATAL_XIDS:
                log.error("GPU %s: critical XID %d", uuid, xid)
                self._fatal[uuid] = f"critical XID {xid}"

    def _handle(self, uuid: str) -> Any:
        try:
            return self._handles[uuid]
        except KeyError:
            raise GpuInvalidArgument(f"no GPU {uuid} on this node") from None

    def inventory(self) -> list[GpuInfo]:
        return list(self._inventory)

    def telemetry(self) -> list[GpuTelemetry]:
        self._drain_xid_events()
        return [self._read(info.uuid) for info in self._inventory]

    def _read(self, uuid: str) -> GpuTelemetry:
        handle = self._handles[uuid]
        try:
            utilization = _optional(pynvml.nvmlDeviceGetUtilizationRates, handle)
            memory = _optional(pynvml.nvmlDeviceGetMemoryInfo, handle)
            power_mw = _optional(pynvml.nvmlDeviceGetPowerUsage, handle)
            limit_mw = _optional(pynvml.nvmlDeviceGetEnforcedPowerLimit, handle)
            energy_mj = _optional(pynvml.nvmlDeviceGetTotalEnergyConsumption, handle)
            temperature_c = _optional(
                pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU
            )
            sm_clock_mhz = _optional(pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_SM)
            reasons = self._throttle_mask(handle)
            ecc = _optional(
                pynvml.nvmlDeviceGetTotalEccErrors,
                handle,
                pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                pynvml.NVML_VOLATILE_ECC,
            )
        except GpuLost as exc:
            log.error("GPU %s is lost: %s", uuid, exc)
            return GpuTelemetry(uuid=uuid, healthy=False, message="GPU is lost")
        fatal = self._fatal.get(uuid, "")
        return GpuTelemetry(
            uuid=uuid,
            healthy=not fatal,
            utilization_pct=float(utilization.gpu) if utilization is not None else None,
            memory_used_mib=memory.used / MIB if memory is not None else None,
            power_draw_w=power_mw / 1000.0 if power_mw is not None else None,
            power_cap_w=limit_mw / 1000.0 if limit_mw is not None else None,
            energy_j=energy_mj / 1000.0 if energy_mj is not None else None,
            temperature_c=float(temperature_c) if temperature_c is not None else None,
            sm_clock_mhz=float(sm_clock_mhz) if sm_clock_mhz is not None else None,
            throttle_reasons=decode_throttle_reasons(reasons) if reasons is not None else None,
            ecc_errors=int(ecc) if ecc is not None else None,
            xid_errors=tuple(self._xids.get(uuid, ())),
            message=fatal,
        )

    @staticmethod
    def _throttle_mask(handle: Any) -> int | None:
        # Drivers >= 535 call them "clock event reasons"; older ones only have the throttle name.
        for name in (
            "nvmlDeviceGetCurrentClocksEventReasons",
            "nvmlDeviceGetCurrentClocksThrottleReasons",
        ):
            fn = getattr(pynvml, name, None)
            if fn is None:
                continue
            try:
                reasons: int = fn(handle)
                return reasons
            except pynvml.NVMLError as exc:
                if exc.value == pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    continue
                typed = _typed(exc)
                if isinstance(typed, GpuLost):
                    raise typed from exc
                return None
        return None

    def enforced_power_limit_w(self, uuid: str) -> float:
        limit_mw: int = _call(pynvml.nvmlDeviceGetEnforcedPowerLimit, self._handle(uuid))
        return limit_mw / 1000.0

    def set_power_limit(self, uuid: str, power_limit_w: float, *, dry_run: bool = False) -> float:
        handle = self._handle(uuid)
        min_mw, max_mw = _call(pynvml.nvmlDeviceGetPowerManagementLimitConstraints, handle)
        # Checked here too, not only by NVML: a dry run must reject what the card would reject.
        if not (min_mw / 1000.0 <= power_limit_w <= max_mw / 1000.0):
            raise GpuInvalidArgument(
                f"power limit {power_limit_w:.1f} W outside {min_mw / 1000.0:.1f}.."
                f"{max_mw / 1000.0:.1f} W of GPU {uuid}"
            )
        # The management limit is what we set; the enforced one can sit lower for reasons of its
        # own (another limit), and writing again would not change that.
        current_mw = _optional(pynvml.nvmlDeviceGetPowerManagementLimit, handle)
        if current_mw is None:
            current_mw = _call(pynvml.nvmlDeviceGetEnforcedPowerLimit, handle)
        if dry_run or abs(current_mw / 1000.0 - power_limit_w) <= LIMIT_TOLERANCE_W:
            return self.enforced_power_limit_w(uuid)
        _call(pynvml.nvmlDeviceSetPowerManagementLimit, handle, int(round(power_limit_w * 1000)))
        enforced_w = self.enforced_power_limit_w(uuid)
        log.info("GPU %s: power limit %.1f W (enforced %.1f W)", uuid, power_limit_w, enforced_w)
        return enforced_w

    def energy_j(self, uuid: str) -> float | None:
        try:
            energy_mj = _optional(pynvml.nvmlDeviceGetTotalEnergyConsumption, self._handle(uuid))
        except GpuLost:
            return None
        return energy_mj / 1000.0 if energy_mj is not None else None

    def close(self) -> None:
        if self._events is not None:
            try:
                pynvml.nvmlEventSetFree(self._events)
            except pynvml.NVMLError:
                pass
            self._events = None
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
