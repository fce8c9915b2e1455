"""What a trace is, once loaded: jobs, nodes and tenants as plain data, plus a seeded generator.

A trace says what happened (who submitted what, when, and how long it ran on its GPUs); it says
nothing about a policy. The policy presets (``policies.py``) turn a trace into the nodes, tenants
and quotas one policy runs on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TypedDict, Unpack

from scheduler.gpu_model import GPU_TYPES, GpuType
from scheduler.model import ANY_GPU_TYPE, Gpu, Node


@dataclass(frozen=True, slots=True)
class TraceJob:
    """One job of a trace: its request and how long it ran (the oracle duration)."""

    job_id: int
    tenant: str
    submit_s: float
    duration_s: float  # run time on its GPUs, uncapped and without restarts
    gpus: int
    user: str = ""
    name: str = ""
    gpu_type: str = ANY_GPU_TYPE
    priority: int = 100
    preemptible: bool = True
    cpus: float = 0.0
    memory_mib: int = 0


@dataclass(frozen=True, slots=True)
class TraceNode:
    """A node of the trace's cluster; ``owner`` is the tenant whose partition it belongs to."""

    name: str
    gpus: int
    gpu_type: str
    owner: str | None = None
    pool: str = "default"
    cpus: float = 0.0
    memory_mib: int = 0


@dataclass(frozen=True, slots=True)
class TraceTenant:
    name: str
    guaranteed_gpus: int
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    jobs: tuple[TraceJob, ...]
    nodes: tuple[TraceNode, ...]
    tenants: tuple[TraceTenant, ...]
    # What the loader did that a reader of the results must know (drops, roundings, mappings).
    notes: tuple[str, ...] = field(default=())

    @property
    def total_gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)

    def limited(self, max_jobs: int | None) -> Trace:
        """The first ``max_jobs`` jobs (all of them for None), for quick runs."""
        if max_jobs is None or max_jobs >= len(self.jobs):
            return self
        note = f"only the first {max_jobs:,} of {len(self.jobs):,} jobs were replayed (--limit)"
        return Trace(self.name, self.jobs[:max_jobs], self.nodes, self.tenants, (*self.notes, note))


def compress_arrivals(jobs: tuple[TraceJob, ...], load_factor: float) -> tuple[TraceJob, ...]:
    """Raise the load by ``load_factor``: ``submit' = t0 + (submit - t0) / L``, t0 the first submit.

    Sizes and durations are unchanged, so the same work arrives in 1/L of the time.
    """
    if load_factor <= 0:
        raise ValueError(f"load factor must be positive, got {load_factor}")
    if load_factor == 1.0 or not jobs:
        return jobs
    t0 = min(j.submit_s for j in jobs)
    out = []
    for j in jobs:
        submit_s = t0 + (j.submit_s - t0) / load_factor
        out.append(
            TraceJob(
                j.job_id,
                j.tenant,
                submit_s,
                j.duration_s,
                j.gpus,
                j.user,
                j.name,
                j.gpu_type,
                j.priority,
                j.preemptible,
                j.cpus,
                j.memory_mib,
            )
        )
    return tuple(out)


# Power limits of GPU types that scheduler.gpu_model does not list. The Alibaba names are that
# trace's own; G2 and G3 are not public, so they get a V100-class board (an assumption).
_EXTRA_GPU_TYPES: dict[str, GpuType] = {
    t.name: t
    for t in (
        GpuType("T4", min_w=60.0, max_w=70.0, idle_w=10.0, memory_mib=15360),
        GpuType("A10", min_w=100.0, max_w=150.0, idle_w=20.0, memory_mib=23028),
        GpuType("P100", min_w=125.0, max_w=250.0, idle_w=30.0, memory_mib=16384),
        GpuType("V100M16", min_w=100.0, max_w=300.0, idle_w=40.0, memory_mib=16384),
        GpuType("V100M32", min_w=100.0, max_w=300.0, idle_w=40.0, memory_mib=32768),
        GpuType("G2", min_w=100.0, max_w=300.0, idle_w=40.0, memory_mib=32768),
        GpuType("G3", min_w=100.0, max_w=300.0, idle_w=40.0, memory_mib=32768),
    )
}
# For a type nobody knows: a generic 300 W training board.
_GENERIC_GPU = GpuType("generic", min_w=100.0, max_w=300.0, idle_w=40.0, memory_mib=32768)
# A static node partition labels its GPUs "<type>@<tenant>"; the power model needs the board.
PARTITION_SEPARATOR = "@"


def gpu_type_limits(gpu_type: str) -> GpuType:
    """Power limits and idle draw of a GPU type (a partition label is reduced to its board)."""
    board = gpu_type.split(PARTITION_SEPARATOR, 1)[0]
    return GPU_TYPES.get(board) or _EXTRA_GPU_TYPES.get(board) or _GENERIC_GPU


class NodeExtras(TypedDict, total=False):
    """The fields of a Node that make_node passes through as given."""

    schedulable: bool
    draining: bool
    cpus: float
    memory_mib: int


def make_node(
    name: str, gpus: int, gpu_type: str, pool: str = "default", **extra: Unpack[NodeExtras]
) -> Node:
    """A scheduler Node with ``gpus`` GPUs of ``gpu_type``, their power limits filled in."""
    limits = gpu_type_limits(gpu_type)
    return Node(
        name=name,
        pool=pool,
        gpus=tuple(
            Gpu(
                uuid=f"{name}-g{i}",
                index=i,
                gpu_type=gpu_type,
                power_min_w=limits.min_w,
                power_max_w=limits.max_w,
                power_default_w=limits.max_w,
            )
            for i in range(gpus)
        ),
        **extra,
    )


def synthetic_trace(
    seed: int = 0,
    *,
    jobs: int = 200,
    tenants: int = 3,
    nodes_per_tenant: int = 2,
    gpus_per_node: int = 8,
    mean_interarrival_s: float = 120.0,
    median_duration_s: float = 1800.0,
    gpu_type: str = "V100-SXM2-32GB",
) -> Trace:
    """A seeded random trace: Poisson arrivals, log-normal durations, mostly 1-GPU jobs.

    Tenants are unequally busy (tenant i submits in proportion to i + 1), so static partitions
    leave capacity idle in some while others queue, as in Philly.
    """
    rng = random.Random(seed)
    names = [f"t{i}" for i in range(tenants)]
    weights = [i + 1 for i in range(tenants)]
    sizes = [1, 1, 1, 1, 1, 1, 2, 4, 8]
    out = []
    now_s = 0.0
    for job_id in range(1, jobs + 1):
        now_s += rng.expovariate(1.0 / mean_interarrival_s)
        tenant = rng.choices(names, weights)[0]
        duration_s = max(1.0, round(rng.lognormvariate(0.0, 1.2) * median_duration_s))
        out.append(
            TraceJob(
                job_id=job_id,
                tenant=tenant,
                submit_s=round(now_s, 3),
                duration_s=duration_s,
                gpus=min(rng.choice(sizes), gpus_per_node),
                user=f"{tenant}-u{rng.randrange(3)}",
                name=rng.choice(["train", "eval", "sweep"]),
            )
        )
    node_list = []
    for t in names:
        for k in range(nodes_per_tenant):
            node_list.append(TraceNode(f"{t}-n{k}", gpus_per_node, gpu_type, owner=t))
    tenant_list = tuple(TraceTenant(t, nodes_per_tenant * gpus_per_node) for t in names)
    return Trace(f"synthetic(seed={seed})", tuple(out), tuple(node_list), tenant_list)
