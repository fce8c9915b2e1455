"""Every job left pending gets one reason a person can read, a queue position and an ETA."""

from scheduler.model import ReasonCode
from tests.scheduler.builders import NOW, cluster, decision


def test_the_reason_names_the_tenants_usage_and_the_job_the_free_gpus_are_reserved_for():
    g = "H100-SXM-80GB"
    c = (
        cluster()
        .node("n1", gpus=8, type=g)
        .node("n2", gpus=8, type=g)
        .tenant("vision", 8, 16)
        .tenant("nlp", 8, 16)
        .running(1, "vision", 4, "n1", ran_s=9000, ends_in_s=7200, priority=200)
        .running(2, "vision", 4, "n1", ran_s=9000, ends_in_s=7200, priority=200)
        .running(3, "nlp", 6, "n2", ran_s=30, ends_in_s=3600, priority=200)
        .pending(118, "nlp", 8, g, waited_s=7200, predicted_s=3600)
        .pending(119, "vision", 4, g, predicted_s=7200)
    )
    p = c.plan()
    head = decision(p, 118)
    assert head.queue_position == 1
    assert head.estimated_start_s == NOW + 3600
    d = decision(p, 119)
    assert d.queue_position == 2
    # Only 2 are free, and even those are held for the head of the queue.
    assert d.reason_code is ReasonCode.NO_CAPACITY
    assert d.reason == (
        f"waiting for 4 x {g}: tenant vision uses 8 of its 8 guaranteed, and the 2 free {g} are "
        "reserved for job 118, which is first in line for H100-SXM-80GB"
    )
    assert d.estimated_start_s is None


def test_queue_positions_count_from_one_in_the_order_jobs_were_considered():
    c = cluster().node("n1", gpus=1).tenant("vision", 1, 1).running(1, "vision", 1)
    for job_id, priority in ((10, 50), (11, 200), (12, 100)):
        c.pending(job_id, "vision", 1, priority=priority)
    p = c.plan(preemption=False)
    assert [(d.job_id, d.queue_position) for d in p.pending] == [(11, 1), (12, 2), (10, 3)]


def test_a_budget_hold_is_explained():
    c = cluster().node("n1").tenant("vision", 8, 8, budget_action="hold").pending(1, "vision", 1)
    assert decision(c.plan(), 1).reason == (
        "held: tenant vision has used up its budget, so none of its jobs start until the budget "
        "renews or is raised"
    )


def test_a_job_waiting_for_a_preemption_says_so_and_expects_to_start_soon():
    c = (
        cluster()
        .node("n1")
        .tenant("vision", 0, 8)
        .tenant("nlp", 8, 8)
        .running(1, "vision", 4)
        .running(2, "vision", 4)
        .pending(10, "nlp", 8)
    )
    d = decision(c.plan(), 10)
    assert d.reason == (
        "waiting for 8 GPUs of any type: 2 running jobs are being preempted to free GPUs for it; "
        "it starts once stopped"
    )
    assert d.estimated_start_s == NOW


def test_every_pending_job_not_started_has_exactly_one_decision():
    c = cluster().node("n1", gpus=4).tenant("vision", 2, 4)
    for job_id in range(1, 9):
        c.pending(job_id, "vision", job_id % 3 + 1)
    p = c.plan()
    started = {s.job_id for s in p.starts}
    assert sorted(d.job_id for d in p.pending) == sorted(set(range(1, 9)) - started)
    assert all(d.reason for d in p.pending)
