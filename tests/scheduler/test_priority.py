"""The order of the queue: guarantees, priority, fair share, duration, aging, and the baselines."""

import random
from dataclasses import replace

import pytest

from scheduler.model import Config, Gpu, Node, Ordering, Pending, Quota, Running, Snapshot, Tenant
from scheduler.policy import plan
from tests.scheduler.builders import cluster, decision, started


def one_free_gpu():
    return (
        cluster()
        .node("n1", gpus=2)
        .tenant("vision", 0, 8)
        .tenant("nlp", 0, 8)
        .running(1, "vision", 1, priority=1000)
    )


def first_started(c, **config) -> int:
    (start,) = c.plan(preemption=False, **config).starts
    return start.job_id


@pytest.mark.parametrize(
    "ordering, jobs, first",
    [
        # (job id, submitted s ago, predicted s, GPUs, attained GPU-s) ... -> who gets the GPU
        (Ordering.FIFO, [(10, 100, 60, 1, 0), (11, 200, 9000, 1, 0)], 11),
        (Ordering.SJF, [(10, 100, 60, 1, 0), (11, 200, 9000, 1, 0)], 10),
        (Ordering.SRTF, [(10, 100, 60, 1, 0), (11, 200, 9000, 1, 0)], 10),
        # QSSF weighs by GPUs: 1 GPU x 2000 s is less than 1 x 3000 s
        (Ordering.QSSF, [(10, 100, 3000, 1, 0), (11, 200, 2000, 1, 0)], 11),
        # LAS: the job that received less service goes first, whatever its age
        (Ordering.LAS, [(10, 100, 60, 1, 0), (11, 200, 60, 1, 90_000)], 10),
        (Ordering.LAS, [(10, 100, 60, 1, 10), (11, 200, 60, 1, 20)], 11),  # same queue: FIFO
    ],
)
def test_each_baseline_ordering_picks_the_job_it_is_named_for(ordering, jobs, first):
    c = one_free_gpu()
    for job_id, ago_s, predicted_s, gpus, attained in jobs:
        c.pending(
            job_id,
            "nlp",
            gpus,
            waited_s=ago_s,
            predicted_s=predicted_s,
            attained_service_s=attained,
        )
    assert first_started(c, ordering=ordering) == first


def test_qssf_counts_gpu_time_not_duration():
    c = cluster().node("n1", gpus=8).tenant("nlp", 0, 8).running(1, "nlp", 4, priority=1000)
    c.pending(10, "nlp", 4, predicted_s=1000).pending(11, "nlp", 1, predicted_s=3000)
    c.pending(12, "nlp", 4, predicted_s=1000, waited_s=10)
    # 11 uses 3000 GPU-s, 10 and 12 4000: 11 first, then 10 (earlier); 12 does not fit.
    p = c.plan(ordering=Ordering.QSSF, preemption=False)
    assert [s.job_id for s in p.starts] == [11]
    assert decision(p, 10).queue_position == 1


@pytest.mark.parametrize(
    "a, b, first",
    [
        # (tenant, priority, predicted s, tenant usage) for two jobs; one GPU is free
        (("nlp", 200, 9000), ("vision", 100, 60), "nlp"),  # priority beats duration
        (("nlp", 100, 9000), ("vision", 100, 60), "vision"),  # equal priority: shorter first
    ],
)
def test_fair_orders_by_priority_then_predicted_duration(a, b, first):
    c = cluster().node("n1", gpus=1).tenant("vision", 0, 8).tenant("nlp", 0, 8)
    c.pending(10, a[0], 1, priority=a[1], predicted_s=a[2])
    c.pending(11, b[0], 1, priority=b[1], predicted_s=b[2])
    (start,) = c.plan(preemption=False).starts
    assert {10: a[0], 11: b[0]}[start.job_id] == first


def test_guaranteed_work_goes_before_borrowing_work_of_higher_priority():
    c = (
        cluster()
        .node("n1", gpus=2)
        .tenant("vision", 0, 8)
        .tenant("nlp", 1, 8)
        .running(1, "vision", 1, priority=1000)
        .pending(10, "vision", 1, priority=200)
        .pending(11, "nlp", 1, priority=50)
    )
    assert first_started(c) == 11


@pytest.mark.parametrize("nlp_weight, first", [(1.0, 10), (4.0, 11)])
def test_the_tenant_with_the_lower_weighted_share_goes_first(nlp_weight, first):
    # vision holds 4 of 16 GPUs, nlp 6: by share vision is served first, unless nlp's weight
    # makes its 6 count for less than vision's 4.
    c = (
        cluster()
        .nodes(2, gpus=8)
        .tenant("vision", 0, 16)
        .tenant("nlp", 0, 16, weight=nlp_weight)
        .tenant("ops", 0, 16)
        .running(1, "vision", 4, "n1", priority=1000)
        .running(2, "nlp", 4, "n1", priority=1000)
        .running(3, "nlp", 2, "n2", priority=1000)
        .running(4, "ops", 5, "n2", priority=1000)
        .pending(10, "vision", 1, predicted_s=600)
        .pending(11, "nlp", 1, predicted_s=600)
    )
    assert first_started(c) == first


def test_a_burst_of_one_tenant_does_not_fill_a_cycle_before_another_tenant_is_served():
    c = cluster().node("n1", gpus=4).tenant("vision", 0, 8).tenant("nlp", 0, 8)
    for job_id in range(10, 20):
        c.pending(job_id, "vision", 1, predicted_s=60)
    c.pending(30, "nlp", 1, predicted_s=600)
    p = c.plan()
    assert 30 in started(p)


def test_waiting_raises_a_jobs_rank_one_priority_step_per_aging_period():
    c = cluster().node("n1", gpus=1).tenant("nlp", 0, 8)
    c.pending(10, "nlp", 1, priority=100, predicted_s=60, waited_s=60)
    c.pending(11, "nlp", 1, priority=99, predicted_s=60, waited_s=3 * 3600)
    # Three hours of waiting are worth three steps: 99 + 3 beats 100 + 0.
    assert first_started(c, aging_period_s=3600) == 11
    assert first_started(c, aging_period_s=0) == 10


def simulate_stream(config: Config, hours: float) -> float | None:
    """One node of 8 GPUs; an 8-GPU job arrives at t=0 behind a stream of 1-GPU jobs that
    arrives faster than the node serves it. Cycles every minute; returns when the big job
    started, or None."""
    uuids = tuple(f"n1-gpu{i}" for i in range(8))
    node = Node(
        "n1", "default", tuple(Gpu(u, i, "H100", 200, 700, 700) for i, u in enumerate(uuids))
    )
    tenant = Tenant("vision", quotas=(Quota("", 8, 8),))
    big = Pending(1, "vision", "u", "big", 8, predicted_duration_s=3600.0, submitted_at_s=0.0)
    pending = {1: big}
    running: dict[int, Running] = {}
    next_id, next_arrival_s = 2, -3000.0  # the stream started before the big job
    t = 0.0
    while t < hours * 3600:
        for job_id in [j for j, r in running.items() if r.predicted_end_s <= t]:
            del running[job_id]
        while next_arrival_s <= t:
            pending[next_id] = Pending(
                next_id,
                "vision",
                "u",
                f"small-{next_id}",
                1,
                predicted_duration_s=1200.0,
                submitted_at_s=next_arrival_s,
            )
            next_id += 1
            next_arrival_s += 100.0
        snap = Snapshot(t, (node,), tuple(running.values()), tuple(pending.values()), (tenant,))
        for s in plan(snap, config).starts:
            job = pending.pop(s.job_id)
            if s.job_id == 1:
                return t
            running[s.job_id] = Running(
                s.job_id,
                s.job_id,
                "vision",
                "u",
                100,
                True,
                t,
                s.gpu_uuids,
                "H100",
                predicted_end_s=t + job.predicted_duration_s,
            )
        t += 60.0
    return None


def test_aging_lets_a_large_job_start_eventually_under_a_stream_of_small_ones():
    started_at_s = simulate_stream(Config(aging_period_s=600.0), hours=4)
    assert started_at_s is not None and started_at_s < 2 * 3600
    # The same stream without aging keeps the large job waiting the whole time.
    assert simulate_stream(Config(aging_period_s=0.0), hours=4) is None


def busy_snapshot(seed: int = 7) -> Snapshot:
    rng = random.Random(seed)
    c = cluster().nodes(6, gpus=8).node("a1", gpus=4, type="A100")
    for t in ("vision", "nlp", "speech"):
        c.tenant(t, 8, 24, weight=rng.choice([1.0, 2.0]))
    job_id = 1
    for node in ("n1", "n2", "n3"):
        for _ in range(3):
            c.running(
                job_id,
                rng.choice(["vision", "nlp"]),
                2,
                node,
                ran_s=rng.uniform(0, 9000),
                ends_in_s=rng.uniform(60, 9000),
                priority=rng.choice([50, 100, 200]),
            )
            job_id += 1
    for _ in range(40):
        c.pending(
            job_id,
            rng.choice(["vision", "nlp", "speech"]),
            rng.choice([1, 2, 4, 8, 12]),
            rng.choice(["", "H100", "A100"]),
            waited_s=rng.uniform(0, 20000),
            priority=rng.choice([50, 100, 200]),
            predicted_s=rng.uniform(60, 20000),
        )
        job_id += 1
    return c.snapshot()


@pytest.mark.parametrize("ordering", list(Ordering))
def test_the_same_snapshot_gives_the_same_plan_whatever_the_order_of_its_parts(ordering):
    snap = busy_snapshot()
    config = Config(ordering=ordering)
    expected = plan(snap, config)
    assert plan(snap, config) == expected
    rng = random.Random(1)
    for _ in range(3):
        shuffled = replace(
            snap,
            nodes=tuple(rng.sample(snap.nodes, len(snap.nodes))),
            running=tuple(rng.sample(snap.running, len(snap.running))),
            pending=tuple(rng.sample(snap.pending, len(snap.pending))),
            tenants=tuple(rng.sample(snap.tenants, len(snap.tenants))),
        )
        assert plan(shuffled, config) == expected
    assert expected.starts and expected.pending
