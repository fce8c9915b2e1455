"""Jobs that mount volumes land only on nodes that have every one of them."""

import pytest

from scheduler.model import ReasonCode
from tests.scheduler.builders import cluster, decision, preempted, start_of, started


def nodes_with_volumes():
    return (
        cluster()
        .node("n1", gpus=8)
        .node("n2", gpus=8, volumes=("datasets",))
        .node("n3", gpus=8, volumes=("datasets", "scratch"))
        .tenant("vision", 8, 24)
    )


@pytest.mark.parametrize(
    "gpus, volumes, nodes",
    [
        (4, (), {"n1"}),  # best fit, by name: the first node
        (4, ("datasets",), {"n2"}),
        (4, ("datasets", "scratch"), {"n3"}),
        (4, ("scratch",), {"n3"}),
        (12, ("datasets",), {"n2", "n3"}),  # a gang over the two nodes that have it
    ],
)
def test_a_job_is_placed_only_on_nodes_with_all_its_volumes(gpus, volumes, nodes):
    c = nodes_with_volumes().pending(10, "vision", gpus, volumes=volumes)
    p = c.plan()
    assert {name for name, _ in start_of(p, 10).placements} == nodes


@pytest.mark.parametrize(
    "volumes, text",
    [
        (("models",), "waiting for a node with volume models"),
        (("models", "datasets"), "waiting for a node with volumes datasets, models"),
    ],
)
def test_a_job_no_node_has_the_volumes_for_waits_with_missing_volume(volumes, text):
    p = nodes_with_volumes().pending(10, "vision", 1, volumes=volumes).plan()
    d = decision(p, 10)
    assert d.reason_code is ReasonCode.MISSING_VOLUME
    assert d.reason == text


def test_a_job_larger_than_the_nodes_with_its_volumes_waits_with_missing_volume():
    p = nodes_with_volumes().pending(10, "vision", 8, volumes=("scratch",)).plan()
    assert started(p) == {10}
    p = nodes_with_volumes().pending(10, "vision", 12, volumes=("scratch",)).plan()
    assert decision(p, 10).reason_code is ReasonCode.MISSING_VOLUME


def test_a_job_waits_when_the_nodes_with_its_volumes_are_busy_and_others_start_elsewhere():
    c = nodes_with_volumes().tenant("nlp", 0, 24)
    c.running(1, "vision", 8, "n2", ran_s=600)
    c.running(2, "vision", 8, "n3", ran_s=600)
    c.pending(10, "vision", 2, volumes=("datasets",), waited_s=600)
    c.pending(11, "vision", 2, waited_s=60)
    p = c.plan()
    assert started(p) == {11}
    assert start_of(p, 11).node == "n1"
    assert decision(p, 10).reason_code is ReasonCode.NO_CAPACITY


def test_preemption_for_a_job_with_volumes_takes_victims_only_on_nodes_with_them():
    c = (
        cluster()
        .node("n1", gpus=4)
        .node("n2", gpus=4, volumes=("datasets",))
        .tenant("vision", 0, 8)
        .tenant("nlp", 4, 8)
    )
    # The attempt on n1 loses the least, but n1 lacks the volume.
    c.running(1, "vision", 4, "n1", ran_s=100)
    c.running(2, "vision", 4, "n2", ran_s=9000)
    c.pending(10, "nlp", 4, volumes=("datasets",))
    assert preempted(c.plan()) == {2}
    assert preempted(c.plan(victim_order="youngest")) == {2}
    # Without volumes the cheapest goes.
    c2 = (
        cluster()
        .node("n1", gpus=4)
        .node("n2", gpus=4, volumes=("datasets",))
        .tenant("vision", 0, 8)
        .tenant("nlp", 4, 8)
        .running(1, "vision", 4, "n1", ran_s=100)
        .running(2, "vision", 4, "n2", ran_s=9000)
        .pending(10, "nlp", 4)
    )
    assert preempted(c2.plan()) == {1}


def test_a_gang_with_volumes_preempts_only_where_the_volumes_are():
    c = (
        cluster()
        .node("n1", gpus=4)
        .node("n2", gpus=4, volumes=("datasets",))
        .node("n3", gpus=4, volumes=("datasets",))
        .tenant("vision", 0, 12)
        .tenant("nlp", 8, 12)
    )
    c.running(1, "vision", 4, "n1", ran_s=100)
    c.running(2, "vision", 4, "n2", ran_s=9000)
    c.running(3, "vision", 4, "n3", ran_s=8000)
    c.pending(10, "nlp", 8, volumes=("datasets",))
    p = c.plan()
    assert preempted(p) == {2, 3}
    assert decision(p, 10).reason_code is ReasonCode.WAITING_FOR_PREEMPTION
