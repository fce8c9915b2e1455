"""The history a what-if replays, and the cluster it replays it on, read from the database.

The period's finished jobs become a trace for the simulator, and what really happened to them a
Result beside the simulated ones (see the package's docstring for what each figure means). The
cluster is today's: its nodes, tenants with their quotas and weights, and pools.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from controlplane.cluster.models import Pool
from controlplane.jobs.models import PRIORITY_VALUE, AttemptState, Job, JobAttempt, JobState
from controlplane.scheduling.loader import load_nodes, load_tenants
from controlplane.scheduling.rows import raw_rows, unix_s
from scheduler import model as m
from scheduler.simulator.engine import JobOutcome, Result
from scheduler.simulator.trace import TraceJob

# Attempts stopped so that their GPUs go to others.
_PREEMPTED_STOP_REASONS = ("preempted", "drained")
_FINISHED_RUN_STATES = (JobState.SUCCEEDED, JobState.FAILED)


@dataclass
class History:
    """The period's finished jobs as a trace, and what really happened to them."""

    jobs: tuple[TraceJob, ...]
    real: Result
    notes: list[str]


@dataclass(frozen=True)
class Cluster:
    nodes: tuple[m.Node, ...]
    tenants: tuple[m.Tenant, ...]
    pools: tuple[m.Pool, ...]

    @property
    def total_gpus(self) -> int:
        return sum(len(n.gpus) for n in self.nodes)


def load_cluster() -> Cluster:
    """The current nodes, tenants (weights, quotas) and pools, as the scheduler sees them."""
    pool_rows = list(Pool.objects.order_by("name").values_list("id", "name", "power_budget_w"))
    pools = tuple(m.Pool(name=name, power_budget_w=budget) for _, name, budget in pool_rows)
    loaded = load_nodes({pk: name for pk, name, _ in pool_rows}, {}, {})
    nodes = tuple(
        replace(
            node,
            schedulable=True,
            draining=False,
            gpus=tuple(replace(g, healthy=True, power_cap_w=None) for g in node.gpus),
        )
        for node in loaded
    )
    return Cluster(nodes=nodes, tenants=load_tenants(), pools=pools)


def load_history(since: dt.datetime, until: dt.datetime, cluster: Cluster) -> History:
    """Finished jobs submitted in [since, until), in two queries."""
    job_rows = raw_rows(
        Job.objects.filter(submitted_at__gte=since, submitted_at__lt=until)
        .order_by("submitted_at", "id")
        .values_list(
            "id",
            "state",
            "tenant__slug",
            "submitted_by__username",
            "name",
            "gpus",
            "gpu_type",
            "priority",
            "preemptible",
            "cpus",
            "memory_mib",
            unix_s("submitted_at"),
        )
    )
    attempts: dict[int, list[tuple]] = defaultdict(list)
    for row in raw_rows(
        JobAttempt.objects.filter(
            job__submitted_at__gte=since,
            job__submitted_at__lt=until,
            job__state__in=_FINISHED_RUN_STATES,
        )
        .order_by("job_id", "number")
        .values_list(
            "job_id",
            "state",
            "stop_reason",
            unix_s("created_at"),
            unix_s("started_at"),
            unix_s("finished_at"),
            "gpu_seconds",
            "energy_j",
        )
    ):
        attempts[row[0]].append(row[1:])

    jobs: list[TraceJob] = []
    outcomes: list[JobOutcome] = []
    intervals: list[tuple[float, float, int]] = []  # (from, to, GPUs) of held GPUs
    skipped: dict[str, int] = defaultdict(int)
    energy_j = 0.0
    preemptions = 0
    preempted_gpu_s = 0.0
    succeeded = failed = 0
    for (
        job_id,
        state,
        tenant,
        user,
        name,
        gpus,
        gpu_type,
        priority,
        preemptible,
        cpus,
        memory_mib,
        submit_s,
    ) in job_rows:
        if state not in _FINISHED_RUN_STATES:
            skipped["cancelled" if state == JobState.CANCELLED else "still active"] += 1
            continue
        rows = attempts.get(job_id, [])
        final = _final_attempt(state, rows)
        if final is None:
            skipped["never ran"] += 1
            continue
        _, _, _, run_start_s, run_end_s, _, _ = final
        held_s = 0.0
        job_preemptions = 0
        for a_state, stop_reason, created_s, started_s, finished_s, gpu_s, a_energy_j in rows:
            energy_j += a_energy_j or 0.0
            if finished_s is None:
                continue
            begun_s = created_s if created_s is not None else started_s
            held_s += max(0.0, finished_s - begun_s)
            intervals.append((begun_s, finished_s, gpus))
            if a_state == AttemptState.STOPPED and stop_reason in _PREEMPTED_STOP_REASONS:
                job_preemptions += 1
                preempted_gpu_s += gpu_s or 0.0
        preemptions += job_preemptions
        succeeded += state == JobState.SUCCEEDED
        failed += state == JobState.FAILED
        run_s = max(0.0, run_end_s - run_start_s)
        jobs.append(
            TraceJob(
                job_id=job_id,
                tenant=tenant,
                submit_s=submit_s,
                duration_s=run_s,
                gpus=gpus,
                user=user,
                name=name,
                gpu_type=gpu_type,
                priority=PRIORITY_VALUE.get(priority, PRIORITY_VALUE["normal"]),
                preemptible=bool(preemptible),
                cpus=float(cpus),
                memory_mib=int(memory_mib),
            )
        )
        first_created_s = rows[0][2] if rows[0][2] is not None else rows[0][3]
        outcomes.append(
            JobOutcome(
                job_id=job_id,
                tenant=tenant,
                gpus=gpus,
                submit_s=submit_s,
                first_start_s=first_created_s,
                finish_s=run_end_s,
                duration_s=run_s,
                held_s=held_s,
                preemptions=job_preemptions,
                restart_overhead_s=0.0,
            )
        )

    times, busy = _busy_timeline(intervals)
    first_submit_s = jobs[0].submit_s if jobs else 0.0
    real = _real_result(
        outcomes=outcomes,
        unfinished_job_ids=[],
        tenants=tuple(t.name for t in cluster.tenants),
        total_gpus=cluster.total_gpus,
        timeline_t_s=times,
        timeline_busy_gpus=busy,
        # Not known for the past; NaN draws nothing on the power plot.
        timeline_power_w=[math.nan] * len(times),
        energy_j=energy_j,
        peak_power_w=math.nan,
        power_budget_w=None,
        over_budget_s=math.nan,
        preemptions=preemptions,
        preempted_gpu_s_lost=preempted_gpu_s,
        first_submit_s=first_submit_s,
    )
    notes = [
        f"{len(jobs):,} finished jobs submitted from {since:%Y-%m-%d %H:%M} to {until:%Y-%m-%d %H:%M} UTC "
        f"({succeeded:,} succeeded, {failed:,} failed) on today's {len(cluster.nodes):,} node{'' if len(cluster.nodes) == 1 else 's'} "
        f"with {cluster.total_gpus:,} GPUs."
    ]
    if skipped:
        left_out = ", ".join(f"{n:,} {why}" for why, n in sorted(skipped.items()))
        notes.append(f"Left out: {left_out}.")
    return History(jobs=tuple(jobs), real=real, notes=notes)


def _real_result(**known) -> Result:
    """A Result for what really happened. The fields it leaves out measure a replay's own run
    (wall and CPU time, plan calls, events): nothing happened there, so they are zero."""
    for f in dataclasses.fields(Result):
        if f.name not in known:
            known[f.name] = [] if "list" in str(f.type) else 0
    return Result(**known)


def _final_attempt(state: str, rows: Sequence[tuple]) -> tuple | None:
    """The attempt whose run time the replay uses, or None when no attempt ran to its end."""
    wanted = AttemptState.SUCCEEDED if state == JobState.SUCCEEDED else None
    for row in reversed(rows):
        a_state, _, _, started_s, finished_s, _, _ = row
        if started_s is None or finished_s is None:
            continue
        if wanted is None or a_state == wanted:
            return row
    return None


def _busy_timeline(intervals: list[tuple[float, float, int]]) -> tuple[list[float], list[int]]:
    deltas: dict[float, int] = defaultdict(int)
    for start_s, end_s, gpus in intervals:
        deltas[start_s] += gpus
        deltas[end_s] -= gpus
    times, busy, level = [], [], 0
    for t in sorted(deltas):
        level += deltas[t]
        times.append(t)
        busy.append(level)
    return times, busy
