"""The two job supervisors (supervise.c, supervise.sh) keep one contract, and the compiled one
is built, kept and given up on as agents/runtime/supervisor.py says.

The contract itself is tested through the runtime with each supervisor (test_process_runtime,
test_leases); here the two are run side by side on what only they read: the lease's end, in
every form that file can take, broken ones included. At the end, the compiled one's fork
server (supervise.c --serve): what it does when it dies, when its answer is lost, when a start is
too large for it, and when its runtime goes.
"""

import gc
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agents.runtime import supervisor
from agents.runtime.base import AttemptSpec, AttemptState
from agents.runtime.process import ProcessRuntime, proc_start_ticks, read_child
from tests.agents.conftest import wait_until

with open("/proc/sys/kernel/random/boot_id") as f:
    BOOT_ID = f.read().strip()


@pytest.fixture(scope="module")
def both(tmp_path_factory) -> dict[str, tuple[str, ...]]:
    build_dir = tmp_path_factory.mktemp("bin")
    return {
        "compiled": supervisor.resolve("compiled", build_dir).argv,
        "bash": supervisor.resolve("bash", build_dir).argv,
    }


def run_supervisor(argv, folder: Path, deadline: str | None, lease: bool, command=("true",)):
    """What the supervisor decided: ("exit", code) for a job it ran, else (kind, message)."""
    folder.mkdir(exist_ok=True)
    deadline_path = folder / "lease.deadline"
    lease_path = folder / "lease.json"
    if deadline is not None:
        deadline_path.write_text(deadline)
    if lease:
        lease_path.write_text("{}")
    attempt = folder / "attempt"
    attempt.mkdir()
    read_end, write_end = os.pipe()
    try:
        done = subprocess.run(
            [*argv, attempt, deadline_path, lease_path, str(write_end), "--", *command],
            pass_fds=(write_end,),
            env={"PATH": os.environ["PATH"], "GPUCP_ATTEMPT_ID": "3"},
            capture_output=True,
            timeout=30,
            check=False,
        )
    finally:
        os.close(read_end)
        os.close(write_end)
    assert done.returncode == 0, done.stderr
    kind, _, rest = (attempt / "exit").read_text().rstrip("\n").partition(" ")
    if kind == "exit":  # exit <code> <time>
        return ("exit", int(rest.split(" ")[0]))
    return (kind, rest.partition(" ")[2])  # <kind> <time> <message>


numbers = st.one_of(
    st.integers(0, 10**6).map(str),  # centiseconds of uptime: a deadline past
    st.integers(10**10, 10**12).map(str),  # one far ahead
    st.sampled_from(["", "-5", "1e3", "12a", "0x10", "007", "+3", "1 2"]),
)
blank = st.sampled_from([" ", "\t", "  ", " \t"])
first_line = st.tuples(
    st.sampled_from([BOOT_ID, "other-boot", ""]),
    blank,
    numbers,
    blank,
    numbers,
    st.sampled_from(["", " ", "\t", " 9"]),
).map("".join)
attempt_line = st.tuples(
    st.sampled_from(["3", "4", "03", "", " 3"]), blank, numbers, st.sampled_from(["", " "])
).map("".join)
deadline_files = st.one_of(
    st.none(),
    st.tuples(
        st.sampled_from(["", "\n"]),
        first_line,
        st.lists(attempt_line, max_size=3),
        st.booleans(),
    ).map(lambda t: t[0] + "\n".join([t[1], *t[2]]) + ("\n" if t[3] else "")),
)


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(deadline=deadline_files, lease=st.booleans())
def test_both_supervisors_read_every_lease_file_alike(both, tmp_path_factory, deadline, lease):
    verdicts = {
        kind: run_supervisor(argv, tmp_path_factory.mktemp(kind), deadline, lease)
        for kind, argv in both.items()
    }
    assert verdicts["compiled"] == verdicts["bash"], (deadline, lease)


@pytest.mark.parametrize("name", ["no-such-command", "no such command", "it's-not-here", ""])
def test_both_supervisors_refuse_a_command_that_is_not_there_alike(both, tmp_path, name):
    verdicts = {
        kind: run_supervisor(argv, tmp_path / kind, None, False, command=(name,))
        for kind, argv in both.items()
    }
    assert verdicts["compiled"][0] == verdicts["bash"][0] == "failed"
    for _, message in verdicts.values():
        assert message.startswith("cannot run ") and message.endswith(": not found")


@pytest.mark.parametrize(
    "script, exit_code",
    [
        ("#!/no/such/interpreter\n", 127),  # found, but its interpreter is not: as bash says
        ("#!/etc/passwd\n", 126),  # an interpreter that cannot run
        ("exit 5\n", 5),  # no #! line: sh runs it, as from a shell
    ],
)
def test_a_command_that_is_there_but_cannot_run_exits_as_from_a_shell(
    both, tmp_path, script, exit_code
):
    program = tmp_path / "program"
    program.write_text(script)
    program.chmod(0o755)
    for kind, argv in both.items():
        assert run_supervisor(argv, tmp_path / kind, None, False, command=(str(program),)) == (
            "exit",
            exit_code,
        ), kind


@pytest.mark.parametrize("first, then", [("bash", "compiled"), ("compiled", "bash")])
def test_an_agent_of_either_supervisor_adopts_the_others_attempts(state_dir, first, then):
    runtime = ProcessRuntime(state_dir, supervisor=first)
    runtime.start(AttemptSpec(attempt_id=1, command=("sleep", "300")))
    runtime.start(AttemptSpec(attempt_id=2, command=("sh", "-c", "exit 4")))
    record = json.loads((state_dir / "process/1/record.json").read_text())
    assert record["supervisor"] == first
    wait_until(lambda: (state_dir / "process/2/exit").exists(), what="attempt 2's exit record")

    upgraded = ProcessRuntime(state_dir, supervisor=then)
    adopted = {s.attempt_id: s for s in upgraded.adopt()}
    assert adopted[1].state is AttemptState.RUNNING
    assert (adopted[2].state, adopted[2].exit_code) == (AttemptState.EXITED, 4)
    upgraded.stop(1, grace_s=30)
    status = wait_until(
        lambda: next((s for s in upgraded.statuses() if s.attempt_id == 1 and s.exit_code), None),
        what="attempt 1 to end",
    )
    assert status.exit_code == 128 + signal.SIGTERM
    upgraded.start(AttemptSpec(attempt_id=3, command=("true",)))
    assert json.loads((state_dir / "process/3/record.json").read_text())["supervisor"] == then


def test_auto_runs_bash_where_nothing_compiles_and_compiled_says_why(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(supervisor, "_built", {})
    (tmp_path / "cc").write_text(
        "#!/bin/sh\necho 'cc: error: this compiler is broken' >&2\nexit 1\n"
    )
    (tmp_path / "cc").chmod(0o755)
    monkeypatch.setattr(supervisor, "_compiler", lambda: str(tmp_path / "cc"))
    assert supervisor.resolve("auto", tmp_path / "bin").kind == "bash"
    assert "this compiler is broken" in caplog.text
    with pytest.raises(supervisor.SupervisorError, match="this compiler is broken"):
        supervisor.resolve("compiled", tmp_path / "bin")
    # Nothing half-built is left to be run later.
    assert [p.name for p in (tmp_path / "bin").iterdir() if p.name != ".build.lock"] == []

    monkeypatch.setattr(supervisor, "_compiler", lambda: None)
    assert supervisor.resolve("auto", tmp_path / "bin").kind == "bash"
    with pytest.raises(supervisor.SupervisorError, match="no C compiler"):
        supervisor.resolve("compiled", tmp_path / "bin")


def test_an_agent_that_cannot_build_its_supervisor_still_runs_jobs(state_dir, monkeypatch):
    monkeypatch.setattr(supervisor, "_built", {})
    monkeypatch.setattr(supervisor, "_compiler", lambda: None)
    runtime = ProcessRuntime(state_dir)  # auto
    runtime.start(AttemptSpec(attempt_id=1, command=("sh", "-c", "exit 3")))
    assert json.loads((state_dir / "process/1/record.json").read_text())["supervisor"] == "bash"
    status = wait_until(
        lambda: next((s for s in runtime.statuses() if s.state is AttemptState.EXITED), None),
        what="the job to end",
    )
    assert status.exit_code == 3


def test_the_build_is_kept_per_source_version_and_made_once(tmp_path, monkeypatch):
    monkeypatch.setattr(supervisor, "_built", {})
    built = supervisor.build(tmp_path / "bin")
    assert built.parent == tmp_path / "bin" and os.access(built, os.X_OK)
    made_at = built.stat().st_mtime_ns
    # A later agent (a new process: nothing remembered) takes the build that is there.
    monkeypatch.setattr(supervisor, "_built", {})
    monkeypatch.setattr(supervisor, "_compiler", lambda: pytest.fail("built again"))
    assert supervisor.build(tmp_path / "bin") == built
    assert built.stat().st_mtime_ns == made_at
    # A new version of the source gets a program of its own, beside the old one.
    monkeypatch.undo()
    monkeypatch.setattr(supervisor, "_built", {})
    source = tmp_path / "supervise.c"
    source.write_bytes(supervisor.SOURCE.read_bytes() + b"\n/* the next version */\n")
    monkeypatch.setattr(supervisor, "SOURCE", source)
    newer = supervisor.build(tmp_path / "bin")
    programs = sorted(p.name for p in (tmp_path / "bin").glob("supervise-*"))
    assert newer != built and programs == sorted([built.name, newer.name])


def test_the_compiled_supervisor_gives_the_job_every_signal_at_its_default(state_dir):
    """An ignore or a blocked mask would pass exec: a job that ignores SIGTERM outlives its
    grace, one that blocks SIGINT never sees a Ctrl-C."""
    ignored = (signal.SIGUSR1, signal.SIGPIPE, signal.SIGTERM)
    before = {sig: signal.signal(sig, signal.SIG_IGN) for sig in ignored}
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGUSR2})
    try:
        runtime = ProcessRuntime(state_dir, supervisor="compiled")
        runtime.start(AttemptSpec(attempt_id=1, command=("sleep", "300")))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        for sig, handler in before.items():
            signal.signal(sig, handler)
    pid = read_child(state_dir / "process/1")["pid"]
    wait_until(lambda: os.readlink(f"/proc/{pid}/exe").endswith("/sleep"), what="the exec")
    with open(f"/proc/{pid}/status") as f:
        masks = {
            name: int(value, 16)
            for name, value in (line.split(":") for line in f)
            if name in ("SigIgn", "SigBlk")
        }
    # The standard signals, 1-31 (32 and 33 are the C library's own: it lets no program change
    # them, and sets them in a program when it uses them).
    standard = (1 << 31) - 1
    assert (masks["SigIgn"] & standard, masks["SigBlk"] & standard) == (0, 0)
    os.killpg(pid, signal.SIGTERM)
    status = wait_until(
        lambda: next((s for s in runtime.statuses() if s.state is AttemptState.EXITED), None),
        what="the job to end",
    )
    assert status.exit_code == 128 + signal.SIGTERM


def test_agents_sharing_a_build_folder_build_it_once(tmp_path):
    """Many simulated nodes on one host start at once (the Kueue benchmark's 250): one builds
    the supervisor, the others wait for it and take it."""
    script = (
        "import sys; from pathlib import Path; from agents.runtime import supervisor; "
        "print(supervisor.build(Path(sys.argv[1])))"
    )
    compilers = tmp_path / "compilers"
    compilers.mkdir()
    # A cc that notes each build it makes, then does it.
    (tmp_path / "cc").write_text(
        f'#!/bin/sh\nmktemp -p {compilers} >/dev/null\nexec {supervisor._compiler()} "$@"\n'
    )
    (tmp_path / "cc").chmod(0o755)
    agents = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path / "shared")],
            env={**os.environ, "CC": str(tmp_path / "cc")},
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(6)
    ]
    paths = {agent.communicate(timeout=120)[0].strip() for agent in agents}
    assert all(agent.returncode == 0 for agent in agents)
    (path,) = paths
    assert os.access(path, os.X_OK)
    assert len(list(compilers.iterdir())) == 1  # the static build succeeded at the first try


def test_a_built_program_that_cannot_run_here_is_given_up_for_bash(tmp_path, monkeypatch):
    """A build folder mounted noexec, or a program that is not one: found once, at the start,
    not as a failed start of every job."""
    monkeypatch.setattr(supervisor, "_built", {})
    broken = supervisor.program_path(tmp_path)  # where this version's build is looked for
    broken.write_bytes(b"\x7fELF not really")
    broken.chmod(0o755)
    assert supervisor.resolve("auto", tmp_path).kind == "bash"
    with pytest.raises(supervisor.SupervisorError, match="does not run here"):
        supervisor.resolve("compiled", tmp_path)


@pytest.mark.usefixtures("every_supervisor")
def test_an_agent_started_with_sigchld_ignored_still_learns_the_jobs_exit_code(state_dir):
    """With SIGCHLD ignored the kernel reaps children by itself; a supervisor that kept the
    ignore would find no exit code to record."""
    before = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        runtime = ProcessRuntime(state_dir)
        runtime.start(AttemptSpec(attempt_id=1, command=("sh", "-c", "sleep 0.2; exit 7")))
    finally:
        signal.signal(signal.SIGCHLD, before)
    status = wait_until(
        lambda: next((s for s in runtime.statuses() if s.state is AttemptState.EXITED), None),
        what="the job to end",
    )
    assert status.exit_code == 7


# -- the fork server (supervise.c --serve) ----------------------------------------------------


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _gone(pid: int) -> bool:
    """Ended: no such process, or a zombie nobody reaped yet."""
    return proc_start_ticks(pid) is None


def _supervisor_pid(state_dir: Path, attempt_id: int) -> int:
    record = json.loads((state_dir / "process" / str(attempt_id) / "record.json").read_text())
    return record["supervisor_pid"]


def _waits_for(marker: Path, code: int) -> tuple[str, ...]:
    return ("sh", "-c", f"while [ ! -e {marker} ]; do sleep 0.02; done; exit {code}")


def test_served_supervisors_are_forked_by_one_server_not_by_the_agent(state_dir, tmp_path):
    runtime = ProcessRuntime(state_dir, supervisor="compiled", serve=True)
    try:
        for attempt_id in (1, 2):
            runtime.start(
                AttemptSpec(attempt_id=attempt_id, command=_waits_for(tmp_path / "go", 3))
            )
        first, second = (_parent(_supervisor_pid(state_dir, a)) for a in (1, 2))
        assert first == second != os.getpid()
        with open(f"/proc/{first}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[1] == b"--serve"
        (tmp_path / "go").touch()
        for attempt_id in (1, 2):
            status = wait_until(
                lambda a=attempt_id: next(
                    (
                        s
                        for s in runtime.statuses()
                        if s.attempt_id == a and s.exit_code is not None
                    ),
                    None,
                ),
                what=f"attempt {attempt_id} to end",
            )
            assert status.exit_code == 3
    finally:
        runtime.close()


def _ends(runtime: ProcessRuntime) -> dict[int, int]:
    statuses = runtime.statuses()
    if not statuses or any(s.state is not AttemptState.EXITED for s in statuses):
        return {}
    return {s.attempt_id: s.exit_code for s in statuses}


def test_a_killed_server_is_started_again_and_the_jobs_it_forked_still_report_their_ends(
    state_dir, tmp_path
):
    runtime = ProcessRuntime(state_dir, supervisor="compiled", serve=True)
    try:
        runtime.start(AttemptSpec(attempt_id=1, command=_waits_for(tmp_path / "go", 5)))
        server = _parent(_supervisor_pid(state_dir, 1))
        os.kill(server, signal.SIGKILL)
        wait_until(lambda: _gone(server), what="the server to die")
        # The next start finds it gone and starts another; the job of the first runs on.
        runtime.start(AttemptSpec(attempt_id=2, command=_waits_for(tmp_path / "go", 6)))
        second = _parent(_supervisor_pid(state_dir, 2))
        assert second not in (server, os.getpid()) and not _gone(second)
        assert not _gone(_supervisor_pid(state_dir, 1))
        (tmp_path / "go").touch()
        assert wait_until(lambda: _ends(runtime), what="both attempts to end") == {1: 5, 2: 6}
    finally:
        runtime.close()


class _AnswerLost:
    """The server's socket, but its answer never comes (a server killed right after the fork)."""

    def __init__(self, sock):
        self._sock = sock

    def recv(self, _size):
        raise TimeoutError("timed out")

    def __getattr__(self, name):
        return getattr(self._sock, name)


def test_a_start_whose_answer_is_lost_runs_the_job_exactly_once(state_dir, tmp_path):
    runtime = ProcessRuntime(state_dir, supervisor="compiled", serve=True)
    server = runtime._server
    assert server is not None
    count, go = tmp_path / "count", tmp_path / "go"
    try:
        server._sock = _AnswerLost(server._ensure())
        command = f"echo ran >> {count}; while [ ! -e {go} ]; do sleep 0.02; done"
        runtime.start(AttemptSpec(attempt_id=1, command=("sh", "-c", command)))
        # The server did fork a supervisor, which got no go byte and ended without starting
        # the job; the agent started it with an exec of its own instead.
        assert _parent(_supervisor_pid(state_dir, 1)) == os.getpid()
        wait_until(count.exists, what="the job to run")
        go.touch()
        assert wait_until(lambda: _ends(runtime), what="the job to end") == {1: 0}
        assert count.read_text() == "ran\n"
    finally:
        runtime.close()


def test_the_server_ends_with_its_agent_and_the_jobs_live_on(state_dir, tmp_path):
    marker = tmp_path / "go"
    agent = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, signal, sys\n"
            "from agents.runtime.base import AttemptSpec\n"
            "from agents.runtime.process import ProcessRuntime\n"
            "runtime = ProcessRuntime(sys.argv[1], supervisor='compiled', serve=True)\n"
            f"runtime.start(AttemptSpec(attempt_id=1, command={_waits_for(marker, 9)!r}))\n"
            "sup = runtime._procs[1].record['supervisor_pid']\n"
            "with open(f'/proc/{sup}/stat') as f:\n"
            "    print(f.read().rsplit(')', 1)[1].split()[1], flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n",
            str(state_dir),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert agent.returncode == -signal.SIGKILL, agent.stderr
    server = int(agent.stdout.split()[0])
    wait_until(lambda: _gone(server), what="the server to end with its agent")
    runtime = ProcessRuntime(state_dir, supervisor="compiled", serve=True)
    try:
        (adopted,) = runtime.adopt()
        assert adopted.state is AttemptState.RUNNING
        marker.touch()
        status = wait_until(
            lambda: next((s for s in runtime.statuses() if s.exit_code is not None), None),
            what="the adopted job to end",
        )
        assert status.exit_code == 9
    finally:
        runtime.close()


def test_a_start_too_large_for_the_server_runs_by_an_exec_with_all_of_its_environment(
    state_dir, tmp_path
):
    runtime = ProcessRuntime(state_dir, supervisor="compiled", serve=True)
    env = {f"V{i}": str(i) for i in range(9000)}
    count = tmp_path / "count"
    try:
        runtime.start(
            AttemptSpec(
                attempt_id=1, command=("sh", "-c", f"env | grep -c '^V' > {count}"), env=env
            )
        )
        assert wait_until(lambda: _ends(runtime), what="the job to end") == {1: 0}
        assert count.read_text() == "9000\n"
        # And the server still serves the next one.
        runtime.start(AttemptSpec(attempt_id=2, command=_waits_for(tmp_path / "go", 0)))
        assert _parent(_supervisor_pid(state_dir, 2)) != os.getpid()
        (tmp_path / "go").touch()
        assert wait_until(lambda: _ends(runtime), what="the second to end") == {1: 0, 2: 0}
    finally:
        runtime.close()


def test_a_runtime_closed_leaves_no_server_and_still_starts_by_an_exec(state_dir, tmp_path):
    runtime = ProcessRuntime(state_dir, supervisor="compiled", serve=True)
    runtime.start(AttemptSpec(attempt_id=1, command=_waits_for(tmp_path / "go", 0)))
    server = _parent(_supervisor_pid(state_dir, 1))
    runtime.close()
    assert _gone(server)
    runtime.start(AttemptSpec(attempt_id=2, command=_waits_for(tmp_path / "go", 4)))
    assert _parent(_supervisor_pid(state_dir, 2)) == os.getpid()
    (tmp_path / "go").touch()
    assert wait_until(lambda: _ends(runtime), what="both to end") == {1: 0, 2: 4}


def test_a_runtime_dropped_without_close_ends_its_server(state_dir, tmp_path):
    """And keeps none of its descriptors: tests and tools make and drop many runtimes."""
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        ProcessRuntime(state_dir, supervisor="compiled", serve=True)
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before
    runtime = ProcessRuntime(state_dir, supervisor="compiled", serve=True)
    runtime.start(AttemptSpec(attempt_id=1, command=_waits_for(tmp_path / "go", 0)))
    server = _parent(_supervisor_pid(state_dir, 1))
    del runtime
    gc.collect()
    wait_until(lambda: _gone(server), what="the server of a dropped runtime to end")
    (tmp_path / "go").touch()
    # Its job lives on, and a new runtime adopts it and learns its end.
    adopter = ProcessRuntime(state_dir, supervisor="compiled", serve=True)
    try:
        (adopted,) = adopter.adopt()
        assert wait_until(lambda: _ends(adopter), what="the job to end") == {1: 0}
    finally:
        adopter.close()
