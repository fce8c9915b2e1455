"""EASY backfill: later jobs start early only where they cannot delay the head of the queue."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import backfill
from scheduler.memo import PlanMemo
from scheduler.model import ReasonCode
from scheduler.placement import ClusterIndex
from tests.scheduler.builders import NOW, cluster, decision, started
from tests.scheduler.test_plan_properties import snapshots

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


def _reserve_by_every_node(job_id, n, ti, now_s, releases, extra, skip, node_ok):
    """The reservation as worked out for every node, no node passed over: the reference for
    backfill.reserve, which passes over nodes that cannot beat the best found so far."""
    if n > ti.max_node_cap:
        return None  # over the whole type: not the per-node walk under test
    best = None
    for node in sorted(ti.node_cap):
        if ti.node_cap[node] < n or (node_ok is not None and not node_ok(node)):
            continue
        listed = releases.by_node.get(ti.gpu_type, {}).get(node, ())
        events = [(e, c) for e, a, c in listed if a not in skip]
        events += [(e, c) for e, nd, c in extra if nd == node]
        events.sort()
        need = n - ti.free_on(node)
        start_s = None
        if need <= 0:
            start_s = now_s
        else:
            got = 0
            for end_s, count in events:
                got += count
                if got >= need:
                    start_s = max(end_s, now_s)
                    break
        if start_s is not None and (best is None or (start_s, node) < best[:2]):
            freed = sum(c for e, c in events if e <= start_s)
            best = (start_s, node, ti.free_on(node) + freed - n)
    return best


def _indexes(snap):
    memo = PlanMemo()
    totals = memo.running_totals(snap.running)
    topology = memo.topology(snap.nodes)
    index = ClusterIndex(
        snap.nodes, snap.running, topology, totals.held, memo.free_gpus(topology, snap.running)
    )
    return topology, index, memo.releases(topology, 3600.0, snap.running)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(snapshots(), st.data())
def test_a_reservation_is_the_earliest_over_every_node_whichever_nodes_it_passes_over(snap, data):
    _, index, releases = _indexes(snap)
    for ti in index.types.values():
        nodes = sorted(ti.node_cap)
        if not nodes:
            continue
        n = data.draw(st.integers(1, ti.max_node_cap))
        now_s = NOW + data.draw(st.sampled_from([0.0, 0.0, 100.0, 5000.0]))
        # GPUs freeing up besides the running attempts' ends (notices, this cycle's starts).
        extra = data.draw(
            st.lists(
                st.tuples(
                    st.floats(NOW - 100, NOW + 20_000), st.sampled_from(nodes), st.integers(1, 4)
                ),
                max_size=4,
            )
        )
        ids = sorted({r.attempt_id for r in snap.running})
        skip = set(data.draw(st.lists(st.sampled_from(ids), max_size=3))) if ids else set()
        barred = set(data.draw(st.lists(st.sampled_from(nodes), max_size=2)))
        node_ok = None
        if data.draw(st.booleans()):
            node_ok = lambda node, barred=barred: node not in barred  # noqa: E731
        got = backfill.reserve(7, n, ti, now_s, releases, extra, skip, node_ok)
        want = _reserve_by_every_node(7, n, ti, now_s, releases, extra, skip, node_ok)
        assert (got is None) == (want is None)
        if got is not None:
            assert (got.start_s, got.node, got.slack) == want


def test_a_later_node_freed_sooner_by_a_notice_than_by_any_end_wins_the_reservation():
    # n1's attempt ends first; n2's ends later, but GPUs told to stop free up on n2 sooner than
    # anything on n1: the walk may pass over a node only by its earliest release of any kind.
    snap = (
        cluster()
        .nodes(2, gpus=2)
        .tenant("a")
        .running(1, "a", gpus=2, node="n1", ends_in_s=1000)
        .running(2, "a", gpus=2, node="n2", ends_in_s=5000)
        .snapshot()
    )
    topology, index, releases = _indexes(snap)
    ti = next(iter(index.types.values()))
    n2 = topology.names.index("n2")
    got = backfill.reserve(9, 2, ti, NOW, releases, [(NOW + 10, n2, 2)], set(), None)
    assert got is not None
    assert (got.start_s, got.node) == (NOW + 10, n2)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(snapshots(), st.data())
def test_each_nodes_earliest_release_stays_in_step_as_attempts_come_and_go(snap, data):
    # reserve meets nodes in the order of their earliest listed end (ReleaseIndex.first),
    # kept as the memo adds and removes attempts from one plan to the next: after any order of
    # removals and additions it must be what the lists themselves say.
    _, _, releases = _indexes(snap)
    attempts = [r for r in snap.running if not r.stopping]
    gone = data.draw(st.lists(st.sampled_from(attempts), unique=True)) if attempts else []

    def in_step():
        for t, per_node in releases.by_node.items():
            heads = sorted((listed[0][0], node) for node, listed in per_node.items() if listed)
            assert releases.first.get(t, []) == heads

    for r in gone:
        releases.remove(r)
        in_step()
    for r in data.draw(st.permutations(gone)):
        releases.add(r)
        in_step()


def test_of_the_nodes_that_can_start_it_now_the_lowest_wins_whatever_their_releases():
    # n2 has the GPUs free; n1 and n3 have them told to stop with notices already over (n3's
    # the longer ago). All three can start the job now, and the lowest node wins, as a walk
    # over every node in order finds: meeting n3 first, by its earlier release, must not end
    # the walk before n1.
    snap = (
        cluster()
        .nodes(3, gpus=2)
        .tenant("a")
        .running(1, "a", gpus=2, node="n1", ends_in_s=1000)
        .running(3, "a", gpus=2, node="n3", ends_in_s=1000)
        .snapshot()
    )
    topology, index, releases = _indexes(snap)
    ti = next(iter(index.types.values()))
    n1, n3 = topology.names.index("n1"), topology.names.index("n3")
    extra = [(NOW - 100, n3, 2), (NOW - 50, n1, 2)]
    got = backfill.reserve(9, 2, ti, NOW, releases, extra, set(), None)
    want = _reserve_by_every_node(9, 2, ti, NOW, releases, extra, set(), None)
    assert got is not None and want is not None
    assert (got.start_s, got.node) == (NOW, n1) == want[:2]
