"""The bound on preemptions per job (Config.max_preemptions) applies only to a job its tenant's
guarantee can hold: at the bound a job may start only within that guarantee, so bounding one
the guarantee can never hold would make it wait for ever (scheduler.quota.PreemptionBound)."""

import pytest

from scheduler.memo import PlanMemo
from scheduler.model import ANY_GPU_TYPE, Config, Ordering, Quota, Tenant
from scheduler.policy import plan
from scheduler.quota import PreemptionBound
from tests.scheduler.builders import cluster, preempted, start_of, started


def full_cluster(scratch_guaranteed: int):
    # vision's guarantee is job 1's node; job 2 (vision) and job 3 (scratch) share n2, job 4
    # (vision) has n3; all borrowed but job 1. nlp is owed a node. Job 3 was preempted twice.
    long = {"remaining_s": 9000.0, "attained_service_s": 9e4}
    return (
        cluster()
        .nodes(3, gpus=8)
        .tenant("vision", 8, 24)
        .tenant("nlp", 8, 16)
        .tenant("scratch", scratch_guaranteed, 8)
        .running(1, "vision", 8, "n1", ran_s=7200, **long)
        .running(2, "vision", 4, "n2", ran_s=1800, **long)
        .running(3, "scratch", 4, "n2", ran_s=900, preemptions=2, **long)
        .running(4, "vision", 8, "n3", ran_s=3600, **long)
        .pending(10, "nlp", 8, predicted_s=60)
    )


@pytest.mark.parametrize("ordering", [Ordering.FAIR, Ordering.SRTF, Ordering.LAS])
def test_past_the_bound_a_job_its_guarantee_cannot_hold_is_still_preempted(ordering):
    # scratch guarantees 4 GPUs: job 3 (4 GPUs) is held by it, so at a bound of 2 it is spared
    # and nlp takes n3 instead. With no guarantee, or one smaller than the job, job 3 could never
    # start within it again: it stays a victim like any borrowed attempt.
    assert preempted(full_cluster(4).plan(ordering=ordering, max_preemptions=2)) == {4}
    for smaller in (0, 3):
        bounded = full_cluster(smaller).plan(ordering=ordering, max_preemptions=2)
        assert preempted(bounded) == {2, 3}, smaller


@pytest.mark.parametrize("ordering", [Ordering.FAIR, Ordering.SRTF, Ordering.LAS])
def test_past_the_bound_a_job_its_guarantee_cannot_hold_still_borrows(ordering):
    def waiting(guaranteed: int, gpus: int):
        return (
            cluster()
            .nodes(2, gpus=8)
            .tenant("scratch", guaranteed, 16)
            .pending(10, "scratch", gpus, preemptions=3, waited_s=600, predicted_s=600)
        )

    # Held by its guarantee: it starts within it, not borrowed.
    within = waiting(8, 8).plan(ordering=ordering, max_preemptions=3)
    assert started(within) == {10} and not start_of(within, 10).borrowed
    # A tenant that only borrows, and a job larger than its tenant's guarantee: bounded, they
    # would never start again; they start on borrowed GPUs, as below the bound.
    for guaranteed, gpus in ((0, 8), (4, 8)):
        free = waiting(guaranteed, gpus).plan(ordering=ordering, max_preemptions=3)
        assert started(free) == {10}, (guaranteed, gpus)
        assert start_of(free, 10).borrowed, (guaranteed, gpus)


def _tenant(*quotas: tuple[str, int]) -> Tenant:
    return Tenant("t", quotas=tuple(Quota(k, g, 64) for k, g in quotas))


@pytest.mark.parametrize(
    "quotas, gpu_type, gpus, holds",
    [
        ((), "A100", 1, False),  # no quota at all
        (((ANY_GPU_TYPE, 0),), "A100", 1, False),  # a tenant that only borrows
        (((ANY_GPU_TYPE, 8),), "A100", 8, True),
        (((ANY_GPU_TYPE, 8),), "A100", 9, False),
        ((("A100", 8),), "A100", 8, True),
        ((("A100", 8),), "H100", 1, False),  # no quota for that type
        ((("A100", 16), (ANY_GPU_TYPE, 4)), "A100", 8, False),  # the sum over types caps it
        ((("A100", 4), (ANY_GPU_TYPE, 16)), "A100", 8, False),
        ((("A100", 4), (ANY_GPU_TYPE, 16)), "H100", 8, True),  # ANY alone covers H100
        ((("A100", 8), ("H100", 2)), ANY_GPU_TYPE, 8, True),  # not yet placed: A100 can
        ((("A100", 4), ("H100", 2)), ANY_GPU_TYPE, 8, False),
    ],
)
def test_a_guarantee_holds_a_job_only_if_every_quota_covering_its_type_does(
    quotas, gpu_type, gpus, holds
):
    bound = PreemptionBound(2, (_tenant(*quotas),))
    assert bound.holds("t", gpu_type, gpus) is holds
    assert bound.reached("t", gpu_type, gpus, 2) is holds
    assert not bound.reached("t", gpu_type, gpus, 1)
    assert not bound.holds("someone else", gpu_type, gpus)
    assert not PreemptionBound(None, (_tenant(*quotas),)).reached("t", gpu_type, gpus, 99)


def test_a_guarantee_changed_between_plans_moves_the_bound_for_a_kept_memo():
    # The control plane keeps one memo across cycles while an admin edits quotas: the next plan
    # must decide as a fresh one does, with the sums made under the old guarantee dropped.
    config = Config(max_preemptions=2)
    memo = PlanMemo()
    before = full_cluster(4).snapshot()
    assert preempted(plan(before, config, memo)) == {4}
    lowered = full_cluster(0).at(before.now_s + 1).snapshot()
    assert preempted(plan(lowered, config, memo)) == preempted(plan(lowered, config)) == {2, 3}
    raised = full_cluster(4).at(before.now_s + 2).snapshot()
    assert preempted(plan(raised, config, memo)) == preempted(plan(raised, config)) == {4}


def test_the_default_bound_is_five_restarts_and_the_published_baselines_have_none():
    from scheduler.simulator.policies import PRESETS

    assert Config().max_preemptions == 5
    for name, p in PRESETS.items():
        if p.config.preemption and not name.startswith("ours"):
            assert p.config.max_preemptions is None, name
