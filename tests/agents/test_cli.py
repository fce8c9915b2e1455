"""`python -m agents`: flags and environment, and a real agent process stopped and started again."""

import os
import signal
import subprocess
import sys

import pytest

from agents.__main__ import build_parser, main
from agents.runtime.process import proc_start_ticks, read_child
from tests.agents.conftest import REPO, wait_until


def test_without_a_control_plane_url_the_agent_says_what_is_missing(capsys, monkeypatch):
    monkeypatch.delenv("GPUCP_URL", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["--runtime", "process"])
    assert exit_info.value.code == 2
    assert "GPUCP_URL" in capsys.readouterr().err


def test_flags_default_to_the_environment(monkeypatch):
    monkeypatch.setenv("GPUCP_URL", "http://cp.example:8000")
    monkeypatch.setenv("GPUCP_RUNTIME", "process")
    monkeypatch.setenv("GPUCP_GPU_BACKEND", "simulated:V100-SXM2-32GB:4")
    monkeypatch.setenv("GPUCP_HEARTBEAT_INTERVAL_S", "2.5")
    monkeypatch.setenv("GPUCP_LABELS", "rack=a1,zone=eu")
    args = build_parser().parse_args(["--label", "row=3"])
    assert args.url == "http://cp.example:8000"
    assert args.runtime == "process"
    assert args.gpu_backend == "simulated:V100-SXM2-32GB:4"
    assert args.heartbeat_interval_s == 2.5
    assert args.label == ["rack=a1,zone=eu", "row=3"]


def test_a_job_path_prepend_comes_from_the_environment_and_is_refused_for_containers(
    monkeypatch, state_dir, caplog
):
    monkeypatch.setenv("GPUCP_JOB_PATH_PREPEND", "/opt/agent/bin")
    assert build_parser().parse_args([]).job_path_prepend == "/opt/agent/bin"
    code = main(
        [
            "--url",
            "http://127.0.0.1:1",
            "--runtime",
            "docker",
            "--gpu-backend",
            "simulated:A100-SXM4-80GB:1",
            "--state-dir",
            str(state_dir),
        ]
    )
    assert code == 2
    assert "process runtime only" in caplog.text


def test_the_short_spellings_of_the_url_and_the_name_are_accepted():
    args = build_parser().parse_args(["--server", "http://cp:8000", "--name", "sim-node-1"])
    assert (args.url, args.node_name) == ("http://cp:8000", "sim-node-1")


def test_a_malformed_label_is_refused(capsys, state_dir):
    with pytest.raises(SystemExit) as exit_info:
        main(["--url", "http://127.0.0.1:1", "--label", "no-equals-sign"])
    assert exit_info.value.code == 2
    assert "key=value" in capsys.readouterr().err


def test_without_a_node_token_or_a_join_token_the_agent_exits_with_a_reason(
    state_dir, monkeypatch, caplog
):
    monkeypatch.delenv("GPUCP_JOIN_TOKEN", raising=False)
    code = main(
        [
            "--url",
            "http://127.0.0.1:1",
            "--runtime",
            "process",
            "--gpu-backend",
            "simulated:A100-SXM4-80GB:1",
            "--state-dir",
            str(state_dir),
        ]
    )
    assert code == 2
    assert "no join token" in caplog.text


def start_agent(control_plane, state_dir, *extra):
    env = {
        **os.environ,
        "GPUCP_URL": control_plane.url,
        "GPUCP_JOIN_TOKEN": control_plane.JOIN_TOKEN,
        "GPUCP_STATE_DIR": str(state_dir),
        "PYTHONPATH": str(REPO),
    }
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agents",
            "--runtime",
            "process",
            "--gpu-backend",
            "simulated:A100-SXM4-80GB:2",
            "--node-name",
            "cli-node",
            "--label",
            "rack=a1",
            *extra,
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


SIMJOB_ATTEMPT = {
    "attempt_id": 41,
    "job_id": 4,
    "image": "",
    "command": ["python", "-m", "agents.simjob", "--work-s", "0.1", "--step-s", "0.05"],
    "env": {},
    "gpu_uuids": [],
    "cpus": 1.0,
    "memory_mib": 64,
    "max_runtime_s": None,
}


@pytest.mark.slow
def test_an_agent_told_to_put_its_bin_first_runs_the_demo_job_on_a_system_path(
    control_plane, state_dir, monkeypatch
):
    # `make run` starts agents with the venv's python but a PATH without the venv on it.
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    control_plane.heartbeat_interval_s = 0.3
    control_plane.set_desired([SIMJOB_ATTEMPT])
    agent = start_agent(
        control_plane, state_dir, "--job-path-prepend", os.path.dirname(sys.executable)
    )
    try:
        ended = wait_until(
            lambda: [r for r in control_plane.reported(41) if r["state"] != "running"],
            timeout_s=60,
            what="the demo job to end",
        )
        assert (ended[-1]["state"], ended[-1]["exit_code"]) == ("exited", 0), ended[-1]
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
        if agent.stdout is not None:
            agent.stdout.close()


@pytest.mark.slow
def test_sigterm_stops_the_agent_and_leaves_its_job_running_for_the_next_start(
    control_plane, state_dir, tmp_path
):
    control_plane.heartbeat_interval_s = 0.3
    marker = tmp_path / "go"
    control_plane.set_desired(
        [
            {
                "attempt_id": 31,
                "job_id": 3,
                "image": "",
                "command": ["sh", "-c", f"echo up; while [ ! -e {marker} ]; do sleep 0.05; done"],
                "env": {},
                "gpu_uuids": [],
                "cpus": 1.0,
                "memory_mib": 64,
                "max_runtime_s": None,
            }
        ]
    )
    agent = start_agent(control_plane, state_dir)
    try:
        wait_until(
            lambda: any(r["state"] == "running" for r in control_plane.reported(31)),
            timeout_s=60,
            what="the agent to run the job",
        )
        (registered,) = control_plane.registrations
        assert registered["labels"] == {"rack": "a1"} and len(registered["gpus"]) == 2
        agent.send_signal(signal.SIGTERM)
        output, _ = agent.communicate(timeout=30)
        assert agent.returncode == 0, output
    finally:
        if agent.poll() is None:
            agent.kill()
    child = read_child(state_dir / "process" / "31")
    assert proc_start_ticks(child["pid"]) == child["start_ticks"], "the job died with the agent"

    reports_before = len(control_plane.reported(31))
    again = start_agent(control_plane, state_dir)
    try:
        wait_until(
            lambda: len(control_plane.reported(31)) > reports_before,
            timeout_s=60,
            what="the restarted agent to report the job",
        )
        assert control_plane.reported(31)[-1]["state"] == "running"
        assert len(control_plane.registrations) == 1  # the kept node token was reused
        marker.touch()
        wait_until(
            lambda: control_plane.reported(31)[-1]["state"] == "exited",
            timeout_s=60,
            what="the exit report",
        )
        assert control_plane.reported(31)[-1]["exit_code"] == 0
        wait_until(lambda: control_plane.logs.get(31) == b"up\n", what="the job's output")
    finally:
        again.send_signal(signal.SIGTERM)
        try:
            again.wait(timeout=30)
        except subprocess.TimeoutExpired:
            again.kill()
    assert again.returncode == 0


def test_the_advertise_address_and_job_ports_come_from_flags_or_the_environment(monkeypatch):
    monkeypatch.setenv("GPUCP_ADVERTISE_ADDRESS", "10.1.2.3")
    monkeypatch.setenv("GPUCP_JOB_PORT_RANGE", "31000-31010")
    args = build_parser().parse_args([])
    assert (args.advertise_address, args.job_port_range) == ("10.1.2.3", (31000, 31010))
    args = build_parser().parse_args(["--job-port-range", "29500-29999"])
    assert args.job_port_range == (29500, 29999)


@pytest.mark.parametrize("value", ["29999-29500", "0-10", "29500", "a-b", "29500-70000"])
def test_a_job_port_range_that_is_not_low_high_ports_is_refused(capsys, value):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--job-port-range", value])
    assert "--job-port-range" in capsys.readouterr().err
