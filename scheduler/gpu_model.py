"""The power model of a job on a GPU under a power cap (DVFS): the physics, apart from
any policy. The cap planner (scheduler.power), the simulated GPU of the agent and the trace
simulator all use it.

The model, per job and GPU (all pure arithmetic, fitted to ../shared/data/zeus):

- Uncapped, the job draws ``demand_w = uncapped_fraction * max_w``.
- A cap makes the GPU's power governor hold the average draw a little under the cap (the zeus
  data: 0.94 .. 0.97 of the cap once it binds). The draw is a smooth minimum of the demand and
  ``BINDING_DRAW_RATIO * cap_w``, because a cap near the mean demand already clips the peaks:
  that is the small loss near the top.
- Of the draw, ``static_fraction * demand_w`` does not scale with clocks (memory, leakage, fans);
  the rest is dynamic and follows the clock as ``clock ** clock_exponent`` while the voltage
  drops with the clock, and only in proportion to the clock below ``floor_clock``, where the
  voltage has reached its floor (that is why throughput falls steeply at the lowest caps).
- The job's time per step is a part that does not follow the clock (memory, input, host) and a
  part that does (``sensitivity`` of it): ``time = (1 - s) + s / clock``.

That gives the shape of the data: almost nothing lost near the top, a knee, then throughput falls
faster as the cap nears the static draw, so energy (draw x time) has its minimum in between and
below it both energy and time get worse. Fitting a profile (to the zeus sweeps or to a job's own
telemetry) is in scheduler.power_fit; the cap planner is scheduler.power.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from scheduler.model import Gpu, PowerProfile

# Average draw over the cap once the cap binds (zeus data: 0.94 .. 0.97).
BINDING_DRAW_RATIO = 0.955
# Sharpness of the smooth minimum between the demand and the binding draw.
_SOFTMIN_ORDER = 6.0
# The clock never reaches zero: below this share of the uncapped clock the model stops.
_MIN_CLOCK = 0.05


@dataclass(frozen=True, slots=True)
class GpuType:
    """Power limits (NVML's min/max power management limit), idle draw and memory of a GPU type."""

    name: str
    min_w: float
    max_w: float
    idle_w: float
    memory_mib: int


# Limits as NVML reports them for these boards; the four zeus GPUs use the limits swept there.
GPU_TYPES: dict[str, GpuType] = {
    t.name: t
    for t in (
        GpuType("A100-SXM4-80GB", min_w=100.0, max_w=400.0, idle_w=55.0, memory_mib=81920),
        GpuType("H100-SXM-80GB", min_w=200.0, max_w=700.0, idle_w=70.0, memory_mib=81559),
        GpuType("V100-SXM2-32GB", min_w=100.0, max_w=300.0, idle_w=40.0, memory_mib=32768),
        GpuType("V100-PCIE-32GB", min_w=100.0, max_w=250.0, idle_w=30.0, memory_mib=32768),
        GpuType("A40", min_w=100.0, max_w=300.0, idle_w=30.0, memory_mib=46068),
        GpuType("P100-PCIE-16GB", min_w=125.0, max_w=250.0, idle_w=30.0, memory_mib=16384),
        GpuType("RTX6000", min_w=100.0, max_w=260.0, idle_w=20.0, memory_mib=24576),
        # Datasheet limits (not measured here): the H200 shares the H100's board power, the
        # 40 GB A100 the 80 GB one's; the L4 is the 72 W inference card.
        GpuType("H200-SXM-141GB", min_w=200.0, max_w=700.0, idle_w=75.0, memory_mib=143771),
        GpuType("A100-SXM4-40GB", min_w=100.0, max_w=400.0, idle_w=50.0, memory_mib=40960),
        GpuType("L4", min_w=40.0, max_w=72.0, idle_w=16.0, memory_mib=23034),
    )
}
# The GPU of each zeus file (summary_power_<key>.csv).
ZEUS_GPU_TYPES: dict[str, str] = {
    "v100": "V100-PCIE-32GB",
    "a40": "A40",
    "p100": "P100-PCIE-16GB",
    "rtx6000": "RTX6000",
}


def clamp(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def _clock_from_share(share: float, clock_exponent: float, floor_clock: float) -> float:
    """The clock (over the unconstrained clock) at which dynamic power is ``share`` of its maximum.

    Above ``floor_clock`` voltage scales with the clock, so dynamic power goes as
    ``clock ** clock_exponent``; below it the voltage sits at its floor and power falls only in
    proportion to the clock (the continuous extension: ``clock * floor_clock ** (exponent - 1)``).
    """
    if share <= 0.0:
        return _MIN_CLOCK
    # Positive bases, so these powers are real (typeshed cannot know that of float ** float).
    floor_share: float = floor_clock**clock_exponent
    if share <= floor_share:
        clock = share / (floor_share / floor_clock)
    else:
        clock = share ** (1.0 / clock_exponent)
    return max(clock, _MIN_CLOCK)


def _curve(
    params: tuple[float, float, float, float, float],
    cap_w: float | None,
    max_w: float,
) -> tuple[float, float, float]:
    """(step time over the unconstrained step time, busy draw W, clock over unconstrained clock).

    ``params`` are a profile's (uncapped_fraction, static_fraction, sensitivity, clock_exponent,
    floor_clock), already within their bounds; ``cap_w`` None means no cap at all, not even the
    board's maximum.
    """
    uncapped_fraction, static_fraction, sensitivity, clock_exponent, floor_clock = params
    demand = uncapped_fraction * max_w
    if cap_w is None:
        draw = demand
    else:
        bound = BINDING_DRAW_RATIO * max(cap_w, 1e-6)
        draw = (demand**-_SOFTMIN_ORDER + bound**-_SOFTMIN_ORDER) ** (-1.0 / _SOFTMIN_ORDER)
    static_w = static_fraction * demand
    clock = _clock_from_share((draw - static_w) / (demand - static_w), clock_exponent, floor_clock)
    return (1.0 - sensitivity) + sensitivity / clock, draw, clock


# The planner asks for the same (profile, cap) points cycle after cycle.
_cached_curve = functools.lru_cache(maxsize=1 << 16)(_curve)


# Bounds of the profile's parameters, in the order of _params.
PARAM_LOWER = (0.02, 0.0, 0.0, 1.0, 0.05)
PARAM_UPPER = (1.0, 0.95, 1.0, 5.0, 0.95)


@functools.lru_cache(maxsize=65536)
def _params(profile: PowerProfile) -> tuple[float, float, float, float, float]:
    raw = (
        profile.uncapped_fraction,
        profile.static_fraction,
        profile.sensitivity,
        profile.clock_exponent,
        profile.floor_clock,
    )
    return tuple(  # type: ignore[return-value]
        clamp(x, lo, hi) for x, lo, hi in zip(raw, PARAM_LOWER, PARAM_UPPER, strict=True)
    )


def demand_w(profile: PowerProfile, max_w: float) -> float:
    """Watts one GPU of the job would draw with no cap at all."""
    return _params(profile)[0] * max_w


def relative_throughput(profile: PowerProfile, cap_w: float, max_w: float) -> float:
    """The job's speed under ``cap_w`` over its speed at the board's maximum cap ``max_w``.

    1.0 uncapped (cap at ``max_w``, or above it); below 1 once the cap binds, by little near the
    top and faster the nearer the cap comes to the job's static draw.
    """
    params = _params(profile)
    time_capped, _, _ = _cached_curve(params, min(cap_w, max_w), max_w)
    time_uncapped, _, _ = _cached_curve(params, max_w, max_w)
    return min(time_uncapped / time_capped, 1.0)


def slowdown(profile: PowerProfile, cap_w: float, max_w: float) -> float:
    """How much longer the job takes under ``cap_w`` than uncapped: 0.05 = 5 % longer."""
    return 1.0 / relative_throughput(profile, cap_w, max_w) - 1.0


def power_draw_w(
    profile: PowerProfile,
    cap_w: float,
    max_w: float,
    idle_w: float,
    utilization: float = 1.0,
) -> float:
    """Average watts a GPU running this job draws under ``cap_w``.

    ``utilization`` (0..1) is the share of the time the job keeps the GPU active: 0 gives
    ``idle_w`` (a job starting up, or no job), 1 the job's capped draw, linear in between. The
    result never exceeds the cap.
    """
    _, busy_w, _ = _cached_curve(_params(profile), min(cap_w, max_w), max_w)
    share = clamp(utilization, 0.0, 1.0)
    return min(idle_w + share * (busy_w - idle_w), cap_w)


def clock_ratio(profile: PowerProfile, cap_w: float, max_w: float) -> float:
    """The SM clock under ``cap_w`` over the GPU's full boost clock (what NVML reports as sm_clock)."""
    _, _, clock = _cached_curve(_params(profile), min(cap_w, max_w), max_w)
    return clock


def gpu_utilization(profile: PowerProfile, cap_w: float, max_w: float) -> float:
    """The share of wall time the GPU has a kernel running (NVML's utilization), 0..1.

    The model's clock-insensitive part of a step is time the SMs wait (input pipeline, host,
    communication), so a cap stretches only the busy part and utilization rises under it: that
    is what lets a job's own telemetry reveal how much a cap slows it.
    """
    params = _params(profile)
    time, _, clock = _cached_curve(params, min(cap_w, max_w), max_w)
    return (params[2] / clock) / time


def energy_per_work(profile: PowerProfile, cap_w: float, max_w: float) -> float:
    """Joules per unit of work under ``cap_w``, relative to the job uncapped (1.0 at ``max_w``)."""
    params = _params(profile)
    time_capped, draw_capped, _ = _cached_curve(params, min(cap_w, max_w), max_w)
    time_max, draw_max, _ = _cached_curve(params, max_w, max_w)
    return (draw_capped * time_capped) / (draw_max * time_max)


# Idle draw of a GPU type missing from GPU_TYPES, as a share of its maximum cap.
_IDLE_FRACTION = 0.12


def idle_power_w(gpu: Gpu) -> float:
    """What the GPU draws with nothing running (never more than its minimum cap)."""
    known = GPU_TYPES.get(gpu.gpu_type)
    idle_w = known.idle_w if known else _IDLE_FRACTION * gpu.power_max_w
    return min(idle_w, gpu.power_min_w)
