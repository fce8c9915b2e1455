"""How many `gpucp logs -f` followers one web process holds: latency and cost as they grow.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/gpucp REDIS_URL=redis://127.0.0.1:6379/15 \
      .venv/bin/python benchmarks/bench_log_followers.py [--followers 1,4,16,64,128] [--phase-s 20]

The production path, as bench_cli starts it: its own database (DATABASE_URL's name +
"_bench_followers"), ONE gunicorn web process (gthread, 32 threads: docker-compose's per-process
default), a Celery worker with beat, one agent (process runtime, the default 10 s heartbeat;
it ships a running job's output every 0.5 s between heartbeats). One job prints its clock every
0.5 s. For each count N, N followers (threads of the SDK's `Client.follow_logs`, which is what
`gpucp logs -f` runs; 32 per client process; a user and token each) follow it for --phase-s seconds, and the script
prints, per N: print -> follower latency (p50, p99), the API answers the followers needed per
second, and the web process's CPU (share of one core, from /proc). Up to
LOG_FOLLOWERS_MAX_PER_PROCESS followers wait inside the server at once; the others are answered
at once and ask again after 0.5 s, so latency grows slowly and the cost is requests, not
threads. The load average is printed before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_heartbeat import (  # noqa: E402 - after the path set-up
    cpu_s,
    percentile,
    process_group,
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
THREADS_PER_CLIENT = 32


def follow_as_client(url: str, tokens: list[str], job_id: int, seconds: float) -> None:
    """One client process: a follower per token for `seconds`; prints their figures as JSON."""
    from gpucp import Client

    answers = [0]
    lock = threading.Lock()
    latencies: list[float] = []
    stop_at = time.monotonic() + seconds

    def follower(token: str) -> None:
        api = Client(url, token)
        logs = api.logs

        def counted(*args, **kwargs):
            with lock:
                answers[0] += 1
            return logs(*args, **kwargs)

        api.logs = counted  # type: ignore[method-assign]
        start = logs(job_id)["next_offset"]
        pending = ""
        for text in api.follow_logs(job_id, offset=start):
            now = time.time()
            pending += text
            *lines, pending = pending.split("\n")
            with lock:
                latencies.extend(now - float(line) for line in lines if line.strip())
            if time.monotonic() > stop_at:
                return

    threads = [threading.Thread(target=follower, args=(t,), daemon=True) for t in tokens]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 30)
    print(json.dumps({"answers": answers[0], "latencies": latencies}))


def cpu_s_of_group(pgid: int) -> float:
    """User + system CPU seconds of the live processes of a process group (the web server)."""
    return cpu_s(process_group(pgid))


def phase(url: str, tokens: list[str], job_id: int, seconds: float, web_pgid: int) -> str:
    count = len(tokens)
    clients = []
    for first in range(0, count, THREADS_PER_CLIENT):
        clients.append(
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--as-client",
                    json.dumps([url, tokens[first : first + THREADS_PER_CLIENT], job_id, seconds]),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    cpu_before = cpu_s_of_group(web_pgid)
    started = time.monotonic()
    answers = 0
    latencies: list[float] = []
    for client in clients:
        out, _ = client.communicate(timeout=seconds + 120)
        result = json.loads(out.strip().splitlines()[-1])
        answers += result["answers"]
        latencies.extend(result["latencies"])
    elapsed_s = time.monotonic() - started
    web_cpu = (cpu_s_of_group(web_pgid) - cpu_before) / elapsed_s
    latencies.sort()
    if not latencies:
        return f"| {count} | 0 lines | - | - | {answers / elapsed_s:.0f} | {web_cpu:.0%} |"
    return (
        f"| {count} | {len(latencies)} | {percentile(latencies, 0.5) * 1000:.0f} ms"
        f" / {percentile(latencies, 0.99) * 1000:.0f} ms | {answers / elapsed_s:.0f}"
        f" | {web_cpu:.0%} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--followers", default="1,4,16,64,128")
    parser.add_argument("--phase-s", type=float, default=20.0)
    parser.add_argument("--port", type=int, default=18475)
    parser.add_argument("--log-dir", default=str(ROOT / "benchmarks" / "out" / "followers"))
    parser.add_argument("--as-client", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_client:
        follow_as_client(*json.loads(args.as_client))
        return
    counts = [int(n) for n in args.followers.split(",")]

    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    env = prepare_database("_bench_followers")
    from gpucp import Client

    from controlplane.cluster.models import Node
    from controlplane.jobs.api.views import LOG_FOLLOWERS_MAX_PER_PROCESS

    # A person per follower: each has their own request rate (API_THROTTLE_USER_RATE), as the
    # researchers following a job from their own terminals do.
    tokens, join_token = seed_tenant(users=max(counts))
    url = f"http://127.0.0.1:{args.port}"
    load_before = os.getloadavg()
    procs = start_servers(args.port, env, log_dir, workers=1, threads=THREADS_PER_CLIENT)
    web = procs[0]
    state_root = log_dir / "agents"
    shutil.rmtree(state_root, ignore_errors=True)
    rows = []
    try:
        wait_for(lambda: _answers(url), 60, f"gunicorn on {url} (see {log_dir})")
        procs.append(
            spawn(
                agent_command(url, "bench-followers", state_root),
                {**env, "GPUCP_JOIN_TOKEN": join_token},
                log_dir / "agent.log",
            )
        )
        wait_for(lambda: Node.objects.filter(ready=True).count() == 1, 90, "the agent")
        api = Client(url, tokens[0])
        lines = int((len(counts) * (args.phase_s + 15) + 60) / 0.5)
        printer = (
            f"import time\nfor i in range({lines}):\n"
            "    print(repr(time.time()), flush=True)\n    time.sleep(0.5)\n"
        )
        job = api.submit(
            {
                "name": "clock",
                "image": "localhost/bench:1",
                "command": [sys.executable, "-c", printer],
                "gpus": 1,
            }
        )
        wait_for(lambda: api.job(job["id"])["state"] == "RUNNING", 60, "the clock job")
        for count in counts:
            print(f"{count} followers for {args.phase_s:g} s ...", flush=True)
            rows.append(phase(url, tokens[:count], job["id"], args.phase_s, web.pid))
        api.cancel(job["id"])
    finally:
        for proc in reversed(procs):
            stop(proc)
        _kill_leftover_jobs(state_root)

    print()
    print(
        f"log followers of one job, one gunicorn process (gthread, {THREADS_PER_CLIENT} "
        f"threads; {LOG_FOLLOWERS_MAX_PER_PROCESS} followers wait in the server at once), agent "
        f"heartbeat 10 s, {os.cpu_count()} CPUs; load average {load_before[0]:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after"
    )
    print("| followers | lines read | print -> follower p50 / p99 | answers/s | web CPU |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(row)
    print("command: " + " ".join([Path(sys.executable).name, *sys.argv]))


if __name__ == "__main__":
    main()
