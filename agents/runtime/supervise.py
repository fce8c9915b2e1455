"""The tiny supervisor each process-runtime attempt runs under:
`supervise.py <attempt-dir> [--lease <lease.json>] -- cmd`.

It is started by path with `python -I` (stdlib only, nothing of the agent imported), so it costs
little and cannot be broken by the job's PYTHONPATH. It starts the job in a process group of its
own, writes the job's pid to `child.json`, waits, and writes the exit code to `exit.json` the
way a shell or a container engine reports it (128 + signal), so the code survives the agent's
death and a restarted agent can still report it.

With --lease, the node's lease (agents/lease.py, read here without importing it) is checked
once more right before the job's process is started: an agent paused between deciding to
start an attempt and starting it may wake after its lease ran out, when the control plane may
have given the GPUs to someone else; this process was not paused, and refuses.
"""

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot: a pid plus this names one process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _write(path: str, data: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _lease_refusal(lease_path: str) -> str:
    """Why the job must not start under this lease, or "" (no lease yet: nothing to check)."""
    try:
        with open(lease_path) as f:
            lease = json.load(f)
    except FileNotFoundError:
        return ""
    except (OSError, ValueError):
        return "the node's lease file cannot be read"
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            this_boot = f.read().strip()
    except OSError:
        this_boot = ""
    if lease.get("boot_id") != this_boot:
        return "the node's lease is from before a reboot"
    attempt = os.environ.get("GPUCP_ATTEMPT_ID", "")
    grace_s = float((lease.get("graces") or {}).get(attempt, lease.get("grace_s", 0.0)))
    term_at = float(lease["expires_at"]) - float(lease["margin_s"]) - grace_s
    if time.clock_gettime(time.CLOCK_BOOTTIME) >= term_at:
        return "the node's lease ran out before the job could start"
    return ""


def main(argv: list[str]) -> int:
    lease_path = None
    if len(argv) >= 4 and argv[2] == "--lease":
        lease_path = argv[3]
        argv = argv[:2] + argv[4:]
    if len(argv) < 4 or argv[2] != "--":
        print("usage: supervise.py <attempt-dir> [--lease FILE] -- command...", file=sys.stderr)
        return 2
    attempt_dir, command = argv[1], argv[3:]
    refusal = _lease_refusal(lease_path) if lease_path else ""
    if refusal:
        print(f"gpucp: not started: {refusal}", file=sys.stderr, flush=True)
        _write(
            os.path.join(attempt_dir, "exit.json"),
            {"exit_code": None, "error": refusal, "fenced": True, "finished_at": time.time()},
        )
        return 0
    # Stop signals are for the job's group; the supervisor must live on to record the exit. A
    # handler (not SIG_IGN, which the job would inherit) is reset to the default by exec.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)
    try:
        child = subprocess.Popen(command, process_group=0)
    except OSError as exc:
        message = f"cannot run {command[0]!r}: {exc.strerror or exc}"
        print(f"gpucp: {message}", file=sys.stderr, flush=True)
        _write(
            os.path.join(attempt_dir, "exit.json"),
            {"exit_code": None, "error": message, "finished_at": time.time()},
        )
        return 127
    _write(
        os.path.join(attempt_dir, "child.json"),
        {"pid": child.pid, "start_ticks": _start_ticks(child.pid), "started_at": time.time()},
    )
    returncode = child.wait()
    exit_code = 128 - returncode if returncode < 0 else returncode
    _write(
        os.path.join(attempt_dir, "exit.json"),
        {"exit_code": exit_code, "finished_at": time.time()},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
