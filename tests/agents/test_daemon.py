"""The reconcile loop, driven against the tiny in-test control plane with real processes.

Most tests turn the loop by hand (`cycle()`), so each step is explicit; the ones about the loop
itself (watch, backoff) run it in a thread.
"""

import json
import os
import sys
import threading
import time

import pytest

from agents import daemon
from agents.client import REGISTRATION_KEY_FILE, ControlPlaneClient, ControlPlaneUnavailable
from agents.daemon import Agent, AgentConfig
from agents.gpu.simulated import SimulatedBackend, parse_spec
from agents.runtime.base import AttemptState
from agents.runtime.process import ProcessRuntime, read_child
from tests.agents.conftest import kept_records, wait_until

NODE = "node-t"


class FakeClock:
    """Wall and monotonic time at once, for the GPU model and the agent's energy accounting."""

    def __init__(self) -> None:
        self.now_s = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


class NoCounterBackend(SimulatedBackend):
    """A board without an energy counter (NVML NotSupported), like GPUs before Volta."""

    def energy_j(self, uuid):
        return None

    def telemetry(self):
        from dataclasses import replace

        return [replace(t, energy_j=None) for t in super().telemetry()]


def make_agent(cp, state_dir, *, gpu=None, clock=None, join=True, **overrides):
    config = AgentConfig(
        url=cp.url,
        state_dir=state_dir,
        node_name=NODE,
        join_token=cp.JOIN_TOKEN if join else None,
        runtime="process",
        poll_interval_s=0.05,
        watch_timeout_s=2.0,
        stop_grace_s=5.0,
        backoff_max_s=0.4,
        # The fence is a process of its own, tested in test_fence.py.
        **{"fence": False, "request_timeout_s": 3.0, **overrides},
    )
    if gpu is None:
        gpu_type, count = parse_spec("simulated:A100-SXM4-80GB:2")
        gpu = SimulatedBackend(
            gpu_type, count, node_name=NODE, **({"clock": clock} if clock else {})
        )
    client = ControlPlaneClient(
        cp.url, state_dir=state_dir, join_token=config.join_token, timeout_s=3.0
    )
    agent = Agent(
        config,
        client=client,
        gpu=gpu,
        runtime=ProcessRuntime(state_dir),
        **({"clock": clock} if clock else {}),
    )
    agent.recover()
    agent.ensure_registered()
    return agent


def attempt(attempt_id, *command, gpus=(), **extra):
    return {
        "attempt_id": attempt_id,
        "job_id": 100 + attempt_id,
        "image": "",
        "command": list(command),
        "env": {},
        "gpu_uuids": list(gpus),
        "cpus": 1.0,
        "memory_mib": 256,
        "max_runtime_s": None,
        **extra,
    }


def waiting_on(marker, before=""):
    """A job that runs until the test creates ``marker``."""
    return ("sh", "-c", f"{before}while [ ! -e {marker} ]; do sleep 0.05; done; echo done")


def runtime_state(agent, attempt_id):
    for status in agent.runtime.statuses():
        if status.attempt_id == attempt_id:
            return status.state
    return None


def ended(agent, attempt_id):
    return wait_until(
        lambda: runtime_state(agent, attempt_id) not in (None, AttemptState.RUNNING),
        what=f"attempt {attempt_id} to end",
    )


def uuids(agent):
    return [g.uuid for g in agent.gpu.inventory()]


def test_the_agent_registers_its_inventory_once_and_reuses_its_node_token(control_plane, state_dir):
    agent = make_agent(control_plane, state_dir)
    assert agent.cycle()
    (registered,) = control_plane.registrations
    assert registered["name"] == NODE and registered["runtime"] == "process"
    assert [g["power_max_w"] for g in registered["gpus"]] == [400.0, 400.0]
    # A simulated node of two A100s has the host of two A100s (a DGX A100's share), whatever
    # machine the test runs on.
    assert (registered["cpus"], registered["memory_mib"]) == (64, 2 * 128 * 1024)

    again = make_agent(control_plane, state_dir)
    assert again.cycle()
    assert len(control_plane.registrations) == 1
    assert control_plane.heartbeat_tokens[0] == control_plane.heartbeat_tokens[1]


def test_a_registration_whose_answer_was_lost_is_sent_again_with_the_same_key(
    control_plane, state_dir
):
    """The control plane registered the node but its answer never came (a timeout under load):
    the retry, by this agent or by the next one after a restart, carries the same registration
    key, which lets a real control plane hand out a node token again for the join token the
    first try spent (tests/controlplane/agent/test_register_retry.py)."""
    control_plane.lost_register_answers = 2
    key_path = state_dir / REGISTRATION_KEY_FILE
    first = ControlPlaneClient(
        control_plane.url, state_dir=state_dir, join_token=control_plane.JOIN_TOKEN
    )
    with pytest.raises(ControlPlaneUnavailable):
        first.register({"name": NODE})
    assert key_path.stat().st_mode & 0o777 == 0o600
    # The agent restarted after a crash: it registers at its start, through one more lost
    # answer, then the answer.
    restarted = make_agent(control_plane, state_dir)
    assert restarted.cycle()
    keys = [r["registration_key"] for r in control_plane.registrations]
    assert len(keys) == 3 and len(set(keys)) == 1 and len(keys[0]) >= 32
    # Numbered, across the restart: a try answered late never takes a later one's token.
    assert [r["registration_try"] for r in control_plane.registrations] == [1, 2, 3]
    assert not key_path.exists()  # the next registration will be another one
    control_plane.node_tokens.clear()
    assert not restarted.cycle()  # the node token refused: it registers anew, with a new key
    assert control_plane.registrations[-1]["registration_key"] != keys[0]
    assert control_plane.registrations[-1]["registration_try"] == 1


def test_a_refused_node_token_makes_the_agent_register_again(control_plane, state_dir):
    agent = make_agent(control_plane, state_dir)
    assert agent.cycle()
    control_plane.node_tokens.clear()  # revoked by an admin, or rotated elsewhere
    assert not agent.cycle()
    assert len(control_plane.registrations) == 2
    assert agent.cycle()


def test_a_listed_attempt_starts_reports_its_exit_and_output_and_is_then_forgotten(
    control_plane, state_dir
):
    agent = make_agent(control_plane, state_dir)
    gpu0 = uuids(agent)[0]
    control_plane.set_desired([attempt(1, "sh", "-c", "echo hello; exit 4", gpus=[gpu0])])
    assert agent.cycle()
    ended(agent, 1)
    assert agent.cycle()
    (report,) = control_plane.reported(1)
    assert report["state"] == "exited" and report["exit_code"] == 4
    assert report["started_at"] <= report["finished_at"]
    assert control_plane.logs[1] == b"hello\n"
    # Acknowledged: forgotten, and never started again though a stale answer still lists it.
    assert 1 not in kept_records(state_dir)
    assert agent.cycle()
    assert len(control_plane.reported(1)) == 1
    assert not (state_dir / "process" / "1").exists()


def test_an_attempt_that_is_not_listed_any_more_is_stopped(control_plane, state_dir):
    agent = make_agent(control_plane, state_dir)
    control_plane.set_desired([attempt(2, "sleep", "300")])
    agent.cycle()
    assert runtime_state(agent, 2) is AttemptState.RUNNING
    control_plane.set_desired([])
    agent.cycle()
    ended(agent, 2)
    agent.cycle()
    assert control_plane.reported(2)[-1]["exit_code"] == 143


def test_an_attempt_that_cannot_start_is_reported_failed_to_start_once(control_plane, state_dir):
    agent = make_agent(control_plane, state_dir)
    control_plane.set_desired([attempt(3, "no-such-command-anywhere")])
    agent.cycle()
    agent.cycle()
    (report,) = control_plane.reported(3)
    assert report["state"] == "failed_to_start" and report["exit_code"] is None
    assert "no-such-command-anywhere" in report["message"]
    agent.cycle()
    assert len(control_plane.reported(3)) == 1


def test_a_restarted_agent_adopts_its_running_attempt_and_never_starts_it_twice(
    control_plane, state_dir, tmp_path
):
    runs, marker = tmp_path / "runs", tmp_path / "go"
    first = make_agent(control_plane, state_dir)
    control_plane.set_desired(
        [attempt(4, *waiting_on(marker, before=f"echo run >> {runs}; "), gpus=uuids(first)[:1])]
    )
    first.cycle()
    wait_until(lambda: runs.exists(), what="the job to start")
    first.cycle()
    # The agent dies here (no shutdown at all); the job lives on.

    second = make_agent(control_plane, state_dir)
    finishes_adopted_once(second, control_plane, 4, marker, runs)
    assert len(control_plane.registrations) == 1


def finishes_adopted_once(agent, control_plane, attempt_id, marker, runs):
    """A restarted agent reports the attempt running, then its end once `marker` lets it end;
    the job ran once (`runs` holds one line)."""
    assert agent.cycle()
    assert control_plane.reported(attempt_id)[-1]["state"] == "running"
    marker.touch()
    ended(agent, attempt_id)
    agent.cycle()
    assert control_plane.reported(attempt_id)[-1]["exit_code"] == 0
    assert runs.read_text() == "run\n"


def test_an_attempts_energy_is_the_counter_delta_of_its_own_gpus(
    control_plane, state_dir, tmp_path
):
    clock = FakeClock()
    agent = make_agent(control_plane, state_dir, clock=clock)
    busy, idle = uuids(agent)
    control_plane.set_desired([attempt(5, *waiting_on(tmp_path / "go"), gpus=[busy])])
    agent.cycle()
    clock.advance(100.0)
    agent.cycle()
    heartbeat = control_plane.last_heartbeat()
    draw_w = {g["uuid"]: g["power_draw_w"] for g in heartbeat["gpus"]}
    assert draw_w[busy] > draw_w[idle]
    (report,) = control_plane.reported(5)
    assert report["energy_estimated"] is False
    assert report["energy_j"] == pytest.approx(100.0 * draw_w[busy], rel=1e-6)
    (tmp_path / "go").touch()


def test_without_an_energy_counter_the_energy_is_integrated_from_the_draw_and_marked_estimated(
    control_plane, state_dir, tmp_path
):
    clock = FakeClock()
    gpu_type, count = parse_spec("simulated:A100-SXM4-80GB:1")
    gpu = NoCounterBackend(gpu_type, count, node_name=NODE, clock=clock)
    agent = make_agent(control_plane, state_dir, gpu=gpu, clock=clock)
    control_plane.set_desired([attempt(6, *waiting_on(tmp_path / "go"), gpus=uuids(agent))])
    agent.cycle()
    agent.cycle()  # the first reading with the job's draw
    clock.advance(50.0)
    agent.cycle()
    heartbeat = control_plane.last_heartbeat()
    assert heartbeat["gpus"][0]["energy_j"] is None
    report = control_plane.reported(6)[-1]
    assert report["energy_estimated"] is True
    assert report["energy_j"] == pytest.approx(50.0 * heartbeat["gpus"][0]["power_draw_w"])
    (tmp_path / "go").touch()


def test_a_cap_is_applied_once_and_only_when_it_differs_from_the_enforced_one(
    control_plane, state_dir
):
    agent = make_agent(control_plane, state_dir)
    gpu0, gpu1 = uuids(agent)
    control_plane.set_desired(caps_w={gpu0: 300.0, gpu1: 400.0})
    agent.cycle()
    agent.cycle()
    assert agent.gpu.power_limit_writes == 1
    caps = {g["uuid"]: g["power_cap_w"] for g in control_plane.last_heartbeat()["gpus"]}
    assert caps == {gpu0: 300.0, gpu1: 400.0}
    assert control_plane.last_heartbeat()["conditions"] == []


def test_in_dry_run_caps_are_validated_but_never_written(control_plane, state_dir):
    agent = make_agent(control_plane, state_dir, power_cap_dry_run=True)
    gpu0, gpu1 = uuids(agent)
    control_plane.set_desired(caps_w={gpu0: 300.0, gpu1: 50.0})
    agent.cycle()
    agent.cycle()
    assert agent.gpu.power_limit_writes == 0
    assert agent.gpu.enforced_power_limit_w(gpu0) == 400.0
    (condition,) = control_plane.last_heartbeat()["conditions"]
    assert condition["gpu_uuid"] == gpu1 and "outside" in condition["message"]


def test_a_cap_the_gpu_refuses_becomes_a_condition_and_the_agent_carries_on(
    control_plane, state_dir
):
    gpu_type, count = parse_spec("simulated:A100-SXM4-80GB:2")
    gpu = SimulatedBackend(gpu_type, count, node_name=NODE, power_limit_settable=False)
    agent = make_agent(control_plane, state_dir, gpu=gpu)
    gpu0, gpu1 = uuids(agent)
    control_plane.set_desired(caps_w={gpu0: 300.0, gpu1: 9999.0})
    assert agent.cycle()
    assert agent.cycle()
    conditions = {c["gpu_uuid"]: c for c in control_plane.last_heartbeat()["conditions"]}
    assert conditions[gpu0]["type"] == "PowerCapFailed"
    assert "Permission" in conditions[gpu0]["message"]
    assert "outside" in conditions[gpu1]["message"]
    control_plane.set_desired(caps_w={})
    agent.cycle()
    agent.cycle()
    assert control_plane.last_heartbeat()["conditions"] == []


def test_a_lost_gpu_is_reported_unhealthy(control_plane, state_dir):
    agent = make_agent(control_plane, state_dir)
    agent.gpu.mark_lost(uuids(agent)[1])
    agent.cycle()
    health = [g["healthy"] for g in control_plane.last_heartbeat()["gpus"]]
    assert health == [True, False]


def test_logs_are_shipped_in_chunks_and_resent_from_the_last_acknowledged_offset(
    control_plane, state_dir
):
    agent = make_agent(control_plane, state_dir)
    # Over two chunks, with a multi-byte character across every chunk boundary sooner or later.
    script = "import sys; sys.stdout.write(''.join(f'line {i} é€😀\\n' for i in range(15000)))"
    control_plane.set_desired([attempt(7, sys.executable, "-c", script)])
    agent.cycle()
    ended(agent, 7)
    expected = agent.runtime.read_logs(7, 0, 10_000_000)
    assert len(expected) > 3 * 64 * 1024
    control_plane.fail_next_log_posts = 1  # the first chunk is lost on the way
    assert agent.cycle()
    # Its exit was acknowledged, but the output is not all there: it is not forgotten yet.
    assert 7 in kept_records(state_dir)
    for _ in range(5):
        agent.cycle()
    assert control_plane.logs[7] == expected
    assert control_plane.logs[7].decode("utf-8")
    assert 7 not in kept_records(state_dir)
    # Every chunk began where the control plane's stored output ended: none stored twice.
    offsets = [offset for attempt_id, offset, _ in control_plane.log_posts if attempt_id == 7]
    assert offsets == sorted(set(offsets))


def test_an_attempt_past_its_max_runtime_is_stopped_and_says_so(control_plane, state_dir):
    clock = FakeClock()
    agent = make_agent(control_plane, state_dir, clock=clock)
    control_plane.set_desired([attempt(8, "sleep", "300", max_runtime_s=60)])
    agent.cycle()
    started_at = read_child(state_dir / "process/8")["started_at"]
    clock.now_s = started_at + 61
    agent.cycle()
    ended(agent, 8)
    agent.cycle()
    report = control_plane.reported(8)[-1]
    assert report["exit_code"] == 143
    assert "max runtime" in report["message"]


def test_a_simulated_job_is_told_how_fast_its_capped_gpus_let_it_go(control_plane, state_dir):
    agent = make_agent(control_plane, state_dir)
    gpu0 = uuids(agent)[0]
    # The speed at start is in the environment; the file (which agents.simjob prefers, and
    # falls back from while it is missing) is only written once the speed changes.
    command = 'echo "$GPUCP_SIM_SPEED"; [ -e "$GPUCP_SIM_SPEED_FILE" ] || echo none; sleep 300'
    control_plane.set_desired([attempt(9, "sh", "-c", command, gpus=[gpu0])])
    agent.cycle()
    wait_until(lambda: agent.runtime.read_logs(9, 0, 100).count(b"\n") >= 2, what="speeds")
    assert agent.runtime.read_logs(9, 0, 100) == b"1.000000\nnone\n"
    control_plane.set_desired(caps_w={gpu0: 150.0})
    agent.cycle()  # applies the cap
    agent.cycle()  # publishes the new speed
    speed = float((state_dir / "attempts" / "9.speed").read_text())
    assert speed == pytest.approx(agent.gpu.progress_speed([gpu0]))
    assert speed < 0.8
    agent.runtime.stop(9, grace_s=1)


def run_in_thread(agent):
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    return thread


def test_new_work_is_picked_up_through_the_watch_not_the_next_periodic_heartbeat(
    control_plane, state_dir, tmp_path
):
    control_plane.heartbeat_interval_s = 300.0  # so only the watch can explain a quick start
    agent = make_agent(control_plane, state_dir)
    thread = run_in_thread(agent)
    try:
        wait_until(lambda: control_plane.heartbeats and control_plane.watches, what="a watch")
        heartbeats_before = len(control_plane.heartbeats)
        control_plane.set_desired([attempt(10, *waiting_on(tmp_path / "go"))])
        wait_until(lambda: runtime_state(agent, 10) is AttemptState.RUNNING, what="the new attempt")
        # ...and its exit is reported as soon as it happens, not 300 s later.
        (tmp_path / "go").touch()
        wait_until(
            lambda: any(r["state"] == "exited" for r in control_plane.reported(10)),
            what="the exit report",
        )
        assert len(control_plane.heartbeats) > heartbeats_before
    finally:
        agent.stop()
        thread.join(timeout=20)
    assert not thread.is_alive()


def test_a_change_costs_the_agent_one_watch_not_a_second_one_before_its_heartbeat(
    control_plane, state_dir, tmp_path
):
    """The control plane answers a watch at once while the node was not yet told the desired
    state: re-armed before the heartbeat that a change wakes, the watch came straight back,
    a request (and the desired state worked out) for nothing at every change."""
    control_plane.heartbeat_interval_s = 300.0
    control_plane.watch_against_last_answer = True
    agent = make_agent(control_plane, state_dir)
    thread = run_in_thread(agent)
    try:
        wait_until(lambda: control_plane.heartbeats and control_plane.watches, what="a watch")
        for n in range(3):
            watches_before = control_plane.watches
            attempts = [attempt(20 + k, *waiting_on(tmp_path / f"go-{k}")) for k in range(n + 1)]
            control_plane.set_desired(attempts)
            wait_until(
                lambda n=n: runtime_state(agent, 20 + n) is AttemptState.RUNNING,
                what=f"attempt {20 + n}",
            )
            # Whatever the start's own report does, the watch is armed again once, and waits.
            time.sleep(0.5)
            assert control_plane.watches == watches_before + 1
    finally:
        for k in range(3):
            (tmp_path / f"go-{k}").touch()
        agent.stop()
        thread.join(timeout=20)
    assert not thread.is_alive()


def test_while_heartbeats_fail_a_change_rearms_the_watch_once_per_request_timeout(
    control_plane, state_dir, tmp_path
):
    """A change the agent cannot fetch (every heartbeat fails) leaves the watch answering
    "changed" at once. The agent must go on asking, so that it learns of the change as soon as
    heartbeats work again, but at the pace of its request timeout: not in a loop of watches
    (each a request, and the desired state worked out), nor never again."""
    request_timeout_s = 1.0
    control_plane.heartbeat_interval_s = 300.0
    control_plane.watch_against_last_answer = True
    agent = make_agent(control_plane, state_dir, request_timeout_s=request_timeout_s)
    thread = run_in_thread(agent)
    go = tmp_path / "go"
    try:
        wait_until(lambda: control_plane.heartbeats and control_plane.watches, what="a watch")
        control_plane.failing_heartbeat_status = 503
        watches_before = control_plane.watches
        control_plane.set_desired([attempt(30, *waiting_on(go))])
        window_s = 4 * request_timeout_s
        time.sleep(window_s)
        rearmed = control_plane.watches - watches_before
        # About one per request timeout (4 here); a watch re-armed at once would be hundreds.
        assert 2 <= rearmed <= 2 * window_s / request_timeout_s, rearmed
        assert control_plane.heartbeats_refused >= 2  # the change did wake heartbeats
        assert runtime_state(agent, 30) is None
        # Heartbeats work again: the change is fetched and the attempt starts.
        control_plane.failing_heartbeat_status = None
        wait_until(lambda: runtime_state(agent, 30) is AttemptState.RUNNING, what="attempt 30")
        # Then the watch waits for the next change again.
        time.sleep(0.5)
        settled = control_plane.watches
        time.sleep(2 * request_timeout_s)
        assert control_plane.watches <= settled + 1
    finally:
        go.touch()
        agent.stop()
        thread.join(timeout=20)
    assert not thread.is_alive()


@pytest.mark.parametrize("flush_s", [0.5, 0.0])
def test_a_running_jobs_output_reaches_the_control_plane_between_heartbeats(
    control_plane, state_dir, tmp_path, flush_s
):
    """Someone following a log sees a line soon after it is printed, not a heartbeat later;
    with the flush turned off (0), output goes with the heartbeats only."""
    control_plane.heartbeat_interval_s = 300.0
    go, end = tmp_path / "go", tmp_path / "end"
    script = (
        f"echo first; while [ ! -e {go} ]; do sleep 0.05; done; echo second; "
        f"while [ ! -e {end} ]; do sleep 0.05; done"
    )
    agent = make_agent(control_plane, state_dir, log_flush_interval_s=flush_s)
    thread = run_in_thread(agent)
    try:
        wait_until(lambda: control_plane.heartbeats and control_plane.watches, what="a watch")
        control_plane.set_desired([attempt(12, "sh", "-c", script)])
        # Its start is reported (a heartbeat of its own), and its first line shipped with it.
        wait_until(
            lambda: any(r["state"] == "running" for r in control_plane.reported(12)),
            what="the start report",
        )
        wait_until(lambda: control_plane.logs.get(12) == b"first\n", what="the first line")
        heartbeats = len(control_plane.heartbeats)
        go.touch()
        wait_until(
            lambda: agent.runtime.read_logs(12, 0, 100) == b"first\nsecond\n", what="line two"
        )
        if flush_s:
            wait_until(
                lambda: control_plane.logs.get(12) == b"first\nsecond\n", what="line two shipped"
            )
        else:
            time.sleep(2.0)
            assert control_plane.logs.get(12) == b"first\n"
        # Either way no heartbeat went meanwhile: the line went on its own, or not at all.
        assert len(control_plane.heartbeats) == heartbeats
    finally:
        end.touch()
        go.touch()
        agent.stop()
        thread.join(timeout=20)
    assert not thread.is_alive()


def test_while_the_control_plane_is_away_jobs_keep_running_and_the_agent_backs_off(
    control_plane, state_dir, tmp_path
):
    control_plane.heartbeat_interval_s = 0.1
    agent = make_agent(control_plane, state_dir)
    control_plane.set_desired([attempt(11, *waiting_on(tmp_path / "go"))])
    thread = run_in_thread(agent)
    try:
        wait_until(
            lambda: any(r["state"] == "running" for r in control_plane.reported(11)),
            what="the job to run",
        )
        control_plane.stop()
        wait_until(lambda: agent.backoff.failures >= 4, what="several failed heartbeats")
        assert runtime_state(agent, 11) is AttemptState.RUNNING
        assert thread.is_alive()
        (tmp_path / "go").touch()  # the job ends while nobody can be told
        ended(agent, 11)
        control_plane.start()
        wait_until(
            lambda: any(r["state"] == "exited" for r in control_plane.reported(11)),
            what="the exit report after the control plane came back",
        )
        assert control_plane.reported(11)[-1]["exit_code"] == 0
        assert control_plane.logs[11] == b"done\n"
        wait_until(lambda: agent.backoff.failures == 0, what="the backoff to reset")
    finally:
        agent.stop()
        thread.join(timeout=20)
    assert not thread.is_alive()


def test_the_state_dir_holds_the_token_and_records_but_no_secret_for_jobs(control_plane, state_dir):
    agent = make_agent(control_plane, state_dir)
    control_plane.set_desired([attempt(12, "env")])
    agent.cycle()
    ended(agent, 12)
    output = agent.runtime.read_logs(12, 0, 100_000).decode()
    token = (state_dir / "node-token").read_text().strip()
    assert token not in output and control_plane.JOIN_TOKEN not in output
    assert "GPUCP_ATTEMPT_ID=12" in output
    assert oct(os.stat(state_dir / "node-token").st_mode & 0o777) == "0o600"


def test_for_a_demo_the_agent_can_stop_its_jobs_on_the_way_out(control_plane, state_dir):
    agent = make_agent(control_plane, state_dir, stop_jobs_on_exit=True)
    control_plane.set_desired([attempt(13, "sleep", "300")])
    thread = run_in_thread(agent)
    wait_until(lambda: runtime_state(agent, 13) is AttemptState.RUNNING, what="the job")
    agent.stop()
    thread.join(timeout=30)
    assert not thread.is_alive()
    (status,) = ProcessRuntime(state_dir).adopt()
    assert status.state is AttemptState.EXITED and status.exit_code == 143


def test_after_registering_anew_an_attempt_id_seen_before_can_run(control_plane, state_dir):
    # A fresh control-plane database (a new demo) numbers its attempts from 1 again.
    agent = make_agent(control_plane, state_dir)
    control_plane.set_desired([attempt(1, "true")])
    agent.cycle()
    ended(agent, 1)
    agent.cycle()
    assert agent.cycle()
    assert len(control_plane.reported(1)) == 1
    control_plane.node_tokens.clear()
    assert not agent.cycle()  # refused, registered again
    agent.cycle()
    ended(agent, 1)
    agent.cycle()
    assert [r["state"] for r in control_plane.reported(1)] == ["exited", "exited"]


@pytest.mark.parametrize("compact_at", [1000, 2])
def test_attempts_forgotten_together_are_never_started_again_by_a_restarted_agent(
    control_plane, state_dir, tmp_path, monkeypatch, compact_at
):
    # compact_at 2: the tombstone log is folded into its snapshot along the way.
    monkeypatch.setattr(daemon, "TOMBSTONE_LOG_COMPACT_AT", compact_at)
    runs = tmp_path / "runs"
    agent = make_agent(control_plane, state_dir)
    wanted = [attempt(a, "sh", "-c", f"echo {a} >> {runs}") for a in range(1, 6)]
    control_plane.set_desired(wanted)
    agent.cycle()
    for a in range(1, 6):
        ended(agent, a)
    agent.cycle()  # reported, acknowledged, forgotten in one go
    assert kept_records(state_dir) == {}
    control_plane.set_desired([*wanted, attempt(6, "sh", "-c", f"echo 6 >> {runs}")])
    agent.cycle()
    ended(agent, 6)
    agent.cycle()

    # A restarted agent given a stale answer that still lists them all starts none again.
    again = make_agent(control_plane, state_dir)
    again.cycle()
    again.cycle()
    assert sorted(runs.read_text().split()) == [str(a) for a in range(1, 7)]
    assert again.runtime.statuses() == []


def test_a_tombstone_log_cut_by_a_crash_keeps_every_whole_line(control_plane, state_dir):
    make_agent(control_plane, state_dir)  # registered: the node token is kept
    (state_dir / "finished.json").write_text(json.dumps({"1": time.time()}))
    (state_dir / "finished.log").write_text(f"2 {time.time():.3f}\n3 17")  # 3: never synced
    agent = make_agent(control_plane, state_dir)
    control_plane.set_desired([attempt(a, "true") for a in (1, 2, 4)])
    agent.cycle()
    assert runtime_state(agent, 1) is None and runtime_state(agent, 2) is None
    assert runtime_state(agent, 4) is not None
    ended(agent, 4)
    agent.cycle()
    # The next append starts on a line of its own: 4 is remembered after a restart.
    again = make_agent(control_plane, state_dir)
    again.cycle()
    assert again.runtime.statuses() == []
    assert len(control_plane.reported(4)) == 1


@pytest.mark.parametrize(
    "spec,overrides,shape",
    [
        ("simulated:H100-SXM-80GB:8", {}, (224, 8 * 256 * 1024)),
        ("simulated:H100-SXM-80GB:8", {"cpus": 96, "memory_mib": 512 * 1024}, (96, 512 * 1024)),
        ("simulated:A40:2", {}, (32, 2 * 128 * 1024)),
    ],
)
def test_a_simulated_node_reports_the_host_shape_of_its_gpus_unless_told(
    control_plane, state_dir, spec, overrides, shape
):
    gpu_type, count = parse_spec(spec)
    gpu = SimulatedBackend(gpu_type, count, node_name=NODE)
    agent = make_agent(control_plane, state_dir, gpu=gpu, **overrides)
    registration = agent.registration()
    assert (registration["cpus"], registration["memory_mib"]) == shape
