"""The window: the plan sees the head of each class of alike pending jobs, and decides the same.

A saturated cluster holds thousands of jobs pending; a plan that walks them all on every event
made a replay's cost grow with the backlog. The engine hands the plan only what could get
anything (see _Engine._window) and asks again with more where the window was too small; every
decision must be the one the whole backlog gives.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.simulator.compare import run_preset
from scheduler.simulator.engine import SimOptions, _Engine
from scheduler.simulator.policies import PRESETS
from scheduler.simulator.trace import Trace, TraceJob, synthetic_trace


def saturated(seed: int, jobs: int = 130) -> Trace:
    # 3 tenants with a node of 4 GPUs each, a job every 40 s of ~30 min: the queue grows to
    # dozens of jobs, of every size, while the cluster is full.
    t = synthetic_trace(
        seed, jobs=jobs, tenants=3, nodes_per_tenant=1, gpus_per_node=4, mean_interarrival_s=40
    )
    # Jobs of one class differ in nothing but their submit time: give some classes many.
    jobs = tuple(
        TraceJob(j.job_id, j.tenant, j.submit_s, j.duration_s, j.gpus, user=j.tenant, name="train")
        if j.job_id % 2
        else j
        for j in t.jobs
    )
    return Trace(t.name, jobs, t.nodes, t.tenants)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_window_decides_as_the_whole_backlog_would(name):
    # LAS plans at every tick while anything runs: a shorter trace keeps the test fast.
    t = saturated(5, jobs=70 if "tiresias" in name else 130)
    whole = run_preset(t, name, SimOptions(window=False))
    windowed = run_preset(t, name, SimOptions(window=True))

    assert windowed.outcomes == whole.outcomes
    assert windowed.preemptions == whole.preemptions
    assert windowed.unfinished_job_ids == whole.unfinished_job_ids
    assert max(o.queue_s for o in whole.outcomes) > 3600  # the cluster was saturated


@pytest.mark.parametrize("name", ["fifo-shared", "sjf-shared", "fifo-static"])
def test_the_window_shows_the_plan_a_small_part_of_a_long_backlog(name):
    t = saturated(7)
    shown = {False: 0, True: 0}
    for window in shown:

        def count(snapshot, _plan, window=window):
            shown[window] += len(snapshot.pending)

        run_preset(t, name, SimOptions(window=window, on_cycle=count))
    assert shown[True] < shown[False] / 3


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("aging_period_s", [0.0, 300.0, 900.0])
def test_under_fair_with_oracle_durations_each_aging_level_is_windowed_apart(seed, aging_period_s):
    # ours-oracle: within a class a younger, shorter job may be met after an older, longer one
    # and still fit where it did not (room before a reservation). Short aging periods put the
    # backlog of this trace in many levels, which move as the cycles go.
    t = saturated(seed)
    changes = {"aging_period_s": aging_period_s}
    shown = {False: 0, True: 0}
    results = {}
    for window in shown:

        def count(snapshot, _plan, window=window):
            shown[window] += len(snapshot.pending)

        results[window] = run_preset(
            t,
            "ours-oracle",
            SimOptions(window=window, on_cycle=count),
            config_changes=changes,
        )
    assert results[True].outcomes == results[False].outcomes
    assert results[True].preemptions == results[False].preemptions
    assert max(o.queue_s for o in results[False].outcomes) > 3600
    assert shown[True] < shown[False]


@pytest.mark.parametrize("name", ["ours", "ours-oracle", "srtf-shared", "tiresias-shared"])
def test_the_window_decides_as_the_whole_backlog_would_under_a_preemption_bound(name):
    # Bounded jobs and jobs that cannot be preempted may use only their tenant's guarantee,
    # counted among the work that cannot be taken back: their classes are apart, and what they
    # may start moves with their tenant's attempts, as every class's does.
    base = saturated(11, jobs=70 if "tiresias" in name else 130)
    t = Trace(
        base.name,
        tuple(replace(j, preemptible=False) if j.job_id % 7 == 0 else j for j in base.jobs),
        base.nodes,
        base.tenants,
    )
    bound = {"max_preemptions": 1}
    whole = run_preset(t, name, SimOptions(window=False), config_changes=bound)
    windowed = run_preset(t, name, SimOptions(window=True), config_changes=bound)

    assert windowed.outcomes == whole.outcomes
    assert windowed.preemptions == whole.preemptions
    assert whole.preemptions > 0  # the bound had something to bound
    assert max(o.queue_s for o in whole.outcomes) > 3600


def with_priorities(seed: int) -> Trace:
    """A saturated trace with three priorities, and every fifth job not preemptible."""
    base = saturated(seed)
    return Trace(
        base.name,
        tuple(
            replace(j, priority=(50, 100, 200)[j.job_id % 3], preemptible=j.job_id % 5 != 0)
            for j in base.jobs
        ),
        base.nodes,
        base.tenants,
    )


@pytest.mark.parametrize("name", ["ours", "ours-oracle"])
def test_whether_a_cut_class_may_claim_freed_gpus_follows_the_running_attempts(name, monkeypatch):
    # _tail_may_claim counts running preemptible attempts per tenant and priority as they start
    # and end, instead of walking them at every plan: at every question, its answer must be
    # the walk's (a cut class may claim GPUs being freed if its tenant runs preemptible work
    # of a lower priority than the class's).
    t = with_priorities(4)
    answers = []
    counted = _Engine._tail_may_claim

    def checked(engine, cut):
        lowest: dict[str, int] = {}
        for a in engine.running.values():
            j = a.job.trace
            if j.preemptible and j.priority < lowest.get(j.tenant, j.priority + 1):
                lowest[j.tenant] = j.priority
        walked = any(k[0] in lowest and lowest[k[0]] < k[3] for k in cut)
        answer = counted(engine, cut)
        assert answer == walked
        answers.append(answer)
        return answer

    monkeypatch.setattr(_Engine, "_tail_may_claim", checked)
    run_preset(t, name, SimOptions(window=True, grace_s=30.0))
    assert True in answers and False in answers


@pytest.mark.parametrize("seed", [3, 4])
@pytest.mark.parametrize("name", ["ours", "ours-oracle"])
def test_the_window_decides_as_the_whole_backlog_would_with_priorities(name, seed):
    # FAIR lets a job take GPUs of its own tenant's lower-priority preemptible work: a class cut
    # by the window may then claim GPUs being freed, and the engine must ask again
    # (_tail_may_claim, which counts the running preemptible attempts per tenant and priority
    # as they start and end). Mixed priorities, some work that cannot be preempted.
    t = with_priorities(seed)
    whole = run_preset(t, name, SimOptions(window=False))
    windowed = run_preset(t, name, SimOptions(window=True))

    assert windowed.outcomes == whole.outcomes
    assert windowed.preemptions == whole.preemptions
    assert whole.preemptions > 0  # the priority rule had work to take
    assert max(o.queue_s for o in whole.outcomes) > 3600
