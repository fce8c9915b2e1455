"""What the core decides, as digests: run in this process (the core from source, as the suites
run it) and in a fresh interpreter with GPUCP_CORE=compiled by test_native.py, which compares
the two. ``python -m tests.scheduler.native_probe`` prints them as JSON, with the core it ran.

Every preset replays saturated traces (queues of dozens of jobs of every size, preemptions,
reservations, the window asked again), a variant per setting the benchmarks vary, and a power
budget; each cycle's plan is digested whole (every start, preemption, reason code, estimate and
cap), and every tenth cycle is planned again without the memo and with the sentences a person
reads, since the replays leave those out.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import sys
from collections.abc import Callable
from dataclasses import replace

from scheduler import gpu_model, native
from scheduler.model import Plan, Snapshot
from scheduler.policy import plan
from scheduler.simulator.compare import run_preset
from scheduler.simulator.engine import SimOptions
from scheduler.simulator.policies import PRESETS, preset
from scheduler.simulator.trace import Trace, TraceJob, TraceNode, TraceTenant, synthetic_trace


def saturated(seed: int, jobs: int) -> Trace:
    """As tests/scheduler/simulator/test_window.py's: three tenants with a 4-GPU node each, a
    job every 40 s of about 30 min, many alike jobs; a fifth of them not preemptible and three
    priorities where ``seed`` is odd."""
    t = synthetic_trace(
        seed, jobs=jobs, tenants=3, nodes_per_tenant=1, gpus_per_node=4, mean_interarrival_s=40
    )
    out = []
    for j in t.jobs:
        if j.job_id % 2:
            j = replace(j, user=j.tenant, name="train")
        if seed % 2:
            j = replace(j, priority=(50, 100, 200)[j.job_id % 3], preemptible=j.job_id % 5 != 0)
        out.append(j)
    return Trace(t.name, tuple(out), t.nodes, t.tenants)


def power_trace() -> Trace:
    gpu = "V100-SXM2-32GB"
    jobs = tuple(
        TraceJob(i, "a", 40.0 * i, 900.0 + 60 * i, 1 + i % 2, user="u", name="run")
        for i in range(12)
    )
    nodes = (TraceNode("a-n0", 4, gpu, owner="a"), TraceNode("a-n1", 4, gpu, owner="a"))
    return Trace("power", jobs, nodes, (TraceTenant("a", 8),))


def canonical(value: object) -> object:
    """``value`` with every number as a float: the compiled core stores an int given for a float
    field as a float (a duration of 293 is 293.0), the source keeps it as given; equal either
    way, and so are the decisions."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, int | float):
        return float(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (
            type(value).__name__,
            tuple(canonical(getattr(value, f.name)) for f in dataclasses.fields(value)),
        )
    if isinstance(value, dict):
        return tuple(sorted((canonical(k), canonical(v)) for k, v in value.items()))
    if isinstance(value, tuple | list):
        return tuple(canonical(v) for v in value)
    raise TypeError(f"no canonical form for {type(value).__name__}")


def decided(made: Plan) -> str:
    """Everything a plan decides, in one text (not its step timings, which are wall time)."""
    return repr(
        canonical(
            (
                made.starts,
                made.preemptions,
                made.pending,
                made.power_caps_w,
                made.predicted_duration_s,
                made.soon_left_after,
            )
        )
    )


def _digest_of(texts: list[str]) -> str:
    return hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]


def replayed(
    t: Trace, name: str, options: SimOptions, changes: dict[str, object] | None = None
) -> str:
    plans: list[str] = []
    config = preset(name).config
    if changes:
        config = replace(config, **changes)

    def seen(snapshot: Snapshot, made: Plan) -> None:
        plans.append(decided(made))
        if len(plans) % 10 == 1:
            plans.append(decided(plan(snapshot, config)))

    on: Callable[[Snapshot, Plan], None] = seen
    result = run_preset(t, name, replace(options, on_cycle=on), config_changes=changes)
    outcomes = sorted(result.outcomes, key=lambda o: o.job_id)
    return _digest_of(
        [*plans, repr(canonical((outcomes, result.preemptions, result.unfinished_job_ids)))]
    )


def fingerprints() -> dict[str, str]:
    out: dict[str, str] = {}
    for name in sorted(PRESETS):
        jobs = 60 if "tiresias" in name else 110
        for seed in (5, 6):
            out[f"{name} seed {seed}"] = replayed(saturated(seed, jobs), name, SimOptions())
    for name in ("ours", "ours-oracle", "srtf-shared"):
        out[f"{name} bound 1, notice 30 s"] = replayed(
            saturated(11, 110), name, SimOptions(grace_s=30.0), {"max_preemptions": 1}
        )
    budget_w = 5 * 0.6 * gpu_model.GPU_TYPES["V100-SXM2-32GB"].max_w
    out["ours power budget"] = replayed(power_trace(), "ours", SimOptions(power_budget_w=budget_w))
    return out


if __name__ == "__main__":
    json.dump({"core": native.active(), "fingerprints": fingerprints()}, sys.stdout)
