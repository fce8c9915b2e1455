"""The shared-pool presets of issue 19, and a thrashing policy reported instead of a crash."""

from __future__ import annotations

from dataclasses import replace

from scheduler.model import Plan, Preemption, Start
from scheduler.policy import plan
from scheduler.simulator.compare import run_preset
from scheduler.simulator.engine import SimOptions
from scheduler.simulator.metrics import summarize
from scheduler.simulator.trace import Trace, synthetic_trace
from tests.scheduler.simulator.builders import by_id, job, run, trace


def test_srtf_shared_lets_a_short_job_take_borrowed_gpus_and_charges_the_restart():
    # Tenant b's long job borrows a's idle GPU; a's short job arrives and takes it back at
    # once under srtf-shared (a shorter remaining time, and the GPU is lent).
    t = trace(
        [job(1, "b", 0, 1000), job(2, "b", 1, 1000), job(3, "a", 100, 10)],
        {"a": (1, 1), "b": (1, 1)},
    )
    out = by_id(run(t, "srtf-shared"))
    assert out[3].first_start_s == 100
    assert out[3].finish_s == 110
    # The victim restarts after the short job and pays its 7 s restart.
    victim = next(o for o in out.values() if o.preemptions)
    assert victim.restart_overhead_s == 7


def test_sjf_shared_runs_the_shortest_waiting_job_first_on_any_free_gpu():
    t = trace(
        [job(1, "a", 0, 100), job(2, "b", 1, 500), job(3, "b", 2, 50)],
        {"a": (1, 1)} | {"b": (0, 1)},
    )
    out = by_id(run(t, "sjf-shared"))
    assert out[3].first_start_s == 100  # shorter than job 2, which waited longer
    assert out[2].first_start_s == 150


def test_the_oracle_srtf_preset_pays_restarts_and_never_thrashes_on_the_shared_pool():
    # Without a minimum run time two jobs of nearly equal remaining time on the shared pool
    # trade GPUs at one instant until the guard holds them (thrash_stalls > 0): the preset's
    # minimum run time is what a restart costs in the large (60 s), and it never thrashes.
    t = synthetic_trace(
        3, jobs=40, tenants=3, nodes_per_tenant=1, gpus_per_node=4, mean_interarrival_s=40
    )
    result = run_preset(t, "srtf-shared", SimOptions())
    assert result.thrash_stalls == 0
    assert not result.unfinished_job_ids
    assert result.preemptions > 0


def test_a_policy_that_keeps_undoing_itself_is_reported_not_a_crash():
    # A policy that preempts every running attempt at every cycle and restarts it: the engine
    # holds its cycles to the next tick at such an instant and counts it.
    def undoes(snapshot, config) -> Plan:
        # Every cycle stops what runs and starts a waiting job on its GPUs instead: two jobs
        # on one GPU swap places forever at one instant.
        if not (snapshot.running and snapshot.pending):
            return plan(snapshot, config)
        r = snapshot.running[0]
        node = next(n.name for n in snapshot.nodes if r.gpus[0] in {g.uuid for g in n.gpus})
        waiting = snapshot.pending[0]
        return Plan(
            starts=(Start(waiting.job_id, ((node, r.gpus),), borrowed=False),),
            preemptions=(Preemption(r.attempt_id, r.job_id, "again"),),
        )

    t = trace([job(1, "a", 0, 100), job(2, "a", 5, 100)], {"a": (1, 1)})
    result = run_preset(t, "fifo-shared", SimOptions(window=False), policy=undoes)
    assert result.thrash_stalls > 0


def test_a_job_at_its_preemption_bound_keeps_no_lent_gpu_from_its_owner():
    # a and b each own one GPU. b's job 2 borrows a's idle GPU and is taken back for a's job 3
    # (its one preemption: the bound). Restarted, it may use only b's guarantee, which it
    # fills before b's job 1, which can still be preempted: so when a claims its GPU again
    # (job 4), job 1 is the borrowed one and gives it back at once. Had job 2 been let borrow
    # again, out of every rule's reach, a would have waited for it for hours.
    t = trace(
        [
            job(1, "b", 0, 20_000),
            job(2, "b", 1, 20_000),
            job(3, "a", 100, 50),
            job(4, "a", 1_000, 50),
        ],
        {"a": (1, 1), "b": (1, 1)},
    )
    bound = {"max_preemptions": 1}
    out = by_id(run_preset(t, "ours", SimOptions(), config_changes=bound))
    assert out[3].first_start_s - 100 <= 120
    assert out[2].preemptions == 1
    assert out[4].first_start_s - 1_000 <= 120
    assert out[1].preemptions == 1
    assert max(o.preemptions for o in out.values()) <= 1
    # b's guarantee held by work that cannot be preempted at all: job 2 waits for b's own GPU
    # instead of taking a's again, so a's claim starts at once.
    fixed = Trace(t.name, (replace(t.jobs[0], preemptible=False), *t.jobs[1:]), t.nodes, t.tenants)
    out = by_id(run_preset(fixed, "ours", SimOptions(), config_changes=bound))
    assert out[4].first_start_s - 1_000 <= 120
    # It restarted only on b's GPU once job 1 ended, with all but the ~100 s it had run before
    # its preemption still to do.
    assert out[2].finish_s >= out[1].finish_s + out[2].duration_s - 200


def test_under_a_preemption_bound_no_job_restarts_more_often_and_claims_on_guarantees_hold():
    # A saturated shared pool where borrowers are taken back again and again without a bound.
    # With one, no job is preempted more than it allows, and a one-GPU claim within its
    # tenant's guarantee still starts within the bound on its wait (minimum run time, notice
    # and a tick): a job at the bound never holds lent GPUs it could not give back.
    t = synthetic_trace(
        5, jobs=160, tenants=3, nodes_per_tenant=1, gpus_per_node=4, mean_interarrival_s=30
    )
    free = run_preset(t, "ours", SimOptions())
    assert max(o.preemptions for o in free.outcomes) > 2  # the bound below has work to do
    for bound in (1, 2):
        bounded = run_preset(t, "ours", SimOptions(), config_changes={"max_preemptions": bound})
        assert not bounded.unfinished_job_ids
        assert max(o.preemptions for o in bounded.outcomes) <= bound
        s = summarize("ours", bounded)
        assert s.guaranteed_jobs > 0
        assert s.guaranteed_over_bound == s.guaranteed_over_bound_gangs, bound
