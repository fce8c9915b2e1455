"""The chaos run from the command line.

    .venv/bin/python -m tests.chaos.run --minutes 20 --seed 1 --agents 4 --gpus-per-agent 2 \\
        [--injections-every 5-15] [--lease-s 20 --lease-margin-s 3] [--out DIR]

Starts a private deployment (tests.chaos.harness), submits a stream of ledger jobs while
breaking one thing every few seconds, drains, and checks the job contract's promises
(tests.chaos.invariants). Prints one line per invariant, the informative lines and the details;
writes the same to <out>/summary.txt and report.json. Exit status 1 when any invariant was
violated, 2 when the deployment could not be brought up.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from tests.chaos.harness import HarnessError, Timings
from tests.chaos.scenario import KIND_WEIGHTS, Config, run


def seconds_range(text: str) -> tuple[float, float]:
    low, sep, high = text.partition("-")
    try:
        pair = (float(low), float(high if sep else low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected A-B seconds, got {text!r}") from None
    if pair[0] <= 0 or pair[1] < pair[0]:
        raise argparse.ArgumentTypeError(f"expected 0 < A <= B, got {text!r}")
    return pair


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tests.chaos.run", description=__doc__.split("\n")[0]
    )
    p.add_argument("--minutes", type=float, default=20.0, help="length of the storm (20)")
    p.add_argument("--seed", type=int, default=1, help="seed of the faults and the jobs (1)")
    p.add_argument("--agents", type=int, default=4, help="node agents (4)")
    p.add_argument("--gpus-per-agent", type=int, default=2, help="simulated GPUs each (2)")
    p.add_argument(
        "--injections-every", type=seconds_range, default=(5.0, 15.0), help="A-B seconds (5-15)"
    )
    p.add_argument("--kinds", default=",".join(KIND_WEIGHTS), help="faults to draw from (all)")
    p.add_argument("--each-kind-first", action="store_true", help="every kind once, then random")
    p.add_argument("--lease-s", type=float, default=20.0, help="NODE_LEASE_S, L (20)")
    p.add_argument("--lease-margin-s", type=float, default=3.0, help="NODE_LEASE_MARGIN_S, m (3)")
    p.add_argument(
        "--db-conn-max-age",
        type=int,
        default=None,
        help="DB_CONN_MAX_AGE for the control plane (default: the production default, unset)",
    )
    p.add_argument(
        "--web-pool",
        type=int,
        default=0,
        help="DB_POOL_MAX_SIZE of the web processes (0: no pool, the default deployment's)",
    )
    p.add_argument("--drain-timeout-s", type=float, default=300.0, help="bound on the drain (300)")
    p.add_argument("--out", type=Path, default=None, help="run folder (default: a new /tmp one)")
    p.add_argument(
        "--code",
        type=Path,
        default=None,
        help="the project tree to run (default: this checkout), e.g. a `git archive` of a commit",
    )
    args = p.parse_args(argv)
    unknown = set(args.kinds.split(",")) - set(KIND_WEIGHTS)
    if unknown:
        p.error(f"unknown kinds {sorted(unknown)}; known: {', '.join(KIND_WEIGHTS)}")
    return args


def _interrupted(signum: int, _frame) -> None:
    # SIGTERM and SIGHUP become an exception in the main thread, so every `finally` runs and the
    # deployment is torn down (the harness's reaper covers a SIGKILL).
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupted)
    cfg = Config(
        minutes=args.minutes,
        seed=args.seed,
        agents=args.agents,
        gpus_per_agent=args.gpus_per_agent,
        injections_every_s=args.injections_every,
        out=args.out,
        timings=Timings(
            lease_s=args.lease_s,
            lease_margin_s=args.lease_margin_s,
            db_conn_max_age_s=args.db_conn_max_age,
        ),
        kinds=tuple(args.kinds.split(",")),
        each_kind_first=args.each_kind_first,
        drain_timeout_s=args.drain_timeout_s,
        code_dir=args.code,
        web_pool=args.web_pool,
    )
    try:
        result = run(cfg, log=lambda line: print(line, flush=True))
    except HarnessError as exc:
        print(f"chaos: the deployment did not come up: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print(f"chaos: interrupted ({exc or 'SIGINT'}); everything started was torn down")
        return 130
    print(result.summary, flush=True)
    return 1 if result.report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
