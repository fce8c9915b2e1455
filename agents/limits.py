"""What the agent protocol accepts: the ranges real GPUs, hosts and runtimes can report.

Both ends read these. The control plane refuses a value outside them, naming the field
(controlplane.cluster.agent_api); the agent leaves such a reading out before it sends it, with
a log line, since one glitching sensor must not cost the node its heartbeat. The bounds are
generous: they separate what hardware can report from garbage (a counter read as -1, a
sentinel of 2**32 - 1, a unit mix-up), they do not describe any one board. No Django here.
"""

from __future__ import annotations

import logging
from typing import Any, TypeGuard

log = logging.getLogger(__name__)

# The largest boards draw about 1.2 kW; NVML reports milliwatts in 32 bits (4.29 MW), so a
# reading beyond a few kW is a sentinel or a corrupted read, not a GPU.
MAX_GPU_POWER_W = 5_000.0
# 1 TiB: ten times the largest GPU memory shipped; NVML reports bytes in 64 bits.
MAX_GPU_MEMORY_MIB = 1 << 20
MIN_TEMPERATURE_C = -50.0
MAX_TEMPERATURE_C = 200.0
MAX_CLOCK_MHZ = 10_000.0
# NVML's energy counter is an unsigned 64-bit count of millijoules; PostgreSQL keeps counts in
# signed 64 bits, so the counter's readable range is what fits there.
MAX_COUNT = 2**63 - 1
MAX_ENERGY_J = MAX_COUNT / 1000.0
# Exit codes as the runtimes report them: 0..255 from a container or a shell, -N for a process
# killed by signal N (Python's subprocess).
MIN_EXIT_CODE = -255
MAX_EXIT_CODE = 255
# Unix times from 1970 to the year 2286; a clock further ahead is broken, not early.
MAX_UNIX_TIME_S = 1e10
# GPU indexes on one host. The control plane parks retired GPUs at index 1000 and up.
MAX_GPU_INDEX = 255
MAX_HOST_CPUS = 1 << 16
# 1 PiB of host memory.
MAX_HOST_MEMORY_MIB = 1 << 30
MAX_LABELS = 64
MAX_LABEL_KEY_CHARS = 253
MAX_LABEL_VALUE_CHARS = 253
MAX_THROTTLE_REASONS = 64
MAX_REASON_CHARS = 64
MAX_MESSAGE_CHARS = 2000

# A GPU reading's numbers, in the order of the heartbeat's `gpus[]` entry: (lowest, highest).
GPU_READING_RANGES: dict[str, tuple[float, float]] = {
    "utilization_pct": (0.0, 100.0),
    "memory_used_mib": (0.0, float(MAX_GPU_MEMORY_MIB)),
    "power_draw_w": (0.0, MAX_GPU_POWER_W),
    "power_cap_w": (0.0, MAX_GPU_POWER_W),
    "energy_j": (0.0, MAX_ENERGY_J),
    "temperature_c": (MIN_TEMPERATURE_C, MAX_TEMPERATURE_C),
    "sm_clock_mhz": (0.0, MAX_CLOCK_MHZ),
}


def in_range(value: object, lowest: float, highest: float) -> TypeGuard[float]:
    """True for a number (not a bool, not NaN) within [lowest, highest]."""
    return (type(value) is int or type(value) is float) and lowest <= value <= highest


def clean_text(text: str, max_chars: int = MAX_MESSAGE_CHARS) -> str:
    """Text the control plane can store: no NUL, no lone surrogate, at most `max_chars`.

    For the agent's own words (a start failure, a condition), which may quote a program's
    output; they are read by people, so a replaced character loses nothing that matters.
    """
    if "\x00" in text:
        text = text.replace("\x00", "\ufffd")
    if not text.isascii():
        text = text.encode("utf-8", "replace").decode("utf-8")
    return text[:max_chars]


# (uuid, field) pairs already logged: a sensor stuck on garbage is logged once, not every 10 s.
_logged: set[tuple[str, str]] = set()


def checked_reading(wire: dict[str, Any]) -> dict[str, Any]:
    """A heartbeat's `gpus[]` entry with every number outside its range left out (null).

    NVML can hand back sentinels (0xFFFFFFFF for "no reading" on some boards, a counter that
    wrapped); the control plane would drop them anyway, with a warning, and this says so in
    the agent's own log, once per GPU and field.
    """
    uuid = str(wire.get("uuid"))
    for key, (lowest, highest) in GPU_READING_RANGES.items():
        value = wire.get(key)
        if value is None or in_range(value, lowest, highest):
            continue
        wire[key] = None
        if (uuid, key) not in _logged:
            _logged.add((uuid, key))
            log.warning(
                "GPU %s: %s = %r is outside %g..%g; left out of heartbeats while it is",
                uuid,
                key,
                value,
                lowest,
                highest,
            )
    ecc = wire.get("ecc_errors")
    if ecc is not None and not (type(ecc) is int and 0 <= ecc <= MAX_COUNT):
        wire["ecc_errors"] = None
        if (uuid, "ecc_errors") not in _logged:
            _logged.add((uuid, "ecc_errors"))
            log.warning("GPU %s: ecc_errors = %r is not a count; left out", uuid, ecc)
    reasons = wire.get("throttle_reasons")
    if reasons is not None:
        wire["throttle_reasons"] = [
            clean_text(str(r), MAX_REASON_CHARS) for r in reasons[:MAX_THROTTLE_REASONS]
        ]
    if "message" in wire:
        wire["message"] = clean_text(str(wire["message"]))
    return wire


# A registration's GPU numbers: (lowest, highest). Required, so a reading outside is clamped.
GPU_INVENTORY_RANGES: dict[str, tuple[float, float]] = {
    "memory_mib": (0, MAX_GPU_MEMORY_MIB),
    "power_min_w": (0.0, MAX_GPU_POWER_W),
    "power_max_w": (0.0, MAX_GPU_POWER_W),
    "power_default_w": (0.0, MAX_GPU_POWER_W),
}


def checked_inventory(wire: dict[str, Any]) -> dict[str, Any]:
    """A registration's `gpus[]` entry with each number brought within its range (logged):
    the registration needs them all, and one odd limit must not keep the node out."""
    for key, (lowest, highest) in GPU_INVENTORY_RANGES.items():
        value = wire.get(key)
        if in_range(value, lowest, highest):
            continue
        clamped = lowest if not in_range(value, float("-inf"), float("inf")) else value
        clamped = min(max(clamped, lowest), highest)
        log.warning(
            "GPU %s: %s = %r is outside %g..%g; registered as %g",
            wire.get("uuid"),
            key,
            value,
            lowest,
            highest,
            clamped,
        )
        wire[key] = type(lowest)(clamped)
    if wire.get("power_min_w", 0) > wire.get("power_max_w", 0):
        wire["power_min_w"] = wire["power_max_w"]
    return wire
