"""A job only nodes that are out now could hold waits for them, and its reason says so."""

from scheduler.model import ReasonCode
from tests.scheduler.builders import cluster, decision

G = "H100-SXM-80GB"


def test_a_job_whose_only_nodes_are_down_waits_for_them_to_come_back():
    c = cluster().node("n1", gpus=8, type=G, schedulable=False).tenant("vision", 8, 16)
    d = decision(c.pending(1, "vision", 8, G).plan(), 1)
    assert d.reason_code is ReasonCode.NODES_UNAVAILABLE
    assert d.reason == (
        f"waiting for 8 x {G}: every node with {G} GPUs is down, cordoned or draining; "
        "it waits for them to come back"
    )


def test_a_draining_node_counts_as_out_too():
    c = cluster().node("n1", gpus=8, type=G, draining=True).tenant("vision", 8, 16)
    assert decision(c.pending(1, "vision", 8, G).plan(), 1).reason_code is (
        ReasonCode.NODES_UNAVAILABLE
    )


def test_the_reason_counts_what_takes_work_now_and_what_is_out():
    c = (
        cluster()
        .node("n1", gpus=4, type=G, unhealthy=(3,))
        .node("n2", gpus=8, type=G, schedulable=False)
        .tenant("vision", 8, 16)
        .pending(1, "vision", 8, G)
    )
    d = decision(c.plan(), 1)
    assert d.reason_code is ReasonCode.NODES_UNAVAILABLE
    assert d.reason == (
        f"waiting for 8 x {G}: only 3 of the cluster's 12 {G} GPUs take work now (8 are on "
        "nodes that are down, cordoned or draining and 1 is unhealthy); it waits for them to "
        "come back"
    )


def test_an_any_type_job_names_the_type_it_waits_for():
    c = (
        cluster()
        .node("a1", gpus=2, type="A100")
        .node("h1", gpus=8, type=G, schedulable=False)
        .tenant("vision", 8, 16)
        .pending(1, "vision", 4)
    )
    d = decision(c.plan(), 1)
    assert d.reason_code is ReasonCode.NODES_UNAVAILABLE
    assert f"every node with {G} GPUs is down" in d.reason


def test_a_job_waiting_for_the_only_node_big_enough_in_memory_says_so():
    c = (
        cluster()
        .node("small", gpus=8, type=G, cpus=32, memory_mib=64_000)
        .node("big", gpus=8, type=G, cpus=64, memory_mib=512_000, schedulable=False)
        .tenant("vision", 8, 16)
        .pending(1, "vision", 1, G, memory_mib=100_000)
    )
    d = decision(c.plan(), 1)
    assert d.reason_code is ReasonCode.NODES_UNAVAILABLE
    assert d.reason == (
        f"waiting for 1 x {G}: every node with {G} GPUs that has 100000 MiB of memory for it "
        "is down, cordoned or draining; it waits for one to come back"
    )


def test_a_cpu_only_job_waits_when_every_node_is_down():
    c = cluster().node("n1", cpus=64, memory_mib=512_000, schedulable=False).tenant("vision")
    d = decision(c.pending(1, "vision", 0, cpus=4, memory_mib=1024).plan(), 1)
    assert d.reason_code is ReasonCode.NODES_UNAVAILABLE
    assert d.reason == (
        "waiting for 0 GPUs of any type: every node that has 4 CPUs and 1024 MiB of memory for "
        "it is down, cordoned or draining; it waits for one to come back"
    )


def test_a_cpu_only_job_on_busy_nodes_that_are_up_is_not_said_to_wait_for_nodes():
    c = (
        cluster()
        .node("n1", cpus=8, memory_mib=64_000)
        .node("n2", cpus=8, memory_mib=64_000, schedulable=False)
        .tenant("vision", 8, 8)
        .running(1, "vision", 1, "n1", cpus=8.0)
        .pending(2, "vision", 0, cpus=4)
    )
    assert decision(c.plan(), 2).reason_code is ReasonCode.NO_MATCHING_GPUS


def test_a_job_bigger_than_every_node_even_when_all_are_back_stays_hopeless():
    c = (
        cluster()
        .node("n1", gpus=8, type=G)
        .node("n2", gpus=8, type=G, schedulable=False)
        .tenant("vision", 99, 99)
        .pending(1, "vision", 24, G)
    )
    d = decision(c.plan(), 1)
    assert d.reason_code is ReasonCode.NO_MATCHING_GPUS
    assert d.reason == f"waiting for 24 x {G}: only 8 healthy {G} exist on schedulable nodes"


def test_a_type_no_node_has_stays_hopeless_whatever_is_down():
    c = cluster().node("n1", gpus=8, type=G, schedulable=False).tenant("vision", 8, 16)
    d = decision(c.pending(1, "vision", 1, "B200").plan(), 1)
    assert d.reason_code is ReasonCode.NO_MATCHING_GPUS


def test_when_the_nodes_are_back_the_job_starts():
    down = cluster().node("n1", gpus=8, type=G, schedulable=False).tenant("vision", 8, 16)
    down.pending(1, "vision", 8, G)
    assert decision(down.plan(), 1).reason_code is ReasonCode.NODES_UNAVAILABLE
    up = cluster().node("n1", gpus=8, type=G).tenant("vision", 8, 16).pending(1, "vision", 8, G)
    assert [s.job_id for s in up.plan().starts] == [1]
