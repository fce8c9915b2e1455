"""CPU the process runtime spends per job: what a node pays for each attempt of `true`.

    .venv/bin/python benchmarks/bench_agent_jobs.py [--jobs 200] [--gpus 8] \
        [--supervisor compiled,bash]

Starts --jobs attempts of `true` through agents.runtime.process.ProcessRuntime, at most --gpus
at once (one-GPU jobs on a node of that many GPUs), observes each until it ended and removes
it, as the agent does. It reports the CPU milliseconds per job of this process (the runtime:
starting, observing, removing) and of its reaped descendants (each attempt's supervisor and the
job itself), and the jobs per second. This process is a child subreaper, so nothing that exits
escapes the count. No control plane and no agent loop: bench_throughput measures those.
--supervisor names the job supervisors to measure, one after the other (the compiled one is
built before its count starts, as an agent builds it once).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agents.runtime.base import AttemptSpec, AttemptState  # noqa: E402 - after the path set-up
from agents.runtime.process import ProcessRuntime  # noqa: E402

PR_SET_CHILD_SUBREAPER = 36


def cpu_s() -> tuple[float, float]:
    """(this process, its reaped descendants) in CPU seconds, user and system."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def reap_orphans() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--supervisor", default="compiled,bash")
    args = parser.parse_args()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    for supervisor in args.supervisor.split(","):
        measure(args.jobs, args.gpus, supervisor)


def measure(jobs: int, gpus: int, supervisor: str) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-agent-jobs-") as state_dir:
        runtime = ProcessRuntime(state_dir, supervisor=supervisor)
        reap_orphans()  # the compiler's, should it have built the supervisor
        own_before_s, children_before_s = cpu_s()
        started_at = time.monotonic()
        next_id, running, done = 1, set(), 0
        while done < jobs:
            while len(running) < gpus and next_id <= jobs:
                runtime.start(AttemptSpec(attempt_id=next_id, command=("true",)))
                running.add(next_id)
                next_id += 1
            time.sleep(0.002)
            for status in runtime.statuses():
                if status.state is not AttemptState.RUNNING:
                    runtime.remove(status.attempt_id)
                    running.discard(status.attempt_id)
                    done += 1
        reap_orphans()
        wall_s = time.monotonic() - started_at
        own_after_s, children_after_s = cpu_s()
    own_ms = 1000 * (own_after_s - own_before_s) / jobs
    children_ms = 1000 * (children_after_s - children_before_s) / jobs
    print(
        f"{supervisor:>8} supervisor: {jobs} jobs of `true` in {wall_s:.1f} s ({jobs / wall_s:.0f} "
        f"jobs/s); CPU per job: runtime {own_ms:.2f} ms + supervisor and job {children_ms:.2f} ms = "
        f"{own_ms + children_ms:.2f} ms (load average {os.getloadavg()[0]:.2f})"
    )


if __name__ == "__main__":
    main()
