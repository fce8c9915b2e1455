"""Preemption: guarantees are kept, borrowed GPUs come back, and nothing is evicted needlessly."""

import pytest

from scheduler.model import Config, Ordering, ReasonCode
from scheduler.policy import plan
from tests.scheduler.builders import (
    cluster,
    decision,
    preempted,
    start_of,
    started,
    with_stopping,
    without,
)


def two_tenants_on_one_node():
    return cluster().node("n1", gpus=8).tenant("vision", 8, 16).tenant("nlp", 8, 16)


@pytest.mark.parametrize("ordering", list(Ordering))
def test_a_tenant_within_its_guarantee_is_never_preempted(ordering):
    # Guarantees add up to more than the cluster: vision holds exactly its 8, so nlp must wait.
    c = (
        two_tenants_on_one_node()
        .running(1, "vision", 4, ran_s=7200, priority=50)
        .running(2, "vision", 4, ran_s=600, priority=50)
        .pending(10, "nlp", 8, priority=200, predicted_s=60)
    )
    p = c.plan(ordering=ordering, min_runtime_s=0)
    assert p.preemptions == ()
    assert decision(p, 10).reason_code is ReasonCode.NO_CAPACITY


def test_borrowed_work_is_reclaimed_when_the_owner_needs_its_gpus():
    c = (
        cluster()
        .nodes(2, gpus=8)
        .tenant("vision", 8, 16)
        .tenant("nlp", 8, 16)
        .running(1, "vision", 8, "n1", ran_s=7200)
        .running(2, "vision", 4, "n2", ran_s=1800)
        .running(3, "vision", 4, "n2", ran_s=900)
        .pending(10, "nlp", 8)
    )
    first = plan(c.snapshot())
    assert preempted(first) == {2, 3}
    assert {p.for_job_id for p in first.preemptions} == {10}
    assert started(first) == set()
    assert decision(first, 10).reason_code is ReasonCode.WAITING_FOR_PREEMPTION

    # While the victims stop, their GPUs stay promised to job 10: nothing more is evicted.
    stopping = with_stopping(c.snapshot(), {2, 3})
    second = plan(stopping)
    assert second.preemptions == ()
    assert decision(second, 10).reason_code is ReasonCode.WAITING_FOR_PREEMPTION

    third = plan(without(stopping, {2, 3}))
    assert start_of(third, 10).node == "n2"
    assert start_of(third, 10).borrowed is False


def owed_a_node_held_by_scattered_surplus(vision_guaranteed: int):
    """vision runs 12 GPUs over two full nodes; the attempts it started last (the borrowed
    ones) sit one on each node, so no node holds 8 borrowed GPUs for nlp's gang."""
    return (
        cluster()
        .nodes(2, gpus=8)
        .tenant("vision", vision_guaranteed, 16)
        .tenant("nlp", 8, 16)
        .tenant("audio", 4, 16)
        .running(1, "vision", 4, "n1", ran_s=7200)
        .running(2, "vision", 4, "n2", ran_s=5400)
        .running(3, "vision", 4, "n1", ran_s=1800)
        .running(4, "audio", 4, "n2", ran_s=900)
        .pending(10, "nlp", 8)
    )


@pytest.mark.parametrize("ordering", [Ordering.FAIR, Ordering.FIFO])
def test_a_gang_within_its_guarantee_gets_a_node_from_another_tenants_surplus(ordering):
    # vision uses 8 beyond its guarantee of 4, but its borrowed attempts (2 and 3, started
    # last) are on different nodes. Both of its attempts on n1 are within that surplus: nlp's
    # guaranteed GPUs are taken back there, and vision keeps its 4.
    c = owed_a_node_held_by_scattered_surplus(vision_guaranteed=4)
    first = c.plan(ordering=ordering)
    assert preempted(first) == {1, 3}
    assert {p.for_job_id for p in first.preemptions} == {10}
    assert all("uses more than its guarantee" in p.reason for p in first.preemptions)
    assert decision(first, 10).reason_code is ReasonCode.WAITING_FOR_PREEMPTION
    after = plan(without(c.snapshot(), {1, 3}), Config(ordering=ordering))
    assert start_of(after, 10).node == "n1"
    assert start_of(after, 10).borrowed is False


def test_a_gang_takes_no_node_whose_emptying_would_push_a_tenant_below_its_guarantee():
    # vision is only 6 over its guarantee of 6: emptying n1 would take 8 of its GPUs, and n2
    # holds audio's guaranteed work. nlp waits; nothing is preempted.
    c = owed_a_node_held_by_scattered_surplus(vision_guaranteed=6)
    p = c.plan()
    assert p.preemptions == ()
    assert decision(p, 10).reason_code is ReasonCode.NO_CAPACITY


def test_borrowed_work_younger_than_the_minimum_runtime_is_not_preempted():
    c = (
        cluster()
        .nodes(2, gpus=8)
        .tenant("vision", 8, 16)
        .tenant("nlp", 8, 16)
        .running(1, "vision", 8, "n1", ran_s=3600)
        .running(2, "vision", 8, "n2", ran_s=30)
        .pending(10, "nlp", 8)
    )
    p = c.plan(min_runtime_s=60)
    assert p.preemptions == ()
    assert decision(p, 10).reason_code is ReasonCode.NO_CAPACITY
    # Half a minute later it has run long enough.
    later = plan(c.at(c.now_s + 30).snapshot(), Config(min_runtime_s=60))
    assert preempted(later) == {2}


@pytest.mark.parametrize("ordering", [Ordering.FAIR, Ordering.SRTF, Ordering.LAS])
def test_a_job_preempted_max_preemptions_times_is_not_preempted_again(ordering):
    # vision's guarantee is job 1's node; 2, 3 (on n2) and 4 (on n3) are borrowed. The rules
    # take n2's two young attempts; job 3 was preempted twice already, so with a bound of 2
    # the job takes n3 instead, and with a bound of 0 nothing at all.
    long = {"remaining_s": 9000.0, "attained_service_s": 9e4}
    c = (
        cluster()
        .nodes(3, gpus=8)
        .tenant("vision", 8, 24)
        .tenant("nlp", 8, 16)
        .running(1, "vision", 8, "n1", ran_s=7200, **long)
        .running(2, "vision", 4, "n2", ran_s=1800, **long)
        .running(3, "vision", 4, "n2", ran_s=900, preemptions=2, **long)
        .running(4, "vision", 8, "n3", ran_s=3600, **long)
        .pending(10, "nlp", 8, predicted_s=60)
    )
    assert preempted(c.plan(ordering=ordering)) == {2, 3}
    assert preempted(c.plan(ordering=ordering, max_preemptions=3)) == {2, 3}
    assert preempted(c.plan(ordering=ordering, max_preemptions=2)) == {4}
    none = c.plan(ordering=ordering, max_preemptions=0)
    assert none.preemptions == ()
    assert decision(none, 10).reason_code is ReasonCode.NO_CAPACITY


@pytest.mark.parametrize("ordering", [Ordering.FAIR, Ordering.SRTF, Ordering.LAS])
def test_a_job_at_its_preemption_bound_starts_only_within_its_guarantee(ordering):
    # Not preempted again, it could not give borrowed GPUs back: an owner would wait for it as
    # long as it runs. So it may use only its tenant's guarantee, which it fills before the
    # tenant's attempts that can be taken back: vision's job 1 (too young to be anyone's victim
    # here) becomes the borrowed one instead, and job 11, which may still be preempted, borrows.
    def vision_on_n1(**job_1):
        return (
            cluster()
            .nodes(3, gpus=8)
            .tenant("vision", 8, 24)
            .tenant("nlp", 8, 16)
            .running(1, "vision", 8, "n1", ran_s=30, **job_1)
            .pending(10, "vision", 8, preemptions=3, waited_s=600, predicted_s=600)
            .pending(11, "vision", 8, waited_s=60, predicted_s=600)
        )

    first = vision_on_n1().plan(ordering=ordering, max_preemptions=3)
    assert started(first) == {10, 11} and first.preemptions == ()
    assert not start_of(first, 10).borrowed and start_of(first, 11).borrowed
    # Below the bound, or with none, it is an ordinary job: vision is at its guarantee, so it
    # borrows.
    for cap in (4, None):
        free = vision_on_n1().plan(ordering=ordering, max_preemptions=cap)
        assert start_of(free, 10).borrowed, cap
    # The guarantee is filled by work that cannot be taken back either: it waits, and says why.
    for job_1 in ({"preemptible": False}, {"preemptions": 3}):
        full = vision_on_n1(**job_1).plan(ordering=ordering, max_preemptions=3)
        assert started(full) == {11} and full.preemptions == ()
        waiting = decision(full, 10)
        assert waiting.reason_code is ReasonCode.QUOTA_LIMIT
        assert "preempted 3 times" in waiting.reason and "guaranteed GPUs" in waiting.reason
        assert "work that cannot be preempted holds 8 of its 8 guaranteed" in waiting.reason


def test_preemption_evicts_the_youngest_borrowed_attempts_first():
    c = (
        cluster()
        .nodes(2, gpus=8)
        .tenant("vision", 4, 16)
        .tenant("nlp", 4, 16)
        .running(1, "vision", 4, "n1", ran_s=9000)
        .running(2, "vision", 4, "n1", ran_s=8000)
        .running(3, "vision", 4, "n2", ran_s=7000)
        .running(4, "vision", 4, "n2", ran_s=6000)
        .pending(10, "nlp", 4)
    )
    assert preempted(c.plan()) == {4}


@pytest.mark.parametrize(
    "attempts, needed, evicted",
    [
        # (job id, GPUs, seconds run) on one node; the youngest alone is enough
        ([(1, 4, 9000), (2, 1, 3000), (3, 1, 2000), (4, 2, 1000)], 2, {4}),
        # the youngest is too small, the next is enough on its own: the youngest is given back
        ([(1, 2, 9000), (2, 4, 2000), (3, 1, 1000)], 4, {2}),
        # two of three are needed
        ([(1, 2, 9000), (2, 2, 2000), (3, 3, 1000)], 5, {2, 3}),
    ],
)
def test_preemption_never_evicts_more_than_needed(attempts, needed, evicted):
    c = cluster().node("n1", gpus=8).node("n2", gpus=8)
    c.tenant("vision", 0, 16).tenant("nlp", 8, 16)
    c.running(100, "vision", 8, "n2", ran_s=9999)  # n2 is full of vision's borrowed work too
    for job_id, gpus, ran_s in attempts:
        c.running(job_id, "vision", gpus, "n1", ran_s=ran_s)
    c.pending(10, "nlp", needed)
    p = c.plan()
    assert preempted(p) == evicted


def test_a_tenant_is_not_pushed_below_its_guarantee_by_another():
    # vision is only 2 over its guarantee; nlp needs 4 and may not take vision's guaranteed GPUs.
    c = (
        two_tenants_on_one_node()
        .tenant("vision", 6, 16)
        .running(1, "vision", 6, ran_s=9000)
        .running(2, "vision", 2, ran_s=100)
        .pending(10, "nlp", 4)
    )
    p = c.plan()
    assert p.preemptions == ()
    assert decision(p, 10).reason_code is ReasonCode.NO_CAPACITY


def test_higher_priority_preempts_lower_priority_inside_a_tenant():
    c = (
        cluster()
        .node("n1", gpus=8)
        .tenant("vision", 8, 8)
        .running(1, "vision", 4, priority=100, ran_s=3000)
        .running(2, "vision", 4, priority=50, ran_s=5000)
        .pending(10, "vision", 4, priority=200)
    )
    p = c.plan()
    assert preempted(p) == {2}
    assert "higher priority" in p.preemptions[0].reason
    assert decision(p, 10).reason_code is ReasonCode.WAITING_FOR_PREEMPTION


def test_equal_priority_does_not_preempt_inside_a_tenant():
    c = (
        cluster()
        .node("n1", gpus=8)
        .tenant("vision", 8, 8)
        .running(1, "vision", 8, priority=100)
        .pending(10, "vision", 4, priority=100)
    )
    p = c.plan()
    assert p.preemptions == ()
    assert decision(p, 10).reason_code is ReasonCode.QUOTA_LIMIT


def test_nothing_is_preempted_when_preemption_is_off():
    c = (
        two_tenants_on_one_node()
        .tenant("vision", 0, 16)
        .running(1, "vision", 8)
        .pending(10, "nlp", 8)
    )
    p = c.plan(preemption=False)
    assert p.preemptions == ()
    assert decision(p, 10).reason_code is ReasonCode.NO_CAPACITY


def test_a_non_preemptible_attempt_is_never_preempted():
    c = (
        two_tenants_on_one_node()
        .tenant("vision", 0, 16)
        .running(1, "vision", 8, preemptible=False)
        .pending(10, "nlp", 8)
    )
    assert c.plan().preemptions == ()


def test_borrowed_attempts_on_a_draining_node_are_preempted_and_guaranteed_ones_stay():
    c = (
        cluster()
        .node("n1", gpus=8, draining=True)
        .node("n2", gpus=8)
        .tenant("vision", 4, 16)
        .running(1, "vision", 4, "n1", ran_s=9000)
        .running(2, "vision", 4, "n1", ran_s=100)
    )
    p = c.plan()
    assert preempted(p) == {2}
    assert p.preemptions[0].reason == "node draining"


def test_srtf_preempts_a_longer_remaining_job_for_a_shorter_one():
    c = (
        cluster()
        .node("n1", gpus=4)
        .tenant("vision", 4, 4)
        .running(1, "vision", 4, remaining_s=5000)
        .pending(10, "vision", 4, predicted_s=600)
        .pending(11, "vision", 4, predicted_s=9000)
    )
    p = c.plan(ordering=Ordering.SRTF, borrowing=False, backfill=False, min_runtime_s=0)
    assert preempted(p) == {1}
    assert "shorter remaining time" in p.preemptions[0].reason
    # Without preemption SRTF only reorders the queue.
    assert c.plan(ordering=Ordering.SRTF, preemption=False).preemptions == ()


def test_las_preempts_a_job_that_received_more_service_for_one_that_received_less():
    c = (
        cluster()
        .node("n1", gpus=4)
        .tenant("vision", 4, 4)
        .running(1, "vision", 4, attained_service_s=50_000.0)
        .pending(10, "vision", 4, attained_service_s=0.0)
    )
    p = c.plan(ordering=Ordering.LAS, borrowing=False, backfill=False, min_runtime_s=0)
    assert preempted(p) == {1}


def test_gpus_set_aside_for_a_job_waiting_on_a_preemption_are_not_given_to_a_later_job():
    # n1: 4 free, 4 held by vision's borrowed job. nlp's 8-GPU job within its guarantee takes
    # the borrowed 4 back and the 4 free beside them; vision's later 4-GPU job gets neither.
    c = (
        cluster()
        .node("n1", gpus=8)
        .tenant("vision", 0, 16)
        .tenant("nlp", 8, 8)
        .running(1, "vision", 4)
        .pending(10, "nlp", 8)
        .pending(11, "vision", 4, predicted_s=60)
    )
    p = c.plan()
    assert preempted(p) == {1}
    assert started(p) == set()
    assert decision(p, 10).reason_code is ReasonCode.WAITING_FOR_PREEMPTION
    assert decision(p, 11).reason_code is ReasonCode.NO_CAPACITY


def test_a_job_waits_for_gpus_being_freed_instead_of_preempting_more():
    c = (
        cluster()
        .nodes(2, gpus=8)
        .tenant("vision", 0, 16)
        .tenant("nlp", 8, 8)
        .running(1, "vision", 8, "n1", stopping=True)
        .running(2, "vision", 8, "n2")
        .pending(10, "nlp", 8)
    )
    p = c.plan()
    assert p.preemptions == ()
    assert decision(p, 10).reason == (
        "waiting for 8 GPUs of any type: GPUs of jobs that are stopping are set aside for it; "
        "it starts once they are released"
    )


def test_gpus_being_freed_go_to_the_jobs_they_fit_most_tightly_so_each_waiting_job_gets_some():
    # Stopping attempts free 6 GPUs on n1, 2 + 2 already free on n2 and 2 on n3. Taken best fit,
    # in queue order (4, then 6, then 2), every job gets a node; taking n1 for the 4-GPU job would
    # leave the 6-GPU one without.
    c = (
        cluster()
        .nodes(3, gpus=8)
        .tenant("vision", 16, 32)
        .tenant("old", 0, 24)
        .running(1, "old", 6, "n1", stopping=True)
        .running(2, "old", 2, "n1", ran_s=30)
        .running(3, "old", 2, "n2", stopping=True)
        .running(4, "old", 4, "n2", ran_s=30)
        .running(5, "old", 2, "n3", stopping=True)
        .running(6, "old", 6, "n3", ran_s=30)
        .pending(10, "vision", 4, priority=300)
        .pending(11, "vision", 6, priority=200)
        .pending(12, "vision", 2, priority=100)
        .pending(13, "vision", 2, priority=50)
    )
    p = c.plan()
    assert p.starts == () and p.preemptions == ()
    for job_id in (10, 11, 12):
        assert decision(p, job_id).reason_code is ReasonCode.WAITING_FOR_PREEMPTION
    # Everything that frees up is promised: the last job has nothing left to wait for.
    assert decision(p, 13).reason_code is not ReasonCode.WAITING_FOR_PREEMPTION
