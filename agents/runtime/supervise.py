"""The tiny supervisor each process-runtime attempt runs under: `supervise.py <attempt-dir> -- cmd`.

It is started by path with `python -I` (stdlib only, nothing of the agent imported), so it costs
little and cannot be broken by the job's PYTHONPATH. It starts the job in a process group of its
own, writes the job's pid to `child.json`, waits, and writes the exit code to `exit.json` the
way a shell or a container engine reports it (128 + signal), so the code survives the agent's
death and a restarted agent can still report it.
"""

import json
import os
import signal
import subprocess
import sys
import time


def _start_ticks(pid):
    """The process's start time in clock ticks since boot: a pid plus this names one process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _write(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv):
    if len(argv) < 4 or argv[2] != "--":
        print("usage: supervise.py <attempt-dir> -- command...", file=sys.stderr)
        return 2
    attempt_dir, command = argv[1], argv[3:]
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
