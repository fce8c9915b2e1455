"""The power model of a job under a GPU power cap (DVFS), and the cap planner.

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
telemetry) is in scheduler.power_fit; the cap planner, ``plan_power_caps``, is at the end.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from scheduler.model import Config, Gpu, PowerProfile, Running, Snapshot

# Average draw over the cap once the cap binds (zeus data: 0.94 .. 0.97).
BINDING_DRAW_RATIO = 0.955
# Sharpness of the smooth minimum between the demand and the binding draw.
_SOFTMIN_ORDER = 6.0
# The clock never reaches zero: below this share of the uncapped clock the model stops.
_MIN_CLOCK = 0.05
# The knee: where a watt buys less than this share of the throughput an average watt buys.
KNEE_GAIN = 0.1


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


def _clock_from_share(share: float, clock_exponent: float, floor_clock: float) -> float:
    """The clock (over the unconstrained clock) at which dynamic power is ``share`` of its maximum.

    Above ``floor_clock`` voltage scales with the clock, so dynamic power goes as
    ``clock ** clock_exponent``; below it the voltage sits at its floor and power falls only in
    proportion to the clock (the continuous extension: ``clock * floor_clock ** (exponent - 1)``).
    """
    if share <= 0.0:
        return _MIN_CLOCK
    floor_share = floor_clock**clock_exponent
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
        _clamp(x, lo, hi) for x, lo, hi in zip(raw, PARAM_LOWER, PARAM_UPPER, strict=True)
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
    share = _clamp(utilization, 0.0, 1.0)
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


def _cap_grid(min_w: float, max_w: float, step_w: float) -> list[float]:
    caps = []
    cap = min_w
    while cap < max_w - 1e-9:
        caps.append(cap)
        cap += step_w
    caps.append(max_w)
    return caps


def energy_optimal_cap_w(
    profile: PowerProfile, min_w: float, max_w: float, step_w: float = 5.0
) -> float:
    """The cap on the grid ``min_w, min_w + step_w, .., max_w`` with the least energy per work.

    Below it the job takes longer and, because the static draw keeps flowing, uses more energy
    too; above it every watt buys less throughput than it costs. On a tie the lower cap wins
    (a job the cap never binds uses the same energy at any cap, and a lower cap frees budget).
    """
    best_cap, best_energy = max_w, energy_per_work(profile, max_w, max_w)
    for cap in _cap_grid(min_w, max_w, step_w):
        energy = energy_per_work(profile, cap, max_w)
        if energy < best_energy - 1e-12 or (energy <= best_energy + 1e-12 and cap < best_cap):
            best_cap, best_energy = cap, energy
    return best_cap


def best_cap_within_slowdown(
    profile: PowerProfile,
    min_w: float,
    max_w: float,
    max_slowdown: float = 0.05,
    step_w: float = 5.0,
) -> float:
    """The least-energy cap on the grid that makes the job at most ``max_slowdown`` slower.

    It is the lowest such cap unless that one lies below the energy-optimal cap, where a lower
    cap would cost both time and energy.
    """
    best_cap, best_energy = max_w, energy_per_work(profile, max_w, max_w)
    for cap in _cap_grid(min_w, max_w, step_w):
        if slowdown(profile, cap, max_w) > max_slowdown:
            continue
        energy = energy_per_work(profile, cap, max_w)
        if energy < best_energy - 1e-12 or (energy <= best_energy + 1e-12 and cap < best_cap):
            best_cap, best_energy = cap, energy
    return best_cap


def knee_cap_w(
    profile: PowerProfile,
    min_w: float,
    max_w: float,
    step_w: float = 5.0,
    knee_gain: float = KNEE_GAIN,
) -> float:
    """The cap above which a watt buys almost nothing.

    "Almost nothing" is a marginal throughput per watt below ``knee_gain`` times the average
    throughput per watt of the job uncapped (1 / its draw at ``max_w``), for every step up to
    ``max_w``. Read from the top down, because at the lowest caps, below the static draw, a
    watt can buy little too.
    """
    average_gain = 1.0 / max(power_draw_w(profile, max_w, max_w, 0.0), 1e-9)
    caps = _cap_grid(min_w, max_w, step_w)
    upper = relative_throughput(profile, caps[-1], max_w)
    for low, high in zip(reversed(caps[:-1]), reversed(caps[1:]), strict=True):
        lower = relative_throughput(profile, low, max_w)
        if (upper - lower) / (high - low) >= knee_gain * average_gain:
            return high
        upper = lower
    return min_w


# ---------------------------------------------------------------------------------------------
# The cap planner
# ---------------------------------------------------------------------------------------------

# Idle draw of a GPU type missing from GPU_TYPES, as a share of its maximum cap.
_IDLE_FRACTION = 0.12
# Caps found by bisection are rounded down to this many watts (down: the draw only falls).
_CAP_RESOLUTION_W = 0.5
# A pool budget is a hard limit (a PDU, a breaker) and the modelled draw an estimate from learned
# profiles, off by a fraction of a percent: a pool is planned to this share short of its budget,
# also where the modelled draw alone would come just under it (a budget is tight already then).
POOL_BUDGET_HEADROOM = 0.005


def idle_power_w(gpu: Gpu) -> float:
    """What the GPU draws with nothing running (never more than its minimum cap)."""
    known = GPU_TYPES.get(gpu.gpu_type)
    idle_w = known.idle_w if known else _IDLE_FRACTION * gpu.power_max_w
    return min(idle_w, gpu.power_min_w)


@functools.lru_cache(maxsize=4096)
def _energy_optimal(profile: PowerProfile, min_w: float, max_w: float) -> float:
    return energy_optimal_cap_w(profile, min_w, max_w)


@functools.lru_cache(maxsize=4096)
def _knee(profile: PowerProfile, min_w: float, max_w: float) -> float:
    return knee_cap_w(profile, min_w, max_w)


@functools.lru_cache(maxsize=4096)
def _eco(profile: PowerProfile, min_w: float, max_w: float, max_slowdown: float) -> float:
    return best_cap_within_slowdown(profile, min_w, max_w, max_slowdown)


def planning_profile(profile: PowerProfile) -> PowerProfile:
    """The profile the planner budgets with: a job no telemetry has refined yet (``samples`` 0)
    is assumed to draw as much as the board allows, so that a new job's unknown demand cannot
    push the pool over its budget before its first telemetry comes in."""
    if profile.samples == 0:
        return replace(profile, uncapped_fraction=1.0)
    return profile


@dataclass(slots=True)
class _Unit:
    """The GPUs of one attempt: capped together, since a gang runs at the pace of its slowest."""

    attempt: Running
    profile: PowerProfile  # what it is planned with (see planning_profile)
    gpus: list[tuple[Gpu, str]]  # (GPU, its pool)
    weight: float
    throttled: bool
    min_w: float
    max_w: float
    cap_w: float = 0.0
    top_w: float = 0.0  # the highest cap the planner gives it

    def draw_w(self, cap_w: float) -> dict[str, float]:
        """Modelled watts per pool at ``cap_w``."""
        draws: dict[str, float] = {}
        profile = self.profile
        for gpu, pool in self.gpus:
            cap = _clamp(cap_w, gpu.power_min_w, gpu.power_max_w)
            draw = power_draw_w(profile, cap, gpu.power_max_w, idle_power_w(gpu))
            draws[pool] = draws.get(pool, 0.0) + draw
        return draws

    def value(self, cap_w: float) -> float:
        """Weighted throughput: GPUs x tenant weight x relative throughput."""
        rel = relative_throughput(self.profile, cap_w, self.max_w)
        return self.weight * len(self.gpus) * rel


class _Ledger:
    """Modelled draw per pool and per tenant against their limits."""

    def __init__(self, pool_budget_w: dict[str, float], tenant_pace_w: dict[str, float]):
        self.pool_budget_w = pool_budget_w
        self.tenant_pace_w = tenant_pace_w
        self.pool_w: dict[str, float] = {}
        self.tenant_w: dict[str, float] = {}

    def add(self, tenant: str | None, draws: dict[str, float], sign: float = 1.0) -> None:
        for pool, watts in draws.items():
            self.pool_w[pool] = self.pool_w.get(pool, 0.0) + sign * watts
            if tenant is not None:
                self.tenant_w[tenant] = self.tenant_w.get(tenant, 0.0) + sign * watts

    def room_w(self, unit: _Unit, pools: set[str]) -> float:
        """Watts the unit may still add before one of its limits is reached."""
        room = math.inf
        for pool in pools:
            if pool in self.pool_budget_w:
                room = min(room, self.pool_budget_w[pool] - self.pool_w.get(pool, 0.0))
        tenant = unit.attempt.tenant
        if tenant in self.tenant_pace_w:
            room = min(room, self.tenant_pace_w[tenant] - self.tenant_w.get(tenant, 0.0))
        return room

    def excess_w(self, pool: str | None = None, tenant: str | None = None) -> float:
        if pool is not None:
            return self.pool_w.get(pool, 0.0) - self.pool_budget_w.get(pool, math.inf)
        assert tenant is not None
        return self.tenant_w.get(tenant, 0.0) - self.tenant_pace_w.get(tenant, math.inf)


def _delta_w(unit: _Unit, from_w: float, to_w: float) -> float:
    return sum(unit.draw_w(to_w).values()) - sum(unit.draw_w(from_w).values())


def _cap_for_delta(unit: _Unit, from_w: float, to_w: float, delta_w: float) -> float:
    """The cap between ``from_w`` and ``to_w`` whose draw differs from the draw at ``from_w`` by
    ``delta_w``, by bisection: when raising, the highest cap adding at most ``delta_w``; when
    lowering, a cap saving at least ``delta_w``. Rounded down to the cap resolution either way,
    which keeps both on the safe side of the budget."""
    within, beyond = from_w, to_w
    while abs(beyond - within) > _CAP_RESOLUTION_W / 4:
        middle = (within + beyond) / 2.0
        if abs(_delta_w(unit, from_w, middle)) <= delta_w:
            within = middle
        else:
            beyond = middle
    if to_w > from_w:
        return max(math.floor(within / _CAP_RESOLUTION_W) * _CAP_RESOLUTION_W, from_w)
    return max(math.floor(beyond / _CAP_RESOLUTION_W) * _CAP_RESOLUTION_W, to_w)


def _move(unit: _Unit, ledger: _Ledger, to_w: float) -> None:
    ledger.add(unit.attempt.tenant, unit.draw_w(unit.cap_w), -1.0)
    unit.cap_w = to_w
    ledger.add(unit.attempt.tenant, unit.draw_w(unit.cap_w))


def _shed(units: list[_Unit], ledger: _Ledger, step_w: float, excess: Callable[[], float]) -> None:
    """Lower caps where a watt saved costs the least weighted throughput until ``excess()`` <= 0.

    ``excess`` reads the ledger: the watts over the limit being enforced.
    """
    heap: list[tuple[float, int, float]] = []

    def push(unit_index: int) -> None:
        unit = units[unit_index]
        if unit.cap_w <= unit.min_w:
            return
        lower = max(unit.cap_w - step_w, unit.min_w)
        saved = -_delta_w(unit, unit.cap_w, lower)
        lost = unit.value(unit.cap_w) - unit.value(lower)
        heapq.heappush(heap, (lost / max(saved, 1e-9), unit_index, lower))

    for index in range(len(units)):
        push(index)
    while heap and excess() > 1e-9:
        _, index, lower = heapq.heappop(heap)
        unit = units[index]
        saved = -_delta_w(unit, unit.cap_w, lower)
        needed = excess()
        if saved > needed:
            lower = _cap_for_delta(unit, unit.cap_w, lower, needed)
        _move(unit, ledger, lower)
        push(index)


def _grant(units: list[_Unit], ledger: _Ledger, step_w: float) -> None:
    """Raise caps where a watt buys the most weighted throughput, up to each unit's top, while
    every pool budget and tenant pace has room; a partial step fills the last of the room."""
    pools_of = [{pool for _, pool in unit.gpus} for unit in units]
    heap: list[tuple[float, int, float]] = []

    def push(unit_index: int) -> None:
        unit = units[unit_index]
        if unit.cap_w >= unit.top_w:
            return
        higher = min(unit.cap_w + step_w, unit.top_w)
        cost = _delta_w(unit, unit.cap_w, higher)
        gain = unit.value(higher) - unit.value(unit.cap_w)
        heapq.heappush(heap, (-gain / max(cost, 1e-9), unit_index, higher))

    for index in range(len(units)):
        push(index)
    while heap:
        _, index, higher = heapq.heappop(heap)
        unit = units[index]
        room = ledger.room_w(unit, pools_of[index])
        if room <= 1e-9:
            continue  # one of its limits is spent: this unit gets nothing more
        cost = _delta_w(unit, unit.cap_w, higher)
        if cost > room:
            higher = _cap_for_delta(unit, unit.cap_w, higher, room)
            if higher > unit.cap_w:
                _move(unit, ledger, higher)
            continue
        _move(unit, ledger, higher)
        push(index)


def plan_power_caps(
    snapshot: Snapshot, config: Config, busy: dict[str, Running]
) -> dict[str, float]:
    """A power cap in watts for every GPU of the snapshot (GPU uuid -> W).

    ``busy`` maps each GPU that will run an attempt after this cycle to that attempt. Idle GPUs
    go to their minimum. A busy GPU is uncapped (its maximum; in eco mode the least-energy cap
    within ``config.eco_max_slowdown``) unless its pool's budget or its tenant's power pace would
    be exceeded that way; then every such GPU starts at its energy-optimal cap and watts are
    handed out in ``config.power_step_w`` steps where they buy the most weighted throughput, up
    to the knee, until the budget or pace is spent. Where even the energy-optimal caps draw too
    much, caps go below them where that costs the least. A pool's budget counts as
    ``1 - POOL_BUDGET_HEADROOM`` of itself throughout. A tenant whose budget action is
    "throttle" stays at its energy-optimal caps. A GPU keeps its current cap when the new one is
    within ``config.power_hysteresis_w`` and keeping it breaks no budget.
    """
    tenants = {t.name: t for t in snapshot.tenants}
    pool_budget_w = {
        p.name: max(p.power_budget_w, 0.0) for p in snapshot.pools if p.power_budget_w is not None
    }
    tenant_pace_w = {
        t.name: max(t.power_pace_w, 0.0) for t in snapshot.tenants if t.power_pace_w is not None
    }
    step_w = max(config.power_step_w, 1.0)
    gpus: dict[str, tuple[Gpu, str]] = {}
    for node in snapshot.nodes:
        for gpu in node.gpus:
            gpus[gpu.uuid] = (gpu, node.pool)

    caps: dict[str, float] = {uuid: gpu.power_min_w for uuid, (gpu, _) in gpus.items()}
    ledger = _Ledger(pool_budget_w, tenant_pace_w)
    for uuid, (gpu, pool) in gpus.items():
        if uuid not in busy:
            ledger.add(None, {pool: idle_power_w(gpu)})

    by_attempt: dict[int, list[tuple[Gpu, str]]] = {}
    attempts: dict[int, Running] = {}
    for uuid in sorted(busy):
        if uuid in gpus:
            attempts[busy[uuid].attempt_id] = busy[uuid]
            by_attempt.setdefault(busy[uuid].attempt_id, []).append(gpus[uuid])
    units: list[_Unit] = []
    for attempt_id in sorted(by_attempt):
        attempt = attempts[attempt_id]
        members = by_attempt[attempt_id]
        tenant = tenants.get(attempt.tenant)
        min_w = max(g.power_min_w for g, _ in members)
        max_w = max(min(g.power_max_w for g, _ in members), min_w)
        unit = _Unit(
            attempt=attempt,
            profile=planning_profile(attempt.power_profile),
            gpus=members,
            weight=tenant.weight if tenant else 1.0,
            throttled=bool(tenant and tenant.budget_action == "throttle"),
            min_w=min_w,
            max_w=max_w,
        )
        profile = unit.profile
        floor_w = _clamp(_energy_optimal(profile, min_w, max_w), min_w, max_w)
        if unit.throttled:
            unit.top_w = floor_w
        elif config.eco_max_slowdown is not None and attempt.power_profile.samples == 0:
            # Nothing seen of it yet: one uncapped cycle shows its own demand and how busy it
            # keeps the SMs, which a guess from the default profile could get badly wrong.
            unit.top_w = max_w
        elif config.eco_max_slowdown is not None:
            unit.top_w = max(_eco(profile, min_w, max_w, config.eco_max_slowdown), floor_w)
        else:
            unit.top_w = max_w
        unit.cap_w = unit.top_w
        ledger.add(attempt.tenant, unit.draw_w(unit.cap_w))
        units.append(unit)

    for pool in pool_budget_w:
        pool_budget_w[pool] *= 1.0 - POOL_BUDGET_HEADROOM
    # Which limits would the unconstrained caps break? Only their units get planned.
    tight_pools = {p for p in pool_budget_w if ledger.excess_w(pool=p) > 1e-9}
    tight_tenants = {t for t in tenant_pace_w if ledger.excess_w(tenant=t) > 1e-9}
    planned: list[_Unit] = []
    for unit in units:
        if unit.attempt.tenant in tight_tenants or any(p in tight_pools for _, p in unit.gpus):
            profile = unit.profile
            floor_w = _clamp(
                _energy_optimal(profile, unit.min_w, unit.max_w), unit.min_w, unit.max_w
            )
            if not unit.throttled:
                knee_w = _knee(profile, unit.min_w, unit.max_w)
                unit.top_w = max(min(unit.top_w, knee_w), floor_w)
            _move(unit, ledger, floor_w)
            planned.append(unit)

    for tenant in sorted(tight_tenants):
        own = [u for u in planned if u.attempt.tenant == tenant]
        _shed(own, ledger, step_w, lambda tenant=tenant: ledger.excess_w(tenant=tenant))
    for pool in sorted(tight_pools):
        inside = [u for u in planned if any(p == pool for _, p in u.gpus)]
        _shed(inside, ledger, step_w, lambda pool=pool: ledger.excess_w(pool=pool))
    _grant([u for u in planned if not u.throttled], ledger, step_w)

    for unit in units:
        for gpu, _ in unit.gpus:
            caps[gpu.uuid] = _clamp(unit.cap_w, gpu.power_min_w, gpu.power_max_w)

    _keep_current_caps(caps, gpus, busy, ledger, config.power_hysteresis_w)
    return caps


def _keep_current_caps(
    caps: dict[str, float],
    gpus: dict[str, tuple[Gpu, str]],
    busy: dict[str, Running],
    ledger: _Ledger,
    hysteresis_w: float,
) -> None:
    """Hysteresis: leave a GPU at its enforced cap when the planned one is close to it, as long as
    the modelled draw stays within every budget and pace that held with the planned caps."""
    for uuid in sorted(caps):
        gpu, pool = gpus[uuid]
        current = gpu.power_cap_w
        if current is None or abs(current - caps[uuid]) >= hysteresis_w:
            continue
        if not gpu.power_min_w <= current <= gpu.power_max_w:
            continue
        attempt = busy.get(uuid)
        if attempt is None:
            caps[uuid] = current  # an idle GPU draws its idle power under any cap
            continue
        profile = planning_profile(attempt.power_profile)
        delta_w = power_draw_w(profile, current, gpu.power_max_w, idle_power_w(gpu)) - power_draw_w(
            profile, caps[uuid], gpu.power_max_w, idle_power_w(gpu)
        )
        if delta_w > 0:
            pool_room = ledger.pool_budget_w.get(pool, math.inf) - ledger.pool_w.get(pool, 0.0)
            tenant_room = ledger.tenant_pace_w.get(attempt.tenant, math.inf) - ledger.tenant_w.get(
                attempt.tenant, 0.0
            )
            if delta_w > min(pool_room, tenant_room):
                continue
        ledger.add(attempt.tenant, {pool: delta_w})
        caps[uuid] = current
