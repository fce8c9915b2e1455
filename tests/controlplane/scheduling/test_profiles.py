"""A running attempt's power profile, learned from its GPUs' telemetry, reaches the cap planner."""

import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from controlplane.cluster.models import GPU, GpuTelemetry, Pool
from controlplane.jobs import actions
from controlplane.scheduling import profiles
from controlplane.scheduling.loader import load_snapshot
from scheduler.gpu_model import GPU_TYPES, power_draw_w
from scheduler.model import Config, PowerProfile
from scheduler.policy import plan
from scheduler.power import planning_profile

pytestmark = pytest.mark.django_db

BUCKET_S = 60.0


@pytest.fixture(autouse=True)
def _nothing_learned_yet():
    profiles.forget_all()
    yield
    profiles.forget_all()


def _run(job, node, gpus, *, started_ago_s):
    attempt = actions.admit_job(job, node=node, gpus=gpus, borrowed=False)
    actions.mark_attempt_running(
        attempt, started_at=timezone.now() - timedelta(seconds=started_ago_s)
    )
    attempt.refresh_from_db()
    return attempt


def _history(gpu, *, since_s, until_s, cap_w, power_w, utilization_pct):
    """Closed one-minute buckets of a GPU between two times (Unix seconds)."""
    at = since_s - since_s % BUCKET_S + BUCKET_S
    while at + BUCKET_S <= until_s:
        GpuTelemetry.objects.create(
            gpu=gpu,
            bucket_at=datetime.fromtimestamp(at, tz=UTC),
            power_cap_w=cap_w,
            power_draw_w=power_w,
            utilization_pct=utilization_pct,
            samples=6,
        )
        at += BUCKET_S


def _latest(gpu, *, cap_w, power_w, utilization_pct):
    GPU.objects.filter(pk=gpu.pk).update(
        power_cap_w=cap_w,
        power_draw_w=power_w,
        utilization_pct=utilization_pct,
        telemetry_at=timezone.now(),
    )


def _budgeted_w(running, gpu) -> float:
    """What the cap planner counts the attempt's GPU to draw uncapped."""
    profile = planning_profile(running.power_profile)
    return power_draw_w(profile, gpu.power_max_w, gpu.power_max_w, GPU_TYPES[gpu.model].idle_w)


def _by_job(snapshot):
    return {r.job_id: r for r in snapshot.running}


def test_a_job_seen_drawing_250_w_uncapped_is_budgeted_near_250_w_not_the_boards_700(
    make_node, make_job, vision, nlp, alice, bob
):
    node = make_node("n1", gpus=2)
    small_gpu, other_gpu = node.gpus.order_by("index")
    now_s = time.time()
    # Before the job, someone else's work drew 650 W on the same GPU: not this job's.
    _history(
        small_gpu,
        since_s=now_s - 1800,
        until_s=now_s - 600,
        cap_w=700,
        power_w=650,
        utilization_pct=98,
    )
    small = make_job(vision, alice, name="small")
    _run(small, node, [small_gpu], started_ago_s=600)
    _history(
        small_gpu, since_s=now_s - 600, until_s=now_s, cap_w=700, power_w=250, utilization_pct=90
    )
    unseen = make_job(nlp, bob, name="unseen")
    _run(unseen, node, [other_gpu], started_ago_s=600)

    running = _by_job(load_snapshot(now_s).snapshot)

    learned = running[small.pk].power_profile
    assert learned.samples >= 5
    assert _budgeted_w(running[small.pk], small_gpu) == pytest.approx(250, abs=10)
    # No telemetry, no guess: the unseen job is budgeted at the board's maximum.
    assert running[unseen.pk].power_profile == PowerProfile()
    assert _budgeted_w(running[unseen.pk], other_gpu) > 600


def test_under_a_tight_pool_budget_the_watts_a_small_job_leaves_go_to_the_others(
    make_node, make_job, vision, nlp, alice, bob
):
    node = make_node("n1", gpus=2)
    small_gpu, big_gpu = node.gpus.order_by("index")
    Pool.objects.filter(pk=node.pool_id).update(power_budget_w=900.0)
    now_s = time.time()
    small = make_job(vision, alice, name="small")
    _run(small, node, [small_gpu], started_ago_s=600)
    _history(
        small_gpu, since_s=now_s - 600, until_s=now_s, cap_w=700, power_w=250, utilization_pct=90
    )
    big = make_job(nlp, bob, name="big")
    _run(big, node, [big_gpu], started_ago_s=600)

    snapshot = load_snapshot(now_s).snapshot
    learned_caps = plan(snapshot, Config()).power_caps_w
    as_before = replace(
        snapshot,
        running=tuple(replace(r, power_profile=PowerProfile()) for r in snapshot.running),
    )
    default_caps = plan(as_before, Config()).power_caps_w

    # With the default profile both jobs are taken to need 700 W: the budget is split evenly.
    assert default_caps[big_gpu.uuid] < 500
    assert learned_caps[big_gpu.uuid] >= default_caps[big_gpu.uuid] + 100
    # And the budget still holds as the planner models the draw.
    running = _by_job(snapshot)
    modelled_w = sum(
        power_draw_w(
            planning_profile(running[job.pk].power_profile),
            learned_caps[gpu.uuid],
            gpu.power_max_w,
            GPU_TYPES[gpu.model].idle_w,
        )
        for job, gpu in ((small, small_gpu), (big, big_gpu))
    )
    assert modelled_w <= 900.0


def test_before_a_bucket_closes_the_latest_reading_teaches_the_profile(
    make_node, make_job, vision, alice
):
    node = make_node("n1", gpus=1)
    (gpu,) = node.gpus.all()
    job = make_job(vision, alice)
    _run(job, node, [gpu], started_ago_s=20)
    _latest(gpu, cap_w=700, power_w=300, utilization_pct=85)

    running = _by_job(load_snapshot(time.time()).snapshot)

    assert running[job.pk].power_profile.samples == 1
    assert _budgeted_w(running[job.pk], gpu) == pytest.approx(300, abs=30)


def test_an_attempt_is_first_looked_at_once_it_has_run_a_few_seconds_not_while_it_starts(
    make_node, make_job, vision, alice
):
    node = make_node("n1", gpus=1)
    (gpu,) = node.gpus.all()
    job = make_job(vision, alice)
    attempt = _run(job, node, [gpu], started_ago_s=0)
    _latest(gpu, cap_w=700, power_w=300, utilization_pct=85)
    started_s = attempt.started_at.timestamp()

    # Just started (a flood of short jobs is all such attempts): no telemetry is read for it.
    with CaptureQueriesContext(connection) as queries:
        young = _by_job(load_snapshot(started_s + 1).snapshot)[job.pk]
    assert not [q for q in queries.captured_queries if "telemetry" in q["sql"]]
    assert young.power_profile == PowerProfile()

    looked = _by_job(load_snapshot(started_s + profiles.PROFILE_UNSEEN_RECHECK_S).snapshot)[job.pk]
    assert looked.power_profile.samples == 1
    assert _budgeted_w(looked, gpu) == pytest.approx(300, abs=30)


def test_a_job_starting_up_idle_keeps_the_default_profile(make_node, make_job, vision, alice):
    node = make_node("n1", gpus=1)
    (gpu,) = node.gpus.all()
    job = make_job(vision, alice)
    _run(job, node, [gpu], started_ago_s=20)
    _latest(gpu, cap_w=700, power_w=72, utilization_pct=0)

    running = _by_job(load_snapshot(time.time()).snapshot)

    assert running[job.pk].power_profile == PowerProfile()


def test_profiles_are_not_reread_every_cycle_but_follow_the_job_when_its_draw_changes(
    make_node, make_job, vision, alice
):
    node = make_node("n1", gpus=1)
    (gpu,) = node.gpus.all()
    now_s = time.time()
    job = make_job(vision, alice)
    _run(job, node, [gpu], started_ago_s=600)
    _history(gpu, since_s=now_s - 600, until_s=now_s, cap_w=700, power_w=250, utilization_pct=90)
    first = _by_job(load_snapshot(now_s).snapshot)[job.pk]

    # A few seconds later: the profile comes from memory, with no query for telemetry.
    with CaptureQueriesContext(connection) as queries:
        again = _by_job(load_snapshot(now_s + 5).snapshot)[job.pk]
    assert not [q for q in queries.captured_queries if "telemetry" in q["sql"]]
    assert again.power_profile == first.power_profile

    # Ten minutes on, it was seen drawing 450 W: the next look refits it.
    later_s = now_s + 600
    _history(gpu, since_s=now_s, until_s=later_s, cap_w=700, power_w=450, utilization_pct=95)
    moved = _by_job(load_snapshot(later_s).snapshot)[job.pk]
    assert moved.power_profile.samples > first.power_profile.samples
    assert _budgeted_w(first, gpu) + 50 < _budgeted_w(moved, gpu) < 450


def test_many_new_jobs_are_learned_over_a_few_loads_not_all_in_one(
    make_node, make_job, vision, alice
):
    count = profiles.MAX_FITS_PER_LOAD + 2
    node = make_node("n1", gpus=count)
    now_s = time.time()
    jobs = []
    for gpu in node.gpus.order_by("index"):
        job = make_job(vision, alice, name=f"train-{gpu.index}")
        _run(job, node, [gpu], started_ago_s=600)
        _history(
            gpu, since_s=now_s - 600, until_s=now_s, cap_w=700, power_w=300, utilization_pct=90
        )
        jobs.append(job)

    first = load_snapshot(now_s).snapshot.running
    assert sum(1 for r in first if r.power_profile.samples) == profiles.MAX_FITS_PER_LOAD
    # Those left over are first in line at the next load, a cycle later.
    second = load_snapshot(now_s + 1).snapshot.running
    assert all(r.power_profile.samples for r in second)
    assert len(second) == len(jobs)
