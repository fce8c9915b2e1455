"""Attempts as plain child processes, for bare-metal hosts and the embedded mode.

Each attempt gets a folder `<state-dir>/process/<attempt-id>/` with its record (the supervisor's
pid and start time, which guard against a reused pid), the job's pid, its output and, once it
ended, its exit code, so an agent restarted while jobs run re-adopts them and still learns the
exit code of those that ended while it was down. Once its end is acknowledged, the folder is
renamed into `<state-dir>/process-trash/` and deleted there by a thread (_Trash).

The supervisor is `supervise.c`, built once by the agent with the host's C compiler, or where
there is none `supervise.sh`, run by `bash -p` (no startup files, no functions from the
environment); agents/runtime/supervisor.py picks. A Python interpreter per attempt cost tens
of milliseconds of CPU per job, bash about 2 ms more than the compiled one, and an exec of the
compiled one about 0.6 ms more than a fork of it: the compiled one runs once as this runtime's
fork server (supervise.c --serve, _ForkServer), which forks each attempt's supervisor, and an
exec is what a start falls back on when the server cannot make one. Both keep the same
contract and write the same records, so either adopts the other's attempts. Between the agent
and the job the supervisor is the one process that keeps every promise of the runtime:

- it runs in a session of its own (a Ctrl-C or SIGTERM to the agent's group never reaches it),
  and starts the job in a process group of its own (made before it goes on: bash's job control,
  or setpgid in both the job and the compiled supervisor), so a stop reaches everything the job
  spawned and nothing else;
- it is the job's parent and outlives the agent: it writes the job's pid and start time to
  `child.json` (as the former Python supervisor did, so that a fence of the former version,
  which lives on through an upgrade while jobs run, still finds the new jobs) and, once the job
  ended, its exit code to `exit` (128 + signal, like a shell), which a restarted agent reads;
- it lives through SIGTERM, SIGINT and SIGHUP, which the job gets at their defaults: bash traps
  them until the job is forked (a trap, unlike an ignore, is not inherited) and ignores them
  from then on (a trapped signal would cut its `wait` short); where the agent itself ignores
  one of them, which bash could then not trap, it is started with the defaults restored. The
  compiled one ignores them and resets every signal to its default in the job;
- right before the job it checks the node's lease once more (`lease.deadline`, written by
  agents.lease beside `lease.json` in a form bash compares without starting a process), and
  refuses with a fenced record when it ran out;
- it closes a pipe the agent waits on once the job runs (or was refused), so start() neither
  polls nor sleeps; and it exits right after writing the exit record, which the agent hears
  at once through a pidfd of it (notify_exits), instead of at its next poll: a flood of short
  jobs turns over as fast as the agent reports them.

A supervisor that vanished without an exit record (killed, host rebooted) is reported as lost,
and its job is killed. Its records are one line each, written by one write and read only whole
(the exit record with its newline, the pid record as JSON that parses); bash cannot fsync, so the
agent fsyncs the exit record when it first reads it, and until then the kernel's writeback (about
30 s) keeps it: the record matters after a crash of the host only for a job that ended in those
seconds while no agent ran.

The job's environment is the supervisor's, which the compiled one passes on unchanged, and bash
too but for what a shell keeps itself: PWD (the job's real folder), OLDPWD (dropped), SHLVL
(one more), PS4 (`+ ` for root), and SHELLOPTS and BASHOPTS, which `bash -p` ignores: a job's
own arrive as the supervisor's.

Attempts started by the former Python supervisor (`supervise.py`, whose exit record is
`exit.json`) are still adopted and read.
"""

from __future__ import annotations

import contextvars
import errno
import json
import logging
import os
import select
import selectors
import shutil
import signal
import socket
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from agents.lease import LEASE_DEADLINE_FILE, LEASE_FILE
from agents.logcontext import bound
from agents.runtime.base import (
    DEFAULT_STOP_SIGNAL,
    STOP_SIGNAL_NAMES,
    AttemptSpec,
    AttemptState,
    AttemptStatus,
    Runtime,
    StartError,
    check_paths,
    ensure_checkpoint_dir,
    read_file_range,
    read_small,
    rendezvous_env,
    stop_env,
    stop_signal_number,
    visible_devices_env,
    write_all,
    write_json_atomic,
)
from agents.runtime.supervisor import resolve as resolve_supervisor

log = logging.getLogger(__name__)

# The supervisor of a runtime made without naming one (the agent's --supervisor), and where
# the compiled one is built under the state folder.
SUPERVISOR_KIND = "auto"
SUPERVISOR_BUILD_DIR = "bin"
# How long start() waits for the supervisor to report that the job runs (or could not start).
START_TIMEOUT_S = 15.0
# The compiled supervisor of a runtime made without saying: forked for each attempt by its
# fork server (supervise.c --serve), not exec'd (an exec costs each job the C library's start,
# about 0.6 ms of CPU in a virtual machine).
SERVE = True
# The supervisor vanished without writing an exit code (killed, or the host rebooted).
LOST_EXIT_CODE = 255
# Signals the supervisor traps; the job must get them at their defaults.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Every signal a job may be stopped with: one the agent ignores would be ignored by the job
# too (an ignore survives exec), so the supervisor starts with their defaults restored then.
JOB_STOP_SIGNALS = tuple(stop_signal_number(name) for name in STOP_SIGNAL_NAMES)
# The runtime's stop of an attempt: its signal, grace, when it went out, and when the job had
# to be killed (written before the SIGKILL, so whoever sees the end sees why).
STOP_RECORD = "stop.json"
# record.json's "records" for attempts of supervise.sh, whose exit record is the line `exit`;
# absent: supervise.py's attempts, whose exit record is `exit.json`.
TEXT_RECORDS = "text"


def proc_start_ticks(pid: int) -> int | None:
    """Start time of a live process in clock ticks since boot; None when there is none."""
    try:
        stat = read_small(f"/proc/{pid}/stat")
        if stat is None:
            return None
        fields = stat.rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == b"Z":  # a zombie has ended; only its parent has not reaped it yet
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _alive(pid: int | None, start_ticks: int | None) -> bool:
    if not pid:
        return False
    ticks = proc_start_ticks(pid)
    return ticks is not None and (start_ticks is None or ticks == start_ticks)


def _read_json(path: Path) -> dict[str, Any] | None:
    data = read_small(path)
    if data is None:
        return None
    try:
        record: dict[str, Any] = json.loads(data)
    except ValueError:
        log.warning("unreadable %s", path)
        return None
    return record


def _read_line(path: Path, *, durable: bool = False) -> str | None:
    """A record of supervise.sh without its newline; None while it is absent or not whole.
    durable: fsync it as it is read (see read_exit)."""
    data = read_small(path, durable=durable)
    if data is None or not data.endswith(b"\n"):
        return None
    return data[:-1].decode(errors="replace")


def read_child(attempt_dir: Path) -> dict[str, Any] | None:
    """The job's pid, start ticks and start time (`child.json`), once its supervisor wrote them.

    Both supervisors write it in the same form, which a fence of the former version, still
    running through an upgrade, reads too. A pid of None means the job ended before it was
    looked at: nothing of it may be signalled. A file being written reads as not there yet.
    """
    data = read_small(attempt_dir / "child.json")
    if data is None:
        return None
    try:
        record: dict[str, Any] = json.loads(data)
    except ValueError:
        return None
    return record


def read_exit(attempt_dir: Path, text: bool, *, durable: bool = False) -> dict[str, Any] | None:
    """The exit record (exit_code, finished_at, and error/fenced/message), once it is written.

    durable: fsync a supervise.sh record as it is read. bash cannot fsync what it writes, so the
    agent does, before it reports the end: after a crash of the host the record is still there.
    """
    if not text:
        return _read_json(attempt_dir / "exit.json")
    line = _read_line(attempt_dir / "exit", durable=durable)
    if line is None:
        return None
    kind, _, rest = line.partition(" ")
    try:
        if kind == "exit":
            code, finished_at, *message = rest.split(" ", 2)
            record: dict[str, Any] = {"exit_code": int(code), "finished_at": float(finished_at)}
            if message:
                record["message"] = message[0]
            return record
        if kind in ("failed", "refused"):
            finished_at, _, error = rest.partition(" ")
            return {
                "exit_code": None,
                "finished_at": float(finished_at),
                "error": error or "the job could not start",
                "fenced": kind == "refused",
            }
    except ValueError:
        pass
    log.warning("unreadable %s", attempt_dir / "exit")
    return {"exit_code": None, "finished_at": None, "error": "its exit record is unreadable"}


def _exit_written(attempt_dir: Path, text: bool) -> bool:
    return (attempt_dir / ("exit" if text else "exit.json")).exists()


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _text_records(record: dict[str, Any]) -> bool:
    return record.get("records") == TEXT_RECORDS


def _ignored(_signum: int, _frame: object) -> None:
    """A signal the agent was started with ignored: still nothing happens to the agent."""


def handle_ignored_stop_signals() -> None:
    """Turn every stop signal the agent was started with ignored into one it handles by doing
    nothing. Call it from the main thread, before the first start.

    nohup leaves SIGHUP ignored, a shell's background job SIGINT and SIGQUIT; an ignore passes
    through exec to every job, which start() would then undo in a Python step between fork and
    exec (preexec_fn): a full fork of the agent's memory instead of a vfork, and Python run in
    the child of a threaded process, for every job. A handled signal is reset to its default
    by exec, so the jobs start with the defaults at no cost, and the agent still shrugs it off.
    """
    for sig in (*STOP_SIGNALS, *JOB_STOP_SIGNALS):
        if signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, _ignored)


def _restore_stop_signals() -> None:
    for sig in (*STOP_SIGNALS, *JOB_STOP_SIGNALS):
        signal.signal(sig, signal.SIG_DFL)


class _Common(TypedDict):
    """The fields of an AttemptStatus that every state of one attempt reports alike."""

    attempt_id: int
    job_id: int | None
    gpu_uuids: tuple[str, ...]
    started_at: float | None
    stop_signal_at: float | None
    killed_after_grace: bool | None


@dataclass(slots=True)
class _Proc:
    attempt_id: int
    dir: Path
    record: dict[str, Any]
    popen: subprocess.Popen[bytes] | None = None  # only for supervisors this agent process started
    stopping: bool = False
    # Kept once read: the job's pid never changes, nor does an ended attempt's status, so a
    # look at a running attempt costs a waitpid (or one /proc read for an adopted one).
    child: dict[str, Any] | None = None
    final: AttemptStatus | None = None
    stop_record: dict[str, Any] | None = None

    @property
    def text(self) -> bool:
        return _text_records(self.record)


class ProcessRuntime(Runtime):
    """Runs each attempt's command as a process group on this host."""

    name = "process"

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        *,
        job_path_prepend: Sequence[str] = (),
        supervisor: str | None = None,
        supervisor_dir: str | os.PathLike[str] | None = None,
        serve: bool | None = None,
    ) -> None:
        """Keep attempt folders under state_dir; job_path_prepend goes first on every job's PATH.

        supervisor: "auto" (the compiled supervisor where it builds, else bash), "compiled"
        or "bash"; None: SUPERVISOR_KIND. supervisor_dir: where the compiled one is built and
        kept (default <state_dir>/bin), a folder agents on one host may share. serve: the
        compiled one forks each attempt's supervisor from a server of this runtime instead of
        an exec per attempt (None: SERVE); any start the server cannot make runs an exec.

        The job inherits the agent's PATH unless the operator asks for more: a host whose jobs
        should find the agent's own interpreter first (the embedded demo's `python -m
        agents.simjob`) names its bin folder here. Only absolute folders are accepted: the job
        runs in its own work folder, where a relative entry would resolve to what the job wrote.
        """
        relative = [d for d in job_path_prepend if not os.path.isabs(d)]
        if relative:
            raise ValueError(f"job PATH folders must be absolute, got {', '.join(relative)}")
        self._supervisor = resolve_supervisor(
            supervisor or SUPERVISOR_KIND,
            Path(supervisor_dir or Path(state_dir) / SUPERVISOR_BUILD_DIR),
        )
        self._root = Path(state_dir) / "process"
        self._lease_path = Path(state_dir) / LEASE_FILE
        self._deadline_path = Path(state_dir) / LEASE_DEADLINE_FILE
        self._root.mkdir(parents=True, exist_ok=True)
        self._trash = _Trash(Path(state_dir) / "process-trash")
        self._job_path_prepend = tuple(job_path_prepend)
        # What every job inherits from the agent, read once: the agent never changes its own
        # environment while it runs, and filtering os.environ (which decodes every entry) at
        # each start was a fifth of the start's own CPU (cProfile) with a login shell's
        # environment.
        self._inherited_env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCP_")}
        self._procs: dict[int, _Proc] = {}
        self._lock = threading.Lock()
        self._exits = _ExitWatch()
        serving = SERVE if serve is None else serve
        self._server = (
            _ForkServer(self._supervisor.argv[0])
            if serving and self._supervisor.kind == "compiled"
            else None
        )
        # Every job's stdin, opened once (Popen's DEVNULL opens it at every start).
        self._devnull = os.open(os.devnull, os.O_RDONLY)
        # Both go with the runtime even where close() is never called (a runtime dropped):
        # exactly once, whichever comes first.
        self._release = weakref.finalize(self, _release, self._server, self._devnull)

    def notify_exits(self, callback: Callable[[], None]) -> None:
        self._exits.start(callback)
        with self._lock:
            procs = list(self._procs.values())
        for proc in procs:
            self._watch_exit(proc)

    def _watch_exit(self, proc: _Proc) -> None:
        if proc.popen is not None:
            self._exits.add(proc.popen.pid, None)
        else:
            record = proc.record
            pid = record.get("supervisor_pid")
            if pid:
                self._exits.add(int(pid), record.get("supervisor_start_ticks"))

    def close(self) -> None:
        self._exits.stop()
        self._trash.close()
        self._release()
        self._server = None  # a start after close() runs an exec, as without a server
        self._devnull = subprocess.DEVNULL  # and opens its own /dev/null

    def _dir(self, attempt_id: int) -> Path:
        return self._root / str(attempt_id)

    def log_path(self, attempt_id: int) -> Path:
        """Where the attempt's stdout and stderr go."""
        return self._dir(attempt_id) / "output.log"

    def adopt(self) -> list[AttemptStatus]:
        with self._lock:
            for entry in sorted(self._root.iterdir()):
                if not entry.is_dir() or not entry.name.isdigit():
                    continue
                attempt_id = int(entry.name)
                record = _read_json(entry / "record.json")
                if record is None or attempt_id in self._procs:
                    continue
                self._procs[attempt_id] = proc = _Proc(attempt_id, entry, record)
                proc.stop_record = _read_json(entry / STOP_RECORD)
                self._watch_exit(proc)
        found = self.statuses()
        with self._lock:
            procs = list(self._procs.values())
        for proc in procs:
            stop = proc.stop_record
            if stop is not None and not proc.stopping and proc.final is None:
                # Stopped by the agent before its restart: the grace ends when it was to.
                proc.stopping = True
                if stop.get("killed_at") is None:
                    ends_at = float(stop.get("at") or 0) + float(stop.get("grace_s") or 0)
                    self._escalate_after(proc, ends_at - time.time())
        for status in found:
            with bound(attempt_id=status.attempt_id, job_id=status.job_id):
                log.info("adopted attempt %d (%s)", status.attempt_id, status.state)
        return found

    def start(self, spec: AttemptSpec, extra_env: dict[str, str] | None = None) -> AttemptStatus:
        if not spec.command:
            raise StartError("the process runtime needs a command (it does not run images)")
        check_paths(spec)
        mount_paths = {}
        for mount in spec.mounts:
            # A process sees the host as it is: the job finds the volume at its host path (in
            # GPUCP_MOUNT_<NAME>), and read_only cannot be enforced.
            if mount.kind != "host_path":
                raise StartError(
                    f"mount {mount.name!r}: the process runtime cannot mount engine volumes "
                    "(a node with the docker runtime can)"
                )
            if not os.path.isdir(mount.source):
                raise StartError(f"mount {mount.name!r}: {mount.source} is not on this node")
            mount_paths[mount.name] = mount.source
        checkpoint_dir = None
        if spec.checkpoint is not None:
            checkpoint_dir = spec.checkpoint.host_path
            ensure_checkpoint_dir(checkpoint_dir, 0o700)  # the job runs as the agent's user
        attempt_dir = self._dir(spec.attempt_id)
        try:
            attempt_dir.mkdir()
        except FileExistsError:
            # Left from an earlier run of this very attempt: never start one twice.
            raise StartError(
                f"attempt {spec.attempt_id} already has a folder in {self._root}"
            ) from None
        workdir = attempt_dir / "work"
        workdir.mkdir()
        env = dict(self._inherited_env)
        env.update(spec.env)
        env.update(visible_devices_env(spec.gpu_uuids))
        env.update(rendezvous_env(spec))
        env.update(extra_env or {})
        env.update(stop_env(spec, checkpoint_dir, mount_paths))
        if self._job_path_prepend:
            # An empty or missing PATH means the system default to exec, so that is what follows.
            env["PATH"] = os.pathsep.join([*self._job_path_prepend, env.get("PATH") or os.defpath])
        env["GPUCP_ATTEMPT_ID"] = str(spec.attempt_id)
        if spec.job_id is not None:
            env["GPUCP_JOB_ID"] = str(spec.job_id)
        # bash can neither trap nor reset a signal ignored when it started, and the job would
        # inherit the ignore: an agent that ignores one (nohup) pays for a Python step instead,
        # unless it made its ignores handlers first (handle_ignored_stop_signals; the agent's
        # main does).
        inherited_ignore = self._supervisor.needs_bash_signals and any(
            signal.getsignal(sig) == signal.SIG_IGN for sig in (*STOP_SIGNALS, *JOB_STOP_SIGNALS)
        )
        args = [str(attempt_dir), str(self._deadline_path), str(self._lease_path)]
        started_r, started_w = os.pipe()
        go_w = None  # served: the supervisor starts nothing before a byte comes down this pipe
        try:
            # A descriptor, not a file object: the job writes to it, the agent never does.
            output = os.open(self.log_path(spec.attempt_id), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            popen = None
            served = None
            try:
                if self._server is not None:
                    go_r, go_w = os.pipe()
                    try:
                        served = self._server.fork(
                            workdir,
                            [*self._supervisor.argv, *args, "3", "--", *spec.command],
                            env,
                            [started_w, output, self._devnull, go_r],
                        )
                    except _ServerUnavailable as exc:
                        # Whatever the server made of the request, nothing of it starts the job
                        # without the go byte, so an exec of the supervisor is as safe as ever.
                        log.warning("attempt %d: the supervisor server: %s", spec.attempt_id, exc)
                        os.close(go_w)
                        go_w = None
                    finally:
                        os.close(go_r)
                if served is None:
                    popen = subprocess.Popen(
                        [*self._supervisor.argv, *args, str(started_w), "--", *spec.command],
                        stdin=self._devnull,
                        stdout=output,
                        stderr=subprocess.STDOUT,
                        cwd=workdir,
                        env=env,
                        # Its own session: a Ctrl-C or SIGTERM to the agent's group never
                        # reaches jobs.
                        start_new_session=True,
                        close_fds=True,
                        pass_fds=(started_w,),
                        preexec_fn=_restore_stop_signals if inherited_ignore else None,
                    )
            finally:
                os.close(started_w)
                os.close(output)
            if served is not None:
                supervisor_pid, supervisor_ticks = served
            else:
                assert popen is not None
                supervisor_pid, supervisor_ticks = popen.pid, proc_start_ticks(popen.pid)
            record = {
                "attempt_id": spec.attempt_id,
                "job_id": spec.job_id,
                "gpu_uuids": list(spec.gpu_uuids),
                "command": list(spec.command),
                "supervisor_pid": supervisor_pid,
                "supervisor_start_ticks": supervisor_ticks,
                "records": TEXT_RECORDS,
                "supervisor": self._supervisor.kind,
                "created_at": time.time(),
            }
            # Written once, into a folder nothing else writes: no temporary file and rename
            # (a new inode and a freed one per job, which ext4 without a journal pays for at
            # every later file it makes). A record cut by a kill of the agent right here reads
            # as missing, as one never written: the same as a kill just before it.
            fd = os.open(attempt_dir / "record.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                write_all(fd, json.dumps(record).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            if go_w is not None:
                os.write(go_w, b"g")  # the record is on disk: the supervisor may go on
            proc = _Proc(spec.attempt_id, attempt_dir, record, popen=popen)
            with self._lock:
                self._procs[spec.attempt_id] = proc
            self._watch_exit(proc)
            # The supervisor closes its end once the job runs, or as it exits: the job was
            # refused or could not start (or the supervisor was killed).
            # poll, not select: an agent with more than FD_SETSIZE (1,024) descriptors open
            # would have select refuse the pipe's number.
            waiter = select.poll()
            waiter.register(started_r, select.POLLIN)
            if not waiter.poll(START_TIMEOUT_S * 1000):
                log.warning("attempt %d: supervisor slow to report the job", spec.attempt_id)
            elif self._child(proc) is None and not self._ended(proc, START_TIMEOUT_S):
                # It could not write the job's pid (a full disk) and runs on.
                log.warning("attempt %d: the job's pid was not recorded", spec.attempt_id)
        finally:
            os.close(started_r)
            if go_w is not None:
                os.close(go_w)  # without its byte (a failed record): the supervisor just ends
        return self._status(proc)

    def _ended(self, proc: _Proc, timeout_s: float) -> bool:
        """Whether the attempt's supervisor ended within timeout_s (it refused the job or the
        job could not start: it writes why and exits)."""
        if proc.popen is not None:
            try:
                proc.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                return False
            return True
        # A served one is not our child: it is ended once it is a zombie, which its server
        # reaps within a second.
        deadline = time.monotonic() + timeout_s
        while self._supervisor_running(proc):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def _child(self, proc: _Proc) -> dict[str, Any] | None:
        if proc.child is None:
            proc.child = read_child(proc.dir)
        return proc.child

    def _supervisor_running(self, proc: _Proc) -> bool:
        if proc.popen is not None:
            return proc.popen.poll() is None  # also reaps our own ended supervisor
        record = proc.record
        return _alive(record.get("supervisor_pid"), record.get("supervisor_start_ticks"))

    def _status(self, proc: _Proc) -> AttemptStatus:
        if proc.final is not None:
            return proc.final
        record = proc.record
        child = self._child(proc) or {}
        stop = proc.stop_record or {}
        common: _Common = {
            "attempt_id": proc.attempt_id,
            "job_id": record.get("job_id"),
            "gpu_uuids": tuple(record.get("gpu_uuids") or ()),
            "started_at": child.get("started_at"),
            "stop_signal_at": stop.get("at"),
            "killed_after_grace": (stop.get("killed_at") is not None) if stop else None,
        }
        if self._supervisor_running(proc):
            return AttemptStatus(state=AttemptState.RUNNING, **common)
        # It ended: whatever it wrote is all there will be.
        exit_record = read_exit(proc.dir, proc.text, durable=True)
        if proc.stop_record is not None:
            # Its stop as recorded on disk, not as this runtime last wrote or read it: the
            # runtime that began the grace (one this agent adopted the attempt from, when it
            # had not quite died) may have been the one that killed it at its end.
            stop = _read_json(proc.dir / STOP_RECORD) or proc.stop_record
            common["killed_after_grace"] = stop.get("killed_at") is not None
        if exit_record is None:
            proc.final = self._lost(proc, child, common)
            return proc.final
        if exit_record.get("error"):
            common["started_at"] = None  # the job never ran
            proc.final = AttemptStatus(
                state=AttemptState.FAILED_TO_START,
                finished_at=exit_record.get("finished_at"),
                message=exit_record["error"],
                logs_complete=True,
                fenced=bool(exit_record.get("fenced")),
                **common,
            )
        else:
            proc.final = AttemptStatus(
                state=AttemptState.EXITED,
                exit_code=exit_record.get("exit_code"),
                finished_at=exit_record.get("finished_at"),
                message=exit_record.get("message", ""),
                logs_complete=True,
                **common,
            )
        return proc.final

    def _lost(self, proc: _Proc, child: dict[str, Any], common: _Common) -> AttemptStatus:
        """The supervisor is gone and left no exit code: make sure the job is gone too."""
        if _alive(child.get("pid"), child.get("start_ticks")):
            self._signal_group(child["pid"], signal.SIGKILL)
        message = "the job's supervisor vanished (killed or host rebooted)"
        finished_at = time.time()
        if proc.text:
            path = proc.dir / "exit"
            tmp = path.with_name("exit.tmp")
            tmp.write_text(f"exit {LOST_EXIT_CODE} {finished_at:.6f} {message}\n")
            os.replace(tmp, path)
            _fsync(path)
        else:
            write_json_atomic(
                proc.dir / "exit.json",
                {"exit_code": LOST_EXIT_CODE, "finished_at": finished_at, "message": message},
            )
        log.warning("attempt %d: %s", proc.attempt_id, message)
        return AttemptStatus(
            state=AttemptState.EXITED,
            exit_code=LOST_EXIT_CODE,
            finished_at=finished_at,
            message=message,
            logs_complete=True,
            **common,
        )

    def statuses(self) -> list[AttemptStatus]:
        with self._lock:
            procs = list(self._procs.values())
        return [self._status(proc) for proc in procs]

    @staticmethod
    def _signal_group(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
        except PermissionError as exc:
            log.error("cannot signal process group %d: %s", pgid, exc)

    def _child_group(self, proc: _Proc) -> int | None:
        """The job's process group, or None once it has ended (so a reused pid is never hit)."""
        if proc.final is not None or _exit_written(proc.dir, proc.text):
            return None
        child = self._child(proc)
        if child is None or not _alive(child.get("pid"), child.get("start_ticks")):
            return None
        return int(child["pid"])

    def stop(self, attempt_id: int, grace_s: float, signal: str = DEFAULT_STOP_SIGNAL) -> None:
        with self._lock:
            proc = self._procs.get(attempt_id)
            if proc is None or proc.stopping:
                return
            proc.stopping = True
        pgid = self._wait_for_child_group(proc)
        if pgid is None:
            return
        number = stop_signal_number(signal)
        record = {"signal": signal, "grace_s": grace_s, "at": time.time(), "killed_at": None}
        # On disk before the signal: an agent restarted within the grace still kills at its
        # end (adopt), and reports when the notice went out.
        self._save_stop(proc, record)
        log.info("attempt %d: %s to group %d, SIGKILL in %.0f s", attempt_id, signal, pgid, grace_s)
        self._signal_group(pgid, number)
        self._escalate_after(proc, grace_s)

    def _save_stop(self, proc: _Proc, record: dict[str, Any]) -> None:
        proc.stop_record = record
        try:
            write_json_atomic(proc.dir / STOP_RECORD, record)
        except OSError as exc:
            log.error("attempt %d: cannot record its stop: %s", proc.attempt_id, exc)

    def _escalate_after(self, proc: _Proc, delay_s: float) -> None:
        def escalate() -> None:
            group = self._child_group(proc)
            if group is None:
                return
            record = dict(proc.stop_record or {})
            log.info("attempt %d: still running at the end of its grace: SIGKILL", proc.attempt_id)
            record["killed_at"] = time.time()
            self._save_stop(proc, record)
            self._signal_group(group, signal.SIGKILL)

        # The timer's thread logs with the ids of the stop that set it (agents.logcontext).
        timer = threading.Timer(max(0.0, delay_s), contextvars.copy_context().run, (escalate,))
        timer.daemon = True
        timer.start()

    def _wait_for_child_group(self, proc: _Proc) -> int | None:
        # An adopted attempt's supervisor may not have written the job's pid yet (start()
        # waits for it, but the agent that started it may have died before it was written).
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            pgid = self._child_group(proc)
            if pgid is not None or proc.child is not None:
                return pgid
            if _exit_written(proc.dir, proc.text) or time.monotonic() > deadline:
                return None
            if not self._supervisor_running(proc):
                return None
            time.sleep(0.01)

    def read_logs(self, attempt_id: int, offset: int, max_bytes: int) -> bytes:
        return read_file_range(self.log_path(attempt_id), offset, max_bytes)

    @staticmethod
    def _job_on_disk(entry: Path) -> dict[str, Any] | None:
        """The job's pid record in an attempt folder, read afresh (for the fence); None once
        the attempt ended (or before its job started)."""
        if _exit_written(entry, True) or _exit_written(entry, False):
            return None
        return read_child(entry)

    def running_attempts(self) -> list[int]:
        running = []
        for entry in self._root.iterdir():
            if not entry.name.isdigit():
                continue
            child = self._job_on_disk(entry)
            if child is not None and _alive(child.get("pid"), child.get("start_ticks")):
                running.append(int(entry.name))
        return sorted(running)

    def signal_attempt(self, attempt_id: int, sig: int) -> None:
        child = self._job_on_disk(self._dir(attempt_id))
        if child is not None and _alive(child.get("pid"), child.get("start_ticks")):
            self._signal_group(int(child["pid"]), sig)

    def remove(self, attempt_id: int) -> None:
        with self._lock:
            proc = self._procs.pop(attempt_id, None)
        if proc is not None and proc.popen is not None:
            proc.popen.poll()
        self._trash.throw(self._dir(attempt_id))


def _delete(folder: str) -> None:
    """Delete an attempt's folder. What it nearly always holds (its records, its output, an
    empty work folder) goes in one flat pass of unlinks; anything more (a job that left files
    in its work folder) goes through shutil.rmtree, whose careful walk costs several times as
    much per folder in a flood of short jobs."""
    try:
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            try:
                os.unlink(path)  # a file, or a symbolic link (never followed)
            except IsADirectoryError:
                os.rmdir(path)  # not empty: the careful walk below
        os.rmdir(folder)
    except OSError:
        shutil.rmtree(folder, ignore_errors=True)


class _Trash:
    """Ended attempts' folders, deleted by a thread of their own.

    Deleting a folder (its records, output and work folder: a dozen unlinks on a journaling
    file system) took the agent's loop longer than anything else it does for an attempt, and
    in a flood of short jobs the loop's turn is what a freed GPU waits for. A rename out of the
    runtime's folder is one system call and atomic: from then on no adopt(), fence or start
    sees the attempt, and what is left is only disk space, which the thread frees (at once,
    or, after a crash, when the next agent starts)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        path.mkdir(parents=True, exist_ok=True)
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="process-trash", daemon=True)
        self._thread.start()
        self._wake.set()  # what an earlier agent left

    def throw(self, folder: Path) -> None:
        target = self._path / f"{folder.name}-{time.monotonic_ns()}"
        try:
            os.rename(folder, target)
        except FileNotFoundError:
            return
        except OSError as exc:  # another file system (a state dir moved by hand): delete here
            log.warning("cannot move %s to the trash (%s); deleting it now", folder, exc)
            shutil.rmtree(folder, ignore_errors=True)
            return
        self._wake.set()

    def empty(self) -> None:
        for entry in list(os.scandir(self._path)):
            _delete(entry.path)

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            try:
                self.empty()
            except OSError as exc:
                log.warning("cannot empty %s: %s", self._path, exc)


class _ExitWatch:
    """One thread that calls back when a watched supervisor exits, through its pidfd.

    A pidfd names one process (never a later one with its pid) and becomes readable when that
    process ends, whether it is this agent's child or an adopted one. Where the kernel has no
    pidfds (before Linux 5.3), nothing is watched and the agent's poll sees the exits.
    """

    def __init__(self) -> None:
        self._selector: selectors.BaseSelector | None = None
        self._callback: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    def start(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if self._selector is not None:
                return
            self._callback = callback
            self._selector = selectors.DefaultSelector()
        threading.Thread(
            target=self._run, args=(self._selector,), name="exit-watch", daemon=True
        ).start()

    def add(self, pid: int, start_ticks: int | None) -> None:
        with self._lock:
            selector = self._selector
        if selector is None:
            return
        try:
            fd = os.pidfd_open(pid)
        except (OSError, AttributeError):
            return  # gone already (the poll reports it), or no pidfds here
        if start_ticks is not None and proc_start_ticks(pid) != start_ticks:
            os.close(fd)  # the pid names another process now: the one watched is gone
            self._notify()
            return
        with self._lock:
            try:
                selector.register(fd, selectors.EVENT_READ)
            except (KeyError, ValueError, OSError):
                os.close(fd)

    def _notify(self) -> None:
        callback = self._callback
        if callback is not None:
            callback()

    def _run(self, selector: selectors.BaseSelector) -> None:
        while not self._stopped.is_set():
            # A bounded wait: pidfds registered meanwhile are seen by epoll at once, and stop()
            # is noticed within a second.
            ready = selector.select(timeout=1.0)
            if not ready:
                continue
            with self._lock:
                for key, _ in ready:
                    selector.unregister(key.fd)
                    os.close(key.fd)
            self._notify()
        with self._lock:
            for key in list(selector.get_map().values()):
                selector.unregister(key.fd)
                os.close(key.fd)
            selector.close()

    def stop(self) -> None:
        self._stopped.set()


class _ServerUnavailable(Exception):
    """The fork server made no supervisor for this attempt (start() runs an exec instead)."""


def _release(server: _ForkServer | None, devnull: int) -> None:
    if server is not None:
        server.close()
    os.close(devnull)


# The most strings (arguments and environment variables) the server reads from one request
# (supervise.c, serve_one); a start with more runs an exec.
MAX_SERVED_STRINGS = 8192


class _ForkServer:
    """The compiled supervisor's fork server (supervise.c --serve) of one runtime.

    Started at the first start, and again at the next after it died; it ends when the runtime
    closes or the agent dies (its end of the socket closes). The supervisors it forked live on
    in sessions of their own, as exec'd ones do, and are watched the same way as adopted ones
    (their pid and start ticks, a pidfd): they are not the agent's children."""

    def __init__(self, program: str) -> None:
        self._program = program
        self._sock: socket.socket | None = None
        self._popen: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    def _ensure(self) -> socket.socket:
        if self._sock is not None and self._popen is not None and self._popen.poll() is None:
            return self._sock
        self._stop()
        # SEQPACKET: each request arrives whole, descriptors with it.
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._popen = subprocess.Popen(
                [self._program, "--serve", str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
            )
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.settimeout(START_TIMEOUT_S)
        self._sock = ours
        return ours

    def fork(
        self, workdir: Path, argv: list[str], env: dict[str, str], fds: list[int]
    ) -> tuple[int, int | None]:
        """The pid and start ticks of a new supervisor, forked with these arguments, this
        environment and these descriptors (started pipe, output, stdin, go pipe), which waits
        for its go byte."""
        for key, value in env.items():
            # What Popen refuses, refused alike.
            if "=" in key or "\0" in key or "\0" in value:
                raise ValueError(f"illegal environment variable name or value: {key!r}")
        strings = [str(workdir), str(len(argv)), *argv, *(f"{k}={v}" for k, v in env.items())]
        if any("\0" in text for text in argv):
            raise ValueError("embedded null byte")
        if len(strings) > MAX_SERVED_STRINGS:
            raise _ServerUnavailable(f"{len(strings)} arguments and variables: more than it takes")
        payload = b"\0".join(os.fsencode(text) for text in strings) + b"\0"
        with self._lock:
            try:
                sock = self._ensure()
            except OSError as exc:
                raise _ServerUnavailable(f"it cannot be started: {exc}") from exc
            try:
                socket.send_fds(sock, [payload], fds)
            except OSError as exc:
                if exc.errno != errno.EMSGSIZE:  # too large for one message: only this one
                    self._stop()
                raise _ServerUnavailable(f"it took no request: {exc}") from exc
            try:
                answer = sock.recv(256)
            except OSError as exc:
                self._stop()
                raise _ServerUnavailable(f"it did not answer: {exc}") from exc
            if not answer:
                self._stop()
                raise _ServerUnavailable("it ended")
        pid_text, _, ticks_text = answer.decode(errors="replace").strip().partition(" ")
        if not pid_text.isdigit():
            raise _ServerUnavailable(f"it could not: {ticks_text}")
        ticks = int(ticks_text) if ticks_text.isdigit() else None
        return int(pid_text), ticks

    def _stop(self) -> None:
        if self._sock is not None:
            self._sock.close()  # the server ends at the end of its socket
            self._sock = None
        if self._popen is not None:
            try:
                self._popen.wait(2.0)
            except subprocess.TimeoutExpired:
                self._popen.kill()
                self._popen.wait()
            self._popen = None

    def close(self) -> None:
        with self._lock:
            self._stop()
