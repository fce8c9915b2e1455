"""The policies the simulator compares: presets of one ``Config`` over the same ``plan``.

A preset is a config plus two things the config cannot say: what the simulator tells the
policy about durations (nothing, the oracle duration, or the oracle remaining time), and how
tenants share the cluster (static partitions, or guarantees with borrowing).

The baselines of ANCHORS.md ran every VC on its own nodes, so the static presets keep a tenant
on its own nodes where the trace says which those are: each partition's GPUs are labelled with
a type of their own (``P100-PCIE-16GB@6214e9``) and the tenant's jobs ask for it, which the
plan's type matching honours without any special case in the core. Where the trace has no node
owners (Alibaba), a static partition is a quota with ``guaranteed == limit``.

The ``-strict`` presets reproduce the published simulators' non-preemptive regime: their FIFO
and SJF stop at the first job of a partition that does not fit (head-of-line blocking), where
the plan with ``backfill=False`` starts every job that fits. They take the plan's own decisions
and keep, per tenant, only the starts before the first job left waiting in the plan's order;
since the plan walks its queue in that order, the kept placements are the ones it chose.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypedDict

from scheduler import priority
from scheduler.model import ANY_GPU_TYPE, Config, Node, Ordering, Plan, Quota, Snapshot, Tenant
from scheduler.simulator.trace import PARTITION_SEPARATOR, Trace, TraceJob, make_node


class Oracle(enum.StrEnum):
    """What the simulator reveals of the future to the policy."""

    NONE = "none"  # nothing: the policy predicts from the simulated history
    DURATION = "duration"  # Pending.predicted_duration_s = the job's true duration
    REMAINING = "remaining"  # and Running.remaining_s = its true remaining time


class Sharing(enum.StrEnum):
    STATIC = "static"  # each tenant on its own partition, no borrowing
    SHARED = "shared"  # guarantees, and idle GPUs lent up to the whole pool


@dataclass(frozen=True, slots=True)
class Preset:
    name: str
    description: str
    config: Config
    oracle: Oracle = Oracle.NONE
    sharing: Sharing = Sharing.SHARED
    strict: bool = False  # head-of-line blocking per tenant (see the module's docstring)


class _Switches(TypedDict):
    borrowing: bool
    preemption: bool
    backfill: bool


_STATIC = _Switches(borrowing=False, preemption=False, backfill=False)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "fifo-static",
            "FIFO, each tenant on its own partition (Philly's regime)",
            Config(ordering=Ordering.FIFO, **_STATIC),
            sharing=Sharing.STATIC,
        ),
        Preset(
            "fifo-strict",
            "FIFO with head-of-line blocking, own partitions (the Helios simulator's FIFO)",
            Config(ordering=Ordering.FIFO, **_STATIC),
            sharing=Sharing.STATIC,
            strict=True,
        ),
        Preset(
            "fifo-shared",
            "FIFO, guarantees with idle GPUs lent out",
            Config(ordering=Ordering.FIFO, borrowing=True, preemption=False, backfill=False),
        ),
        Preset(
            "sjf",
            "shortest job first, oracle durations, static partitions",
            Config(ordering=Ordering.SJF, **_STATIC),
            oracle=Oracle.DURATION,
            sharing=Sharing.STATIC,
        ),
        Preset(
            "sjf-strict",
            "SJF with head-of-line blocking, oracle durations (the Helios simulator's SJF)",
            Config(ordering=Ordering.SJF, **_STATIC),
            oracle=Oracle.DURATION,
            sharing=Sharing.STATIC,
            strict=True,
        ),
        # Helios' SRTF preempts as soon as a shorter job arrives: no minimum run time.
        Preset(
            "srtf",
            "shortest remaining time first, oracle, preemptive, static partitions",
            Config(
                ordering=Ordering.SRTF,
                borrowing=False,
                preemption=True,
                backfill=False,
                min_runtime_s=0.0,
                max_preemptions=None,
            ),
            oracle=Oracle.REMAINING,
            sharing=Sharing.STATIC,
        ),
        Preset(
            "tiresias",
            "Tiresias 2D-LAS, no duration knowledge, preemptive, static partitions",
            Config(
                ordering=Ordering.LAS,
                borrowing=False,
                preemption=True,
                backfill=False,
                min_runtime_s=0.0,
                max_preemptions=None,
            ),
            sharing=Sharing.STATIC,
        ),
        Preset(
            "qssf",
            "Helios QSSF: shortest predicted GPU time first (history), static partitions",
            Config(ordering=Ordering.QSSF, **_STATIC),
            sharing=Sharing.STATIC,
        ),
        Preset("ours", "our default policy (Config defaults), predictions from history", Config()),
        Preset(
            "sjf-shared",
            "shortest job first, oracle durations, guarantees with idle GPUs lent out",
            Config(ordering=Ordering.SJF, borrowing=True, preemption=False, backfill=False),
            oracle=Oracle.DURATION,
        ),
        # The preempting baselines are the published rules, with no bound on preemptions per job.
        # A preempted job pays its restart before it progresses again, and the oracle counts it
        # in the job's remaining time (see the engine's _make_pending): a victim is taken only
        # by a job that ends sooner than it would even after paying that. The minimum run time
        # is the restart itself (a job restarting is not taken again before it could progress),
        # so two jobs of nearly equal remaining time never trade GPUs back and forth.
        Preset(
            "srtf-shared",
            "shortest remaining time first, oracle, preemptive, guarantees with idle GPUs lent out",
            Config(
                ordering=Ordering.SRTF,
                borrowing=True,
                preemption=True,
                backfill=False,
                min_runtime_s=60.0,
                max_preemptions=None,
            ),
            oracle=Oracle.REMAINING,
        ),
        Preset(
            "tiresias-shared",
            "Tiresias 2D-LAS, no duration knowledge, preemptive, guarantees with idle GPUs lent out",
            Config(
                ordering=Ordering.LAS,
                borrowing=True,
                preemption=True,
                backfill=False,
                min_runtime_s=60.0,
                max_preemptions=None,
            ),
        ),
        Preset(
            "ours-oracle",
            "our default policy with the oracle's durations instead of predictions",
            Config(),
            oracle=Oracle.DURATION,
        ),
    )
}
# The reference of finish-time fairness: every tenant alone on its own partition.
REFERENCE_PRESET = "fifo-static"


def preset(name: str) -> Preset:
    """The preset called ``name``; a clear error listing the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(PRESETS)}") from None


PlanFunction = Callable[[Snapshot, Config], Plan]


def head_of_line(policy: PlanFunction) -> PlanFunction:
    """``policy`` with head-of-line blocking: per tenant, no start after its first waiting job."""

    def strict(snapshot: Snapshot, config: Config) -> Plan:
        made = policy(snapshot, config)
        started = {s.job_id for s in made.starts}
        if len(started) == len(snapshot.pending):
            return made
        queue = priority.order(
            snapshot.pending, config, snapshot.now_s, {}, made.predicted_duration_s
        )
        blocked: set[str] = set()
        kept: set[int] = set()
        for p in queue:
            if p.tenant in blocked:
                continue
            if p.job_id in started:
                kept.add(p.job_id)
            else:
                blocked.add(p.tenant)
        if len(kept) == len(started):
            return made
        return replace(made, starts=tuple(s for s in made.starts if s.job_id in kept))

    return strict


def pinned(trace: Trace, sharing: Sharing) -> bool:
    """Whether a static run keeps every tenant on nodes of its own (a GPU type per partition)."""
    return sharing is Sharing.STATIC and all(n.owner for n in trace.nodes)


def independent(trace: Trace, sharing: Sharing) -> bool:
    """Whether no tenant's decisions can depend on another's: pinned, and every job's tenant
    has nodes (a tenant without any would have jobs of no type of its own)."""
    owners = {n.owner for n in trace.nodes}
    return pinned(trace, sharing) and all(j.tenant in owners for j in trace.jobs)


def cluster_for(
    trace: Trace, sharing: Sharing
) -> tuple[tuple[TraceJob, ...], tuple[Node, ...], tuple[Tenant, ...]]:
    """The jobs, nodes and tenants a trace gives under one way of sharing the cluster."""
    total = trace.total_gpus
    on_own_nodes = pinned(trace, sharing)
    nodes = []
    for n in trace.nodes:
        gpu_type = f"{n.gpu_type}{PARTITION_SEPARATOR}{n.owner}" if on_own_nodes else n.gpu_type
        nodes.append(
            make_node(n.name, n.gpus, gpu_type, pool=n.pool, cpus=n.cpus, memory_mib=n.memory_mib)
        )
    jobs = trace.jobs
    if on_own_nodes:
        # A partition has one board type in every trace we load, so the label is unambiguous.
        board = {n.owner: n.gpu_type for n in trace.nodes}
        jobs = tuple(
            replace(j, gpu_type=f"{board[j.tenant]}{PARTITION_SEPARATOR}{j.tenant}")
            if j.tenant in board
            else j
            for j in jobs
        )
    tenants = []
    for t in trace.tenants:
        limit = t.guaranteed_gpus if sharing is Sharing.STATIC else total
        quota = Quota(ANY_GPU_TYPE, guaranteed_gpus=t.guaranteed_gpus, limit_gpus=limit)
        tenants.append(Tenant(t.name, weight=t.weight, quotas=(quota,)))
    return jobs, tuple(nodes), tuple(tenants)
