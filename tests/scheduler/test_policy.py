"""The entry point: named, timed steps, and a plan that leaves power to the power step."""

import pytest

from scheduler.model import Config, Ordering, Snapshot, config_with
from scheduler.policy import plan
from tests.scheduler.builders import cluster


def test_the_plan_times_each_named_step():
    c = cluster().node("n1").tenant("vision", 8, 8).pending(1, "vision", 2)
    p = c.plan()
    assert list(p.step_seconds) == [
        "index",
        "quota",
        "predict",
        "drain",
        "order",
        "admit",
        "reasons",
    ]
    assert all(s >= 0 for s in p.step_seconds.values())


def test_plan_leaves_power_caps_to_the_power_step():
    p = cluster().node("n1").tenant("vision", 8, 8).pending(1, "vision", 2).plan()
    assert p.power_caps_w == {}


def test_an_empty_cluster_plans_nothing():
    p = plan(Snapshot(now_s=0.0, nodes=()))
    assert (p.starts, p.preemptions, p.pending) == ((), (), ())


def test_a_job_without_gpus_starts_on_a_schedulable_node():
    c = cluster().node("a", schedulable=False).node("b").tenant("ops", 0, 0).pending(1, "ops", 0)
    (start,) = c.plan().starts
    assert start.placements == (("b", ()),)


def test_an_ordering_given_by_name_plans_like_the_enum_member():
    c = cluster().node("n1", gpus=1).tenant("v", 0, 4)
    c.pending(1, "v", 1, predicted_s=9000, waited_s=500).pending(2, "v", 1, predicted_s=60)
    by_name = plan(c.snapshot(), Config(ordering="sjf"))
    assert by_name == plan(c.snapshot(), Config(ordering=Ordering.SJF))
    assert [s.job_id for s in by_name.starts] == [2]


def test_settings_applied_by_name_give_the_members_and_name_what_is_wrong():
    # config_with is where settings and benchmark variants reach the core: a choice by name
    # becomes its member (a compiled core takes nothing else), anything else a clear error.
    c = cluster().node("n1", gpus=1).tenant("v", 0, 4)
    c.pending(1, "v", 1, predicted_s=9000, waited_s=500).pending(2, "v", 1, predicted_s=60)
    by_name = config_with(Config(), {"ordering": "sjf", "min_runtime_s": 5})
    assert by_name.ordering is Ordering.SJF and by_name.min_runtime_s == 5
    assert plan(c.snapshot(), by_name) == plan(
        c.snapshot(), Config(ordering=Ordering.SJF, min_runtime_s=5)
    )
    with pytest.raises(
        ValueError, match="victim_order='oldest': expected one of lost_work, youngest"
    ):
        config_with(Config(), {"victim_order": "oldest"})
    with pytest.raises(ValueError, match="unknown Config fields: backfil, order"):
        config_with(Config(), {"order": "sjf", "backfil": False})
