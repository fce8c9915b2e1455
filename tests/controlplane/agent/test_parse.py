"""The one-pass GPU reading parser accepts and refuses exactly what the field validators do."""

import math

import pytest

from controlplane.cluster.agent_api import checked_gpu_sample, gpu_sample

from .conftest import gpu_reading

VARIANTS = [
    {},
    {"healthy": False},
    {"healthy": None},
    {"power_draw_w": 512},
    {"power_draw_w": None, "sm_clock_mhz": None},
    {"temperature_c": -5.0},
    {"throttle_reasons": None},
    {"throttle_reasons": ["sw_power_cap", "hw_slowdown"]},
    {"ecc_errors": None},
    {"ecc_errors": 3},
    {"uuid": "G" * 96},
    # Refused, each naming its field:
    {"uuid": "G" * 97},
    {"uuid": ""},
    {"uuid": None},
    {"uuid": ["GPU-x-4"]},
    {"uuid": 7},
    {"power_draw_w": "512"},
    {"power_draw_w": True},
    {"power_draw_w": math.nan},
    {"energy_j": math.inf},
    {"utilization_pct": -1},
    {"healthy": "yes"},
    {"throttle_reasons": "sw_power_cap"},
    {"throttle_reasons": ["ok", 3]},
    {"ecc_errors": -1},
    {"ecc_errors": 1.5},
    {"ecc_errors": False},
    {"utilization_pct": 100.5},
    {"power_draw_w": 1e12},
    {"temperature_c": 1e9},
    {"temperature_c": -60},
    {"energy_j": -1},
    {"energy_j": 2.0**63},
    {"sm_clock_mhz": 1e6},
    {"memory_used_mib": 2.0**40},
    {"ecc_errors": 2**64},
    {"power_draw_w": 10**400},
    {"uuid": "GPU x"},
    {"uuid": "GPU-\x00"},
    {"uuid": "GPU-\ud800"},
    {"throttle_reasons": ["sw\x00"]},
    {"throttle_reasons": ["r"] * 65},
    {"throttle_reasons": ["réduit", "tab\there"]},
]


def outcome(parse, reading):
    warnings = {}
    return parse(reading, 4, warnings), warnings


@pytest.mark.parametrize("change", VARIANTS, ids=[repr(v)[:40] for v in VARIANTS])
def test_the_fast_parse_agrees_with_the_field_validators(change):
    reading = {**gpu_reading("GPU-x-4"), **change}

    assert outcome(gpu_sample, reading) == outcome(checked_gpu_sample, reading)


def test_a_reading_with_only_its_uuid_is_accepted_with_nothing_measured():
    sample = gpu_sample({"uuid": "GPU-x-0"}, 0, {})
    assert sample.healthy is True
    assert sample.power_draw_w is None
    assert sample.throttle_reasons is None
    assert sample.ecc_errors is None
