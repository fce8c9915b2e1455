"""The simulated GPU keeps NVML's contract, and draws what the scheduler's power model says."""

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.gpu import GpuInvalidArgument, GpuLost, GpuNoPermission, make_backend
from agents.gpu.simulated import SimulatedBackend, parse_spec, simulated_uuid
from scheduler.gpu_model import GPU_TYPES, relative_throughput
from scheduler.model import PowerProfile


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


def make(spec="simulated:H100-SXM-80GB:2", node="node-a", **kwargs):
    gpu_type, count = parse_spec(spec)
    return SimulatedBackend(gpu_type, count, node_name=node, **kwargs)


@pytest.mark.parametrize(
    "profile, min_w, max_w, memory_mib",
    [
        ("A100-SXM4-80GB", 100.0, 400.0, 81920),
        ("H100-SXM-80GB", 200.0, 700.0, 81559),
        ("V100-SXM2-32GB", 100.0, 300.0, 32768),
    ],
)
def test_each_profile_reports_its_power_limits_in_watts_and_memory_in_mib(
    profile, min_w, max_w, memory_mib
):
    gpus = make(f"simulated:{profile}:3").inventory()
    assert [g.index for g in gpus] == [0, 1, 2]
    for gpu in gpus:
        assert gpu.model == profile
        assert (gpu.power_min_w, gpu.power_max_w, gpu.power_default_w) == (min_w, max_w, max_w)
        assert gpu.memory_mib == memory_mib


def test_the_spec_names_a_profile_in_any_case_and_defaults_to_eight_gpus():
    assert len(make("simulated:h100-sxm-80gb").inventory()) == 8
    with pytest.raises(ValueError, match="unknown simulated GPU profile"):
        parse_spec("simulated:RTX-9090")
    with pytest.raises(ValueError):
        make_backend("cuda", node_name="n")


def test_uuids_are_stable_for_a_node_and_differ_between_nodes():
    first = [g.uuid for g in make(node="node-a").inventory()]
    again = [g.uuid for g in make(node="node-a").inventory()]
    other = [g.uuid for g in make(node="node-b").inventory()]
    assert first == again
    assert not set(first) & set(other)
    assert len(set(first)) == 2
    assert first[0] == simulated_uuid("node-a", 0)
    assert first[0].startswith("GPU-") and len(first[0]) == len("GPU-") + 36


def test_an_idle_gpu_draws_its_idle_power_at_the_default_cap():
    gpu = make("simulated:A100-SXM4-80GB:1")
    reading = gpu.telemetry()[0]
    assert reading.healthy
    assert reading.power_draw_w == GPU_TYPES["A100-SXM4-80GB"].idle_w
    assert reading.power_cap_w == 400.0
    assert reading.utilization_pct == 0.0
    assert reading.throttle_reasons == ("gpu_idle",)


def test_the_draw_rises_with_the_load_of_a_running_job():
    gpu = make("simulated:H100-SXM-80GB:2")
    busy, idle = (g.uuid for g in gpu.inventory())
    gpu.attach_load(1, [busy], utilization=0.5)
    half = {t.uuid: t for t in gpu.telemetry()}
    gpu.attach_load(1, [busy], utilization=1.0)
    full = {t.uuid: t for t in gpu.telemetry()}
    assert half[idle].power_draw_w < half[busy].power_draw_w < full[busy].power_draw_w
    assert full[busy].utilization_pct > half[busy].utilization_pct > 0
    assert full[busy].memory_used_mib > full[idle].memory_used_mib
    gpu.detach_load(1)
    assert gpu.telemetry()[0].power_draw_w == full[idle].power_draw_w


@settings(max_examples=60, deadline=None)
@given(
    cap_w=st.floats(min_value=200.0, max_value=700.0),
    utilization=st.floats(min_value=0.0, max_value=1.0),
)
def test_the_draw_never_exceeds_the_cap(cap_w, utilization):
    gpu = make("simulated:H100-SXM-80GB:1")
    uuid = gpu.inventory()[0].uuid
    gpu.set_power_limit(uuid, cap_w)
    gpu.attach_load(7, [uuid], utilization=utilization)
    reading = gpu.telemetry()[0]
    assert reading.power_cap_w == cap_w
    assert 0 < reading.power_draw_w <= cap_w


def test_a_binding_cap_lowers_the_draw_and_shows_as_a_power_cap_throttle():
    gpu = make("simulated:H100-SXM-80GB:1")
    uuid = gpu.inventory()[0].uuid
    gpu.attach_load(1, [uuid])
    uncapped = gpu.telemetry()[0]
    gpu.set_power_limit(uuid, 300.0)
    capped = gpu.telemetry()[0]
    assert capped.power_draw_w < uncapped.power_draw_w
    assert capped.sm_clock_mhz < uncapped.sm_clock_mhz
    assert "sw_power_cap" in capped.throttle_reasons
    assert "sw_power_cap" not in uncapped.throttle_reasons


def test_the_energy_counter_integrates_the_draw_over_monotonic_time():
    clock = FakeClock()
    gpu = make("simulated:V100-SXM2-32GB:1", clock=clock)
    uuid = gpu.inventory()[0].uuid
    start_j = gpu.energy_j(uuid)
    clock.advance(10.0)
    idle_w = gpu.telemetry()[0].power_draw_w
    assert gpu.energy_j(uuid) == pytest.approx(start_j + 10.0 * idle_w)
    gpu.attach_load(1, [uuid])
    busy_w = gpu.telemetry()[0].power_draw_w
    clock.advance(5.0)
    assert gpu.energy_j(uuid) == pytest.approx(start_j + 10.0 * idle_w + 5.0 * busy_w)


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.floats(min_value=0.0, max_value=100.0),  # seconds to advance (even 0)
            st.floats(min_value=100.0, max_value=300.0),  # a cap
            st.floats(min_value=0.0, max_value=1.0),  # a load
        ),
        min_size=1,
        max_size=20,
    )
)
def test_the_energy_counter_only_grows_whatever_the_caps_and_loads(steps):
    clock = FakeClock()
    gpu = make("simulated:V100-SXM2-32GB:1", clock=clock)
    uuid = gpu.inventory()[0].uuid
    last_j = gpu.energy_j(uuid)
    for advance_s, cap_w, load in steps:
        gpu.set_power_limit(uuid, cap_w)
        gpu.attach_load(1, [uuid], utilization=load)
        clock.advance(advance_s)
        now_j = gpu.telemetry()[0].energy_j
        assert now_j >= last_j
        last_j = now_j


def test_the_energy_counter_and_the_caps_survive_an_agent_restart(tmp_path):
    clock = FakeClock()
    state = tmp_path / "simulated-gpus.json"
    gpu = make("simulated:A100-SXM4-80GB:1", clock=clock, state_path=state)
    uuid = gpu.inventory()[0].uuid
    gpu.set_power_limit(uuid, 250.0)
    clock.advance(100.0)
    before_j = gpu.telemetry()[0].energy_j
    gpu.close()
    again = make("simulated:A100-SXM4-80GB:1", clock=FakeClock(), state_path=state)
    assert again.energy_j(uuid) >= before_j > 0
    assert again.enforced_power_limit_w(uuid) == 250.0


@pytest.mark.parametrize("cap_w", [99.0, 400.5, -1.0])
def test_a_cap_outside_the_constraints_is_refused_like_nvml_refuses_it(cap_w):
    gpu = make("simulated:A100-SXM4-80GB:1")
    uuid = gpu.inventory()[0].uuid
    with pytest.raises(GpuInvalidArgument, match="outside 100.0..400.0 W"):
        gpu.set_power_limit(uuid, cap_w)
    with pytest.raises(GpuInvalidArgument):
        gpu.set_power_limit(uuid, cap_w, dry_run=True)
    assert gpu.enforced_power_limit_w(uuid) == 400.0
    with pytest.raises(GpuInvalidArgument, match="no GPU"):
        gpu.set_power_limit("GPU-not-here", 200.0)


def test_a_cap_is_written_only_when_it_changes_and_a_dry_run_writes_nothing():
    gpu = make("simulated:A100-SXM4-80GB:1")
    uuid = gpu.inventory()[0].uuid
    assert gpu.set_power_limit(uuid, 400.0) == 400.0
    assert gpu.power_limit_writes == 0
    assert gpu.set_power_limit(uuid, 300.0, dry_run=True) == 400.0
    assert gpu.power_limit_writes == 0
    assert gpu.set_power_limit(uuid, 300.0) == 300.0
    assert gpu.set_power_limit(uuid, 300.0) == 300.0
    assert gpu.power_limit_writes == 1


def test_a_board_that_refuses_writes_raises_no_permission():
    gpu = make("simulated:A100-SXM4-80GB:1", power_limit_settable=False)
    uuid = gpu.inventory()[0].uuid
    with pytest.raises(GpuNoPermission):
        gpu.set_power_limit(uuid, 300.0)
    assert gpu.enforced_power_limit_w(uuid) == 400.0


def test_a_cap_slows_the_modelled_progress_as_the_scheduler_predicts():
    gpu = make("simulated:H100-SXM-80GB:2")
    a, b = (g.uuid for g in gpu.inventory())
    assert gpu.progress_speed([a, b]) == 1.0
    gpu.set_power_limit(b, 250.0)
    expected = relative_throughput(PowerProfile(), 250.0, 700.0)
    assert expected < 0.9
    # A job on both runs at the pace of the slower GPU.
    assert gpu.progress_speed([a, b]) == pytest.approx(expected)
    assert gpu.progress_speed([a]) == 1.0


def test_a_lost_gpu_is_unhealthy_reads_nothing_and_refuses_caps():
    gpu = make("simulated:H100-SXM-80GB:2")
    lost, fine = (g.uuid for g in gpu.inventory())
    gpu.mark_lost(lost)
    readings = {t.uuid: t for t in gpu.telemetry()}
    assert readings[lost].healthy is False
    assert readings[lost].power_draw_w is None and readings[lost].energy_j is None
    assert readings[fine].healthy is True
    with pytest.raises(GpuLost):
        gpu.set_power_limit(lost, 300.0)
    assert gpu.progress_speed([lost, fine]) == 0.0


def test_the_wire_form_carries_units_in_its_names_and_nulls_for_what_is_unknown():
    gpu = make("simulated:H100-SXM-80GB:2")
    gpu.mark_lost(gpu.inventory()[0].uuid)
    lost, fine = (t.to_wire() for t in gpu.telemetry())
    expected_keys = {
        "uuid",
        "healthy",
        "utilization_pct",
        "memory_used_mib",
        "power_draw_w",
        "power_cap_w",
        "energy_j",
        "temperature_c",
        "sm_clock_mhz",
        "throttle_reasons",
        "ecc_errors",
    }
    assert expected_keys <= set(fine)
    assert lost["power_draw_w"] is None and lost["energy_j"] is None
    assert lost["healthy"] is False
    assert fine["ecc_errors"] == 0


def test_the_state_kept_at_every_reading_is_rewritten_in_place_and_survives_a_kill(tmp_path):
    """Every telemetry read saves the counters (an agent killed at any time loses none of the
    energy it reported), into the same file: no new file per reading."""
    clock = FakeClock()
    state = tmp_path / "simulated-gpus.json"
    gpu = make("simulated:A100-SXM4-80GB:2", clock=clock, state_path=state)
    uuids = [g.uuid for g in gpu.inventory()]
    gpu.attach_load(1, uuids[:1], utilization=1.0)
    gpu.telemetry()
    inode = state.stat().st_ino
    reported_j = {}
    for cap_w in (400.0, 123.0, 400.0):  # the text grows and shrinks with the numbers
        gpu.set_power_limit(uuids[0], cap_w)
        clock.advance(3.5)
        reported_j = {t.uuid: t.energy_j for t in gpu.telemetry()}
        assert state.stat().st_ino == inode
        assert os.listdir(tmp_path) == ["simulated-gpus.json"]
    # No close(): the agent was killed right after its last reading.
    again = make("simulated:A100-SXM4-80GB:2", clock=FakeClock(), state_path=state)
    for uuid in uuids:
        assert again.energy_j(uuid) >= reported_j[uuid]
    assert reported_j[uuids[0]] > reported_j[uuids[1]] > 0
    assert again.enforced_power_limit_w(uuids[0]) == 400.0


def test_a_state_longer_than_a_page_is_replaced_whole(tmp_path):
    """A write of more than a page can be cut by a kill between its pages: a large node's
    state goes through a new file and a rename instead, and reads back whole."""
    clock = FakeClock()
    state = tmp_path / "simulated-gpus.json"
    gpu = make("simulated:A100-SXM4-80GB:64", clock=clock, state_path=state)
    clock.advance(10.0)
    reported = {t.uuid: t.energy_j for t in gpu.telemetry()}
    assert state.stat().st_size > 4096
    inode = state.stat().st_ino
    clock.advance(10.0)
    gpu.telemetry()
    assert state.stat().st_ino != inode
    again = make("simulated:A100-SXM4-80GB:64", clock=FakeClock(), state_path=state)
    assert all(again.energy_j(uuid) >= j for uuid, j in reported.items())
