"""The chaos run's job: `python3 -I ledger_job.py <ledger-dir> <duration_s> <exit_code>`.

It proves, after the fact, when and where each attempt's process really ran. The control plane's
own records cannot be the witness of its own mistakes (a job it thinks stopped may still run on
a node it declared lost), so every attempt appends to `<ledger-dir>/job-<id>.log`:

    <unix time> job=<id> attempt=<id> gpus=<CUDA_VISIBLE_DEVICES> pid=<pid> event=<event>

with the events `start`, `tick` (every 0.2 s), `end` (it ran its whole duration, then exits
with <exit_code>) and `term` (it got SIGTERM, then exits 143). A SIGKILL leaves no line: the
last tick bounds the interval to within a tick. Each line is one `os.write` of fewer than 512
bytes to a file opened with O_APPEND, which Linux appends whole, so attempts of one job running
at the same time (the very bug the run hunts) never interleave inside a line.

Standard library only, started with -I: it runs under the agent's process runtime with whatever
environment the job gets, and must cost next to nothing on a 2-core machine.
"""

import os
import signal
import sys
import time

TICK_S = 0.2
TERM_EXIT_CODE = 143  # 128 + SIGTERM, what a shell reports for a job ended by SIGTERM
MAX_LINE_BYTES = 511


def main(argv: list[str]) -> int:
    """Append start, ticks and end (or term) for this attempt; exit with the asked code."""
    if len(argv) != 4:
        print("usage: ledger_job.py <ledger-dir> <duration_s> <exit_code>", file=sys.stderr)
        return 2
    ledger_dir, duration_s, exit_code = argv[1], float(argv[2]), int(argv[3])
    job_id = os.environ.get("GPUCP_JOB_ID", "?")
    attempt_id = os.environ.get("GPUCP_ATTEMPT_ID", "?")
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    os.makedirs(ledger_dir, exist_ok=True)
    fd = os.open(
        os.path.join(ledger_dir, f"job-{job_id}.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644
    )
    prefix = f"job={job_id} attempt={attempt_id} gpus={gpus} pid={os.getpid()}"

    def record(event: str) -> None:
        line = f"{time.time():.3f} {prefix} event={event}\n".encode()
        os.write(fd, line[:MAX_LINE_BYTES])

    def on_term(_signum: int, _frame: object) -> None:
        record("term")
        os._exit(TERM_EXIT_CODE)

    signal.signal(signal.SIGTERM, on_term)
    record("start")
    deadline = time.monotonic() + duration_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(TICK_S, left))
        if time.monotonic() < deadline:
            record("tick")
    # Blocked while writing `end`, a SIGTERM must not also write `term`: the job did finish.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    record("end")
    os.close(fd)
    print(f"ran {duration_s:.1f} s, exiting {exit_code}", flush=True)
    return exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
