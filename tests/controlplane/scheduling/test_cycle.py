"""Whole cycles (load, the real scheduler.policy.plan, apply, record) on PostgreSQL."""

import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from controlplane.jobs import actions
from controlplane.jobs.models import Allocation, Job, JobAttempt, JobEvent, JobState
from controlplane.scheduling.cycle import run_scheduling_cycle
from controlplane.scheduling.models import SchedulingCycle
from tests.controlplane.scheduling.conftest import read, submit

pytestmark = pytest.mark.django_db


def test_a_job_submitted_through_the_api_is_admitted_by_a_cycle_with_its_allocations(
    client, alice_token, make_node
):
    make_node("n1", gpus=8)
    job_id = submit(client, alice_token, gpus=4, gpu_type="H100-SXM-80GB")
    assert read(client, alice_token, job_id)["state"] == JobState.PENDING
    summary = run_scheduling_cycle(trigger="test")
    shown = read(client, alice_token, job_id)
    assert shown["state"] == JobState.ADMITTED
    assert shown["attempt_count"] == 1
    attempt = JobAttempt.objects.get(job_id=job_id)
    assert attempt.allocations.filter(active=True).count() == 4
    assert attempt.node.name == "n1"
    assert summary["starts"] == 1 and summary["skipped"] is False
    cycle = SchedulingCycle.objects.get(pk=summary["cycle"])
    assert (cycle.trigger, cycle.starts, cycle.preemptions, cycle.pending) == ("test", 1, 0, 0)
    assert {"load", "plan", "apply"} <= set(cycle.step_ms)
    assert cycle.slowest_step
    assert cycle.duration_ms > 0
    assert cycle.decisions["starts"][0]["job"] == job_id


def test_a_job_that_cannot_start_shows_a_reason_a_person_can_read_in_the_api(
    client, alice_token, make_node, make_job, nlp, bob
):
    make_node("n1", gpus=8)
    make_job(nlp, bob, name="holds-six", gpus=6)
    run_scheduling_cycle()
    job_id = submit(client, alice_token, gpus=4, gpu_type="H100-SXM-80GB")
    summary = run_scheduling_cycle()
    shown = read(client, alice_token, job_id)
    assert shown["state"] == JobState.PENDING
    assert shown["pending_reason_code"]
    assert "4" in shown["pending_reason"]
    assert shown["queue_position"] == 1
    assert shown["predicted_duration_s"] is not None
    assert summary["pending"] == 1
    assert SchedulingCycle.objects.get(pk=summary["cycle"]).decisions["pending_by_reason"] == {
        shown["pending_reason_code"]: 1
    }


def test_a_second_cycle_does_not_start_the_same_job_again(make_node, make_job, vision, alice):
    make_node("n1", gpus=8)
    job = make_job(vision, alice, gpus=2)
    run_scheduling_cycle()
    again = run_scheduling_cycle()
    assert again["starts"] == 0
    assert JobAttempt.objects.filter(job=job).count() == 1


def test_a_cycle_killed_half_way_leaves_no_partial_plan_applied(
    make_node, make_job, vision, alice, monkeypatch
):
    make_node("n1", gpus=8)
    jobs = [make_job(vision, alice, name=f"j{i}", gpus=2) for i in range(3)]
    make_job(vision, alice, name="too-big", gpus=16)
    real_admit_jobs = actions.admit_jobs
    admitted = []

    def admit_then_die(admissions):
        admitted.append(real_admit_jobs(admissions))
        raise RuntimeError("worker killed in the middle of apply")

    monkeypatch.setattr(actions, "admit_jobs", admit_then_die)
    with pytest.raises(RuntimeError):
        run_scheduling_cycle()
    assert len(admitted[0]) == 3  # the admissions really happened, then were rolled back
    assert not JobAttempt.objects.exists()
    assert not Allocation.objects.exists()
    assert set(Job.objects.values_list("state", flat=True)) == {JobState.PENDING}
    assert not Job.objects.exclude(pending_reason="").exists()
    assert not SchedulingCycle.objects.exists()
    monkeypatch.setattr(actions, "admit_jobs", real_admit_jobs)
    summary = run_scheduling_cycle()
    assert summary["starts"] == 3
    assert {j.pk for j in jobs} == set(
        Job.objects.filter(state=JobState.ADMITTED).values_list("pk", flat=True)
    )


def test_borrowed_work_is_preempted_for_a_tenant_within_its_guarantee_and_requeued_when_the_node_confirms(
    make_node, make_job, vision, nlp, alice, bob
):
    make_node("n1", gpus=8)
    make_node("n2", gpus=8)
    # nlp borrows the whole cluster while vision is idle.
    borrowed = [make_job(nlp, bob, name=f"nlp-{i}", gpus=8) for i in range(2)]
    run_scheduling_cycle()
    attempts = list(JobAttempt.objects.filter(job__in=borrowed))
    assert len(attempts) == 2
    long_ago = timezone.now() - timedelta(hours=1)
    for attempt in attempts:
        actions.mark_attempt_running(attempt, started_at=long_ago)
    # vision asks for GPUs within its guarantee of 8.
    owner = make_job(vision, alice, name="vision", gpus=8, gpu_type="H100-SXM-80GB")
    summary = run_scheduling_cycle()
    assert summary["preemptions"] >= 1
    stopping = list(JobAttempt.objects.filter(stop_reason="preempted"))
    assert {a.job.tenant.slug for a in stopping} == {"nlp"}
    owner.refresh_from_db()
    assert owner.state == JobState.PENDING
    for attempt in stopping:
        attempt.refresh_from_db()
        actions.finish_attempt(attempt, exit_code=137)
        attempt.job.refresh_from_db()
        assert attempt.job.state == JobState.PENDING
    run_scheduling_cycle()
    owner.refresh_from_db()
    assert owner.state == JobState.ADMITTED


def test_a_gang_within_its_guarantee_gets_a_node_back_when_the_borrowed_work_is_scattered(
    make_node, make_job, vision, nlp, alice, bob
):
    """nlp runs four 4-GPU jobs on the two nodes. The two that started last are its borrowed
    ones, one on each node, so they alone free no node for vision's 8-GPU job; the cycle
    takes back the node whose two jobs lose the least work, and nlp keeps its guarantee."""
    make_node("n1", gpus=8)
    make_node("n2", gpus=8)
    jobs = [make_job(nlp, bob, name=f"nlp-{i}", gpus=4) for i in range(4)]
    run_scheduling_cycle()
    by_node = {
        node: sorted({al.attempt.job_id for al in Allocation.objects.filter(gpu__node__name=node)})
        for node in ("n1", "n2")
    }
    assert all(len(ids) == 2 for ids in by_node.values()), by_node
    (a1, b1), (a2, b2) = by_node["n1"], by_node["n2"]
    hours_ago = {a1: 4, a2: 3, b1: 2, b2: 1}  # the borrowed ones: b1 on n1, b2 on n2
    for attempt in JobAttempt.objects.filter(job__in=jobs):
        started = timezone.now() - timedelta(hours=hours_ago[attempt.job_id])
        actions.mark_attempt_running(attempt, started_at=started)
    owner = make_job(vision, alice, name="vision", gpus=8, gpu_type="H100-SXM-80GB")
    assert run_scheduling_cycle()["preemptions"] == 2
    stopping = list(JobAttempt.objects.filter(stop_reason="preempted"))
    # n2's jobs ran 3 and 1 hours, n1's 4 and 2: n2 loses less.
    assert {a.job_id for a in stopping} == {a2, b2}
    for attempt in stopping:
        (told,) = JobEvent.objects.filter(job=attempt.job, kind="stop_requested")
        assert f"uses more than its guarantee, and job {owner.pk}" in told.message
        actions.finish_attempt(attempt, exit_code=137)
    run_scheduling_cycle()
    owner.refresh_from_db()
    assert owner.state == JobState.ADMITTED
    (placed,) = JobAttempt.objects.filter(job=owner)
    assert {al.gpu.node.name for al in placed.allocations.all()} == {"n2"}
    assert not placed.borrowed


def test_a_job_preempted_as_often_as_the_policy_allows_waits_for_its_own_guarantee(
    settings, make_node, make_job, vision, nlp, alice, bob
):
    """SCHEDULER_POLICY's max_preemptions counts the job's real preemptions: once there, it is
    not preempted again, so it may use only its tenant's guarantee (borrowed GPUs could not be
    given back)."""
    from controlplane.jobs.api.serializers import JobSerializer
    from controlplane.scheduling.loader import load_snapshot

    make_node("n1", gpus=8)
    make_node("n2", gpus=8)
    borrowers = [make_job(nlp, bob, name=f"nlp-{i}", gpus=8) for i in range(2)]
    run_scheduling_cycle()
    for attempt in JobAttempt.objects.filter(job__in=borrowers):
        actions.mark_attempt_running(attempt, started_at=timezone.now() - timedelta(hours=1))
    owner = make_job(vision, alice, name="vision", gpus=8, gpu_type="H100-SXM-80GB")
    assert run_scheduling_cycle()["preemptions"] == 1
    (stopping,) = JobAttempt.objects.filter(stop_reason="preempted")
    actions.finish_attempt(stopping, exit_code=137)
    victim = stopping.job
    victim.refresh_from_db()
    assert (victim.state, victim.preemptions) == (JobState.PENDING, 1)
    assert JobSerializer(victim).data["preemptions"] == 1  # what the API and the CLI show
    run_scheduling_cycle()
    (owner_attempt,) = JobAttempt.objects.filter(job=owner)
    actions.mark_attempt_running(owner_attempt)
    actions.finish_attempt(owner_attempt, exit_code=0)

    # A node is free, and nlp holds its guarantee. With a bound of 0 nothing may be taken back,
    # nlp's running job included: its guarantee is full of such work, and the victim waits.
    (waiting,) = load_snapshot().snapshot.pending
    assert (waiting.job_id, waiting.preemptions) == (victim.pk, 1)
    settings.SCHEDULER_POLICY = {"max_preemptions": 0}
    assert run_scheduling_cycle()["starts"] == 0
    victim.refresh_from_db()
    assert victim.state == JobState.PENDING
    assert "preempted 1 time, so it is not preempted again" in victim.pending_reason
    # With a bound of 1 nlp's other job can still be taken back: the victim fills nlp's
    # guarantee first, and that other job is the borrowed one from now on.
    settings.SCHEDULER_POLICY = {"max_preemptions": 1}
    assert run_scheduling_cycle()["starts"] == 1
    (again,) = JobAttempt.objects.filter(job=victim, stop_reason="")
    assert not again.borrowed
    (running,) = [r for r in load_snapshot().snapshot.running if r.job_id == victim.pk]
    assert running.preemptions == 1


def test_past_the_default_bound_a_job_its_guarantee_cannot_hold_still_borrows(
    settings, make_node, make_job, vision, alice
):
    """The default bound (5) applies only where the tenant's guarantee can hold the job: a
    tenant that only borrows would otherwise never run a job again once it reached it."""
    from controlplane.tenancy.models import Quota

    settings.SCHEDULER_POLICY = {}
    make_node("n1", gpus=8)
    Quota.objects.filter(tenant=vision).update(guaranteed_gpus=0)
    job = make_job(vision, alice, name="borrower", gpus=4, gpu_type="H100-SXM-80GB")
    Job.objects.filter(pk=job.pk).update(preemptions=7)
    assert run_scheduling_cycle()["starts"] == 1
    (attempt,) = JobAttempt.objects.filter(job=job)
    assert attempt.borrowed
    # Guaranteed 4 GPUs, the same job is held by the guarantee: at the bound, it starts
    # within it.
    Quota.objects.filter(tenant=vision).update(guaranteed_gpus=4)
    held = make_job(vision, alice, name="held", gpus=4, gpu_type="H100-SXM-80GB")
    Job.objects.filter(pk=held.pk).update(preemptions=7)
    actions.finish_attempt(attempt, exit_code=0)
    assert run_scheduling_cycle()["starts"] == 1
    (within,) = JobAttempt.objects.filter(job=held)
    assert not within.borrowed


@pytest.mark.django_db(transaction=True)
def test_two_cycles_started_at_once_never_allocate_a_gpu_twice(make_node, make_job, vision, alice):
    for i in range(4):
        make_node(f"n{i}", gpus=8)
    for i in range(40):
        make_job(vision, alice, name=f"j{i}", gpus=1 + i % 4)
    barrier = threading.Barrier(2)
    results: list[dict] = []
    errors: list[BaseException] = []

    def cycle():
        try:
            barrier.wait(timeout=30)
            results.append(run_scheduling_cycle(trigger="race"))
        except BaseException as exc:  # surfaced below, in the test's thread
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=cycle) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert len(results) == 2
    # Either the second skipped, or it ran after the first and found what was left.
    active = list(Allocation.objects.filter(active=True).values_list("gpu_id", flat=True))
    assert len(active) == len(set(active)) > 0
    per_job = list(JobAttempt.objects.values_list("job_id", flat=True).order_by("job_id"))
    assert len(per_job) == len(set(per_job))
    assert sum(r.get("starts", 0) for r in results) == len(per_job)
