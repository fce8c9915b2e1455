"""The shared-pool presets of issue 19, and a thrashing policy reported instead of a crash."""

from __future__ import annotations

from scheduler.model import Plan, Preemption, Start
from scheduler.policy import plan
from scheduler.simulator.compare import run_preset
from scheduler.simulator.engine import SimOptions
from scheduler.simulator.trace import synthetic_trace
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
