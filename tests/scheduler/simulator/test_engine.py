"""The simulator on traces small enough to work out by hand, through the production plan."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler import gpu_model
from scheduler.model import Config, Ordering, PowerProfile
from scheduler.policy import plan
from scheduler.simulator.engine import PlanError, RestartCost, SimOptions, replay
from scheduler.simulator.policies import Sharing, cluster_for, head_of_line, preset
from tests.scheduler.simulator.builders import GPU, by_id, job, mean, run, trace
from tests.scheduler.simulator.standin import standin_plan


def test_sjf_beats_fifo_by_the_amount_worked_out_by_hand():
    # One GPU. Job 1 (10 s) holds it while 2 (300 s), 3 (100 s) and 4 (200 s) arrive.
    # FIFO then runs 2, 3, 4: JCTs 10, 309, 408, 607 (mean 333.5).
    # SJF runs 3, 4, 2:       JCTs 10, 609, 108, 307 (mean 258.5): 75 s better.
    t = trace(
        [job(1, "a", 0, 10), job(2, "a", 1, 300), job(3, "a", 2, 100), job(4, "a", 3, 200)],
        {"a": (1, 1)},
    )
    fifo, sjf = by_id(run(t, "fifo-static")), by_id(run(t, "sjf"))

    assert [fifo[i].jct_s for i in (1, 2, 3, 4)] == [10, 309, 408, 607]
    assert [sjf[i].jct_s for i in (1, 2, 3, 4)] == [10, 609, 108, 307]
    assert mean(o.jct_s for o in fifo.values()) - mean(o.jct_s for o in sjf.values()) == 75
    assert [sjf[i].queue_s for i in (1, 2, 3, 4)] == [0, 309, 8, 107]


def test_a_static_partition_leaves_a_tenant_idle_while_another_queues_and_borrowing_fixes_it():
    # Tenant a has 4 GPUs and 8 jobs of 100 s; tenant b's 4 GPUs stay idle unless lent.
    jobs = [job(i, "a", 0, 100) for i in range(1, 9)] + [job(9, "b", 5000, 10)]
    t = trace(jobs, {"a": (1, 4), "b": (1, 4)})

    static = run(t, "fifo-static")
    shared = run(t, "ours")

    a_static = [o for o in static.outcomes if o.tenant == "a"]
    assert sorted(o.queue_s for o in a_static) == [0] * 4 + [100] * 4
    assert max(static.timeline_busy_gpus) == 4  # b's GPUs idle while half of a's jobs queue
    a_shared = [o for o in shared.outcomes if o.tenant == "a"]
    assert [o.queue_s for o in a_shared] == [0] * 8
    assert max(shared.timeline_busy_gpus) == 8


def test_borrowed_gpus_are_reclaimed_for_their_owner_and_the_restart_cost_is_charged():
    # a borrows b's 4 GPUs at t=0; b's job arrives at t=70 (past the 60 s minimum run time),
    # so one of a's borrowed jobs is preempted with 30 s of work left. It restarts when a's
    # other jobs end at t=100 and pays 7 s (1 GPU): it finishes at 100 + 7 + 30 = 137.
    jobs = [job(i, "a", 0, 100) for i in range(1, 9)] + [job(9, "b", 70, 50)]
    result = run(trace(jobs, {"a": (1, 4), "b": (1, 4)}), "ours")
    out = by_id(result)

    assert out[9].queue_s == 0 and out[9].finish_s == 120
    victims = [o for o in out.values() if o.preemptions]
    assert len(victims) == 1 and victims[0].tenant == "a"
    assert victims[0].finish_s == 137
    assert victims[0].restart_overhead_s == 7
    assert victims[0].queue_s == 30  # pending from t=70 to t=100
    assert result.preemptions == 1
    assert result.preempted_gpu_s_lost == 7


@pytest.mark.parametrize(
    ("gpus", "cost_s"), [(1, 7.0), (4, 30.0), (8, 30.0), (16, 60.0)], ids=lambda v: str(v)
)
def test_srtf_preempts_for_a_shorter_job_and_charges_the_restart_cost_of_its_size(gpus, cost_s):
    # A (1000 s) runs from t=0; B (50 s) arrives at t=100 and SRTF preempts A for it. A resumes at
    # t=150 with 900 s left and pays the restart cost first. The partition holds one of them.
    partition = (max(gpus // 8, 1), min(gpus, 8))
    t = trace([job(1, "a", 0, 1000, gpus), job(2, "a", 100, 50, gpus)], {"a": partition})
    result = run(t, "srtf")
    out = by_id(result)

    assert out[2].jct_s == 50
    assert out[1].preemptions == 1
    assert out[1].finish_s == 150 + cost_s + 900
    assert out[1].queue_s == 50
    assert result.preempted_gpu_s_lost == cost_s * gpus


def test_the_restart_cost_is_configurable():
    t = trace([job(1, "a", 0, 1000), job(2, "a", 100, 50)], {"a": (1, 1)})
    out = by_id(run(t, "srtf", restart_cost=RestartCost(2.0, 3.0, 4.0)))
    assert out[1].finish_s == 150 + 2 + 900


def test_a_job_larger_than_its_partition_is_reported_unfinished_and_the_rest_still_run():
    t = trace([job(1, "a", 0, 100, gpus=8), job(2, "a", 10, 100)], {"a": (1, 4)})
    result = run(t, "fifo-static")
    assert result.unfinished_job_ids == [1]
    assert by_id(result)[2].jct_s == 100


def test_quiet_periods_cost_no_plan_calls():
    # Two jobs a day apart on an idle cluster: two arrivals, two plans, not 1,440 ticks.
    t = trace([job(1, "a", 0, 100), job(2, "a", 86400, 100)], {"a": (1, 1)})
    result = run(t, "ours", cycle_s=60.0)
    assert result.plan_calls == 2
    assert [o.queue_s for o in result.outcomes] == [0, 0]


def test_with_periodic_cycles_only_a_job_waits_for_the_next_tick():
    t = trace([job(1, "a", 10, 100), job(2, "a", 200, 100)], {"a": (1, 1)})
    out = by_id(run(t, "fifo-static", cycle_s=60.0, event_cycles=False))
    assert out[1].first_start_s == 60 and out[2].first_start_s == 240


def test_a_load_factor_compresses_arrivals_and_keeps_durations():
    from scheduler.simulator.compare import run_preset

    t = trace([job(1, "a", 1000, 50), job(2, "a", 1400, 50)], {"a": (1, 1)})
    out = by_id(run_preset(t, "fifo-static", SimOptions(), load_factor=4.0))
    assert out[2].submit_s == 1000 + 400 / 4
    assert [o.duration_s for o in out.values()] == [50, 50]


def test_the_simulator_and_a_direct_plan_call_decide_the_same_for_the_same_snapshot():
    # Contention across tenants, borrowing and reclaiming: every cycle's snapshot is captured
    # inside the engine and given to plan() again; the plans must be equal, decision for decision.
    from scheduler.simulator.trace import synthetic_trace

    t = synthetic_trace(7, jobs=150, tenants=3, nodes_per_tenant=1, mean_interarrival_s=60)
    p = preset("ours")
    jobs, nodes, tenants = cluster_for(t, p.sharing)
    seen = []
    options = SimOptions(on_cycle=lambda snap, made: seen.append((snap, made)))
    result = replay(jobs, nodes, tenants, p.config, options)

    assert result.preemptions > 0 and len(seen) > 100
    for snapshot, made in seen:
        assert plan(snapshot, p.config) == made
    started = {s.job_id for _, made in seen for s in made.starts}
    assert started == {o.job_id for o in result.outcomes}


def test_a_power_cap_stretches_run_time_by_the_power_model():
    # Every GPU capped at 60 % of its maximum: a 1,000 s job takes 1000 / relative_throughput.
    max_w = gpu_model.GPU_TYPES[GPU].max_w

    def capped_plan(snapshot, config):
        made = standin_plan(snapshot, config)
        caps = {g.uuid: 0.6 * max_w for n in snapshot.nodes for g in n.gpus}
        return replace(made, power_caps_w=caps)

    t = trace([job(1, "a", 0, 1000)], {"a": (1, 1)})
    p = preset("fifo-static")
    jobs, nodes, tenants = cluster_for(t, p.sharing)
    result = replay(jobs, nodes, tenants, p.config, policy=capped_plan)

    speed = gpu_model.relative_throughput(PowerProfile(), 0.6 * max_w, max_w)
    assert speed < 0.95
    assert result.outcomes[0].jct_s == pytest.approx(1000 / speed)


def test_energy_is_the_busy_and_idle_draw_integrated_over_time():
    t = trace([job(1, "a", 0, 1000)], {"a": (1, 2)})  # one busy GPU, one idle
    result = run(t, "fifo-static")
    gpu = cluster_for(t, Sharing.STATIC)[1][0].gpus[0]
    idle_w = gpu_model.idle_power_w(replace(gpu, gpu_type=GPU))
    busy_w = gpu_model.power_draw_w(PowerProfile(), gpu.power_max_w, gpu.power_max_w, idle_w)
    assert result.energy_j == pytest.approx(1000 * (busy_w + idle_w))
    assert result.peak_power_w == pytest.approx(busy_w + idle_w)


def test_a_power_budget_is_held_by_the_cap_planner_at_the_cost_of_run_time():
    t = trace([job(i, "a", 0, 1000) for i in (1, 2, 3, 4)], {"a": (1, 4)})
    max_w = gpu_model.GPU_TYPES[GPU].max_w
    budget_w = 4 * 0.6 * max_w
    result = run(t, "ours", power_budget_w=budget_w)

    assert result.over_budget_s == 0
    assert result.peak_power_w <= budget_w
    assert all(o.jct_s > 1000 for o in result.outcomes)


def test_a_plan_that_gives_a_busy_gpu_away_is_an_error_not_a_silent_fix():
    def greedy(snapshot, config):
        made = standin_plan(snapshot, config)
        if snapshot.running and snapshot.pending:
            busy = snapshot.running[0]
            node = next(n.name for n in snapshot.nodes if busy.gpus[0] in {g.uuid for g in n.gpus})
            from scheduler.model import Start

            bad = Start(snapshot.pending[0].job_id, ((node, busy.gpus[:1]),), borrowed=False)
            return replace(made, starts=(bad,))
        return made

    t = trace([job(1, "a", 0, 100), job(2, "a", 10, 100)], {"a": (1, 1)})
    p = preset("fifo-static")
    jobs, nodes, tenants = cluster_for(t, p.sharing)
    with pytest.raises(PlanError, match=r"job 2 started on GPU a-n0-g0, held by job 1"):
        # No window: it would spare this plan the cycle where no GPU is free.
        replay(jobs, nodes, tenants, p.config, SimOptions(window=False), policy=greedy)


def test_a_plan_that_takes_a_tenant_past_its_limit_is_an_error():
    def ignores_quota(snapshot, config):
        unlimited = tuple(
            replace(t, quotas=(replace(t.quotas[0], limit_gpus=99),)) for t in snapshot.tenants
        )
        return standin_plan(replace(snapshot, tenants=unlimited), replace(config, borrowing=True))

    # a may use 1 GPU in all, however much is idle; the policy starts both of its jobs anyway.
    t = trace([job(1, "a", 0, 100), job(2, "a", 0, 100)], {"a": (1, 1), "b": (1, 1)})
    jobs, nodes, tenants = cluster_for(t, Sharing.SHARED)
    tenants = tuple(replace(x, quotas=(replace(x.quotas[0], limit_gpus=1),)) for x in tenants)
    with pytest.raises(
        PlanError, match="takes tenant a to 2 GPUs of any type, past its limit of 1"
    ):
        replay(jobs, nodes, tenants, Config(ordering=Ordering.FIFO), policy=ignores_quota)


@pytest.mark.parametrize(
    "name", ["fifo-static", "fifo-strict", "sjf-strict", "srtf", "tiresias", "qssf"]
)
def test_a_snapshot_of_only_the_partitions_in_play_decides_as_the_whole_cluster_would(name):
    # Static partitions on nodes of their own: planning only the partitions an event touched,
    # with only their nodes and attempts in the snapshot (the fast path), must change no decision.
    from scheduler.simulator.trace import synthetic_trace

    t = synthetic_trace(11, jobs=120, tenants=4, nodes_per_tenant=1, mean_interarrival_s=30)
    p = preset(name)
    jobs, nodes, tenants = cluster_for(t, p.sharing)
    runs = [
        replay(
            jobs,
            nodes,
            tenants,
            p.config,
            SimOptions(oracle=p.oracle, partitioned_tenants=fast),
            policy=head_of_line(plan) if p.strict else plan,
        )
        for fast in (False, True)
    ]
    full, fast = runs
    assert full.outcomes == fast.outcomes
    assert full.preemptions == fast.preemptions
    assert sum(o.queue_s for o in full.outcomes) > 0  # the partitions were contended
    assert fast.plan_calls <= full.plan_calls


def test_a_partitioned_snapshot_holds_the_partitions_in_play_unless_a_power_budget_needs_all():
    # a's job waits behind a's first; b and c are idle. The plan sees a's nodes alone, except
    # where a pool budget is held: the cap planner must weigh the draw of every node.
    t = trace([job(1, "a", 0, 100), job(2, "a", 10, 50)], {"a": (1, 1), "b": (2, 1), "c": (1, 1)})
    p = preset("fifo-static")
    jobs, nodes, tenants = cluster_for(t, p.sharing)
    for budget_w, seen_nodes in ((None, {"a-n0"}), (10_000.0, {n.name for n in nodes})):
        seen: list[set[str]] = []
        result = replay(
            jobs,
            nodes,
            tenants,
            p.config,
            SimOptions(
                partitioned_tenants=True,
                power_budget_w=budget_w,
                on_cycle=lambda snapshot, _, seen=seen: seen.append(
                    {n.name for n in snapshot.nodes}
                ),
            ),
        )
        assert by_id(result)[2].first_start_s == 100.0
        assert seen and all(s == seen_nodes for s in seen)


def test_strict_fifo_blocks_the_queue_behind_a_job_that_does_not_fit_and_greedy_fifo_does_not():
    # 2 GPUs. Job 1 holds one until t=100; job 2 needs both; job 3 needs one. Greedy FIFO starts
    # 3 at once beside 1; strict FIFO (the Helios simulator's) holds 3 until 2 has run.
    t = trace(
        [job(1, "a", 0, 100), job(2, "a", 1, 50, gpus=2), job(3, "a", 2, 10)],
        {"a": (1, 2)},
    )
    greedy, strict = by_id(run(t, "fifo-static")), by_id(run(t, "fifo-strict"))
    assert [greedy[i].first_start_s for i in (1, 2, 3)] == [0, 100, 2]
    assert [strict[i].first_start_s for i in (1, 2, 3)] == [0, 100, 150]


def test_srtf_counts_the_restart_cost_in_a_preempted_jobs_remaining_time_so_two_never_thrash():
    # A (1000 s) is preempted at t=2 for B (995 s); both are preempted for C (100 s) at t=4.
    # At t=104 A has 998 s left and B 993 s: B restarts (993 + 7 = 1000 s to go), and A, which
    # needs 998 + 7 = 1005 s once restarted, must not take the GPU back at the next cycle
    # (t=105, when tenant b submits: B then has 999 s to go), nor B again, forever.
    jobs = [job(1, "a", 0, 1000), job(2, "a", 2, 995), job(3, "a", 4, 100), job(4, "b", 105, 10)]
    result = run(trace(jobs, {"a": (1, 1), "b": (1, 1)}), "srtf")
    out = by_id(result)
    assert out[3].finish_s == 104
    assert out[2].finish_s == 104 + 7 + 993
    assert out[1].finish_s == 1104 + 7 + 998
    assert result.preemptions == 2
