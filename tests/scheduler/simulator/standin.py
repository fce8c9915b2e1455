"""A tiny policy with the contract of ``scheduler.policy.plan``, to test the engine on its own.

It knows FIFO / SJF / SRTF order, static quotas or borrowing up to the limit, single-node first
fit, and (for SRTF) preempting the running job of the same tenant with the longest remaining time
when a shorter one cannot be placed. What it decides is easy to compute by hand, which is the point:
tests of the engine's bookkeeping then do not depend on the production policy's finer rules.
"""

from __future__ import annotations

from scheduler.model import (
    ANY_GPU_TYPE,
    Config,
    Ordering,
    PendingDecision,
    Plan,
    Preemption,
    ReasonCode,
    Snapshot,
    Start,
)


def standin_plan(snapshot: Snapshot, config: Config) -> Plan:
    held = {u for r in snapshot.running for u in r.gpus}
    free = {
        n.name: [g for g in n.gpus if g.uuid not in held]
        for n in sorted(snapshot.nodes, key=lambda n: n.name)
    }
    usage: dict[str, int] = {}
    for r in snapshot.running:
        usage[r.tenant] = usage.get(r.tenant, 0) + len(r.gpus)
    cap = {}
    for t in snapshot.tenants:
        q = next(q for q in t.quotas if q.gpu_type == ANY_GPU_TYPE)
        cap[t.name] = q.limit_gpus if config.borrowing else q.guaranteed_gpus

    def key(p):
        if config.ordering in (Ordering.SJF, Ordering.SRTF):
            return (p.predicted_duration_s, p.submitted_at_s, p.job_id)
        return (p.submitted_at_s, p.job_id)

    starts, preemptions, pending = [], [], []
    victims = set()
    for p in sorted(snapshot.pending, key=key):
        placed = None
        if usage.get(p.tenant, 0) + p.gpus <= cap[p.tenant]:
            for name, gpus in free.items():
                fit = [g for g in gpus if p.gpu_type in (ANY_GPU_TYPE, g.gpu_type)]
                if len(fit) >= p.gpus:
                    placed = (name, tuple(g.uuid for g in fit[: p.gpus]))
                    free[name] = [g for g in gpus if g.uuid not in placed[1]]
                    break
        if placed:
            starts.append(Start(p.job_id, (placed,), borrowed=False))
            usage[p.tenant] = usage.get(p.tenant, 0) + p.gpus
            continue
        if config.ordering is Ordering.SRTF and config.preemption:
            longer = [
                r
                for r in snapshot.running
                if r.tenant == p.tenant
                and r.attempt_id not in victims
                and len(r.gpus) >= p.gpus
                and r.remaining_s is not None
                and r.remaining_s > p.predicted_duration_s
                and snapshot.now_s - r.started_at_s >= config.min_runtime_s
            ]
            if longer:
                victim = max(longer, key=lambda r: (r.remaining_s, r.attempt_id))
                victims.add(victim.attempt_id)
                preemptions.append(
                    Preemption(victim.attempt_id, victim.job_id, "shorter job", p.job_id)
                )
                pending.append(
                    PendingDecision(p.job_id, ReasonCode.WAITING_FOR_PREEMPTION, "waiting", 1)
                )
                continue
        pending.append(PendingDecision(p.job_id, ReasonCode.NO_CAPACITY, "no room", 1))
    return Plan(starts=tuple(starts), preemptions=tuple(preemptions), pending=tuple(pending))
