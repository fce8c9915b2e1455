"""The power model of a job under a GPU power cap (DVFS), and the cap planner.

The model, per job and GPU (all pure arithmetic, fitted to ../shared/data/zeus):

- Uncapped, the job draws ``demand_w = uncapped_fraction * max_w``.
- A cap makes the GPU's power governor hold the average draw a little under the cap (the zeus
  data: 0.94 .. 0.97 of the cap once it binds). The draw is a smooth minimum of the demand and
  ``BINDING_DRAW_RATIO * cap_w``, because a cap near the mean demand already clips the peaks:
  that is the small loss near the top.
- Of the draw, ``static_fraction * demand_w`` does not scale with clocks (memory, leakage, fans);
  the rest is dynamic and follows the clock as ``clock ** clock_exponent`` (voltage drops with
  the clock, so the exponent is above 1).
- The job's time per step is a part that does not follow the clock (memory, input, host) and a
  part that does (``sensitivity`` of it): ``time = (1 - s) + s / clock``.

That gives the shape of the data: almost nothing lost near the top, a knee, then throughput falls
faster as the cap nears the static draw, so energy (draw x time) has its minimum in between and
below it both energy and time get worse.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.model import PowerProfile

# Average draw over the cap once the cap binds (zeus data: 0.94 .. 0.97).
BINDING_DRAW_RATIO = 0.955
# Sharpness of the smooth minimum between the demand and the binding draw.
_SOFTMIN_ORDER = 8.0
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
    )
}
# The GPU of each zeus file (summary_power_<key>.csv).
ZEUS_GPU_TYPES: dict[str, str] = {
    "v100": "V100-PCIE-32GB",
    "a40": "A40",
    "p100": "P100-PCIE-16GB",
    "rtx6000": "RTX6000",
}


def _clamp(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def demand_w(profile: PowerProfile, max_w: float) -> float:
    """Watts one GPU of the job draws uncapped."""
    return _clamp(profile.uncapped_fraction, 0.05, 1.0) * max_w


def _busy_draw_w(profile: PowerProfile, cap_w: float, max_w: float) -> float:
    demand = demand_w(profile, max_w)
    bound = BINDING_DRAW_RATIO * max(cap_w, 1e-9)
    n = _SOFTMIN_ORDER
    return (demand**-n + bound**-n) ** (-1.0 / n)


def _clock(profile: PowerProfile, draw_w: float, max_w: float) -> float:
    demand = demand_w(profile, max_w)
    static_w = _clamp(profile.static_fraction, 0.0, 0.95) * demand
    dynamic_share = (draw_w - static_w) / (demand - static_w)
    exponent = max(profile.clock_exponent, 1.0)
    return _clamp(max(dynamic_share, 0.0) ** (1.0 / exponent), _MIN_CLOCK, 1.0)


def relative_throughput(profile: PowerProfile, cap_w: float, max_w: float) -> float:
    """The job's speed under ``cap_w`` over its speed uncapped (at ``max_w``).

    1.0 when uncapped (and, to within rounding, when the cap is well above the job's demand);
    below 1 when the cap binds, falling faster the nearer the cap comes to the static draw.
    """
    sensitivity = _clamp(profile.sensitivity, 0.0, 1.0)
    capped = _clock(profile, _busy_draw_w(profile, cap_w, max_w), max_w)
    uncapped = _clock(profile, _busy_draw_w(profile, max_w, max_w), max_w)

    def time(clock: float) -> float:
        return (1.0 - sensitivity) + sensitivity / clock

    return min(time(uncapped) / time(capped), 1.0)


def power_draw_w(
    profile: PowerProfile,
    cap_w: float,
    max_w: float,
    idle_w: float,
    utilization: float = 1.0,
) -> float:
    """Average watts a GPU running this job draws under ``cap_w``.

    ``utilization`` (0..1) is the share of time the GPU is busy: 0 gives ``idle_w``, 1 the job's
    (capped) busy draw, linear in between. The result never exceeds the cap.
    """
    busy_w = _busy_draw_w(profile, cap_w, max_w)
    share = _clamp(utilization, 0.0, 1.0)
    draw = idle_w + share * (busy_w - idle_w)
    return min(draw, cap_w)
