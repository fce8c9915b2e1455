"""The process runtime: real child processes, real signals, a real restart of the runtime."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from agents.runtime.base import AttemptSpec, AttemptState, StartError
from agents.runtime.process import (
    LOST_EXIT_CODE,
    ProcessRuntime,
    handle_ignored_stop_signals,
    proc_start_ticks,
    read_child,
    read_exit,
)
from tests.agents.conftest import wait_until

# Every test here runs with both supervisors: they keep one contract.
pytestmark = pytest.mark.usefixtures("every_supervisor")


def spec(attempt_id, *command, **kwargs):
    return AttemptSpec(attempt_id=attempt_id, command=tuple(command), **kwargs)


def job_pid(state_dir, attempt_id):
    """The job's pid (its process group) once its supervisor wrote it."""
    child = wait_until(
        lambda: read_child(state_dir / "process" / str(attempt_id)),
        what="the job's pid",
    )
    return child["pid"]


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
    pgid = job_pid(state_dir, 1)
    wait_until(lambda: len(_group_members(pgid)) >= 3, what="the job and its two sleeps")
    runtime.stop(1, grace_s=30)
    status = ended(runtime, 1)
    assert status.exit_code == 128 + signal.SIGTERM
    wait_until(lambda: _group_members(pgid) == [], what="every process of the group to end")


def test_a_job_that_ignores_sigterm_is_killed_after_the_grace_period(state_dir):
    runtime = ProcessRuntime(state_dir)
    runtime.start(
        spec(1, "sh", "-c", "trap 'echo got TERM' TERM; echo ready; while :; do sleep 0.1; done")
    )
    wait_until(lambda: b"ready" in runtime.read_logs(1, 0, 1000), what="the job's trap")
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


def test_the_runtime_says_at_once_that_an_attempt_ended_started_or_adopted(state_dir):
    # The agent reports an exit when the runtime calls back, not at its next poll: nobody
    # polls here, and each callback must come by itself once its job ended.
    import threading

    release = state_dir / "go"
    waiting = f"while [ ! -e {release} ]; do sleep 0.05; done"
    first = ProcessRuntime(state_dir)
    first.start(spec(21, "sh", "-c", f"{waiting}; exit 3"))
    del first  # the agent died; the job's supervisor did not

    runtime = ProcessRuntime(state_dir)
    ended_event = threading.Event()
    runtime.notify_exits(ended_event.set)
    runtime.adopt()
    runtime.start(spec(22, "sh", "-c", "exit 4"))
    assert ended_event.wait(30), "no callback for a started attempt's exit"
    ended_event.clear()
    release.touch()
    assert ended_event.wait(30), "no callback for an adopted attempt's exit"
    codes = {s.attempt_id: s.exit_code for s in runtime.statuses()}
    assert codes == {21: 3, 22: 4}
    runtime.close()


def test_an_agent_holding_more_than_a_thousand_descriptors_still_starts_attempts(state_dir):
    # A long-lived agent (or a test process) may hold more descriptors than select() takes.
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.fail(f"the descriptor limit ({hard}) is below what this test needs")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        runtime = ProcessRuntime(state_dir)
        started = runtime.start(spec(31, "sh", "-c", "exit 5"))
        assert started.state is not AttemptState.FAILED_TO_START
        assert ended(runtime, 31).exit_code == 5
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_an_exit_while_no_agent_was_running_is_still_reported_with_its_code(state_dir):
    first = ProcessRuntime(state_dir)
    first.start(spec(8, "sh", "-c", "exit 9"))
    wait_until(lambda: read_exit(state_dir / "process/8", text=True), what="the exit record")
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
    # Its files go in the background, soon.
    deadline = time.monotonic() + 10
    while any((state_dir / "process-trash").iterdir()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any((state_dir / "process-trash").iterdir())


def test_whatever_a_job_left_in_its_folder_goes_with_it_and_nothing_outside(state_dir, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("mine")
    runtime = ProcessRuntime(state_dir)
    script = (
        "mkdir -p a/b/c && echo x > a/b/c/f && chmod 0400 a/b/c/f && touch top"
        f" && ln -s {outside} link && ln -s {outside}/keep filelink && mkdir empty"
    )
    runtime.start(spec(1, "sh", "-c", script))
    assert ended(runtime, 1).exit_code == 0
    runtime.remove(1)
    runtime.start(spec(2, "true"))  # the plain case: records, output, an empty work folder
    ended(runtime, 2)
    runtime.remove(2)
    wait_until(
        lambda: not any((state_dir / "process-trash").iterdir()), what="the trash to be emptied"
    )
    assert (outside / "keep").read_text() == "mine"


def test_what_a_crash_left_in_the_trash_is_deleted_by_the_next_agent(state_dir):
    left = state_dir / "process-trash" / "7-123"
    (left / "work").mkdir(parents=True)
    (left / "output.log").write_text("old")
    runtime = ProcessRuntime(state_dir)
    deadline = time.monotonic() + 10
    while left.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not left.exists()
    assert runtime.adopt() == []


# --- the supervisor's promises ---------------------------------------------------------------

AGENT_THEN_KILL9 = """
import os, signal, sys
from agents.runtime.base import AttemptSpec
from agents.runtime.process import ProcessRuntime
runtime = ProcessRuntime(sys.argv[1])
runtime.start(AttemptSpec(attempt_id=1, job_id=3, gpu_uuids=("GPU-x",), command=(
    "sh", "-c", f"echo started; while [ ! -e {sys.argv[2]} ]; do sleep 0.05; done; exit 42")))
runtime.start(AttemptSpec(attempt_id=2, command=("sh", "-c", "sleep 0.3; kill -USR1 $$")))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_jobs_outlive_an_agent_killed_with_sigkill_and_a_new_one_learns_every_exit_code(
    state_dir, tmp_path
):
    marker = tmp_path / "go"
    agent = subprocess.run(
        [sys.executable, "-c", AGENT_THEN_KILL9, str(state_dir), str(marker)], check=False
    )
    assert agent.returncode == -signal.SIGKILL
    # Attempt 2 ends (by a signal) while no agent runs at all.
    wait_until(lambda: read_exit(state_dir / "process/2", text=True), what="attempt 2 to end")

    runtime = ProcessRuntime(state_dir)
    adopted = {s.attempt_id: s for s in runtime.adopt()}
    assert adopted[1].state is AttemptState.RUNNING
    assert (adopted[1].job_id, adopted[1].gpu_uuids) == (3, ("GPU-x",))
    assert adopted[2].state is AttemptState.EXITED
    assert adopted[2].exit_code == 128 + signal.SIGUSR1
    marker.touch()
    assert ended(runtime, 1).exit_code == 42
    assert runtime.read_logs(1, 0, 100) == b"started\n"


def test_a_stop_right_after_the_start_reaches_the_job(state_dir):
    runtime = ProcessRuntime(state_dir)
    runtime.start(spec(1, "sleep", "300"))
    runtime.stop(1, grace_s=30)
    assert ended(runtime, 1).exit_code == 128 + signal.SIGTERM


def _handled_signals(pid):
    """The stop signals the process ignores or catches (instead of their default action)."""
    with open(f"/proc/{pid}/status") as f:
        masks = dict(line.split(":\t") for line in f.read().splitlines() if line.startswith("Sig"))
    changed = int(masks["SigIgn"], 16) | int(masks["SigCgt"], 16)
    stops = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    return [s.name for s in stops if changed & (1 << (s - 1))]


@pytest.mark.parametrize("agent_ignores", [(), (signal.SIGHUP,), (signal.SIGTERM, signal.SIGINT)])
def test_the_job_gets_default_stop_signals_while_its_supervisor_lives_through_them(
    state_dir, agent_ignores
):
    # An agent under nohup ignores SIGHUP; what the job gets must not depend on that.
    before = {sig: signal.signal(sig, signal.SIG_IGN) for sig in agent_ignores}
    try:
        runtime = ProcessRuntime(state_dir)
        runtime.start(spec(1, "sleep", "300"))
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    pid = job_pid(state_dir, 1)
    wait_until(lambda: os.readlink(f"/proc/{pid}/exe").endswith("/sleep"), what="the exec")
    assert _handled_signals(pid) == []
    supervisor = json.loads((state_dir / "process/1/record.json").read_text())["supervisor_pid"]
    for _ in range(20):  # in bursts, as a signal that cuts a wait short could lose the code
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            os.kill(supervisor, sig)
    os.killpg(pid, signal.SIGTERM)
    status = ended(runtime, 1)
    assert (status.state, status.exit_code) == (AttemptState.EXITED, 128 + signal.SIGTERM)


def test_a_stopped_job_is_not_taken_for_an_ended_one(state_dir):
    runtime = ProcessRuntime(state_dir)
    runtime.start(spec(1, "sleep", "300"))
    pid = job_pid(state_dir, 1)
    os.killpg(pid, signal.SIGSTOP)
    wait_until(lambda: open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "T")
    os.killpg(pid, signal.SIGCONT)
    (status,) = runtime.statuses()
    assert status.state is AttemptState.RUNNING
    os.killpg(pid, signal.SIGKILL)
    assert ended(runtime, 1).exit_code == 128 + signal.SIGKILL


@pytest.mark.parametrize("adopted", [False, True])
def test_a_killed_supervisor_is_reported_lost_and_its_job_killed(state_dir, adopted):
    runtime = ProcessRuntime(state_dir)
    runtime.start(spec(1, "sh", "-c", "sleep 300 & sleep 300"))
    pgid = job_pid(state_dir, 1)
    wait_until(lambda: len(_group_members(pgid)) >= 2, what="the job and its child")
    supervisor = json.loads((state_dir / "process/1/record.json").read_text())["supervisor_pid"]
    os.kill(supervisor, signal.SIGKILL)
    if adopted:
        runtime.statuses()  # reaps the supervisor this runtime started, as an agent's poll does
        runtime = ProcessRuntime(state_dir)
        runtime.adopt()
    status = ended(runtime, 1)
    assert (status.exit_code, status.logs_complete) == (LOST_EXIT_CODE, True)
    assert "vanished" in status.message
    wait_until(lambda: _group_members(pgid) == [], what="the job's group to be killed")
    # The verdict is on disk: a later agent reports the same.
    (again,) = ProcessRuntime(state_dir).adopt()
    assert again.exit_code == LOST_EXIT_CODE


def _old_attempt(state_dir, attempt_id, supervisor_pid, job_pid=None):
    """An attempt folder as the former Python supervisor (supervise.py) left it."""
    folder = state_dir / "process" / str(attempt_id)
    folder.mkdir(parents=True)
    record = {
        "attempt_id": attempt_id,
        "job_id": 40 + attempt_id,
        "gpu_uuids": ["GPU-old"],
        "command": ["sleep", "300"],
        "supervisor_pid": supervisor_pid,
        "supervisor_start_ticks": proc_start_ticks(supervisor_pid),
        "created_at": 1.0,
    }
    (folder / "record.json").write_text(json.dumps(record))
    if job_pid is not None:
        child = {"pid": job_pid, "start_ticks": proc_start_ticks(job_pid), "started_at": 2.0}
        (folder / "child.json").write_text(json.dumps(child))
    return folder


def test_attempts_of_the_former_python_supervisor_are_still_adopted(state_dir):
    ended_folder = _old_attempt(state_dir, 1, supervisor_pid=os.getpid())
    (ended_folder / "record.json").write_text(
        json.dumps({**json.loads((ended_folder / "record.json").read_text()), "supervisor_pid": 0})
    )
    (ended_folder / "exit.json").write_text(json.dumps({"exit_code": 3, "finished_at": 5.0}))
    supervisor = subprocess.Popen(["sleep", "300"], start_new_session=True)
    job = subprocess.Popen(["sleep", "300"], process_group=0)
    try:
        running_folder = _old_attempt(state_dir, 2, supervisor.pid, job_pid=job.pid)
        runtime = ProcessRuntime(state_dir)
        adopted = {s.attempt_id: s for s in runtime.adopt()}
        assert (adopted[1].state, adopted[1].exit_code) == (AttemptState.EXITED, 3)
        assert adopted[2].state is AttemptState.RUNNING
        assert (adopted[2].job_id, adopted[2].gpu_uuids, adopted[2].started_at) == (
            42,
            ("GPU-old",),
            2.0,
        )
        assert runtime.running_attempts() == [2]  # what the fence sees
        runtime.stop(2, grace_s=30)
        assert job.wait(timeout=20) == -signal.SIGTERM
        # The old supervisor writes its exit record and goes.
        (running_folder / "exit.json").write_text(json.dumps({"exit_code": 143, "finished_at": 6}))
        supervisor.kill()
        supervisor.wait()
        assert ended(runtime, 2).exit_code == 143
    finally:
        for process in (supervisor, job):
            process.kill()
            process.wait()


def test_the_jobs_environment_reaches_it_unchanged_through_the_supervisor(state_dir):
    # Names a shell supervisor might use for itself, and settings that change how bash runs.
    env = {
        name: f"mine-{name}"
        for name in ("dir", "lease", "deadline", "uptime", "job", "status", "ticks", "stat")
    }
    env.update({"POSIXLY_CORRECT": "1", "BASH_ENV": "/dev/null/x"})
    runtime = ProcessRuntime(state_dir)
    runtime.start(spec(1, "env", env=env))
    status = ended(runtime, 1)
    assert (status.state, status.exit_code) == (AttemptState.EXITED, 0)
    lines = runtime.read_logs(1, 0, 100_000).decode().splitlines()
    assert {f"{k}={v}" for k, v in env.items()} <= set(lines)


def test_a_fence_of_the_former_version_still_finds_and_stops_new_jobs(state_dir):
    # Through an upgrade the old fence lives on while jobs run; it reads child.json as JSON,
    # takes a pid whose start ticks match for a running job, and signals its group.
    runtime = ProcessRuntime(state_dir)
    runtime.start(spec(1, "sleep", "300"))
    child = json.loads((state_dir / "process/1/child.json").read_text())
    assert proc_start_ticks(child["pid"]) == child["start_ticks"]
    assert not (state_dir / "process/1/exit.json").exists()
    os.killpg(child["pid"], signal.SIGKILL)
    assert ended(runtime, 1).exit_code == 128 + signal.SIGKILL


def test_an_agent_started_with_stop_signals_ignored_starts_jobs_without_a_python_step(
    state_dir, monkeypatch
):
    """nohup ignores SIGHUP, a shell's background job SIGINT and SIGQUIT. The agent makes those
    ignores do-nothing handlers: it still lives through them, exec gives every job the
    defaults, and no job's start forks the agent to run Python before the exec."""
    ignored = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT)
    before = {sig: signal.signal(sig, signal.SIG_IGN) for sig in ignored}
    popens = []
    real_popen = subprocess.Popen

    def popen(*args, **kwargs):
        popens.append(kwargs.get("preexec_fn"))
        return real_popen(*args, **kwargs)

    try:
        handle_ignored_stop_signals()
        for sig in ignored:
            os.kill(os.getpid(), sig)  # the test process (the agent here) lives on
        runtime = ProcessRuntime(state_dir)  # its making may build and try the supervisor
        monkeypatch.setattr(subprocess, "Popen", popen)
        runtime.start(spec(1, "sleep", "300"))
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert popens == [None]
    pid = job_pid(state_dir, 1)
    wait_until(lambda: os.readlink(f"/proc/{pid}/exe").endswith("/sleep"), what="the exec")
    assert _handled_signals(pid) == []
    with open(f"/proc/{pid}/status") as f:
        ignores = int(next(x for x in f if x.startswith("SigIgn")).split()[1], 16)
    assert not ignores & (1 << (signal.SIGQUIT - 1))
    os.killpg(pid, signal.SIGTERM)
    assert ended(runtime, 1).exit_code == 128 + signal.SIGTERM
