"""The agent sends what the control plane can take: every byte of output, readings within what
hardware reports (an odd one left out, not the heartbeat), and it resends a report the control
plane said it could not apply."""

import sys
from dataclasses import replace

from agents import limits
from agents.daemon import _exit_code
from agents.gpu.simulated import SimulatedBackend, parse_spec
from tests.agents.conftest import kept_records
from tests.agents.test_daemon import NODE, attempt, ended, make_agent


class GlitchingBackend(SimulatedBackend):
    """NVML as it sometimes is: sentinels and garbage in some readings, odd power limits."""

    def telemetry(self):
        readings = super().telemetry()
        readings[0] = replace(
            readings[0], power_draw_w=1e12, temperature_c=1e9, utilization_pct=float("nan")
        )
        return readings

    def inventory(self):
        gpus = super().inventory()
        gpus[1] = replace(gpus[1], power_max_w=4_294_967.295, memory_mib=2**50)
        return gpus


def glitching():
    gpu_type, count = parse_spec("simulated:A100-SXM4-80GB:2")
    return GlitchingBackend(gpu_type, count, node_name=NODE)


def test_output_that_is_not_text_is_shipped_byte_for_byte(control_plane, state_dir):
    agent = make_agent(control_plane, state_dir)
    script = (
        "import sys; sys.stdout.buffer.write(b'before\\n\\x00nul \\xff\\xfe bad \\xe2\\x82 cut\\n');"
        "sys.stdout.write('after \u00e9\\n')"
    )
    control_plane.set_desired([attempt(3, sys.executable, "-c", script)])
    agent.cycle()
    ended(agent, 3)
    for _ in range(3):
        agent.cycle()

    assert control_plane.logs[3] == (b"before\n\x00nul \xff\xfe bad \xe2\x82 cut\nafter \xc3\xa9\n")


def test_readings_outside_what_hardware_reports_are_left_out_and_the_rest_sent(
    control_plane, state_dir
):
    agent = make_agent(control_plane, state_dir, gpu=glitching())

    agent.cycle()

    glitched, fine = control_plane.last_heartbeat()["gpus"]
    assert (glitched["power_draw_w"], glitched["temperature_c"]) == (None, None)
    assert glitched["utilization_pct"] is None
    assert glitched["memory_used_mib"] is not None
    assert fine["power_draw_w"] is not None and fine["temperature_c"] is not None


def test_an_odd_inventory_limit_is_clamped_so_the_node_still_registers(control_plane, state_dir):
    make_agent(control_plane, state_dir, gpu=glitching())

    gpus = control_plane.registrations[-1]["gpus"]
    assert gpus[1]["power_max_w"] == limits.MAX_GPU_POWER_W
    assert gpus[1]["memory_mib"] == limits.MAX_GPU_MEMORY_MIB
    assert gpus[1]["power_min_w"] <= gpus[1]["power_max_w"]


def test_an_exit_code_no_process_has_is_reported_as_unknown():
    assert _exit_code(1, 2**40) is None
    assert _exit_code(1, -9) == -9
    assert _exit_code(1, 137) == 137


def test_an_exit_report_the_control_plane_could_not_apply_is_sent_again(control_plane, state_dir):
    agent = make_agent(control_plane, state_dir)
    control_plane.set_desired([attempt(5, sys.executable, "-c", "pass")])
    agent.cycle()
    ended(agent, 5)
    answer = control_plane._heartbeat
    refusals = []

    def refusing_once(body, token):
        reply = answer(body, token)
        if not refusals and body["attempts"]:
            refusals.append(body["attempts"][0])
            reply["warnings"] = {"attempts[0].state": ["One of running, exited."]}
        return reply

    control_plane._heartbeat = refusing_once
    control_plane.set_desired([])
    agent.cycle()
    agent.cycle()

    reports = [r for r in control_plane.reported(5) if r["state"] == "exited"]
    assert len(reports) >= 2  # sent again after the warning, then acknowledged
    agent.cycle()
    assert 5 not in kept_records(state_dir)
