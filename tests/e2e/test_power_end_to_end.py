"""A pool power budget through the real processes: planner, agent, simulated GPUs, accounting.

Two stand-in training jobs (`python -m agents.simjob`) on a node of two simulated H100s would
draw some 1150 W uncapped; the pool may draw 900 W. The test watches the GPU rows the agent's
heartbeats keep current, as an operator's dashboard would, from before the jobs start until
after they end.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import pytest
import requests

from .conftest import wait_until

pytestmark = pytest.mark.slow

POOL_BUDGET_W = 900.0
# Seconds of work at full speed: long enough for several heartbeats under the caps.
WORK_S = 10.0
# The agent counts a cap within this of the planned one as applied (agents.daemon).
CAP_TOLERANCE_W = 0.5


@dataclass(frozen=True)
class Reading:
    at: float  # the heartbeat's time, Unix seconds
    desired_cap_w: float | None
    cap_w: float | None
    power_w: float | None
    energy_j: float | None
    utilization_pct: float | None


def _read_gpus(node_name: str) -> dict[str, Reading]:
    from controlplane.cluster.models import GPU

    return {
        g.uuid: Reading(
            at=g.telemetry_at.timestamp(),
            desired_cap_w=g.desired_power_cap_w,
            cap_w=g.power_cap_w,
            power_w=g.power_draw_w,
            energy_j=g.energy_j,
            utilization_pct=g.utilization_pct,
        )
        for g in GPU.objects.filter(node__name=node_name, telemetry_at__isnull=False)
    }


def _energy_bounds(readings: list[Reading], finished_at: float) -> tuple[float, float]:
    """What a GPU's energy counter says one job used, from the readings seen of it.

    The readings are those of the GPU's only job: idle, then busy, then idle again. The job's
    energy is at least the counter's rise over the busy readings taken before its exit, and at
    most the rise from the last idle reading before to the first idle one after.

    Readings between the exit and the agent reaping it may still show the GPU busy (the
    simulated GPU drops a job's load when the agent reaps it; NVML's utilization trails by its
    sample period), so they are left out of the lower bound. A reading's time is when the heartbeat was stored, after its
    sample was taken, so one stored before the exit was sampled before it too.
    """
    busy = [i for i, r in enumerate(readings) if r.utilization_pct]
    assert busy, "no reading showed the job running"
    first, last = busy[0], busy[-1]
    assert first > 0 and last < len(readings) - 1, "the idle readings around the job are missing"
    assert all(readings[i].utilization_pct for i in range(first, last + 1))
    before_exit = [i for i in busy if readings[i].at <= finished_at]
    assert before_exit, "no reading showed the job running before it exited"
    lower = readings[before_exit[-1]].energy_j - readings[first].energy_j
    upper = readings[last + 1].energy_j - readings[first - 1].energy_j
    return lower, upper


def test_caps_keep_a_pool_under_its_power_budget_and_jobs_are_charged_their_gpus_energy(cluster):
    from controlplane.cluster.models import Pool
    from controlplane.jobs.models import JobAttempt

    node = "e2e-power"
    cluster.start_agent(node, gpus=2)
    Pool.objects.filter(name="default").update(power_budget_w=POOL_BUDGET_W)
    history: dict[str, list[Reading]] = {}

    def watch() -> dict[str, Reading]:
        latest = _read_gpus(node)
        for uuid, reading in latest.items():
            seen = history.setdefault(uuid, [])
            if not seen or reading.at > seen[-1].at:
                seen.append(reading)
        return latest

    watch()
    job_ids = [
        cluster.submit(
            [sys.executable, "-m", "agents.simjob", f"--work-s={WORK_S}", "--step-s=0.2"],
            name=f"train-{i}",
        )
        for i in range(2)
    ]

    def all_ended() -> bool:
        watch()
        attempts = JobAttempt.objects.filter(job_id__in=job_ids)
        return len(attempts) == 2 and all(a.finished_at is not None for a in attempts)

    wait_until(all_ended, 90, "both jobs to finish")
    # A few more heartbeats: the GPUs idle again after their jobs.
    settle_until = time.monotonic() + 3.0
    wait_until(lambda: watch() and time.monotonic() > settle_until, 30, "readings after the jobs")

    attempts = {
        a.job_id: a
        for a in JobAttempt.objects.filter(job_id__in=job_ids).prefetch_related("allocations__gpu")
    }
    assert {a.state for a in attempts.values()} == {"SUCCEEDED"}
    gpu_of = {job_id: a.allocations.get().gpu.uuid for job_id, a in attempts.items()}
    assert sorted(gpu_of.values()) == sorted(history)

    # Caps reached the GPUs: while both jobs ran, a heartbeat showed every GPU enforcing the cap
    # the planner set for it, and those caps were below the board's 700 W.
    # One heartbeat reports both GPUs of the node: readings with the same time go together.
    heartbeats = [
        (a, b)
        for a in history[gpu_of[job_ids[0]]]
        for b in history[gpu_of[job_ids[1]]]
        if a.at == b.at
    ]
    both_busy = [(a, b) for a, b in heartbeats if a.utilization_pct and b.utilization_pct]
    assert both_busy, "the two jobs never ran at the same time"
    enforced = [
        (a, b)
        for a, b in both_busy
        if all(
            r.desired_cap_w is not None and abs(r.cap_w - r.desired_cap_w) <= CAP_TOLERANCE_W
            for r in (a, b)
        )
    ]
    assert enforced, f"no heartbeat showed the planned caps enforced: {both_busy}"
    assert all(r.cap_w < 650.0 for pair in enforced for r in pair)

    # The pool's reported draw never went over its budget, in any heartbeat, while it ran two
    # jobs that would have drawn far more uncapped.
    assert max(a.power_w + b.power_w for a, b in heartbeats) <= POOL_BUDGET_W, [
        (a.power_w, b.power_w) for a, b in heartbeats
    ]
    assert max(a.power_w + b.power_w for a, b in both_busy) > 700.0

    # Each job was charged what its GPU's energy counter says it used.
    for job_id in job_ids:
        attempt = attempts[job_id]
        lower, upper = _energy_bounds(history[gpu_of[job_id]], attempt.finished_at.timestamp())
        assert not attempt.energy_estimated
        assert lower <= attempt.energy_j <= upper, (lower, attempt.energy_j, upper)
        # Under its cap the job drew well under the board's maximum for its whole run.
        run_s = (attempt.finished_at - attempt.started_at).total_seconds()
        assert attempt.energy_j < 650.0 * run_s

    # And the chargeback report adds them up for the tenant.
    response = requests.get(
        f"{cluster.api}/accounting/usage/",
        params={"period": "month"},
        headers={"Authorization": f"Bearer {cluster.user_token}"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    (row,) = [r for r in response.json() if r["tenant"] == "vision"]
    charged_j = sum(a.energy_j for a in attempts.values())
    assert row["energy_kwh"] == pytest.approx(charged_j / 3.6e6, abs=1e-6)
