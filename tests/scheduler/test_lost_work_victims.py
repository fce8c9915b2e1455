"""Victims by lost work: a preemption throws away as little work as it can.

Every scenario: nlp (guarantee 8) wants GPUs that vision (guarantee 0) borrowed; the same
rules as ever say who may go, the victim order says who goes first.
"""

from dataclasses import replace

import pytest

from scheduler.model import ReasonCode, Running, VictimOrder
from scheduler.policy import plan
from scheduler.preemption import lost_work_s
from tests.scheduler.builders import NOW, cluster, decision, preempted, with_stopping

LOST, YOUNGEST = VictimOrder.LOST_WORK, VictimOrder.YOUNGEST


def borrowed_on_one_node(attempts):
    """vision's borrowed attempts fill n1: (job id, GPUs, seconds run, checkpointed s ago,
    interval s, grace s); n2 is full of vision's work that has run longest (never worth it)."""
    c = cluster().node("n1", gpus=sum(a[1] for a in attempts)).node("n2", gpus=8)
    c.tenant("vision", 0, 16).tenant("nlp", 8, 16)
    c.running(100, "vision", 8, "n2", ran_s=90_000)
    for job_id, gpus, ran_s, ago_s, interval_s, grace_s in attempts:
        c.running(
            job_id,
            "vision",
            gpus,
            "n1",
            ran_s=ran_s,
            checkpointed_ago_s=ago_s,
            checkpoint_interval_s=interval_s,
            grace_s=grace_s,
        )
    return c


@pytest.mark.parametrize(
    "attempts, needed, order, evicted",
    [
        # The one that checkpointed most recently goes first, though it is the oldest.
        ([(1, 2, 9000, 60, None, 0), (2, 2, 3000, None, None, 0)], 2, LOST, {1}),
        ([(1, 2, 9000, 60, None, 0), (2, 2, 3000, None, None, 0)], 2, YOUNGEST, {2}),
        # A long job that never checkpointed is protected against a short one that just did.
        ([(1, 2, 20_000, None, None, 0), (2, 2, 600, 30, None, 0)], 2, LOST, {2}),
        # One about to checkpoint within its notice loses only its restart: it is preferred
        # to one that checkpointed five minutes ago.
        ([(1, 2, 5000, 1790, 1800, 30), (2, 2, 4000, 300, None, 0)], 2, LOST, {1}),
        # ... but not when its next checkpoint is long after its notice.
        ([(1, 2, 5000, 1000, 1800, 5), (2, 2, 4000, 300, None, 0)], 2, LOST, {2}),
        # An 8-GPU attempt that checkpointed a minute ago costs more in all than a 1-GPU one
        # that did five minutes ago: a 1-GPU job takes the small one.
        ([(1, 7, 9000, 60, None, 0), (2, 1, 9000, 300, None, 0)], 1, LOST, {2}),
        # For 8 GPUs, one 8-GPU attempt that loses little beats four 2-GPU ones that lose more.
        ([(1, 8, 9000, 60, None, 0)], 8, LOST, {1}),
    ],
)
def test_victims_are_the_attempts_that_lose_the_least_work(attempts, needed, order, evicted):
    c = borrowed_on_one_node(attempts).pending(10, "nlp", needed)
    assert preempted(c.plan(victim_order=order)) == evicted


def test_one_large_victim_that_loses_little_beats_several_small_ones_that_lose_more():
    c = cluster().node("n1", gpus=8).node("n2", gpus=8)
    c.tenant("vision", 0, 16).tenant("nlp", 8, 16)
    c.running(1, "vision", 8, "n1", ran_s=9000, checkpointed_ago_s=60)
    for job_id in (2, 3, 4, 5):
        c.running(job_id, "vision", 2, "n2", ran_s=400)
    c.pending(10, "nlp", 8)
    assert preempted(c.plan()) == {1}
    # Before jobs reported checkpoints, the youngest went first: the four on n2.
    assert preempted(c.plan(victim_order=YOUNGEST)) == {2, 3, 4, 5}


def test_several_small_victims_beat_one_large_one_when_they_lose_less_in_all():
    c = cluster().node("n1", gpus=8).node("n2", gpus=8)
    c.tenant("vision", 0, 16).tenant("nlp", 8, 16)
    c.running(1, "vision", 8, "n1", ran_s=9000, checkpointed_ago_s=600)
    for job_id in (2, 3, 4, 5):
        c.running(job_id, "vision", 2, "n2", ran_s=9000, checkpointed_ago_s=120)
    c.pending(10, "nlp", 8)
    assert preempted(c.plan()) == {2, 3, 4, 5}


@pytest.mark.parametrize("order", list(VictimOrder))
def test_guarantees_and_the_minimum_runtime_hold_under_every_victim_order(order):
    # vision borrows 4 beyond its guarantee of 4 (its two youngest attempts); the one that just
    # checkpointed ran under a minute, the one that checkpointed longest ago is guaranteed.
    c = cluster().node("n1", gpus=8).tenant("vision", 4, 16).tenant("nlp", 4, 16)
    c.running(1, "vision", 2, "n1", ran_s=30, checkpointed_ago_s=1)
    c.running(2, "vision", 2, "n1", ran_s=5000, checkpointed_ago_s=10)
    c.running(3, "vision", 4, "n1", ran_s=9000)
    c.pending(10, "nlp", 2)
    p = c.plan(victim_order=order, min_runtime_s=60)
    assert preempted(p) == {2}
    # A second job finds nothing more to take: the rest is too young or guaranteed.
    c.pending(11, "nlp", 2)
    assert preempted(c.plan(victim_order=order, min_runtime_s=60)) == {2}


@pytest.mark.parametrize("order", list(VictimOrder))
def test_other_tenants_borrowed_work_goes_before_the_tenants_own(order):
    c = cluster().node("n1", gpus=4).tenant("vision", 0, 8).tenant("nlp", 4, 8)
    c.running(1, "nlp", 2, "n1", ran_s=5000, priority=10, checkpointed_ago_s=1)
    c.running(2, "vision", 2, "n1", ran_s=5000, checkpointed_ago_s=3000)
    c.pending(10, "nlp", 2, priority=200)
    assert preempted(c.plan(victim_order=order)) == {2}


def test_own_lower_priority_victims_go_by_priority_then_lost_work():
    c = cluster().node("n1", gpus=4).tenant("nlp", 4, 4)
    c.running(1, "nlp", 1, "n1", ran_s=9000, priority=10, checkpointed_ago_s=3000)
    c.running(2, "nlp", 1, "n1", ran_s=9000, priority=20, checkpointed_ago_s=5)
    c.running(3, "nlp", 1, "n1", ran_s=9000, priority=10, checkpointed_ago_s=60)
    c.running(4, "nlp", 1, "n1", ran_s=200, priority=10)
    c.pending(10, "nlp", 1, priority=200)
    assert preempted(c.plan()) == {3}
    assert preempted(c.plan(victim_order=YOUNGEST)) == {4}


@pytest.mark.parametrize(
    "ran_s, ago_s, interval_s, grace_s, lost_s",
    [
        (600, None, None, 30, 600 + 60),  # never checkpointed: everything since its start
        (600, 100, None, 30, 100 + 60),
        (600, 5000, None, 30, 600 + 60),  # a checkpoint of an earlier attempt: since the start
        (600, 100, 120, 30, 60),  # its next one (in 20 s) is within its notice
        (600, 100, 120, 10, 100 + 60),  # ... but not within 10 s
        (600, None, 610, 30, 60),  # never reported one, but the first is due in 10 s
        (600, 100, 1800, 0, 100 + 60),  # no notice
    ],
)
def test_lost_work_counts_the_run_time_since_the_last_checkpoint_and_the_restart(
    ran_s, ago_s, interval_s, grace_s, lost_s
):
    r = Running(
        attempt_id=1,
        job_id=1,
        tenant="t",
        user="u",
        priority=100,
        preemptible=True,
        started_at_s=NOW - ran_s,
        gpus=("g0", "g1"),
        gpu_type="H100",
        grace_s=grace_s,
        last_checkpoint_s=None if ago_s is None else NOW - ago_s,
        checkpoint_interval_s=interval_s,
    )
    assert lost_work_s(r, NOW, 60.0) == pytest.approx(lost_s)


@pytest.mark.parametrize(
    "next_checkpoint_in_s, grace_s, waits",
    [
        (10, 5, True),  # 5 s of waiting for 2 GPUs saves 10 min of work on 2 GPUs
        (300, 30, True),  # 270 s of waiting still costs less than the 600 s it saves
        (700, 30, False),  # 670 s of waiting costs more: preempt now
        (20, 30, False),  # within its notice already: preempt now, it saves it before it goes
    ],
)
def test_a_job_waits_for_a_victims_next_checkpoint_when_that_costs_less_than_preempting_now(
    next_checkpoint_in_s, grace_s, waits
):
    # Both checkpointed 10 min ago; attempt 1 says when it will again, attempt 2 does not.
    c = borrowed_on_one_node(
        [
            (1, 2, 9000, 600, 600 + next_checkpoint_in_s, grace_s),
            (2, 2, 9000, 600, None, 0),
        ]
    ).pending(10, "nlp", 2)
    p = c.plan()
    d = decision(p, 10)
    if waits:
        assert p.preemptions == ()
        assert d.reason_code is ReasonCode.WAITING_FOR_PREEMPTION
        assert "saved its next checkpoint" in d.reason
        assert d.estimated_start_s == NOW + next_checkpoint_in_s - grace_s
        # Once it is within its notice of that checkpoint, it is the victim.
        later = c.at(NOW + next_checkpoint_in_s - grace_s).plan()
        assert preempted(later) == {1}
    else:
        assert len(preempted(p)) == 1
        if next_checkpoint_in_s <= grace_s:
            assert preempted(p) == {1}
        assert d.estimated_start_s is not None and d.estimated_start_s <= NOW + grace_s
    # Youngest-first never waits.
    assert preempted(c.plan(victim_order=YOUNGEST))


# ----- notice (grace) ----------------------------------------------------------------------------


def test_the_estimated_start_of_a_job_waiting_for_victims_includes_their_notice():
    c = cluster().node("n1", gpus=8).tenant("vision", 0, 16).tenant("nlp", 8, 16)
    c.running(1, "vision", 4, "n1", ran_s=3000, grace_s=45)
    c.running(2, "vision", 4, "n1", ran_s=9000, grace_s=10)
    c.pending(10, "nlp", 4)
    p = c.plan()
    assert preempted(p) == {1}
    d = decision(p, 10)
    assert d.reason_code is ReasonCode.WAITING_FOR_PREEMPTION
    assert d.estimated_start_s == NOW + 45

    # Next cycle: the victim is stopping, told to be gone 30 s from now. Its GPUs are not free
    # before: nothing starts on them, and the job waits for the end of that notice.
    stopping = with_stopping(c.snapshot(), {1})
    stopping = replace(
        stopping,
        running=tuple(
            replace(r, stop_by_s=NOW + 30) if r.attempt_id == 1 else r for r in stopping.running
        ),
    )
    second = plan(stopping)
    assert second.starts == () and second.preemptions == ()
    assert decision(second, 10).estimated_start_s == NOW + 30


def test_gpus_of_a_stopping_attempt_are_not_given_to_a_job_that_does_not_wait_for_them():
    c = cluster().node("n1", gpus=4).tenant("vision", 0, 8).tenant("nlp", 0, 8)
    c.running(1, "vision", 4, "n1", stopping=True, stop_by_s=NOW + 20, grace_s=30)
    c.pending(10, "nlp", 2)
    p = c.plan()
    assert p.starts == ()
    assert decision(p, 10).estimated_start_s == NOW + 20


def test_a_reservation_behind_stopping_attempts_starts_when_their_notice_ends():
    # nlp may not preempt (no guarantee): it gets the reservation, at the stopping one's end.
    c = cluster().node("n1", gpus=4).tenant("vision", 4, 8).tenant("nlp", 0, 8)
    c.running(1, "vision", 2, "n1", stopping=True, stop_by_s=NOW + 50)
    c.running(2, "vision", 2, "n1", ends_in_s=7200)
    c.pending(10, "nlp", 2)
    d = decision(c.plan(), 10)
    assert d.estimated_start_s == NOW + 50
