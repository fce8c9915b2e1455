"""Attempts as plain child processes, for bare-metal hosts and the embedded mode.

Each attempt gets a folder `<state-dir>/process/<attempt-id>/` with its record (the supervisor's
pid and start time, which guard against a reused pid), the job's pid, its output and, once it
ended, its exit code, so an agent restarted while jobs run re-adopts them and still learns the
exit code of those that ended while it was down. The job runs under `supervise.py`, in a process
group of its own, so a stop reaches everything it spawned.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from agents.lease import LEASE_FILE
from agents.runtime.base import (
    AttemptSpec,
    AttemptState,
    AttemptStatus,
    Runtime,
    StartError,
    read_file_range,
    visible_devices_env,
    write_json_atomic,
)

log = logging.getLogger(__name__)

SUPERVISOR = Path(__file__).with_name("supervise.py")
# How long start() waits for the supervisor to report that the job runs (or could not start).
START_TIMEOUT_S = 15.0
# The supervisor vanished without writing an exit code (killed, or the host rebooted).
LOST_EXIT_CODE = 255


def proc_start_ticks(pid: int) -> int | None:
    """Start time of a live process in clock ticks since boot; None when there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":  # a zombie has ended; only its parent has not reaped it yet
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
    try:
        record: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        log.warning("unreadable %s", path)
        return None
    return record


class _Common(TypedDict):
    """The fields of an AttemptStatus that every state of one attempt reports alike."""

    attempt_id: int
    job_id: int | None
    gpu_uuids: tuple[str, ...]
    started_at: float | None


@dataclass(slots=True)
class _Proc:
    attempt_id: int
    dir: Path
    record: dict[str, Any]
    popen: subprocess.Popen[bytes] | None = None  # only for supervisors this agent process started
    stopping: bool = False
    lost_message: str = ""


class ProcessRuntime(Runtime):
    """Runs each attempt's command as a process group on this host."""

    name = "process"

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        *,
        python: str = sys.executable,
        job_path_prepend: Sequence[str] = (),
    ) -> None:
        """Keep attempt folders under state_dir; job_path_prepend goes first on every job's PATH.

        The job inherits the agent's PATH unless the operator asks for more: a host whose jobs
        should find the agent's own interpreter first (the embedded demo's `python -m
        agents.simjob`) names its bin folder here. Only absolute folders are accepted: the job
        runs in its own work folder, where a relative entry would resolve to what the job wrote.
        """
        relative = [d for d in job_path_prepend if not os.path.isabs(d)]
        if relative:
            raise ValueError(f"job PATH folders must be absolute, got {', '.join(relative)}")
        self._root = Path(state_dir) / "process"
        self._lease_path = Path(state_dir) / LEASE_FILE
        self._root.mkdir(parents=True, exist_ok=True)
        self._python = python
        self._job_path_prepend = tuple(job_path_prepend)
        self._procs: dict[int, _Proc] = {}
        self._lock = threading.Lock()

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
                self._procs[attempt_id] = _Proc(attempt_id, entry, record)
        found = self.statuses()
        for status in found:
            log.info("adopted attempt %d (%s)", status.attempt_id, status.state)
        return found

    def start(self, spec: AttemptSpec, extra_env: dict[str, str] | None = None) -> AttemptStatus:
        if not spec.command:
            raise StartError("the process runtime needs a command (it does not run images)")
        attempt_dir = self._dir(spec.attempt_id)
        if attempt_dir.exists():
            # Left from an earlier run of this very attempt: never start one twice.
            raise StartError(f"attempt {spec.attempt_id} already has a folder in {self._root}")
        workdir = attempt_dir / "work"
        workdir.mkdir(parents=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCP_")}
        env.update(spec.env)
        env.update(visible_devices_env(spec.gpu_uuids))
        env.update(extra_env or {})
        if self._job_path_prepend:
            # An empty or missing PATH means the system default to exec, so that is what follows.
            env["PATH"] = os.pathsep.join([*self._job_path_prepend, env.get("PATH") or os.defpath])
        env["GPUCP_ATTEMPT_ID"] = str(spec.attempt_id)
        if spec.job_id is not None:
            env["GPUCP_JOB_ID"] = str(spec.job_id)
        with open(self.log_path(spec.attempt_id), "ab") as output:
            popen = subprocess.Popen(
                [
                    self._python,
                    "-I",
                    str(SUPERVISOR),
                    str(attempt_dir),
                    "--lease",
                    str(self._lease_path),
                    "--",
                    *spec.command,
                ],
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                cwd=workdir,
                env=env,
                # Its own session: a Ctrl-C or SIGTERM to the agent's group never reaches jobs.
                start_new_session=True,
                close_fds=True,
            )
        record = {
            "attempt_id": spec.attempt_id,
            "job_id": spec.job_id,
            "gpu_uuids": list(spec.gpu_uuids),
            "command": list(spec.command),
            "supervisor_pid": popen.pid,
            "supervisor_start_ticks": proc_start_ticks(popen.pid),
            "created_at": time.time(),
        }
        write_json_atomic(attempt_dir / "record.json", record)
        proc = _Proc(spec.attempt_id, attempt_dir, record, popen=popen)
        with self._lock:
            self._procs[spec.attempt_id] = proc
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if (attempt_dir / "child.json").exists() or (attempt_dir / "exit.json").exists():
                break
            if popen.poll() is not None:
                break
            time.sleep(0.005)
        status = self._status(proc)
        if status.state is AttemptState.RUNNING and status.started_at is None:
            log.warning("attempt %d: supervisor slow to report the job", spec.attempt_id)
        return status

    def _status(self, proc: _Proc) -> AttemptStatus:
        record = proc.record
        child = _read_json(proc.dir / "child.json") or {}
        common: _Common = {
            "attempt_id": proc.attempt_id,
            "job_id": record.get("job_id"),
            "gpu_uuids": tuple(record.get("gpu_uuids") or ()),
            "started_at": child.get("started_at"),
        }
        exit_record = _read_json(proc.dir / "exit.json")
        if exit_record is None:
            if proc.popen is not None:
                running = proc.popen.poll() is None  # also reaps our own ended supervisor
            else:
                running = _alive(record.get("supervisor_pid"), record.get("supervisor_start_ticks"))
            if running:
                return AttemptStatus(state=AttemptState.RUNNING, **common)
            # It may have written the exit code between the two looks.
            exit_record = _read_json(proc.dir / "exit.json")
        if exit_record is None:
            return self._lost(proc, child, common)
        if exit_record.get("error"):
            return AttemptStatus(
                state=AttemptState.FAILED_TO_START,
                finished_at=exit_record.get("finished_at"),
                message=exit_record["error"],
                logs_complete=True,
                fenced=bool(exit_record.get("fenced")),
                **common,
            )
        return AttemptStatus(
            state=AttemptState.EXITED,
            exit_code=exit_record.get("exit_code"),
            finished_at=exit_record.get("finished_at"),
            message=exit_record.get("message", ""),
            logs_complete=True,
            **common,
        )

    def _lost(self, proc: _Proc, child: dict[str, Any], common: _Common) -> AttemptStatus:
        """The supervisor is gone and left no exit code: make sure the job is gone too."""
        if not proc.lost_message:
            if _alive(child.get("pid"), child.get("start_ticks")):
                self._signal_group(child["pid"], signal.SIGKILL)
            proc.lost_message = "the job's supervisor vanished (killed or host rebooted)"
            write_json_atomic(
                proc.dir / "exit.json",
                {
                    "exit_code": LOST_EXIT_CODE,
                    "finished_at": time.time(),
                    "message": proc.lost_message,
                },
            )
            log.warning("attempt %d: %s", proc.attempt_id, proc.lost_message)
        return AttemptStatus(
            state=AttemptState.EXITED,
            exit_code=LOST_EXIT_CODE,
            finished_at=time.time(),
            message=proc.lost_message,
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
        if (proc.dir / "exit.json").exists():
            return None
        child = _read_json(proc.dir / "child.json")
        if child is None or not _alive(child.get("pid"), child.get("start_ticks")):
            return None
        return int(child["pid"])

    def stop(self, attempt_id: int, grace_s: float) -> None:
        with self._lock:
            proc = self._procs.get(attempt_id)
            if proc is None or proc.stopping:
                return
            proc.stopping = True
        pgid = self._wait_for_child_group(proc)
        if pgid is None:
            return
        log.info("attempt %d: SIGTERM to group %d, SIGKILL in %.0f s", attempt_id, pgid, grace_s)
        self._signal_group(pgid, signal.SIGTERM)

        def escalate() -> None:
            group = self._child_group(proc)
            if group is not None:
                log.info("attempt %d: still running after %.0f s: SIGKILL", attempt_id, grace_s)
                self._signal_group(group, signal.SIGKILL)

        timer = threading.Timer(grace_s, escalate)
        timer.daemon = True
        timer.start()

    def _wait_for_child_group(self, proc: _Proc) -> int | None:
        # A stop right after start can come before the supervisor wrote the job's pid.
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            pgid = self._child_group(proc)
            if pgid is not None or (proc.dir / "child.json").exists():
                return pgid
            if (proc.dir / "exit.json").exists() or time.monotonic() > deadline:
                return None
            time.sleep(0.01)

    def read_logs(self, attempt_id: int, offset: int, max_bytes: int) -> bytes:
        return read_file_range(self.log_path(attempt_id), offset, max_bytes)

    def running_attempts(self) -> list[int]:
        running = []
        for entry in self._root.iterdir():
            if not entry.name.isdigit() or (entry / "exit.json").exists():
                continue
            child = _read_json(entry / "child.json")
            if child is not None and _alive(child.get("pid"), child.get("start_ticks")):
                running.append(int(entry.name))
        return sorted(running)

    def signal_attempt(self, attempt_id: int, sig: int) -> None:
        child = _read_json(self._dir(attempt_id) / "child.json")
        if child is not None and _alive(child.get("pid"), child.get("start_ticks")):
            self._signal_group(int(child["pid"]), sig)

    def remove(self, attempt_id: int) -> None:
        with self._lock:
            proc = self._procs.pop(attempt_id, None)
        if proc is not None and proc.popen is not None:
            proc.popen.poll()
        shutil.rmtree(self._dir(attempt_id), ignore_errors=True)
