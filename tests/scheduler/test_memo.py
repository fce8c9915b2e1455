"""plan() reuses indexes only through a memo its caller owns: two threads planning different
clusters at once (the embedded loop and a what-if replay) each get their own plan, and a memo
handed a different cluster rebuilds instead of reusing the other's topology or history."""

from __future__ import annotations

import sys
import threading

from scheduler.memo import PlanMemo
from scheduler.policy import plan
from tests.scheduler.builders import cluster


def two_clusters():
    # Different node counts, GPU types and histories, so any index of one applied to the other
    # places jobs on GPUs that do not exist there or predicts other durations.
    small = (
        cluster()
        .nodes(2, prefix="a", gpus=4, type="A100")
        .tenant("vision", guaranteed=4, limit=8)
        .history("vision", "train", 1, 600.0)
    )
    for job in range(1, 12):
        small.pending(job, "vision", gpus=1 + job % 2, type="A100")
    small.pending(60, "vision", gpus=16, type="A100")  # no node holds it: the fleet is read
    large = (
        cluster()
        .nodes(6, prefix="h", gpus=8, type="H100")
        .tenant("nlp", guaranteed=16, limit=48)
        .history("nlp", "train", 4, 7200.0)
        .running(900, "nlp", gpus=8, node="h1")
    )
    for job in range(100, 130):
        large.pending(job, "nlp", gpus=(1, 2, 4, 8)[job % 4], type="H100")
    large.pending(160, "nlp", gpus=64, type="H100")
    return small.snapshot(), large.snapshot()


def test_each_threads_plan_is_its_single_threaded_plan():
    snapshots = two_clusters()
    expected = [plan(s) for s in snapshots]
    assert expected[0] != expected[1] and all(p.starts for p in expected)
    hopeless = [d.reason_code.name for p in expected for d in p.pending if d.job_id in (60, 160)]
    assert hopeless == ["NO_MATCHING_GPUS", "NO_MATCHING_GPUS"]
    wrong: list[str] = []
    barrier = threading.Barrier(2)

    def keep_planning(i: int) -> None:
        memo = PlanMemo()
        barrier.wait()
        for round_ in range(150):
            got = plan(snapshots[i], memo=memo) if round_ % 3 else plan(snapshots[i])
            if got != expected[i]:
                wrong.append(f"thread {i}, round {round_}")

    threads = [threading.Thread(target=keep_planning, args=(i,)) for i in (0, 1)]
    # Switch threads as often as the interpreter allows, to interleave inside plan().
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(previous)
    assert not wrong, wrong[:5]


def test_one_memo_handed_another_cluster_rebuilds_its_indexes():
    small, large = two_clusters()
    memo = PlanMemo()
    for snapshot in (small, large, small, large):
        assert plan(snapshot, memo=memo) == plan(snapshot)


def test_a_memo_reuses_the_index_of_the_same_tuple_and_only_of_it():
    small, large = two_clusters()
    memo = PlanMemo()
    assert memo.topology(small.nodes) is memo.topology(small.nodes)
    assert memo.history_index(small.history) is memo.history_index(small.history)
    assert memo.fleet(small.nodes) is memo.fleet(small.nodes)
    assert memo.fleet(large.nodes) is not memo.fleet(small.nodes)
    first = memo.topology(small.nodes)
    assert memo.topology(large.nodes) is not first
    # Equal contents in a new tuple: rebuilt, since identity is what a caller promises to keep.
    assert memo.topology(tuple(small.nodes)) is not None
