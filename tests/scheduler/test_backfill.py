"""EASY backfill: later jobs start early only where they cannot delay the head of the queue."""

import pytest

from scheduler.model import ReasonCode
from tests.scheduler.builders import NOW, cluster, decision, started

H = 3600.0


def head_waits_for_n1():
    # n1: 2 free now, 4 more in 1 h, 2 more in 3 h. Job 10 (8 GPUs, high priority) is the head
    # and can start in 3 h, when n1 is empty; n2 has 2 GPUs no reservation needs.
    return (
        cluster()
        .node("n1", gpus=8)
        .node("n2", gpus=2)
        .tenant("vision", 32, 32)
        .running(1, "vision", 4, "n1", ends_in_s=1 * H, priority=200)
        .running(2, "vision", 2, "n1", ends_in_s=3 * H, priority=200)
        .pending(10, "vision", 8, priority=200, predicted_s=2 * H)
    )


def gpus_free_on(snapshot, plan, node: str, at_s: float) -> int:
    """Free GPUs of a node at a future time, from the plan's starts and their predictions."""
    busy = sum(
        sum(1 for u in r.gpus if u.startswith(node + "-"))
        for r in snapshot.running
        if (r.predicted_end_s or float("inf")) > at_s
    )
    for s in plan.starts:
        if snapshot.now_s + plan.predicted_duration_s[s.job_id] > at_s:
            busy += sum(len(u) for n, u in s.placements if n == node)
    total = next(len(n.gpus) for n in snapshot.nodes if n.name == node)
    return total - busy


def test_the_head_of_the_queue_gets_a_reservation_with_an_estimated_start():
    p = head_waits_for_n1().plan()
    d = decision(p, 10)
    assert d.queue_position == 1
    assert d.estimated_start_s == NOW + 3 * H
    assert d.reason == (
        "waiting for 8 GPUs of any type: tenant vision uses 6 of its 32 guaranteed, and only 4 "
        "H100 are free; it is first in line for H100 and should start in about 3 h"
    )


@pytest.mark.parametrize(
    "gpus, predicted_s, starts_on",
    [
        (2, 2 * H, "n1"),  # ends before the reservation: may use n1's free GPUs
        (2, 5 * H, "n2"),  # runs past it: only GPUs the reservation does not need
        (4, 5 * H, None),  # neither: it waits
    ],
)
def test_backfill_never_delays_the_reservation(gpus, predicted_s, starts_on):
    c = head_waits_for_n1().pending(11, "vision", gpus, predicted_s=predicted_s)
    snap = c.snapshot()
    p = c.plan()
    if starts_on is None:
        assert started(p) == set()
        d = decision(p, 11)
        assert d.reason_code in (ReasonCode.RESERVED, ReasonCode.GANG_FRAGMENTED)
    else:
        assert [s.node for s in p.starts] == [starts_on]
    start_s = decision(p, 10).estimated_start_s
    assert gpus_free_on(snap, p, "n1", start_s) >= 8


def test_a_long_job_may_use_what_the_reservation_leaves_over():
    # n1 frees 4 GPUs in 1 h; the head needs 6 of the 8, so 2 of the 4 free now are slack.
    c = (
        cluster()
        .node("n1", gpus=8)
        .tenant("vision", 32, 32)
        .running(1, "vision", 4, "n1", ends_in_s=1 * H, priority=200)
        .pending(10, "vision", 6, priority=200, predicted_s=H)
        .pending(11, "vision", 3, predicted_s=9 * H)
        .pending(12, "vision", 2, predicted_s=9 * H)
    )
    snap = c.snapshot()
    p = c.plan()
    assert started(p) == {12}
    assert decision(p, 11).reason_code is ReasonCode.RESERVED
    assert decision(p, 11).reason == (
        "waiting for 3 GPUs of any type: tenant vision uses 4 of its 32 guaranteed, and 2 of the "
        "4 free H100 are reserved for job 10, which is first in line for H100"
    )
    assert gpus_free_on(snap, p, "n1", decision(p, 10).estimated_start_s) >= 6


def test_without_backfill_a_later_job_takes_what_fits_and_nothing_is_reserved():
    c = head_waits_for_n1().pending(11, "vision", 2, predicted_s=9 * H)
    p = c.plan(backfill=False)
    assert started(p) == {11}
    assert decision(p, 10).estimated_start_s is None


def test_the_reservation_of_one_gpu_type_does_not_hold_back_another():
    c = (
        head_waits_for_n1()
        .node("a1", gpus=4, type="A100")
        .pending(11, "vision", 4, "A100", predicted_s=9 * H)
    )
    assert started(c.plan()) == {11}


def test_a_gang_larger_than_any_node_reserves_gpus_over_the_whole_type():
    # 4 free now, 6 more in 1 h, 6 more in 2 h: the 14-GPU head starts in 2 h with 2 to spare.
    c = (
        cluster()
        .nodes(2, gpus=8)
        .tenant("vision", 32, 32)
        .running(1, "vision", 6, "n1", ends_in_s=H, priority=200)
        .running(2, "vision", 6, "n2", ends_in_s=2 * H, priority=200)
        .pending(10, "vision", 14, priority=200)
        .pending(11, "vision", 2, predicted_s=9 * H)
        .pending(12, "vision", 2, predicted_s=9 * H)
    )
    snap = c.snapshot()
    p = c.plan()
    assert decision(p, 10).estimated_start_s == NOW + 2 * H
    assert started(p) == {11}
    assert decision(p, 12).reason_code is ReasonCode.RESERVED
    at_s = NOW + 2 * H
    assert gpus_free_on(snap, p, "n1", at_s) + gpus_free_on(snap, p, "n2", at_s) >= 14
