"""Small traces built by hand, so that what a policy must do can be worked out on paper."""

from __future__ import annotations

from scheduler.simulator.compare import run_preset
from scheduler.simulator.engine import JobOutcome, Result, SimOptions
from scheduler.simulator.loaders import DEFAULT_DATA_DIR
from scheduler.simulator.trace import Trace, TraceJob, TraceNode, TraceTenant

GPU = "V100-SXM2-32GB"
PHILLY_DIR = DEFAULT_DATA_DIR / "philly"
ALIBABA_DIR = DEFAULT_DATA_DIR / "alibaba-openb"


def job(job_id: int, tenant: str, submit_s: float, duration_s: float, gpus: int = 1) -> TraceJob:
    return TraceJob(job_id, tenant, submit_s, duration_s, gpus, user=f"{tenant}-user", name="run")


def trace(jobs: list[TraceJob], partitions: dict[str, tuple[int, int]]) -> Trace:
    """``partitions``: tenant -> (nodes, GPUs per node) of its own."""
    nodes = []
    tenants = []
    for tenant, (count, per_node) in partitions.items():
        nodes += [TraceNode(f"{tenant}-n{k}", per_node, GPU, owner=tenant) for k in range(count)]
        tenants.append(TraceTenant(tenant, count * per_node))
    return Trace("by-hand", tuple(jobs), tuple(nodes), tuple(tenants))


def run(t: Trace, preset: str, **options) -> Result:
    return run_preset(t, preset, SimOptions(**options))


def by_id(result: Result) -> dict[int, JobOutcome]:
    return {o.job_id: o for o in result.outcomes}


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)
