"""The power step of plan(): caps for the cluster as the plan leaves it."""

from dataclasses import replace

from scheduler import gpu_model, power
from scheduler.model import Config, Pool
from scheduler.policy import plan
from tests.scheduler.builders import cluster


def _busy_cluster():
    return (
        cluster()
        .node("n1", gpus=8)
        .node("n2", gpus=8)
        .tenant("vision", guaranteed=16, limit=16)
        .running(1, "vision", gpus=8, node="n1")
        .pending(2, "vision", gpus=4)
    )


def test_with_no_budget_anywhere_the_plan_leaves_every_gpu_uncapped():
    result = _busy_cluster().plan()
    assert result.starts  # the pending job starts
    assert result.power_caps_w == {}


def test_a_pool_budget_caps_the_gpus_the_plan_keeps_and_starts_within_the_budget():
    snap = _busy_cluster().snapshot()
    budget_w = 6000.0  # 12 busy H100s uncapped would draw well over this
    snap = replace(snap, pools=(Pool("default", power_budget_w=budget_w),))
    result = plan(snap, Config())
    (start,) = result.starts
    caps = result.power_caps_w
    assert set(caps) == {g.uuid for n in snap.nodes for g in n.gpus}
    assert all(200.0 <= cap <= 700.0 for cap in caps.values())
    busy = set(start.gpu_uuids) | set(snap.running[0].gpus)
    idle = set(caps) - busy
    assert all(caps[u] == 200.0 for u in idle)  # idle GPUs at their minimum
    # The newly started job's GPUs are budgeted too, not only those already running.
    assert all(caps[u] < 700.0 for u in start.gpu_uuids)
    gpus = {g.uuid: g for n in snap.nodes for g in n.gpus}
    # Jobs without telemetry are budgeted as if they drew the board's maximum, the worst case.
    worst = power.planning_profile(snap.running[0].power_profile)
    modelled_w = sum(
        gpu_model.power_draw_w(worst, caps[u], 700.0, gpu_model.idle_power_w(gpus[u])) for u in busy
    ) + sum(gpu_model.idle_power_w(gpus[u]) for u in idle)
    assert modelled_w <= budget_w
    assert gpu_model.relative_throughput(worst, caps[next(iter(busy))], 700.0) < 1.0


def test_the_eco_setting_alone_is_enough_to_plan_caps():
    result = _busy_cluster().plan(eco_max_slowdown=0.05)
    assert result.power_caps_w


def test_a_job_that_asks_for_no_gpu_starts_under_a_throttled_tenant_without_upsetting_the_caps():
    snap = (
        cluster()
        .node("n1", gpus=2)
        .tenant("vision", guaranteed=2, limit=2, budget_action="throttle")
        .pending(1, "vision", gpus=0)
        .snapshot()
    )
    result = plan(snap, Config())
    assert [s.job_id for s in result.starts] == [1]
    assert set(result.power_caps_w) == {"n1-gpu0", "n1-gpu1"}
