"""The process runtime: real child processes, real signals, a real restart of the runtime."""

import json
import os
import signal
import sys

import pytest

from agents.runtime.base import AttemptSpec, AttemptState, StartError
from agents.runtime.process import LOST_EXIT_CODE, ProcessRuntime, proc_start_ticks
from tests.agents.conftest import wait_until


def spec(attempt_id, *command, **kwargs):
    return AttemptSpec(attempt_id=attempt_id, command=tuple(command), **kwargs)


def ended(runtime, attempt_id):
    def check():
        for status in runtime.statuses():
            if status.attempt_id == attempt_id and status.state is not AttemptState.RUNNING:
                return status
        return None

    return wait_until(check, what=f"attempt {attempt_id} to end")


def test_a_command_runs_with_only_its_gpus_visible_and_its_output_is_captured(state_dir):
    runtime = ProcessRuntime(state_dir)
    started = runtime.start(
        spec(
            11,
            "sh",
            "-c",
            'echo "gpus=$CUDA_VISIBLE_DEVICES nv=$NVIDIA_VISIBLE_DEVICES '
            'attempt=$GPUCP_ATTEMPT_ID job=$GPUCP_JOB_ID epochs=$EPOCHS"; echo oops >&2',
            job_id=5,
            env={"EPOCHS": "3"},
            gpu_uuids=("GPU-1", "GPU-2"),
        )
    )
    assert started.started_at is not None
    status = ended(runtime, 11)
    assert status.state is AttemptState.EXITED and status.exit_code == 0
    assert status.logs_complete
    assert status.job_id == 5 and status.gpu_uuids == ("GPU-1", "GPU-2")
    output = runtime.read_logs(11, 0, 10_000).decode()
    assert "gpus=GPU-1,GPU-2 nv=GPU-1,GPU-2 attempt=11 job=5 epochs=3" in output
    assert "oops" in output
    assert runtime.read_logs(11, 4, 3) == output.encode()[4:7]


def test_an_attempt_without_gpus_sees_none(state_dir):
    runtime = ProcessRuntime(state_dir)
    runtime.start(spec(1, "sh", "-c", 'echo "[$CUDA_VISIBLE_DEVICES] [$NVIDIA_VISIBLE_DEVICES]"'))
    ended(runtime, 1)
    assert runtime.read_logs(1, 0, 100) == b"[] [void]\n"


def test_the_agents_own_secrets_do_not_reach_the_job(state_dir, monkeypatch):
    monkeypatch.setenv("GPUCP_JOIN_TOKEN", "gcpj_secret")
    monkeypatch.setenv("GPUCP_URL", "http://cp")
    runtime = ProcessRuntime(state_dir)
    runtime.start(spec(1, "env"))
    ended(runtime, 1)
    output = runtime.read_logs(1, 0, 100_000).decode()
    assert "gcpj_secret" not in output and "GPUCP_URL" not in output
    assert "GPUCP_ATTEMPT_ID=1" in output


SYSTEM_PATH = "/usr/bin:/bin"  # what `make run` and a systemd unit give an agent: no virtualenv


def test_a_job_runs_the_agents_own_python_when_the_operator_puts_its_bin_first(
    state_dir, monkeypatch
):
    monkeypatch.setenv("PATH", SYSTEM_PATH)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    agent_bin = os.path.dirname(sys.executable)
    runtime = ProcessRuntime(state_dir, job_path_prepend=(agent_bin,))
    runtime.start(spec(1, "python", "-m", "agents.simjob", "--work-s", "0.1", "--step-s", "0.05"))
    status = ended(runtime, 1)
    output = runtime.read_logs(1, 0, 100_000).decode()
    assert (status.state, status.exit_code) == (AttemptState.EXITED, 0), output
    assert "done: 0.1 s of work" in output
    runtime.start(spec(2, "sh", "-c", 'echo "$PATH"'))
    ended(runtime, 2)
    assert runtime.read_logs(2, 0, 1000).decode() == f"{agent_bin}:{SYSTEM_PATH}\n"


def test_without_a_path_prepend_a_job_gets_the_agents_path_unchanged(state_dir, monkeypatch):
    monkeypatch.setenv("PATH", SYSTEM_PATH)
    runtime = ProcessRuntime(state_dir)
    runtime.start(spec(1, "sh", "-c", 'echo "$PATH"'))
    ended(runtime, 1)
    assert runtime.read_logs(1, 0, 1000).decode() == f"{SYSTEM_PATH}\n"


def test_a_relative_path_prepend_is_refused(state_dir):
    # The job runs in its own work folder: a relative entry would run what the job wrote there.
    with pytest.raises(ValueError, match="must be absolute"):
        ProcessRuntime(state_dir, job_path_prepend=("bin",))


@pytest.mark.parametrize(
    "command, exit_code",
    [
        ("exit 0", 0),
        ("exit 3", 3),
        ("kill -TERM $$", 128 + signal.SIGTERM),
        ("kill -KILL $$", 128 + signal.SIGKILL),
    ],
)
def test_exit_codes_are_reported_as_a_shell_or_a_container_would(state_dir, command, exit_code):
    runtime = ProcessRuntime(state_dir)
    runtime.start(spec(1, "sh", "-c", command))
    status = ended(runtime, 1)
    assert status.state is AttemptState.EXITED
    assert status.exit_code == exit_code
    assert status.finished_at >= status.started_at


def test_a_command_that_does_not_exist_fails_to_start_and_says_why(state_dir):
    runtime = ProcessRuntime(state_dir)
    status = runtime.start(spec(1, "no-such-command-here"))
    assert status.state is AttemptState.FAILED_TO_START
    assert status.exit_code is None
    assert "no-such-command-here" in status.message
    assert "no-such-command-here" in runtime.read_logs(1, 0, 1000).decode()
    with pytest.raises(StartError, match="needs a command"):
        runtime.start(AttemptSpec(attempt_id=2, image="busybox"))


def test_the_same_attempt_is_never_started_twice(state_dir):
    runtime = ProcessRuntime(state_dir)
    runtime.start(spec(1, "true"))
    with pytest.raises(StartError, match="already"):
        runtime.start(spec(1, "true"))


def _group_members(pgid):
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid and proc_start_ticks(int(entry)) is not None:
                    members.append(int(entry))
            except (ProcessLookupError, PermissionError):
                pass
    return members


def test_stop_terminates_the_whole_process_group(state_dir):
    runtime = ProcessRuntime(state_dir)
    runtime.start(spec(1, "sh", "-c", "sleep 300 & sleep 300 & wait"))
    child = wait_until(
        lambda: json.loads((state_dir / "process/1/child.json").read_text()),
        what="the job's pid",
    )
    pgid = child["pid"]
    wait_until(lambda: len(_group_members(pgid)) >= 3, what="the job and its two sleeps")
    runtime.stop(1, grace_s=30)
    status = ended(runtime, 1)
    assert status.exit_code == 128 + signal.SIGTERM
    wait_until(lambda: _group_members(pgid) == [], what="every process of the group to end")


def test_a_job_that_ignores_sigterm_is_killed_after_the_grace_period(state_dir):
    runtime = ProcessRuntime(state_dir)
    runtime.start(spec(1, "sh", "-c", "trap 'echo got TERM' TERM; while :; do sleep 0.1; done"))
    wait_until(lambda: (state_dir / "process/1/child.json").exists(), what="the job's pid")
    runtime.stop(1, grace_s=0.5)
    status = ended(runtime, 1)
    assert status.exit_code == 137
    assert b"got TERM" in runtime.read_logs(1, 0, 1000)


def test_a_restarted_runtime_adopts_a_live_process_and_reports_its_exit(state_dir):
    first = ProcessRuntime(state_dir)
    marker = state_dir / "go"
    first.start(
        spec(
            7,
            "sh",
            "-c",
            f"echo started; while [ ! -e {marker} ]; do sleep 0.05; done; exit 42",
            gpu_uuids=("GPU-x",),
            job_id=3,
        )
    )
    del first  # the agent died; its supervisor and job did not

    second = ProcessRuntime(state_dir)
    (adopted,) = second.adopt()
    assert adopted.attempt_id == 7 and adopted.state is AttemptState.RUNNING
    assert adopted.job_id == 3 and adopted.gpu_uuids == ("GPU-x",)
    marker.touch()
    status = ended(second, 7)
    assert status.exit_code == 42
    assert second.read_logs(7, 0, 100) == b"started\n"


def test_an_exit_while_no_agent_was_running_is_still_reported_with_its_code(state_dir):
    first = ProcessRuntime(state_dir)
    first.start(spec(8, "sh", "-c", "exit 9"))
    wait_until(lambda: (state_dir / "process/8/exit.json").exists(), what="the exit file")
    del first

    (adopted,) = ProcessRuntime(state_dir).adopt()
    assert adopted.state is AttemptState.EXITED and adopted.exit_code == 9


def test_a_reused_pid_is_not_taken_for_the_attempts_supervisor(state_dir):
    # A record whose pid is alive again but as another process (this test's own): the start
    # time does not match, so the attempt is reported ended, and nothing is signalled.
    attempt_dir = state_dir / "process" / "5"
    attempt_dir.mkdir(parents=True)
    record = {
        "attempt_id": 5,
        "job_id": 1,
        "gpu_uuids": [],
        "supervisor_pid": os.getpid(),
        "supervisor_start_ticks": (proc_start_ticks(os.getpid()) or 0) + 12345,
    }
    (attempt_dir / "record.json").write_text(json.dumps(record))
    (status,) = ProcessRuntime(state_dir).adopt()
    assert status.state is AttemptState.EXITED
    assert status.exit_code == LOST_EXIT_CODE
    assert "vanished" in status.message


def test_remove_forgets_the_attempt_and_its_files(state_dir):
    runtime = ProcessRuntime(state_dir)
    runtime.start(spec(1, "true"))
    ended(runtime, 1)
    runtime.remove(1)
    assert runtime.statuses() == []
    assert not (state_dir / "process" / "1").exists()
    assert ProcessRuntime(state_dir).adopt() == []
