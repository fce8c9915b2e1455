"""The `gpucp` command's figures: start-up, `run --wait` round trip, and log-follow latency.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/gpucp REDIS_URL=redis://127.0.0.1:6379/15 \
      .venv/bin/python benchmarks/bench_cli.py [--jobs 50] [--heartbeat-s 10]

Like bench_submit_to_running, it creates its own database (DATABASE_URL's name + "_bench_cli"),
starts gunicorn, a Celery worker with beat and one agent (8 simulated GPUs, process runtime)
on 127.0.0.1, and runs the installed `gpucp` command in processes of its own, as a person would:

- start-up: wall time of `gpucp --help` (goal < 150 ms);
- round trip: wall time of `gpucp run --wait -q -- true`, one at a time on the idle cluster
  (submit, scheduling, the agent starting and reporting the job, the wait's polls);
- follow latency: a job prints its clock every 0.5 s; `gpucp logs -f` reads each line, and the
  difference is the time from print to terminal (goal p50 < 1 s). The agent ships a running
  job's output every 0.5 s between heartbeats (--heartbeat-s; production's default is 10 s).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_heartbeat import (  # noqa: E402 - after the path set-up
    percentile,
    stop,
)
from bench_submit_to_running import (  # noqa: E402
    _answers,
    _kill_leftover_jobs,
    agent_command,
    prepare_database,
    seed_tenant,
    spawn,
    start_servers,
    wait_for,
)

BIN = Path(sys.executable).parent
GPUCP = str(BIN / "gpucp")


def timed(cmd: list[str], env: dict) -> tuple[float, subprocess.CompletedProcess]:
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    return time.perf_counter() - started, done


def summary(label: str, values: list[float]) -> str:
    values = sorted(values)
    if not values:
        return f"  {label:34s} (none)"
    return (
        f"  {label:34s} p50 {percentile(values, 0.5) * 1000:7.0f} ms"
        f"  p90 {percentile(values, 0.9) * 1000:7.0f} ms  max {values[-1] * 1000:7.0f} ms"
        f"  (n={len(values)})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--lines", type=int, default=20)
    parser.add_argument("--heartbeat-s", type=float, default=10.0)
    parser.add_argument("--port", type=int, default=18470)
    parser.add_argument("--log-dir", default=str(ROOT / "benchmarks" / "out" / "cli"))
    args = parser.parse_args()

    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    env = prepare_database("_bench_cli", AGENT_HEARTBEAT_INTERVAL_S=str(args.heartbeat_s))
    from controlplane.cluster.models import Node

    (user_token,), join_token = seed_tenant()
    url = f"http://127.0.0.1:{args.port}"
    startup: list[float] = []
    cli_env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("GPUCP_")},
        "GPUCP_URL": url,
        "GPUCP_TOKEN": user_token,
    }
    # Before the servers start, which would share the CPUs with it.
    for _ in range(20):
        elapsed_s, done = timed([GPUCP, "--help"], cli_env)
        assert done.returncode == 0, done.stderr
        startup.append(elapsed_s)
    procs = start_servers(args.port, env, log_dir)
    state_root = log_dir / "agents"
    shutil.rmtree(state_root, ignore_errors=True)
    round_trips: list[float] = []
    latencies: list[float] = []
    try:
        wait_for(lambda: _answers(url), 60, f"gunicorn on {url} (see {log_dir})")
        procs.append(
            spawn(
                agent_command(url, "bench-cli", state_root),
                {**env, "GPUCP_JOIN_TOKEN": join_token},
                log_dir / "agent.log",
            )
        )
        wait_for(lambda: Node.objects.filter(ready=True).count() == 1, 90, "the agent")
        time.sleep(2)
        print(f"{args.jobs} x gpucp run --wait, one at a time ...", flush=True)
        for _ in range(args.jobs):
            elapsed_s, done = timed(
                [GPUCP, "run", "--wait", "-q", "--image", "localhost/bench:1", "--", "true"],
                cli_env,
            )
            if done.returncode != 0:
                sys.exit(f"gpucp run --wait exited {done.returncode}: {done.stderr[-300:]}")
            round_trips.append(elapsed_s)

        printer = (
            f"import time\nfor i in range({args.lines}):\n"
            "    print(repr(time.time()), flush=True)\n    time.sleep(0.5)\n"
        )
        _, done = timed(
            [
                GPUCP,
                "run",
                "-q",
                "--image",
                "localhost/bench:1",
                "--",
                sys.executable,
                "-c",
                printer,
            ],
            cli_env,
        )
        job_id = done.stdout.strip()
        print(f"following job {job_id} ({args.lines} lines, 0.5 s apart) ...", flush=True)
        follower = subprocess.Popen(
            [GPUCP, "logs", "-f", job_id], env=cli_env, stdout=subprocess.PIPE, text=True
        )
        assert follower.stdout is not None
        for line in follower.stdout:
            latencies.append(time.time() - float(line))
        follower.wait(timeout=60)
    finally:
        for proc in reversed(procs):
            stop(proc)
        _kill_leftover_jobs(state_root)

    print()
    print(
        f"gpucp benchmark: 1 node x 8 simulated GPUs, process runtime, gunicorn + Celery + Redis,"
        f" agent heartbeat {args.heartbeat_s:g} s, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(summary("gpucp --help (start-up)", startup))
    print(summary("gpucp run --wait (round trip)", round_trips))
    print(summary("logs -f: print -> terminal", latencies))


if __name__ == "__main__":
    main()
