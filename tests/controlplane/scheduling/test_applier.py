"""The applier against plans built by hand, so each rule is shown on exactly the rows it names."""

import logging
import threading
import time

import pytest
from django.db import connection, transaction

from controlplane import wakeups as notify
from controlplane.cluster.models import GPU, NodeState
from controlplane.jobs import actions
from controlplane.jobs.models import Allocation, Job, JobAttempt, JobEvent, JobState
from controlplane.scheduling.applier import DEEP_REFRESH_S, EXACT_POSITIONS, apply_plan
from controlplane.scheduling.loader import load_snapshot
from scheduler import model as m

pytestmark = pytest.mark.django_db


def start(job, *placements, borrowed=False):
    return m.Start(
        job_id=job.pk,
        placements=tuple((node, tuple(uuids)) for node, uuids in placements),
        borrowed=borrowed,
    )


def waiting(job, code=m.ReasonCode.NO_CAPACITY, reason="waiting", position=1, eta_s=None):
    return m.PendingDecision(
        job_id=job.pk,
        reason_code=code,
        reason=reason,
        queue_position=position,
        estimated_start_s=eta_s,
    )


def test_a_start_creates_the_attempt_with_its_allocations_and_admits_the_job(
    make_node, make_job, vision, alice
):
    make_node("n1", gpus=4)
    job = make_job(vision, alice, gpus=2)
    loaded = load_snapshot()
    seen = notify.node_version("n1")
    result = apply_plan(
        m.Plan(
            starts=(start(job, ("n1", ["GPU-n1-0", "GPU-n1-1"]), borrowed=True),),
            predicted_duration_s={job.pk: 420.0},
        ),
        loaded,
    )
    job.refresh_from_db()
    assert job.state == JobState.ADMITTED
    assert job.predicted_duration_s == 420.0
    attempt = job.attempts.get()
    assert (attempt.node.name, attempt.borrowed, attempt.number) == ("n1", True, 1)
    assert sorted(a.gpu.uuid for a in attempt.allocations.filter(active=True)) == [
        "GPU-n1-0",
        "GPU-n1-1",
    ]
    assert result.started == [job.pk] and result.skipped_rows == 0
    assert result.nodes_changed == {"n1"}
    # Inside the test's transaction nothing commits, so the node is not told yet.
    assert notify.node_version("n1") == seen


def test_a_gang_across_nodes_is_admitted_as_one_attempt_holding_all_its_gpus(
    make_node, make_job, vision, alice
):
    make_node("n1", gpus=2)
    make_node("n2", gpus=2)
    job = make_job(vision, alice, gpus=3)
    result = apply_plan(
        m.Plan(starts=(start(job, ("n1", ["GPU-n1-0", "GPU-n1-1"]), ("n2", ["GPU-n2-0"])),)),
        load_snapshot(),
    )
    attempt = JobAttempt.objects.get(job=job)
    assert attempt.allocations.count() == 3
    assert result.nodes_changed == {"n1", "n2"}


def test_a_job_cancelled_between_load_and_apply_is_skipped_and_logged(
    make_node, make_job, vision, alice, caplog
):
    make_node("n1", gpus=2)
    cancelled = make_job(vision, alice, name="cancelled")
    kept = make_job(vision, alice, name="kept")
    loaded = load_snapshot()
    actions.cancel_job(cancelled, actor=alice)
    plan = m.Plan(
        starts=(
            start(cancelled, ("n1", ["GPU-n1-0"])),
            start(kept, ("n1", ["GPU-n1-1"])),
        )
    )
    with caplog.at_level(logging.INFO, logger="controlplane.scheduling.applier"):
        result = apply_plan(plan, loaded)
    cancelled.refresh_from_db()
    assert cancelled.state == JobState.CANCELLED
    assert cancelled.attempts.count() == 0
    assert result.started == [kept.pk]
    assert [(s.kind, s.id) for s in result.skipped] == [("start", cancelled.pk)]
    assert f"skipped start {cancelled.pk}" in caplog.text
    assert "CANCELLED" in caplog.text


def test_a_job_is_never_started_twice_from_the_same_plan(make_node, make_job, vision, alice):
    make_node("n1", gpus=2)
    job = make_job(vision, alice)
    loaded = load_snapshot()
    plan = m.Plan(starts=(start(job, ("n1", ["GPU-n1-0"])),))
    apply_plan(plan, loaded)
    again = apply_plan(plan, loaded)
    assert again.started == [] and again.skipped_rows == 1
    assert JobAttempt.objects.filter(job=job).count() == 1


def test_a_gpu_already_held_skips_only_the_job_that_wanted_it(make_node, make_job, vision, alice):
    make_node("n1", gpus=2)
    first = make_job(vision, alice, name="first")
    second = make_job(vision, alice, name="second", gpus=2)
    third = make_job(vision, alice, name="third")
    plan = m.Plan(
        starts=(
            start(first, ("n1", ["GPU-n1-0"])),
            # A plan that is wrong about GPU-n1-0: the unique index has the last word.
            start(second, ("n1", ["GPU-n1-1", "GPU-n1-0"])),
            start(third, ("n1", ["GPU-n1-1"])),
        )
    )
    result = apply_plan(plan, load_snapshot())
    assert result.started == [first.pk, third.pk]
    assert [(s.id, s.why) for s in result.skipped] == [
        (second.pk, "one of its GPUs is already allocated")
    ]
    second.refresh_from_db()
    assert (second.state, second.attempts.count(), second.attempt_count) == (JobState.PENDING, 0, 0)
    assert Allocation.objects.filter(active=True).count() == 2


def test_a_start_naming_a_gpu_of_another_node_is_skipped_and_the_rest_start(
    make_node, make_job, vision, alice
):
    make_node("n1", gpus=2)
    make_node("n2", gpus=2)
    wrong, right = make_job(vision, alice), make_job(vision, alice)
    result = apply_plan(
        m.Plan(
            starts=(
                start(wrong, ("n1", ["GPU-n2-0"])),
                start(right, ("n2", ["GPU-n2-1"])),
            )
        ),
        load_snapshot(),
    )
    assert result.started == [right.pk]
    assert [(s.id, s.why) for s in result.skipped] == [(wrong.pk, "GPU GPU-n2-0 is not on node n1")]
    wrong.refresh_from_db()
    assert wrong.state == JobState.PENDING and not wrong.attempts.exists()


def test_a_node_cordoned_since_the_snapshot_gets_no_new_work(make_node, make_job, vision, alice):
    node = make_node("n1", gpus=1)
    job = make_job(vision, alice)
    loaded = load_snapshot()
    node.state = NodeState.CORDONED
    node.save()
    result = apply_plan(m.Plan(starts=(start(job, ("n1", ["GPU-n1-0"])),)), loaded)
    assert result.started == []
    assert result.skipped[0].why == "node n1 stopped taking new work"


def test_an_apply_that_dies_half_way_leaves_nothing_applied(
    make_node, make_job, vision, alice, monkeypatch
):
    make_node("n1", gpus=2)
    first = make_job(vision, alice, name="first")
    second = make_job(vision, alice, name="second")
    waiting_job = make_job(vision, alice, name="third")
    real_admit_jobs = actions.admit_jobs
    admitted = []

    def admit_then_die(admissions):
        admitted.append(real_admit_jobs(admissions))
        raise RuntimeError("worker killed after the admissions")

    monkeypatch.setattr(actions, "admit_jobs", admit_then_die)
    plan = m.Plan(
        starts=(start(first, ("n1", ["GPU-n1-0"])), start(second, ("n1", ["GPU-n1-1"]))),
        pending=(waiting(waiting_job, reason="no room"),),
        power_caps_w={"GPU-n1-0": 500.0},
    )
    with pytest.raises(RuntimeError), transaction.atomic():
        apply_plan(plan, load_snapshot())
    assert len(admitted[0]) == 2  # both admissions were written, then rolled back
    assert not JobAttempt.objects.exists()
    assert not Allocation.objects.exists()
    assert set(Job.objects.values_list("state", flat=True)) == {JobState.PENDING}
    assert not JobEvent.objects.filter(kind="admitted").exists()
    assert Job.objects.get(pk=waiting_job.pk).pending_reason == ""
    assert GPU.objects.get(uuid="GPU-n1-0").desired_power_cap_w is None


def _admission_rows(job):
    job.refresh_from_db()
    attempt = job.attempts.get()
    event = job.events.get(kind="admitted")
    data = dict(event.data, attempt=None)
    return (
        (job.state, job.state_reason, job.attempt_count, job.pending_reason, job.queue_position),
        (attempt.number, attempt.node.name, attempt.borrowed, attempt.state),
        sorted(a.gpu.uuid for a in attempt.allocations.filter(active=True)),
        (event.from_state, event.to_state, event.message, data),
    )


def test_a_batch_admission_writes_what_one_admission_at_a_time_writes(
    make_node, make_job, vision, alice
):
    node = make_node("n1", gpus=2)
    gpu0, gpu1 = node.gpus.order_by("index")
    one = make_job(vision, alice, name="one")
    batched = make_job(vision, alice, name="batched")
    for job in (one, batched):
        Job.objects.filter(pk=job.pk).update(pending_reason="was waiting", queue_position=1)
        job.refresh_from_db()
    actions.admit_job(one, node=node, gpus=[gpu0], borrowed=True, reason="Admitted to n1 (1)")
    outcome = actions.admit_jobs(
        [actions.Admission(batched, node, [gpu1], borrowed=True, reason="Admitted to n1 (1)")]
    )
    assert isinstance(outcome[batched.pk], JobAttempt)
    alone, together = _admission_rows(one), _admission_rows(batched)
    assert alone[0] == together[0] == (JobState.ADMITTED, "Admitted to n1 (1)", 1, "", None)
    assert alone[1] == together[1]
    assert (alone[2], together[2]) == (["GPU-n1-0"], ["GPU-n1-1"])
    assert alone[3][:3] == together[3][:3]
    assert {**alone[3][3], "gpus": None} == {**together[3][3], "gpus": None}


def _release_once_someone_waits_on_a_lock(release: threading.Event) -> None:
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE wait_event_type = 'Lock' AND datname = current_database()"
                )
                if cursor.fetchone()[0]:
                    break
            time.sleep(0.05)
    finally:
        release.set()
        connection.close()


@pytest.mark.django_db(transaction=True)
def test_a_gpu_taken_by_a_concurrent_writer_mid_batch_refuses_only_that_job(
    make_node, make_job, vision, alice
):
    node = make_node("n1", gpus=2)
    gpu0, gpu1 = node.gpus.order_by("index")
    intruder = make_job(vision, alice, name="intruder")
    wanted = make_job(vision, alice, name="wanted")
    other = make_job(vision, alice, name="other")
    inserted = threading.Event()
    release = threading.Event()

    def concurrent_admission():
        try:
            with transaction.atomic():
                actions.admit_job(intruder, node=node, gpus=[gpu0], borrowed=False)
                inserted.set()
                release.wait(timeout=30)
        finally:
            connection.close()

    writer = threading.Thread(target=concurrent_admission)
    writer.start()
    assert inserted.wait(timeout=30)
    # The batch cannot see the uncommitted allocation; its insert waits on the unique index,
    # which refuses it once the other transaction commits.
    watcher = threading.Thread(target=_release_once_someone_waits_on_a_lock, args=(release,))
    watcher.start()
    outcome = actions.admit_jobs(
        [
            actions.Admission(wanted, node, [gpu0], borrowed=False),
            actions.Admission(other, node, [gpu1], borrowed=False),
        ]
    )
    writer.join(timeout=30)
    watcher.join(timeout=30)
    assert outcome[wanted.pk] == actions.GPU_TAKEN
    assert isinstance(outcome[other.pk], JobAttempt)
    wanted.refresh_from_db()
    assert (wanted.state, wanted.attempt_count) == (JobState.PENDING, 0)
    assert Allocation.objects.get(gpu=gpu0, active=True).attempt.job_id == intruder.pk


def test_pending_reasons_positions_and_estimates_are_stored_on_the_job(
    make_node, make_job, vision, alice
):
    make_node("n1", gpus=1)
    job = make_job(vision, alice, gpus=4)
    loaded = load_snapshot()
    eta_s = loaded.snapshot.now_s + 3600
    sentence = "waiting for 4 x H100: only 1 exists"
    result = apply_plan(
        m.Plan(
            pending=(waiting(job, m.ReasonCode.NO_MATCHING_GPUS, sentence, 3, eta_s),),
            predicted_duration_s={job.pk: 1800.0},
        ),
        loaded,
    )
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    assert (job.pending_reason_code, job.pending_reason, job.queue_position) == (
        "no_matching_gpus",
        sentence,
        3,
    )
    assert job.estimated_start_at.timestamp() == pytest.approx(eta_s, abs=1)
    assert job.predicted_duration_s == 1800.0
    assert result.pending_rows_written == 1


def test_reasons_are_stored_exactly_as_written_for_many_jobs_in_one_write(
    make_node, make_job, vision, alice
):
    make_node("n1", gpus=1)
    jobs = [make_job(vision, alice, gpus=4) for _ in range(3)]
    loaded = load_snapshot()
    eta_s = loaded.snapshot.now_s + 7200
    sentences = [
        'waiting for 4 x H100: tenant "vision" uses 0 of its 8 guaranteed \\ and that\'s all',
        "waiting for 4 x H100: réservé pour le job 7 — 日本語",
        "",
    ]
    plan = m.Plan(
        pending=tuple(
            waiting(job, reason=text, position=i + 1, eta_s=eta_s if i == 0 else None)
            for i, (job, text) in enumerate(zip(jobs, sentences, strict=True))
        ),
        predicted_duration_s={jobs[0].pk: 1234.5678, jobs[1].pk: float("inf")},
    )
    assert apply_plan(plan, loaded).pending_rows_written == 3
    for i, (job, text) in enumerate(zip(jobs, sentences, strict=True)):
        job.refresh_from_db()
        assert (job.pending_reason, job.queue_position) == (text, i + 1)
    jobs[0].refresh_from_db()
    jobs[1].refresh_from_db()
    jobs[2].refresh_from_db()
    assert jobs[0].estimated_start_at.timestamp() == pytest.approx(eta_s, abs=1)
    assert jobs[1].estimated_start_at is None
    assert jobs[0].predicted_duration_s == 1234.5678
    assert jobs[1].predicted_duration_s == float("inf")
    assert jobs[2].predicted_duration_s is None
    # Read back, the same plan finds nothing to write.
    assert apply_plan(plan, load_snapshot()).pending_rows_written == 0


def test_a_started_job_gets_its_prediction_written_only_when_it_is_not_stored_yet(
    make_node, make_job, vision, alice
):
    make_node("n1", gpus=2)
    known, new = make_job(vision, alice), make_job(vision, alice)
    apply_plan(
        m.Plan(pending=(waiting(known),), predicted_duration_s={known.pk: 600.0}),
        load_snapshot(),
    )
    result = apply_plan(
        m.Plan(
            starts=(start(known, ("n1", ["GPU-n1-0"])), start(new, ("n1", ["GPU-n1-1"]))),
            predicted_duration_s={known.pk: 600.0, new.pk: 900.0},
        ),
        load_snapshot(),
    )
    assert sorted(result.started) == sorted([known.pk, new.pk])
    assert result.pending_rows_written == 1
    known.refresh_from_db()
    new.refresh_from_db()
    assert (known.state, known.predicted_duration_s) == (JobState.ADMITTED, 600.0)
    assert (new.state, new.predicted_duration_s) == (JobState.ADMITTED, 900.0)


def test_an_unchanged_reason_is_not_written_again(make_node, make_job, vision, alice):
    make_node("n1", gpus=1)
    job = make_job(vision, alice, gpus=4)
    plan = m.Plan(pending=(waiting(job, reason="same"),))
    assert apply_plan(plan, load_snapshot()).pending_rows_written == 1
    assert apply_plan(plan, load_snapshot()).pending_rows_written == 0
    moved = m.Plan(pending=(waiting(job, reason="same", position=2),))
    assert apply_plan(moved, load_snapshot()).pending_rows_written == 1


def test_a_position_deep_in_the_queue_is_rewritten_only_when_it_moved_noticeably(
    make_node, make_job, vision, alice
):
    make_node("n1", gpus=1)
    job = make_job(vision, alice, gpus=4)
    clock = [time.time()]

    def at(position, after_s=DEEP_REFRESH_S):
        clock[0] += after_s
        plan = m.Plan(pending=(waiting(job, reason="same", position=position),))
        return apply_plan(plan, load_snapshot(now_s=clock[0])).pending_rows_written

    assert at(500) == 1
    assert at(510) == 0  # 2 % off: not worth a write every cycle
    assert at(600) == 1
    assert at(EXACT_POSITIONS) == 1
    assert at(EXACT_POSITIONS - 1, after_s=0.1) == 1  # near the head every move is shown
    job.refresh_from_db()
    assert job.queue_position == EXACT_POSITIONS - 1


def test_a_prediction_that_moved_by_a_job_ending_is_rewritten_only_when_it_moved_noticeably(
    make_node, make_job, vision, alice
):
    make_node("n1", gpus=1)
    job = make_job(vision, alice, gpus=4)

    def predicted(duration_s):
        plan = m.Plan(pending=(waiting(job),), predicted_duration_s={job.pk: duration_s})
        return apply_plan(plan, load_snapshot()).pending_rows_written

    assert predicted(600.0) == 1
    assert predicted(606.0) == 0  # 1 %: the history took in one more job
    assert predicted(900.0) == 1
    assert predicted(float("inf")) == 1
    assert predicted(float("inf")) == 0
    job.refresh_from_db()
    assert job.predicted_duration_s == float("inf")


def test_deep_in_a_busy_queue_a_drifted_position_is_refreshed_at_most_every_few_seconds(
    make_node, make_job, vision, alice
):
    """Cycles come several times a second in a flood of short jobs; deep rows that only
    drifted wait for the next refresh, rows near the head and new reasons do not."""
    make_node("n1", gpus=1)
    deep = make_job(vision, alice, gpus=4)
    head = make_job(vision, alice, gpus=4)
    clock = [time.time() + 3600.0]

    def cycle(deep_position, head_position, reason="same", after_s=0.5):
        clock[0] += after_s
        plan = m.Plan(
            pending=(
                waiting(deep, reason=reason, position=deep_position),
                waiting(head, reason="same", position=head_position),
            )
        )
        apply_plan(plan, load_snapshot(now_s=clock[0]))
        deep.refresh_from_db()
        head.refresh_from_db()
        return deep.queue_position, head.queue_position

    near = EXACT_POSITIONS
    assert cycle(900, near, after_s=DEEP_REFRESH_S) == (900, near)
    assert cycle(700, near - 3) == (900, near - 3)  # 22 % off, but refreshed a moment ago
    assert cycle(600, near - 6, reason="other") == (600, near - 6)  # a new reason: at once
    assert cycle(500, near - 9, reason="other") == (600, near - 9)
    assert cycle(400, 5, reason="other", after_s=DEEP_REFRESH_S) == (400, 5)  # refresh due


def test_a_reason_never_lands_on_a_job_that_left_the_queue(make_node, make_job, vision, alice):
    make_node("n1", gpus=1)
    job = make_job(vision, alice, gpus=4)
    loaded = load_snapshot()
    actions.cancel_job(job)
    apply_plan(m.Plan(pending=(waiting(job, reason="stale"),)), loaded)
    job.refresh_from_db()
    assert (job.state, job.pending_reason, job.queue_position) == (JobState.CANCELLED, "", None)


def test_a_preemption_marks_the_attempt_to_stop_and_the_job_requeues_when_the_node_confirms(
    make_node, make_job, vision, nlp, alice, bob
):
    make_node("n1", gpus=1)
    make_node("n2", gpus=1)
    borrower = make_job(nlp, bob)
    apply_plan(
        m.Plan(starts=(start(borrower, ("n1", ["GPU-n1-0"]), borrowed=True),)), load_snapshot()
    )
    attempt = JobAttempt.objects.get(job=borrower)
    actions.mark_attempt_running(attempt)
    owner = make_job(vision, alice)
    plan = m.Plan(
        preemptions=(
            m.Preemption(
                attempt_id=attempt.pk,
                job_id=borrower.pk,
                reason="vision needs its guaranteed GPUs back",
                for_job_id=owner.pk,
            ),
        )
    )
    result = apply_plan(plan, load_snapshot())
    assert result.preempted == [attempt.pk]
    assert result.nodes_changed == {"n1"}
    attempt.refresh_from_db()
    borrower.refresh_from_db()
    assert attempt.stop_reason == "preempted" and attempt.stop_requested_at is not None
    # The GPU stays held until the node says the container is gone.
    assert borrower.state == JobState.RUNNING
    assert Allocation.objects.filter(attempt=attempt, active=True).count() == 1
    assert borrower.events.filter(kind="stop_requested").get().message == (
        "vision needs its guaranteed GPUs back"
    )
    # Asking twice changes nothing and is counted as skipped.
    assert apply_plan(plan, load_snapshot()).skipped_rows == 1
    actions.finish_attempt(attempt, exit_code=137)
    borrower.refresh_from_db()
    assert borrower.state == JobState.PENDING
    states = list(borrower.events.values_list("to_state", flat=True))
    assert states[-2:] == [JobState.PREEMPTED, JobState.PENDING]
    assert not Allocation.objects.filter(active=True).exists()


def test_a_preemption_of_an_attempt_that_already_ended_is_skipped(
    make_node, make_job, vision, alice
):
    make_node("n1", gpus=1)
    job = make_job(vision, alice)
    apply_plan(m.Plan(starts=(start(job, ("n1", ["GPU-n1-0"])),)), load_snapshot())
    attempt = JobAttempt.objects.get(job=job)
    loaded = load_snapshot()
    actions.finish_attempt(attempt, exit_code=0)
    plan = m.Plan(preemptions=(m.Preemption(attempt_id=attempt.pk, job_id=job.pk, reason="x"),))
    result = apply_plan(plan, loaded)
    assert result.preempted == [] and result.skipped[0].kind == "preemption"
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED


def test_a_batch_of_preemptions_writes_what_one_request_at_a_time_writes(
    make_node, make_job, vision, alice
):
    make_node("n1", gpus=3)
    jobs = [make_job(vision, alice) for _ in range(3)]
    apply_plan(
        m.Plan(starts=tuple(start(j, ("n1", [f"GPU-n1-{i}"])) for i, j in enumerate(jobs))),
        load_snapshot(),
    )
    alone, together, told = (JobAttempt.objects.get(job=j) for j in jobs)
    assert actions.request_stop(told, reason="fenced", message="told first")
    assert actions.request_stop(alone, reason="preempted", message="reclaimed")
    loaded = load_snapshot()
    result = apply_plan(
        m.Plan(
            preemptions=(
                m.Preemption(attempt_id=together.pk, job_id=jobs[1].pk, reason="reclaimed"),
                m.Preemption(attempt_id=told.pk, job_id=jobs[2].pk, reason="reclaimed"),
            )
        ),
        loaded,
    )
    assert result.preempted == [together.pk]
    assert [(s.id, s.why) for s in result.skipped] == [
        (told.pk, "the attempt was already told to stop")
    ]

    def stop_rows(attempt):
        attempt.refresh_from_db()
        event = attempt.job.events.get(kind="stop_requested")
        return (
            attempt.stop_reason,
            attempt.stop_requested_at is not None,
            (event.message, event.from_state, event.to_state, event.actor_id),
            {**event.data, "attempt": None},
        )

    assert stop_rows(alone) == stop_rows(together)
    assert together.job.events.get(kind="stop_requested").data["attempt"] == together.pk
    # The attempt told first keeps its reason and gets no second event.
    assert stop_rows(told)[0] == "fenced"


def test_desired_power_caps_are_written_only_where_they_move(make_node):
    make_node("n1", gpus=2)
    make_node("n2", gpus=1)
    GPU.objects.filter(uuid="GPU-n1-1").update(desired_power_cap_w=450.0)
    result = apply_plan(
        m.Plan(power_caps_w={"GPU-n1-0": 450.0, "GPU-n1-1": 450.0, "GPU-n2-0": 200.0}),
        load_snapshot(),
    )
    assert result.power_caps_written == 2
    assert result.nodes_changed == {"n1", "n2"}
    caps = dict(GPU.objects.values_list("uuid", "desired_power_cap_w"))
    assert caps == {"GPU-n1-0": 450.0, "GPU-n1-1": 450.0, "GPU-n2-0": 200.0}
    assert apply_plan(m.Plan(power_caps_w=caps), load_snapshot()).nodes_changed == set()


@pytest.mark.django_db(transaction=True)
def test_the_nodes_are_told_once_the_plan_has_committed(make_node, make_job, vision, alice):
    from controlplane.redis_client import get_redis

    make_node("n1", gpus=1)
    make_node("n2", gpus=1)
    job = make_job(vision, alice)
    subscriber = get_redis().pubsub()
    subscriber.subscribe(notify.node_channel("n1"), notify.node_channel("n2"))
    assert subscriber.get_message(timeout=2)["type"] == "subscribe"
    assert subscriber.get_message(timeout=2)["type"] == "subscribe"
    seen = notify.node_version("n1")
    apply_plan(m.Plan(starts=(start(job, ("n1", ["GPU-n1-0"])),)), load_snapshot())
    assert notify.node_version("n1") == seen + 1
    message = subscriber.get_message(timeout=5)
    assert (message["channel"], message["data"]) == (notify.node_channel("n1").encode(), b"changed")
    assert subscriber.get_message(timeout=0.5) is None
    subscriber.close()
