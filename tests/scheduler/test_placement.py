"""Placement: gangs are all or nothing, best fit keeps whole nodes free, constraints hold."""

import pytest

from scheduler.model import ReasonCode
from tests.scheduler.builders import cluster, decision, start_of, started


def test_a_gang_never_starts_partially():
    # 12 GPUs free over two nodes, the job needs 16: nothing of it starts.
    c = (
        cluster()
        .nodes(2, gpus=8)
        .tenant("vision", 32, 32)
        .running(1, "vision", 2, "n1")
        .running(2, "vision", 2, "n2")
        .pending(10, "vision", 16)
    )
    p = c.plan()
    assert p.starts == ()
    assert decision(p, 10).reason_code is ReasonCode.NO_CAPACITY


def test_a_gang_larger_than_any_node_spans_whole_nodes():
    c = cluster().nodes(3, gpus=8).tenant("vision", 32, 32).pending(10, "vision", 12)
    start = start_of(c.plan(), 10)
    assert [(node, len(uuids)) for node, uuids in start.placements] == [("n1", 8), ("n2", 4)]
    assert len(set(start.gpu_uuids)) == 12


def test_best_fit_keeps_a_whole_node_free_for_an_8_gpu_job():
    c = (
        cluster()
        .nodes(2, gpus=8)
        .tenant("vision", 16, 16)
        .running(1, "vision", 6, "n2")
        .pending(10, "vision", 2, predicted_s=60)
        .pending(11, "vision", 8, predicted_s=3600)
    )
    p = c.plan()
    assert start_of(p, 10).node == "n2"
    assert start_of(p, 11).node == "n1"


def test_a_job_that_fits_one_node_waits_for_one_instead_of_spreading():
    # 8 GPUs are free in total, 4 on each node: an 8-GPU job would fit one node, so it waits.
    c = (
        cluster()
        .nodes(2, gpus=8)
        .tenant("vision", 16, 16)
        .running(1, "vision", 4, "n1")
        .running(2, "vision", 4, "n2")
        .pending(10, "vision", 8)
    )
    d = decision(c.plan(), 10)
    assert d.reason_code is ReasonCode.GANG_FRAGMENTED
    assert d.reason.startswith(
        "waiting for 8 GPUs of any type: 8 H100 are free, but no node has 8 of them free together"
    )


def test_the_gpu_type_constraint_is_honoured():
    c = (
        cluster()
        .node("a1", gpus=8, type="A100")
        .node("h1", gpus=8, type="H100")
        .tenant("vision", 16, 16)
        .pending(10, "vision", 4, "H100")
        .pending(11, "vision", 4, "A100")
        .pending(12, "vision", 1, "B200")
    )
    p = c.plan()
    assert start_of(p, 10).node == "h1"
    assert start_of(p, 11).node == "a1"
    assert decision(p, 12).reason == "waiting for 1 x B200: no schedulable node has B200"


@pytest.mark.parametrize(
    "node_kw",
    [dict(unhealthy=(0, 1, 2, 3, 4)), dict(schedulable=False), dict(draining=True)],
    ids=["unhealthy GPUs", "cordoned node", "draining node"],
)
def test_unhealthy_gpus_and_unschedulable_nodes_are_not_used(node_kw):
    c = (
        cluster()
        .node("n1", gpus=8, **node_kw)
        .node("n2", gpus=8)
        .tenant("vision", 16, 16)
        .running(1, "vision", 4, "n2")
        .pending(10, "vision", 4)
        .pending(11, "vision", 4)
    )
    p = c.plan()
    assert started(p) == {10}
    assert start_of(p, 10).node == "n2"
    assert all("n1" not in u for s in p.starts for u in s.gpu_uuids)


def test_nodes_without_enough_cpus_or_memory_are_skipped():
    c = (
        cluster()
        .node("small", gpus=8, cpus=8, memory_mib=64_000)
        .node("zbig", gpus=8, cpus=64, memory_mib=512_000)
        .tenant("vision", 16, 16)
        .pending(10, "vision", 2, cpus=16, memory_mib=100_000)
        .pending(12, "vision", 1, cpus=128)
    )
    p = c.plan()
    # Both nodes have 8 free and "small" comes first by name, but it is too small.
    assert start_of(p, 10).node == "zbig"
    assert decision(p, 12).reason_code is ReasonCode.NO_MATCHING_GPUS
    assert decision(p, 12).reason == (
        "waiting for 1 GPU of any type: no schedulable node with GPUs has 128 CPUs for it"
    )


def test_cpus_held_by_running_attempts_are_not_promised_again():
    c = cluster().node("n1", gpus=8, cpus=32).node("n2", gpus=8, cpus=32).tenant("vision", 16, 16)
    c.running(1, "vision", 1, "n1", cpus=30.0)
    c.pending(10, "vision", 1, cpus=8)
    assert start_of(c.plan(), 10).node == "n2"


def test_a_job_too_big_for_the_cluster_says_so():
    d = decision(cluster().nodes(2, gpus=8).tenant("v", 99, 99).pending(1, "v", 24).plan(), 1)
    assert d.reason_code is ReasonCode.NO_MATCHING_GPUS
    assert (
        d.reason
        == "waiting for 24 GPUs of any type: only 16 healthy GPUs exist on schedulable nodes"
    )
