"""The power model against the zeus measurements, and learning a profile from telemetry."""

import csv
import math
import random
import statistics
from pathlib import Path

import pytest

from scheduler.gpu_model import (
    GPU_TYPES,
    ZEUS_GPU_TYPES,
    clock_ratio,
    energy_per_work,
    gpu_utilization,
    power_draw_w,
    relative_throughput,
)
from scheduler.model import PowerProfile
from scheduler.power import best_cap_within_slowdown, energy_optimal_cap_w, knee_cap_w
from scheduler.power_fit import (
    CapSummary,
    PowerSample,
    fit_profile,
    samples_moved,
    zeus_curves,
    zeus_samples,
)

ZEUS = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "zeus"
needs_zeus = pytest.mark.skipif(
    not (ZEUS / "summary_power_v100.csv").exists(),
    reason=f"the zeus power sweeps are not at {ZEUS} (optional: README.md, section Data, says where to get it)",
)


def _fitted(gpu: str):
    """Every workload of one zeus file: (its curve, its samples, the profile fitted to them)."""
    gpu_type = GPU_TYPES[ZEUS_GPU_TYPES[gpu]]
    with open(ZEUS / f"summary_power_{gpu}.csv", newline="") as f:
        curves = zeus_curves(csv.DictReader(f))
    fitted = []
    for curve in curves.values():
        samples = zeus_samples(curve)
        fitted.append((curve, samples, fit_profile(samples, gpu_type.max_w)))
    return gpu_type, fitted


@pytest.fixture(scope="module")
def zeus_fits():
    return {gpu: _fitted(gpu) for gpu in ("v100", "a40")}


def _compute_bound(gpu_type, fitted):
    """Workloads that draw at least 70 % of the maximum cap uncapped: the ones a cap binds."""
    return [(c, s, p) for c, s, p in fitted if c[-1][2] >= 0.7 * gpu_type.max_w]


@needs_zeus
@pytest.mark.slow
def test_the_model_fits_every_v100_and_a40_workload_within_the_measurement_noise(zeus_fits):
    # Relative throughput RMSE over all V100 and A40 workloads and power limits. The bound comes
    # from the data: where the average power stays under 70 % of the cap, the cap cannot bind and
    # the true relative throughput is 1, so the spread of the measured values there is the
    # measurement noise (about 0.06). An RMSE of at most 0.045, three quarters of that, means the
    # model's own error is small next to what the measurements can resolve; a model that ignores
    # the cap scores 0.21.
    squared, noise, flat, count = 0.0, [], 0.0, 0
    for gpu_type, fitted in zeus_fits.values():
        for _, samples, profile in fitted:
            for sample in samples:
                model = relative_throughput(profile, sample.cap_w, gpu_type.max_w)
                squared += (model - sample.relative_throughput) ** 2
                flat += (1.0 - sample.relative_throughput) ** 2
                count += 1
                if sample.power_w < 0.7 * sample.cap_w and sample.cap_w < gpu_type.max_w:
                    noise.append((sample.relative_throughput - 1.0) ** 2)
    rmse = math.sqrt(squared / count)
    noise_floor = math.sqrt(sum(noise) / len(noise))
    flat_rmse = math.sqrt(flat / count)
    print(
        f"rel. throughput RMSE {rmse:.4f} ({count} points), noise {noise_floor:.4f}, flat {flat_rmse:.4f}"
    )
    assert count > 700
    assert rmse < 0.045
    assert rmse < 0.75 * noise_floor
    assert rmse < flat_rmse / 3


@needs_zeus
@pytest.mark.slow
def test_the_fitted_draw_follows_the_measured_power_within_a_few_percent_of_the_max_cap(
    zeus_fits,
):
    for gpu_type, fitted in zeus_fits.values():
        squared = [
            ((power_draw_w(p, s.cap_w, gpu_type.max_w, 0.0) - s.power_w) / gpu_type.max_w) ** 2
            for _, samples, p in fitted
            for s in samples
        ]
        assert math.sqrt(statistics.fmean(squared)) < 0.035


@needs_zeus
@pytest.mark.slow
def test_on_v100_little_is_lost_near_the_top_and_energy_is_least_near_half_the_max_cap(
    zeus_fits,
):
    gpu_type, fitted = zeus_fits["v100"]
    bound = _compute_bound(gpu_type, fitted)
    max_w = gpu_type.max_w
    assert len(bound) >= 20
    at_80 = statistics.median(relative_throughput(p, 0.8 * max_w, max_w) for _, _, p in bound)
    at_50 = statistics.median(relative_throughput(p, 0.5 * max_w, max_w) for _, _, p in bound)
    # The data README: medians 0.96 at 80 % of the maximum cap and 0.82 at 50 %.
    assert 0.92 <= at_80 <= 0.99
    assert 0.76 <= at_50 <= 0.88
    optimal = [energy_optimal_cap_w(p, gpu_type.min_w, max_w) for _, _, p in bound]
    assert 0.4 * max_w <= statistics.median(optimal) <= 0.6 * max_w


@needs_zeus
@pytest.mark.slow
def test_a_watt_buys_far_less_above_the_knee_than_below_it(zeus_fits):
    for gpu_type, fitted in zeus_fits.values():
        max_w = gpu_type.max_w
        for _, _, p in _compute_bound(gpu_type, fitted):
            knee_w = knee_cap_w(p, gpu_type.min_w, max_w)
            optimal_w = energy_optimal_cap_w(p, gpu_type.min_w, max_w)
            assert optimal_w < knee_w
            below = (
                relative_throughput(p, optimal_w + 25.0, max_w)
                - relative_throughput(p, optimal_w, max_w)
            ) / 25.0
            above = (
                relative_throughput(p, max_w, max_w) - relative_throughput(p, knee_w, max_w)
            ) / (max(max_w - knee_w, 1e-9))
            assert above < below / 3


@needs_zeus
@pytest.mark.slow
def test_below_the_energy_optimal_cap_both_energy_and_time_get_worse(zeus_fits):
    checked = 0
    for gpu_type, fitted in zeus_fits.values():
        max_w = gpu_type.max_w
        for _, _, p in _compute_bound(gpu_type, fitted):
            optimal_w = energy_optimal_cap_w(p, gpu_type.min_w, max_w)
            if optimal_w - gpu_type.min_w < 10.0:
                continue
            checked += 1
            lower = gpu_type.min_w
            assert energy_per_work(p, lower, max_w) > energy_per_work(p, optimal_w, max_w)
            assert relative_throughput(p, lower, max_w) < relative_throughput(p, optimal_w, max_w)
            # ... and above it time improves while energy rises.
            assert energy_per_work(p, max_w, max_w) > energy_per_work(p, optimal_w, max_w)
    assert checked >= 20


@needs_zeus
@pytest.mark.slow
def test_the_measured_energy_optimal_cap_is_matched_to_within_one_zeus_step(zeus_fits):
    for gpu_type, fitted in zeus_fits.values():
        misses = []
        for curve, _, p in _compute_bound(gpu_type, fitted):
            measured_w = min(curve, key=lambda row: row[1] * row[2])[0]
            modelled_w = energy_optimal_cap_w(p, gpu_type.min_w, gpu_type.max_w)
            misses.append(abs(modelled_w - measured_w))
        assert statistics.median(misses) <= 25.0


def test_once_the_cap_binds_the_draw_sits_at_094_to_097_of_the_cap():
    profile = PowerProfile()
    for cap_w in (100.0, 125.0, 150.0):
        ratio = power_draw_w(profile, cap_w, 300.0, 30.0) / cap_w
        assert 0.94 <= ratio <= 0.97


def test_uncapped_a_job_runs_at_full_speed_and_draws_its_demand():
    profile = PowerProfile(uncapped_fraction=0.5)
    assert relative_throughput(profile, 400.0, 400.0) == 1.0
    assert power_draw_w(profile, 400.0, 400.0, 50.0) == pytest.approx(200.0, rel=0.02)
    # A cap far above a light job's draw costs it nothing.
    assert relative_throughput(profile, 350.0, 400.0) > 0.995


def test_the_draw_never_exceeds_the_cap_and_is_idle_power_without_activity():
    for profile in (PowerProfile(), PowerProfile(uncapped_fraction=1.0, static_fraction=0.6)):
        for cap_w in range(100, 401, 10):
            assert power_draw_w(profile, cap_w, 400.0, 55.0) <= cap_w
            assert power_draw_w(profile, cap_w, 400.0, 55.0, utilization=0.0) == 55.0


def test_a_lower_cap_never_makes_a_job_faster_or_draw_more():
    profile = PowerProfile()
    caps = range(100, 401, 5)
    speeds = [relative_throughput(profile, c, 400.0) for c in caps]
    draws = [power_draw_w(profile, c, 400.0, 55.0) for c in caps]
    assert speeds == sorted(speeds)
    assert draws == sorted(draws)


def test_a_memory_bound_job_loses_less_under_a_cap_than_a_compute_bound_one():
    compute = PowerProfile(sensitivity=1.0)
    memory = PowerProfile(sensitivity=0.3)
    assert relative_throughput(memory, 200.0, 400.0) > relative_throughput(compute, 200.0, 400.0)


def test_the_eco_cap_costs_at_most_the_allowed_slowdown_and_saves_energy():
    profile = PowerProfile()
    cap_w = best_cap_within_slowdown(profile, 100.0, 400.0, max_slowdown=0.05)
    assert cap_w < 400.0
    assert 1.0 / relative_throughput(profile, cap_w, 400.0) <= 1.05 + 1e-9
    assert energy_per_work(profile, cap_w, 400.0) < 0.97


def _telemetry(truth: PowerProfile, max_w: float, caps, rng: random.Random):
    """What the agent reports at each cap: draw, utilization and SM clock, with 1 % noise."""

    def noisy(x: float) -> float:
        return x * (1.0 + rng.gauss(0.0, 0.01))

    return [
        PowerSample(
            cap_w=cap,
            power_w=noisy(power_draw_w(truth, cap, max_w, 0.0)),
            utilization=min(noisy(gpu_utilization(truth, cap, max_w)), 1.0),
            clock_ratio=min(noisy(clock_ratio(truth, cap, max_w)), 1.0),
        )
        for cap in caps
    ]


@pytest.mark.parametrize(
    "truth",
    [
        PowerProfile(uncapped_fraction=0.95, static_fraction=0.33, sensitivity=0.75),
        PowerProfile(uncapped_fraction=0.7, static_fraction=0.3, sensitivity=0.95, floor_clock=0.5),
        PowerProfile(
            uncapped_fraction=0.8, static_fraction=0.4, sensitivity=0.45, clock_exponent=2.5
        ),
    ],
    ids=["bert-like", "deepspeech-like", "memory-bound"],
)
def test_telemetry_at_the_caps_a_job_ran_under_reveals_how_much_a_cap_slows_it(truth):
    max_w = 250.0
    samples = _telemetry(truth, max_w, (250.0, 225.0, 200.0, 175.0, 150.0), random.Random(5))
    learned = fit_profile(samples, max_w)

    def error(cap_w: float) -> float:
        return abs(
            relative_throughput(learned, cap_w, max_w) - relative_throughput(truth, cap_w, max_w)
        )

    # Within the caps it ran under the curve is learned closely; below them it is extrapolated.
    assert max(error(c) for c in range(150, 251, 5)) < 0.03
    assert max(error(c) for c in range(100, 150, 5)) < 0.1
    assert learned.samples == 5
    true_eco = best_cap_within_slowdown(truth, 100.0, max_w)
    learned_eco = best_cap_within_slowdown(learned, 100.0, max_w)
    assert abs(true_eco - learned_eco) <= 15.0


def test_a_job_seen_only_uncapped_keeps_the_prior_shape_but_learns_its_demand():
    truth = PowerProfile(uncapped_fraction=0.55)
    samples = _telemetry(truth, 400.0, (400.0, 400.0, 400.0), random.Random(7))
    learned = fit_profile(samples, 400.0)
    assert learned.uncapped_fraction == pytest.approx(0.55, abs=0.02)
    assert learned.static_fraction == pytest.approx(PowerProfile().static_fraction, abs=0.05)


def test_without_samples_the_prior_comes_back_unchanged():
    prior = PowerProfile(uncapped_fraction=0.6, samples=3)
    assert fit_profile([], 400.0, prior=prior) == prior


def test_readings_summarised_per_cap_teach_what_the_readings_themselves_teach():
    truth = PowerProfile(uncapped_fraction=0.6, sensitivity=0.7)
    rng = random.Random(11)
    readings = _telemetry(truth, 400.0, [400.0] * 20 + [300.0] * 20 + [302.0] * 5, rng)
    summary = CapSummary(bin_w=5.0)
    for r in readings:
        summary.add(r.cap_w, r.power_w, r.utilization, r.clock_ratio)

    samples = summary.samples()
    assert [round(s.cap_w) for s in samples] == [300, 400]
    assert [s.weight for s in samples] == [25, 20]
    assert summary.readings == 45
    from_summary, from_readings = fit_profile(samples, 400.0), fit_profile(readings, 400.0)
    assert from_summary.samples == from_readings.samples == 45
    for cap_w in (250.0, 300.0, 350.0, 400.0):
        assert power_draw_w(from_summary, cap_w, 400.0, 0.0) == pytest.approx(
            power_draw_w(from_readings, cap_w, 400.0, 0.0), rel=0.02
        )
        assert relative_throughput(from_summary, cap_w, 400.0) == pytest.approx(
            relative_throughput(from_readings, cap_w, 400.0), abs=0.02
        )


def test_more_readings_of_the_same_behaviour_call_for_no_refit_and_a_new_cap_does():
    truth = PowerProfile(uncapped_fraction=0.6)
    rng = random.Random(3)
    summary = CapSummary()
    for r in _telemetry(truth, 400.0, [400.0] * 10, rng):
        summary.add(r.cap_w, r.power_w, r.utilization)
    fitted_on = summary.samples()
    for r in _telemetry(truth, 400.0, [400.0] * 10, rng):
        summary.add(r.cap_w, r.power_w, r.utilization)
    assert not samples_moved(fitted_on, summary.samples())
    for r in _telemetry(truth, 400.0, [320.0] * 3, rng):
        summary.add(r.cap_w, r.power_w, r.utilization)
    assert samples_moved(fitted_on, summary.samples())
    # The same cap, but the job now draws far more (a new phase of training).
    busier = CapSummary()
    for _ in range(20):
        busier.add(400.0, 300.0, 0.9)
    assert samples_moved(fitted_on, busier.samples())
