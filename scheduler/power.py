"""The cap planner: power caps per GPU under pool budgets and tenant paces (DVFS).

The power model it plans with (draw and throughput of a job under a cap) is scheduler.gpu_model;
this module holds the policy: the energy-optimal, knee and eco caps of a job, and
``plan_power_caps``, which fits a cycle's caps under every pool budget and tenant pace.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from scheduler.gpu_model import (
    clamp,
    energy_per_work,
    idle_power_w,
    power_draw_w,
    relative_throughput,
    slowdown,
)
from scheduler.model import Config, Gpu, PowerProfile, Running, Snapshot

# The knee: where a watt buys less than this share of the throughput an average watt buys.
KNEE_GAIN = 0.1


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

# Caps found by bisection are rounded down to this many watts (down: the draw only falls).
_CAP_RESOLUTION_W = 0.5
# A pool budget is a hard limit (a PDU, a breaker) and the modelled draw an estimate from learned
# profiles, off by a fraction of a percent: a pool is planned to this share short of its budget,
# also where the modelled draw alone would come just under it (a budget is tight already then).
POOL_BUDGET_HEADROOM = 0.005


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
            cap = clamp(cap_w, gpu.power_min_w, gpu.power_max_w)
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
    return sum(unit.draw_w(to_w).values(), 0.0) - sum(unit.draw_w(from_w).values(), 0.0)


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
        floor_w = clamp(_energy_optimal(profile, min_w, max_w), min_w, max_w)
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
            floor_w = clamp(
                _energy_optimal(profile, unit.min_w, unit.max_w), unit.min_w, unit.max_w
            )
            if not unit.throttled:
                knee_w = _knee(profile, unit.min_w, unit.max_w)
                unit.top_w = max(min(unit.top_w, knee_w), floor_w)
            _move(unit, ledger, floor_w)
            planned.append(unit)

    for tenant_name in sorted(tight_tenants):
        own = [u for u in planned if u.attempt.tenant == tenant_name]
        _shed(own, ledger, step_w, functools.partial(ledger.excess_w, tenant=tenant_name))
    for pool in sorted(tight_pools):
        inside = [u for u in planned if any(p == pool for _, p in u.gpus)]
        _shed(inside, ledger, step_w, functools.partial(ledger.excess_w, pool=pool))
    _grant([u for u in planned if not u.throttled], ledger, step_w)

    for unit in units:
        for gpu, _ in unit.gpus:
            caps[gpu.uuid] = clamp(unit.cap_w, gpu.power_min_w, gpu.power_max_w)

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
