"""One scheduling cycle: lock, load, plan, apply, record.

Load, plan and apply share one transaction, which also holds the cycle lock: a cycle that dies
half-way (a crash, a killed worker, an exception) rolls back whole and leaves nothing of its
plan behind, and the next cycle plans from the same state again.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from django.conf import settings

from controlplane import event_metrics
from controlplane.scheduling.applier import ApplyResult, apply_plan
from controlplane.scheduling.loader import from_unix_s, load_snapshot
from controlplane.scheduling.lock import cycle_transaction
from controlplane.scheduling.models import SchedulingCycle
from scheduler import model as m
from scheduler.memo import PlanMemo
from scheduler.policy import cyclic_gc_paused
from scheduler.policy import plan as make_plan

log = logging.getLogger(__name__)

# A cycle's record lists decisions for a person to read; past this many it keeps counts only.
MAX_LISTED_DECISIONS = 200


def scheduler_config() -> m.Config:
    """The policy's switches: the core's defaults, overridden by settings.SCHEDULER_POLICY."""
    overrides = getattr(settings, "SCHEDULER_POLICY", None) or {}
    # The cost of a restart is the operator's setting; SCHEDULER_POLICY may still override it.
    try:
        return m.config_with(
            m.Config(), {"restart_cost_s": settings.PREEMPTION_RESTART_COST_S, **overrides}
        )
    except ValueError as e:
        raise ValueError(f"SCHEDULER_POLICY: {e}") from None


# The loader hands out the same node and history tuples from cycle to cycle until they change
# (its caches are per process); the core reuses their indexes through this memo. Used only
# inside the cycle lock, so by one cycle at a time.
_MEMO = PlanMemo()


def run_scheduling_cycle(
    trigger: str = "tick", *, config: m.Config | None = None, now_s: float | None = None
) -> dict:
    """Run one cycle unless another is running; returns a summary (or {"skipped": True})."""
    config = config or scheduler_config()
    began = time.perf_counter()
    started_at = time.time()
    # Loading builds tens of thousands of rows and snapshot objects at once, and the cyclic
    # collector would walk them (and the whole Django process) over and over while they are
    # young, for nothing: they form no cycles. It runs again as soon as the cycle is over.
    with cyclic_gc_paused():
        with cycle_transaction() as held:
            if not held:
                log.debug("another scheduling cycle is running; skipping (%s)", trigger)
                return {"skipped": True, "trigger": trigger}
            t0 = time.perf_counter()
            loaded = load_snapshot(now_s)
            t1 = time.perf_counter()
            plan = make_plan(loaded.snapshot, config, _MEMO)
            t2 = time.perf_counter()
            result = apply_plan(plan, loaded)
            t3 = time.perf_counter()
        t4 = time.perf_counter()
    step_ms = {
        "lock": (t0 - began) * 1000.0,
        "load": (t1 - t0) * 1000.0,
        "plan": (t2 - t1) * 1000.0,
        "apply": (t3 - t2) * 1000.0,
        "commit": (t4 - t3) * 1000.0,
    }
    core_ms = {f"plan.{name}": s * 1000.0 for name, s in plan.step_seconds.items()}
    # The slowest named step, looking inside the plan when the core reports its own steps.
    candidates = {k: v for k, v in step_ms.items() if not (k == "plan" and core_ms)} | core_ms
    slowest = max(candidates, key=candidates.__getitem__)
    step_ms |= core_ms
    duration_ms = (t4 - began) * 1000.0
    cycle = SchedulingCycle.objects.create(
        started_at=from_unix_s(started_at),
        duration_ms=duration_ms,
        starts=len(result.started),
        preemptions=len(result.preempted),
        pending=len(plan.pending),
        skipped_rows=result.skipped_rows,
        slowest_step=slowest[:32],
        step_ms={k: round(v, 3) for k, v in step_ms.items()},
        decisions=_decisions(plan, result),
        trigger=trigger[:32],
    )
    # Counted in Redis too: the rows are pruned, and the histogram must only ever grow.
    event_metrics.record_cycle(duration_ms / 1000.0)
    summary = {
        "skipped": False,
        "cycle": cycle.pk,
        "trigger": trigger,
        "starts": len(result.started),
        "preemptions": len(result.preempted),
        "pending": len(plan.pending),
        "skipped_rows": result.skipped_rows,
        "pending_rows_written": result.pending_rows_written,
        "power_caps_written": result.power_caps_written,
        "nodes_changed": len(result.nodes_changed),
        "duration_ms": round(duration_ms, 3),
        "slowest_step": slowest,
        "step_ms": cycle.step_ms,
    }
    # A cycle that changed nothing is routine; one that did is worth a line in the log.
    level = logging.INFO if summary["starts"] or summary["preemptions"] else logging.DEBUG
    log.log(
        level,
        "scheduling cycle %s (%s): %d starts, %d preemptions, %d pending, %d skipped in %.0f ms",
        cycle.pk,
        trigger,
        summary["starts"],
        summary["preemptions"],
        summary["pending"],
        summary["skipped_rows"],
        duration_ms,
        extra={"cycle_id": cycle.pk},
    )
    return summary


def _decisions(plan: m.Plan, result: ApplyResult) -> dict:
    started = set(result.started)
    preempted = set(result.preempted)
    return {
        "starts": [
            {
                "job": s.job_id,
                "placements": [[n, list(u)] for n, u in s.placements],
                "borrowed": s.borrowed,
            }
            for s in plan.starts
            if s.job_id in started
        ][:MAX_LISTED_DECISIONS],
        "preemptions": [
            {"attempt": p.attempt_id, "job": p.job_id, "for_job": p.for_job_id, "reason": p.reason}
            for p in plan.preemptions
            if p.attempt_id in preempted
        ][:MAX_LISTED_DECISIONS],
        "skipped": [{"kind": s.kind, "id": s.id, "why": s.why} for s in result.skipped][
            :MAX_LISTED_DECISIONS
        ],
        "pending_by_reason": dict(Counter(str(d.reason_code) for d in plan.pending)),
        "pending_rows_written": result.pending_rows_written,
        "power_caps_written": result.power_caps_written,
    }
