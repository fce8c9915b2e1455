"""python -m scheduler.simulator: replay a trace under several policies and write a report."""

from __future__ import annotations

import argparse
import sys

from scheduler.simulator.checkpoints import CheckpointIntervals
from scheduler.simulator.compare import compare
from scheduler.simulator.engine import RestartCost, SimOptions
from scheduler.simulator.loaders import TraceError, load_trace
from scheduler.simulator.policies import PRESETS
from scheduler.simulator.report import (
    command_line,
    guarantees,
    summary_table,
    tenant_table,
    trace_label,
    write_report,
)
from scheduler.simulator.trace import Trace


def _restart_cost(text: str) -> RestartCost:
    try:
        one, eight, beyond = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError("expected three seconds: 1 GPU,up to 8,beyond") from None
    return RestartCost(one, eight, beyond)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m scheduler.simulator",
        description="Replay a GPU-cluster trace through scheduler.policy.plan under several "
        "policies and compare them.",
    )
    parser.add_argument("--trace", default="philly", help="philly, alibaba, synthetic or a path")
    parser.add_argument(
        "--vc-nodes",
        default=None,
        metavar="FILE",
        help="nodes per virtual cluster of a Philly-format --trace path (columns vc,node num; "
        "default: philly-vc-nodes.csv beside it)",
    )
    parser.add_argument(
        "--node-list",
        default=None,
        metavar="FILE",
        help="node list of an openb --trace path (columns sn,cpu_milli,memory_mib,gpu,model; "
        "default: openb_node_list_gpu_node.csv beside it)",
    )
    parser.add_argument(
        "--policy",
        default="fifo-static,ours",
        help=f"comma-separated, from: {', '.join(PRESETS)}",
    )
    parser.add_argument("--cycle-s", type=float, default=60.0, help="periodic scheduling tick")
    parser.add_argument(
        "--debounce-s",
        type=float,
        default=0.0,
        help="delay of the cycle an arrival or completion requests",
    )
    parser.add_argument(
        "--periodic-only",
        action="store_true",
        help="schedule only at the periodic tick (no cycle requested by arrivals or completions)",
    )
    parser.add_argument("--load-factor", type=float, default=1.0, help="compress arrivals by L")
    parser.add_argument("--power-budget", type=float, default=None, help="pool budget in W")
    parser.add_argument(
        "--restart-cost",
        type=_restart_cost,
        default=RestartCost(),
        help="seconds per restart for 1 GPU, up to 8, beyond (default 7,30,60)",
    )
    parser.add_argument(
        "--checkpoint-interval",
        default="continuous",
        help="how often jobs checkpoint: continuous (default: a preemption costs only the "
        "restart), none (a preempted job starts over), fixed:<seconds>, uniform:<lo>-<hi> "
        "(seconds, drawn per job)",
    )
    parser.add_argument(
        "--checkpoint-seed", type=int, default=0, help="seed of the per-job interval draws"
    )
    parser.add_argument(
        "--no-checkpoint-knowledge",
        action="store_true",
        help="do not tell the scheduler the jobs' checkpoint intervals and last checkpoints",
    )
    parser.add_argument(
        "--grace-s",
        type=float,
        default=0.0,
        help="notice before a preemption, with checkpoint intervals: a victim whose next "
        "checkpoint falls within it saves it before its GPUs are freed",
    )
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N jobs")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic trace")
    parser.add_argument("--out", default=None, help="folder for report.md and the plots")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


class UsageError(Exception):
    """What is wrong with the command line, said as the command prints it."""


def prepare(args: argparse.Namespace) -> tuple[list[str], Trace, SimOptions]:
    """The policies, the trace and the options the parsed command line asks for (shared with
    ``python -m scheduler.simulator.sweep``); UsageError names what is wrong."""
    names = [n.strip() for n in args.policy.split(",") if n.strip()]
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        raise UsageError(f"unknown policy {', '.join(unknown)}; known: {', '.join(PRESETS)}")
    try:
        checkpoints = CheckpointIntervals.parse(args.checkpoint_interval, args.checkpoint_seed)
    except ValueError as exc:
        raise UsageError(f"--checkpoint-interval: {exc}") from None
    try:
        trace = load_trace(
            args.trace, seed=args.seed, vc_nodes=args.vc_nodes, node_list=args.node_list
        ).limited(args.limit)
    except TraceError as exc:
        raise UsageError(f"cannot load the trace: {exc}") from None
    options = SimOptions(
        cycle_s=args.cycle_s,
        event_cycles=not args.periodic_only,
        debounce_s=args.debounce_s,
        restart_cost=args.restart_cost,
        power_budget_w=args.power_budget,
        checkpoints=checkpoints,
        checkpoint_knowledge=not args.no_checkpoint_knowledge,
        grace_s=args.grace_s,
    )
    return names, trace, options


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        names, trace, options = prepare(args)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
    for note in trace.notes:
        print(f"trace: {note}", file=sys.stderr)
    result = compare(trace, names, options, load_factor=args.load_factor, progress=not args.quiet)
    power = args.power_budget is not None
    print(summary_table(result.summaries, power=power))
    print()
    print(tenant_table(result.summaries))
    if args.out:
        argv = argv if argv is not None else sys.argv[1:]
        label = trace_label(args.trace, trace, seed=args.seed)
        path = write_report(
            args.out,
            result.summaries,
            result.results,
            title=f"{label}: {len(trace.jobs):,} jobs, load factor {args.load_factor:g}",
            notes=trace.notes,
            command=command_line("python -m scheduler.simulator", argv),
            plots=not args.no_plots,
            guarantees=guarantees(trace),
        )
        print(f"\nreport: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
