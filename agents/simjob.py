"""A stand-in training job for simulated nodes: `python -m agents.simjob --work-s 60`.

It does ``work_s`` seconds of work at full speed, going as fast as the modelled speed of its GPUs
under their power caps allows: the agent writes that speed (relative throughput, 1.0 uncapped)
to GPUCP_SIM_SPEED_FILE and keeps it current when a cap changes; GPUCP_SIM_SPEED is the speed at
start, for runtimes that cannot share a file. So a cap the scheduler sets makes a demo job take
longer, as it would on hardware.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable


def read_speed(path: str | None, fallback: float) -> float:
    """The current modelled speed, or ``fallback`` where the file is missing or unreadable."""
    if not path:
        return fallback
    try:
        with open(path) as f:
            return max(float(f.read().strip()), 0.0)
    except (OSError, ValueError):
        return fallback


def run_work(
    work_s: float,
    speed: Callable[[], float],
    *,
    step_s: float = 0.5,
    sleep: Callable[[float], None] = time.sleep,
    report: Callable[[float, float], None] | None = None,
) -> float:
    """Advance ``work_s`` of work at ``speed()`` per wall second; returns the wall seconds spent.

    The speed is read again every ``step_s``, so a changed cap takes effect within a step.
    """
    done_s = 0.0
    wall_s = 0.0
    while done_s < work_s:
        rate = speed()
        if rate <= 0.0:
            sleep(step_s)  # a lost GPU makes no progress; wait for it (or for a kill)
            wall_s += step_s
            continue
        step = min(step_s, (work_s - done_s) / rate)
        sleep(step)
        wall_s += step
        done_s += step * rate
        if report is not None:
            report(min(done_s, work_s), rate)
    return wall_s


def main(argv: list[str] | None = None) -> int:
    """Parse the flags and run the stand-in job; exits with --exit-code (0 by default)."""
    p = argparse.ArgumentParser(prog="python -m agents.simjob")
    p.add_argument("--work-s", type=float, default=10.0, help="seconds of work at full speed")
    p.add_argument("--exit-code", type=int, default=0, help="what to exit with when done")
    p.add_argument("--step-s", type=float, default=0.5, help="how often progress is printed")
    args = p.parse_args(argv)
    fallback = float(os.environ.get("GPUCP_SIM_SPEED") or 1.0)
    path = os.environ.get("GPUCP_SIM_SPEED_FILE")

    def report(done_s: float, rate: float) -> None:
        print(f"progress {done_s:.1f}/{args.work_s:.1f} s of work at speed {rate:.3f}", flush=True)

    wall_s = run_work(
        args.work_s, lambda: read_speed(path, fallback), step_s=args.step_s, report=report
    )
    print(f"done: {args.work_s:.1f} s of work in {wall_s:.1f} s", flush=True)
    return int(args.exit_code)


if __name__ == "__main__":
    sys.exit(main())
