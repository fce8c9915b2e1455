"""The simulator's checkpoint model: a preempted job resumes from its last checkpoint."""

from __future__ import annotations

import pytest

from scheduler.simulator.checkpoints import CheckpointIntervals
from tests.scheduler.simulator.builders import by_id, job, run, trace

RESTART_S = 60.0  # Config.restart_cost_s of the presets


def srtf_preempts_a_at_100(**options):
    # A (1000 s) runs from t=0; B (50 s) arrives at t=100 and SRTF preempts A for it; A starts
    # again at t=150, pays the restart, and redoes what it lost.
    t = trace([job(1, "a", 0, 1000), job(2, "a", 100, 50)], {"a": (1, 1)})
    return run(t, "srtf", **options)


@pytest.mark.parametrize(
    "mode, lost_s",
    [
        ("fixed:40", 20),  # checkpoints at 40 and 80: the 20 s since are lost
        ("fixed:100", 0),  # it checkpointed at the very moment it was preempted
        ("fixed:300", 100),  # none yet in this attempt: everything
        ("none", 100),  # never: it starts over
    ],
)
def test_a_preempted_job_loses_the_work_since_its_last_checkpoint_and_redoes_the_restart(
    mode, lost_s
):
    result = srtf_preempts_a_at_100(checkpoints=CheckpointIntervals.parse(mode))
    a = by_id(result)[1]
    assert a.preemptions == 1
    assert a.finish_s == 150 + RESTART_S + (1000 - 100 + lost_s)
    assert result.preempted_gpu_s_lost == lost_s + RESTART_S


def test_by_default_a_preempted_job_keeps_its_progress_and_pays_the_restart_of_its_size():
    result = srtf_preempts_a_at_100()
    assert by_id(result)[1].finish_s == 150 + 7 + 900
    assert result.preempted_gpu_s_lost == 7


@pytest.mark.parametrize("interval_s", [10.0, 25.0, 45.0, 90.0])
def test_a_preemption_loses_at_most_the_interval_plus_the_restart(interval_s):
    # a borrows b's 4 GPUs at t=0; b's job at t=70 takes one back. Checkpoints persist across
    # attempts, so a later preemption never loses what an earlier checkpoint saved.
    jobs = [job(i, "a", 0, 100) for i in range(1, 9)] + [job(9, "b", 70, 50)]
    t = trace(jobs, {"a": (1, 4), "b": (1, 4)})
    # Told nothing about checkpoints, the plan preempts at once instead of waiting for one.
    result = run(
        t,
        "ours",
        checkpoints=CheckpointIntervals("fixed", interval_s),
        checkpoint_knowledge=False,
    )
    assert result.preemptions == 1
    assert RESTART_S <= result.preempted_gpu_s_lost <= interval_s + RESTART_S
    victim = next(o for o in result.outcomes if o.preemptions)
    lost_s = result.preempted_gpu_s_lost - RESTART_S
    # Work at preemption (70 s) less what was lost is redone after the restart.
    assert victim.finish_s == pytest.approx(100 + RESTART_S + (100 - 70) + lost_s)


def test_interval_draws_are_per_job_seeded_and_within_bounds():
    draw = CheckpointIntervals.parse("uniform:900-3600", seed=7)
    again = CheckpointIntervals.parse("uniform:900-3600", seed=7)
    other_seed = CheckpointIntervals.parse("uniform:900-3600", seed=8)
    values = [draw.interval_s(j) for j in range(200)]
    assert values == [again.interval_s(j) for j in range(200)]
    assert values != [other_seed.interval_s(j) for j in range(200)]
    assert all(900 <= v <= 3600 for v in values)
    assert len(set(values)) == 200
    # The same job draws the same whatever else is asked first.
    assert draw.interval_s(150) == values[150]
    assert CheckpointIntervals.parse("fixed:120").interval_s(3) == 120
    assert CheckpointIntervals.parse("none").interval_s(3) is None


@pytest.mark.parametrize(
    "text", ["fixed:0", "fixed:-5", "fixed:nan", "uniform:60-30", "uniform:1", "hourly", "none:5"]
)
def test_bad_interval_specs_are_refused(text):
    with pytest.raises(ValueError):
        CheckpointIntervals.parse(text)


@pytest.mark.parametrize("knowledge", [True, False])
def test_the_plan_is_told_each_attempts_interval_and_last_checkpoint_unless_hidden(knowledge):
    seen = []

    def grab(snapshot, plan):
        seen.extend((snapshot.now_s, r) for r in snapshot.running if r.job_id == 1)

    # A long job runs while short ones arrive: the plan sees it at several instants.
    jobs = [job(1, "a", 0, 1000)] + [job(10 + k, "a", 95 + 100 * k, 500) for k in range(6)]
    t = trace(jobs, {"a": (1, 1)})
    run(
        t,
        "fifo-static",
        checkpoints=CheckpointIntervals("fixed", 40),
        checkpoint_knowledge=knowledge,
        on_cycle=grab,
        # Without the window the plan is asked at every arrival, even with no GPU free.
        window=False,
    )
    assert len(seen) >= 5
    for now_s, r in seen:
        if knowledge:
            assert r.checkpoint_interval_s == 40
            assert r.last_checkpoint_s == (now_s // 40) * 40
        else:
            assert r.checkpoint_interval_s is None and r.last_checkpoint_s is None


@pytest.mark.parametrize(
    "interval_s, grace_s, b_starts_s, lost_s",
    [
        (110, 30, 110, 0),  # its checkpoint at 110 is within the notice: it saves it, then leaves
        (110, 5, 100, 100),  # not within 5 s: it leaves at once and loses everything
        (40, 15, 100, 20),  # next one at 120 is past the notice: it leaves at once, loses 20
        (40, 30, 120, 0),  # ... within a longer one: it saves it at 120
    ],
)
def test_with_a_notice_a_victim_about_to_checkpoint_saves_it_before_its_gpus_are_freed(
    interval_s, grace_s, b_starts_s, lost_s
):
    result = srtf_preempts_a_at_100(
        checkpoints=CheckpointIntervals("fixed", interval_s), grace_s=grace_s
    )
    out = by_id(result)
    assert out[2].first_start_s == b_starts_s
    assert result.preempted_gpu_s_lost == lost_s + RESTART_S
    done_s = 100 + (b_starts_s - 100)  # A's progress up to when it left
    assert out[1].finish_s == pytest.approx(b_starts_s + 50 + RESTART_S + (1000 - done_s + lost_s))
