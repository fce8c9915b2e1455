"""Issue 19's promise to a tenant within its guarantee: it never waits longer than its
guaranteed GPUs take to free up under the preemption rules, and the replay says whether it did.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from scheduler.simulator.metrics import summarize
from tests.scheduler.simulator.builders import by_id, job, run, trace


def _borrowed_then_claimed(claim_at_s: float):
    # Tenant b fills both nodes (it borrows a's two GPUs) with long jobs at t = 0: its first two
    # are within its own guarantee of 2, the next two are not. Tenant a then asks for three GPUs,
    # one at a time: the first two are within its guarantee of 2 (the second counts the first,
    # still waiting, ahead of it), the third is not.
    jobs = [job(k, "b", 0, 5000) for k in range(1, 5)]
    jobs += [job(10 + k, "a", claim_at_s + k, 100) for k in range(3)]
    return trace(jobs, {"a": (1, 2), "b": (1, 2)})


def test_jobs_within_the_guarantee_are_told_apart_from_those_beyond_it():
    result = run(_borrowed_then_claimed(100.0), "ours")
    assert result.within_guarantee_job_ids == {1, 2, 10, 11}
    assert result.guarantee_wait_bound_s == 60.0 + 0.0 + 60.0  # min run time, notice, a tick


def test_ours_gives_a_tenant_its_guarantee_back_within_the_bound_and_fifo_shared_does_not():
    t = _borrowed_then_claimed(100.0)
    ours = summarize("ours", run(t, "ours"))
    # b's borrowers have run 100 s (past the 60 s minimum): a's two jobs start at their submit,
    # as b's first two did on free GPUs.
    assert ours.guaranteed_jobs == 4
    assert ours.guaranteed_wait_max_s == 0.0
    assert ours.guaranteed_over_bound == 0
    fifo = summarize("fifo-shared", run(t, "fifo-shared"))
    # Without preemption a waits for b's borrowers to finish, 4,900 s after it asked.
    assert fifo.guaranteed_jobs == 4
    assert fifo.guaranteed_wait_max_s > 4000
    assert fifo.guaranteed_over_bound == 2


def test_a_claim_on_young_borrowers_waits_for_their_minimum_run_time_only():
    result = run(_borrowed_then_claimed(10.0), "ours")
    out = by_id(result)
    # The borrowers started at 0 and may be taken from 60 s on.
    assert out[10].first_start_s == 60.0
    assert out[11].first_start_s == 60.0
    s = summarize("ours", result)
    assert s.guaranteed_wait_max_s == 50.0
    assert s.guaranteed_over_bound == 0


def test_a_replay_recorded_before_the_guarantee_was_tracked_says_so():
    old = dataclasses.replace(
        run(_borrowed_then_claimed(100.0), "ours"),
        within_guarantee_job_ids=None,
        guarantee_wait_bound_s=None,
        owed_spells=None,
    )
    s = summarize("ours", old)
    assert s.guaranteed_jobs == -1
    assert s.guaranteed_over_bound == -1
    assert math.isnan(s.guaranteed_wait_max_s)
    assert s.owed_spells == -1 and s.owed_over_bound == -1
    assert math.isnan(s.owed_max_s)


# tiresias-shared is not among them: under 2D-LAS a new job outranks the borrower only once the
# borrower's attained service crosses a queue threshold, which the engine plans for apart.
@pytest.mark.parametrize("preset", ["ours", "ours-oracle", "srtf-shared"])
@pytest.mark.parametrize("borrowed_at_s", [0.0, 5.0, 59.0])
def test_a_victim_that_comes_of_age_with_no_event_is_taken_at_the_next_tick(preset, borrowed_at_s):
    # The class of a bug the replays had: with no arrival or completion after the claim, the
    # cycle at the tick after the borrower's minimum run time was skipped as "nothing changed",
    # and the claim waited for the borrower's end (5,000 s) instead of a tick, whatever the
    # preset. b borrows a's only GPU; a's short job arrives while the borrower is young.
    t = trace(
        [
            job(1, "b", 0, 5000),
            job(2, "b", borrowed_at_s, 5000),
            job(3, "a", borrowed_at_s + 1, 10),
        ],
        {"a": (1, 1), "b": (1, 1)},
    )
    out = by_id(run(t, preset))
    of_age_s = borrowed_at_s + 60.0
    next_tick_s = math.ceil(of_age_s / 60.0) * 60.0
    assert out[3].first_start_s == next_tick_s


def test_gangs_over_the_bound_are_counted_apart():
    # b borrows a's two GPUs; a asks for both at once (a gang of 2, within its guarantee) and
    # for one more GPU later. Without preemption both wait past the bound, one of them a gang.
    jobs = [job(k, "b", 0, 5000) for k in range(1, 5)]
    jobs += [job(10, "a", 100, 100, gpus=2), job(11, "a", 6000, 100)]
    t = trace(jobs, {"a": (1, 2), "b": (1, 2)})
    fifo = summarize("fifo-shared", run(t, "fifo-shared"))
    assert fifo.guaranteed_over_bound == 1  # job 11 arrives with a's GPUs free again
    assert fifo.guaranteed_over_bound_gangs == 1
    ours = summarize("ours", run(t, "ours"))
    assert ours.guaranteed_over_bound == 0
    assert ours.guaranteed_over_bound_gangs == 0


def test_a_tenant_is_owed_from_its_claim_until_it_holds_its_guarantee():
    t = _borrowed_then_claimed(100.0)
    fifo = run(t, "fifo-shared")
    # a asks at 100 and gets its two GPUs when b's borrowers end at 5,000.
    # (spell, longest stretch of it with a one-GPU job waiting): one-GPU jobs waited throughout.
    assert fifo.owed_spells == [(4900.0, 4900.0)]
    s = summarize("fifo-shared", fifo)
    assert (s.owed_spells, s.owed_over_bound, s.owed_over_bound_gangs) == (1, 1, 0)
    assert s.owed_max_s == 4900.0
    ours = summarize("ours", run(t, "ours"))
    assert (ours.owed_spells, ours.owed_over_bound) == (0, 0)  # served at the claim's instant
    young = summarize("ours", run(_borrowed_then_claimed(10.0), "ours"))
    assert (young.owed_spells, young.owed_over_bound, young.owed_max_s) == (1, 0, 50.0)


def test_the_tenant_measure_follows_the_policys_order_where_the_per_job_count_cannot():
    # a's guarantee is one GPU, lent to b. a asks for a long and a shorter job at one instant:
    # FAIR with oracle durations serves the shorter first, so the long one, counted within the
    # guarantee in submit order, waits past the bound while a holds its whole guarantee.
    t = trace(
        [
            job(1, "b", 0, 9000),
            job(2, "b", 0, 9000),
            job(3, "a", 100, 5000),
            job(4, "a", 100, 1000),
        ],
        {"a": (1, 1), "b": (1, 1)},
    )
    s = summarize("ours-oracle", run(t, "ours-oracle"))
    assert s.guaranteed_over_bound == 1  # job 3, in submit order
    assert (s.owed_spells, s.owed_over_bound) == (0, 0)  # a held its GPU from 100 on


def test_gangs_alone_waiting_through_a_spell_are_counted_apart():
    jobs = [job(k, "b", 0, 5000) for k in range(1, 5)]
    jobs += [job(10, "a", 100, 100, gpus=2)]
    s = summarize("fifo-shared", run(trace(jobs, {"a": (1, 2), "b": (1, 2)}), "fifo-shared"))
    assert (s.owed_spells, s.owed_over_bound, s.owed_over_bound_gangs) == (1, 1, 1)


def test_a_spell_long_only_for_a_gang_is_told_from_one_where_a_single_gpu_claim_waited():
    result = dataclasses.replace(
        run(_borrowed_then_claimed(100.0), "ours"),
        # a gang waited 5,000 s while one-GPU jobs were served within 30 s; one-GPU jobs waited
        # 4,000 s; a short spell within the bound
        owed_spells=[(5000.0, 30.0), (5000.0, 4000.0), (50.0, 50.0)],
    )
    s = summarize("ours", result)
    assert (s.owed_spells, s.owed_over_bound, s.owed_over_bound_gangs) == (3, 2, 1)
    assert s.owed_max_s == 5000.0


def test_a_gang_within_its_guarantee_starts_within_the_bound_though_the_borrowed_work_is_scattered():
    # b fills both 4-GPU nodes with 2-GPU jobs at t = 0; job 2 ends at 100 and job 5 (borrowed,
    # as b already holds its guarantee of 4) takes its place. b's borrowed attempts are then
    # job 5 and the last of its t = 0 jobs, one on each node, so they free no node for a's
    # 4-GPU job within its guarantee of 4 at t = 200: a node of b's surplus is taken back.
    jobs = [job(k, "b", 0, 100 if k == 2 else 5000, gpus=2) for k in range(1, 5)]
    jobs += [job(5, "b", 101, 5000, gpus=2), job(10, "a", 200, 100, gpus=4)]
    t = trace(jobs, {"a": (1, 4), "b": (1, 4)})
    result = run(t, "ours")
    assert 10 in result.within_guarantee_job_ids
    s = summarize("ours", result)
    assert (s.guaranteed_over_bound, s.owed_over_bound) == (0, 0)
    assert by_id(result)[10].first_start_s - 200 <= result.guarantee_wait_bound_s
    # b keeps its guarantee: two of its jobs were stopped, no more.
    assert sum(o.preemptions for o in result.outcomes if o.tenant == "b") == 2
    fifo = by_id(run(t, "fifo-shared"))
    assert fifo[10].first_start_s >= 5000  # without preemption, a waits for b's long jobs
