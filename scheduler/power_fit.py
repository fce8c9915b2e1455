"""Fitting a job's power profile to what was measured at the caps it ran under.

One function serves both sources: the zeus sweeps in ../shared/data/zeus (time per epoch and
average power per power limit, turned into relative throughput and draw) and a running job's own
telemetry (draw, utilization and SM clock at each cap it ran under, no throughput at all). What a
sample leaves out simply drops out of the loss; a weak pull towards a prior profile keeps the
parameters the samples cannot tell apart (all samples at one cap, say) where the prior has them.

Pure Python (no numpy in the scheduling core): a bounded Nelder-Mead over the profile's five
parameters, a few hundred evaluations of a seven-sample loss, a few milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import NamedTuple

from scheduler.gpu_model import (
    _SOFTMIN_ORDER,
    BINDING_DRAW_RATIO,
    PARAM_LOWER,
    PARAM_UPPER,
    _clock_from_share,
    _params,
)
from scheduler.model import PowerProfile

# How far a parameter may stray from the prior before the pull matters (its spread over zeus).
_PRIOR_SCALE = (0.25, 0.1, 0.25, 0.5, 0.2)
_START_STEP = (0.1, 0.1, 0.2, 0.5, 0.2)
# Weight of the prior in the loss, shared out over the samples: a handful of samples overrule it.
PRIOR_WEIGHT = 0.002


class PowerSample(NamedTuple):
    """What was seen while the job ran under one cap; any measurement may be missing (None).

    relative_throughput: speed over the speed at the board's maximum cap (zeus sweeps, or a job
    that reports its own steps per second); power_w: average draw while the job ran;
    utilization: NVML GPU utilization 0..1; clock_ratio: SM clock over the full boost clock.
    weight: how many measurements the sample stands for (a mean of ten telemetry buckets at one
    cap weighs ten), so that a summary of much telemetry overrules the prior as the telemetry
    itself would, at the cost of one sample in the loss.
    """

    cap_w: float
    relative_throughput: float | None = None
    power_w: float | None = None
    utilization: float | None = None
    clock_ratio: float | None = None
    weight: float = 1.0


def _loss(
    params: Sequence[float],
    samples: Sequence[PowerSample],
    max_w: float,
    prior: Sequence[float],
) -> float:
    """Mean squared error over the samples (weighted) plus the prior's pull."""
    outside = sum(
        max(lo - x, 0.0) ** 2 + max(x - hi, 0.0) ** 2
        for x, lo, hi in zip(params, PARAM_LOWER, PARAM_UPPER, strict=True)
    )
    if outside:
        return 1e3 * (1.0 + outside)
    u, a, s, e, v = params
    # _curve inlined: the fit evaluates it tens of thousands of times.
    demand = u * max_w
    static_w = a * demand
    dynamic_w = demand - static_w
    demand_term = demand**-_SOFTMIN_ORDER
    inverse_order = -1.0 / _SOFTMIN_ORDER

    def curve(cap_w: float) -> tuple[float, float, float]:
        draw = (demand_term + (BINDING_DRAW_RATIO * cap_w) ** -_SOFTMIN_ORDER) ** inverse_order
        clock = _clock_from_share((draw - static_w) / dynamic_w, e, v)
        return (1.0 - s) + s / clock, draw, clock

    time_at_max = curve(max_w)[0]
    error = 0.0
    total_weight = 0.0
    for sample in samples:
        time_capped, draw, clock = curve(min(sample.cap_w, max_w))
        sample_error = 0.0
        if sample.relative_throughput is not None:
            sample_error += (time_at_max / time_capped - sample.relative_throughput) ** 2
        if sample.power_w is not None:
            sample_error += ((min(draw, sample.cap_w) - sample.power_w) / max_w) ** 2
        if sample.utilization is not None:
            sample_error += ((s / clock) / time_capped - sample.utilization) ** 2
        if sample.clock_ratio is not None:
            sample_error += (clock - sample.clock_ratio) ** 2
        error += sample.weight * sample_error
        total_weight += sample.weight
    pull = sum(
        ((x - x0) / scale) ** 2 for x, x0, scale in zip(params, prior, _PRIOR_SCALE, strict=True)
    )
    return (error + PRIOR_WEIGHT * pull) / total_weight


def _nelder_mead(
    function: Callable[[Sequence[float]], float],
    start: Sequence[float],
    step: Sequence[float],
    iterations: int,
) -> tuple[list[float], float]:
    """Minimise ``function`` from ``start``; the textbook simplex method (Nelder and Mead, 1965)."""
    n = len(start)
    points = [list(start)]
    for i in range(n):
        point = list(start)
        point[i] += step[i]
        points.append(point)
    values = [function(p) for p in points]
    for _ in range(iterations):
        order = sorted(range(n + 1), key=values.__getitem__)
        points = [points[i] for i in order]
        values = [values[i] for i in order]
        if values[-1] - values[0] < 1e-10:
            break
        centroid = [sum(p[i] for p in points[:-1]) / n for i in range(n)]
        worst = points[-1]
        reflected = [c + (c - w) for c, w in zip(centroid, worst, strict=True)]
        reflected_value = function(reflected)
        if reflected_value < values[0]:
            expanded = [c + 2.0 * (c - w) for c, w in zip(centroid, worst, strict=True)]
            expanded_value = function(expanded)
            if expanded_value < reflected_value:
                points[-1], values[-1] = expanded, expanded_value
            else:
                points[-1], values[-1] = reflected, reflected_value
        elif reflected_value < values[-2]:
            points[-1], values[-1] = reflected, reflected_value
        else:
            contracted = [c + 0.5 * (w - c) for c, w in zip(centroid, worst, strict=True)]
            contracted_value = function(contracted)
            if contracted_value < values[-1]:
                points[-1], values[-1] = contracted, contracted_value
            else:
                best = points[0]
                for j in range(1, n + 1):
                    points[j] = [b + 0.5 * (x - b) for b, x in zip(best, points[j], strict=True)]
                    values[j] = function(points[j])
    best_index = min(range(n + 1), key=values.__getitem__)
    return points[best_index], values[best_index]


def fit_profile(
    samples: Iterable[PowerSample | tuple[float, ...]],
    max_w: float,
    prior: PowerProfile | None = None,
    iterations: int = 150,
) -> PowerProfile:
    """The profile that best explains ``samples`` (PowerSample or plain tuples in its order).

    ``max_w`` is the board's maximum cap. With no samples the prior comes back unchanged (the
    default profile when none is given). The result's ``samples`` counts the prior's samples plus
    these (by weight, rounded), so a profile refined cycle after cycle records how much
    telemetry it rests on.
    """
    prior = prior or PowerProfile()
    measured = [s if isinstance(s, PowerSample) else PowerSample(*s) for s in samples]
    measured = [s for s in measured if s.weight > 0.0]
    if not measured:
        return prior
    prior_params = _params(prior)
    u0, a0, s0, e0, v0 = prior_params
    starts = [prior_params, (0.9, 0.3, 0.8, 3.0, 0.5), (0.6, 0.45, 0.5, 3.0, 0.3)]
    # A draw seen well under its cap is the job's own demand: a better start than the prior's.
    free = [s.power_w for s in measured if s.power_w is not None and s.power_w < 0.85 * s.cap_w]
    if free:
        starts.append((min(max(free) / max_w, 1.0), a0, s0, e0, v0))

    def loss(params: Sequence[float]) -> float:
        return _loss(params, measured, max_w, prior_params)

    best_params, best_value = list(prior_params), math.inf
    for start in starts:
        params, value = _nelder_mead(loss, start, _START_STEP, iterations)
        if value < best_value:
            best_params, best_value = params, value
    u, a, s, e, v = (
        min(max(x, lo), hi) for x, lo, hi in zip(best_params, PARAM_LOWER, PARAM_UPPER, strict=True)
    )
    return replace(
        prior,
        uncapped_fraction=u,
        static_fraction=a,
        sensitivity=s,
        clock_exponent=e,
        floor_clock=v,
        samples=prior.samples + max(round(sum(s.weight for s in measured)), 1),
    )


class CapSummary:
    """A job's telemetry summarised per operating point, ready for fit_profile.

    Readings at caps within ``bin_w`` of each other are one point: running means of the cap,
    draw, utilization and clock, which become one PowerSample weighted by its readings. So the
    memory and the fit's cost follow the caps a job ran under, not how long it ran.
    """

    def __init__(self, bin_w: float = 5.0) -> None:
        self.bin_w = bin_w
        # bin -> [readings, cap sum, then (sum, count) for draw, utilization and clock]
        self._points: dict[int, list[float]] = {}

    def add(
        self,
        cap_w: float,
        power_w: float | None = None,
        utilization: float | None = None,
        clock_ratio: float | None = None,
    ) -> None:
        point = self._points.setdefault(round(cap_w / self.bin_w), [0.0] * 8)
        point[0] += 1
        point[1] += cap_w
        for i, value in ((2, power_w), (4, utilization), (6, clock_ratio)):
            if value is not None:
                point[i] += value
                point[i + 1] += 1

    @property
    def readings(self) -> int:
        return int(sum(p[0] for p in self._points.values()))

    def samples(self, min_readings: int = 1) -> list[PowerSample]:
        """One sample per point with at least ``min_readings`` readings, lowest cap first."""

        def mean(total: float, count: float) -> float | None:
            return total / count if count else None

        return [
            PowerSample(
                cap_w=p[1] / p[0],
                power_w=mean(p[2], p[3]),
                utilization=mean(p[4], p[5]),
                clock_ratio=mean(p[6], p[7]),
                weight=p[0],
            )
            for _, p in sorted(self._points.items())
            if p[0] >= min_readings
        ]


def samples_moved(
    before: Sequence[PowerSample],
    now: Sequence[PowerSample],
    power_w: float = 3.0,
    share: float = 0.02,
) -> bool:
    """Whether a profile fitted to ``before`` is worth refitting to ``now``: a new operating
    point, or a point whose mean draw moved ``power_w`` or whose utilization or clock moved
    ``share``. More readings of the same behaviour change nothing."""
    if len(before) != len(now):
        return True
    for old, new in zip(before, now, strict=True):
        for a, b, limit in (
            (old.cap_w, new.cap_w, power_w),
            (old.power_w, new.power_w, power_w),
            (old.utilization, new.utilization, share),
            (old.clock_ratio, new.clock_ratio, share),
        ):
            if a is None or b is None:
                if (a is None) != (b is None):
                    return True
            elif abs(a - b) >= limit:
                return True
    return False


ZeusKey = tuple[str, str, str, str]  # dataset, network, batch size, optimizer


def zeus_curves(
    rows: Iterable[Mapping[str, str]],
) -> dict[ZeusKey, list[tuple[float, float, float]]]:
    """Group rows of a zeus summary_power_*.csv into (power_limit W, time_per_epoch s, average_power W)
    per workload, sorted by power limit; rows repeated for a limit are averaged."""
    grouped: dict[ZeusKey, dict[float, list[tuple[float, float]]]] = {}
    for row in rows:
        key = (row["dataset"], row["network"], row["batch_size"], row["optimizer"])
        by_cap = grouped.setdefault(key, {})
        by_cap.setdefault(float(row["power_limit"]), []).append(
            (float(row["time_per_epoch"]), float(row["average_power"]))
        )
    return {
        key: [
            (
                cap,
                sum(t for t, _ in measured) / len(measured),
                sum(p for _, p in measured) / len(measured),
            )
            for cap, measured in sorted(by_cap.items())
        ]
        for key, by_cap in grouped.items()
    }


def zeus_samples(curve: Sequence[tuple[float, float, float]]) -> list[PowerSample]:
    """One workload's zeus curve as samples: throughput relative to the one at the highest limit."""
    time_at_max = curve[-1][1]
    return [
        PowerSample(cap_w=cap, relative_throughput=time_at_max / time_s, power_w=power_w)
        for cap, time_s, power_w in curve
    ]
