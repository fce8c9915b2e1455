"""The waiting jobs a cycle keeps between loads are always the ones a full read would give.

On PostgreSQL a load reads each waiting job's row version and reads whole only the rows that
are new or changed (loader._load_pending). These tests change the queue every way the loader
can see, through actions and through plain writes (several to one row in one transaction
included, where the writer's transaction id is the same), and after each change compare what
the load built with a full read of the same rows.
"""

import dataclasses
import random
import time

import pytest
from django.contrib.auth import get_user_model
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from controlplane.jobs import actions
from controlplane.jobs.models import Job, JobAttempt
from controlplane.scheduling import loader
from controlplane.scheduling.applier import apply_plan
from controlplane.scheduling.loader import forget_pending, load_snapshot
from controlplane.storage.models import Volume
from controlplane.tenancy.models import Tenant
from scheduler import model as m
from scheduler.policy import plan as make_plan

pytestmark = pytest.mark.django_db


def _full_read(now_s: float):
    """What a load without kept rows gives, leaving the kept rows as they were."""
    kept = loader._pending_cache
    forget_pending()
    try:
        return load_snapshot(now_s)
    finally:
        loader._pending_cache = kept


def _pending_reads(queries, *, by_id: bool = False) -> list[str]:
    """The loader's reads of whole waiting rows among these queries: of every waiting job, or
    (by_id) of those it found new or changed."""
    return [
        q["sql"]
        for q in queries
        if '"pending_reason"' in q["sql"]
        and 'AS "version"' in q["sql"]
        and ("= ANY(" in q["sql"]) == by_id
    ]


def _incremental(now_s: float):
    """A load that must not read every waiting row whole (the point of keeping them)."""
    with CaptureQueriesContext(connection) as queries:
        loaded = load_snapshot(now_s)
    assert not _pending_reads(queries), "a load with kept rows read every waiting job whole"
    return loaded


def _cycle(now_s: float, capture, *, starts: bool = True) -> int:
    """A cycle's load, plan and apply, committed as far as the loader can tell (its on-commit
    steps run); returns the waiting rows it wrote. Without starts, it only writes what it
    decided of the jobs it leaves waiting."""
    with capture(execute=True):
        loaded = load_snapshot(now_s)
        decided = make_plan(loaded.snapshot, m.Config())
        if not starts:
            decided = dataclasses.replace(decided, starts=(), preemptions=())
        return apply_plan(decided, loaded).pending_rows_written


def _same(loaded, full) -> None:
    assert [p.job_id for p in loaded.snapshot.pending] == [p.job_id for p in full.snapshot.pending]
    assert loaded.snapshot.pending == full.snapshot.pending
    assert loaded.pending_rows == full.pending_rows


def test_kept_waiting_jobs_match_a_full_read_after_every_kind_of_change(
    make_node, make_job, vision, nlp, alice, bob, django_capture_on_commit_callbacks
):
    rng = random.Random(20261206)
    node = make_node("n1", gpus=8)
    volume = Volume.objects.create(name="ckpt", source="/srv/ckpt")
    users = {vision.pk: alice, nlp.pk: bob}
    tenants = [vision, nlp]
    jobs = [make_job(rng.choice(tenants), alice, gpus=rng.randint(1, 4)) for _ in range(12)]
    jobs += [make_job(nlp, bob, gpus=1) for _ in range(6)]
    now_s = time.time()
    forget_pending()
    load_snapshot(now_s)

    def waiting() -> list[Job]:
        return list(Job.objects.filter(state="PENDING").order_by("id"))

    def submit():
        tenant = rng.choice(tenants)
        jobs.append(make_job(tenant, users[tenant.pk], gpus=rng.randint(1, 8)))

    def column():
        # A plain write in the test's own transaction: a job written twice this way keeps the
        # writer's transaction id, and only the row's slot tells the versions apart.
        job = rng.choice(waiting())
        field, value = rng.choice(
            [
                ("gpus", rng.randint(1, 8)),
                ("priority", rng.choice(["low", "normal", "high"])),
                ("name", f"renamed-{rng.randint(0, 99)}"),
                ("cpus", rng.choice([0.0, 2.0, 8.0])),
                ("memory_mib", rng.choice([0, 4096])),
                ("estimated_duration_s", rng.choice([None, 60.0, 3600.0])),
                ("preemption_grace_s", rng.choice([0, 30])),
                ("mounts", [{"volume": "ckpt", "path": "/ckpt"}] if rng.random() < 0.5 else []),
                ("pending_reason", f"reason {rng.randint(0, 9)}"),
                ("queue_position", rng.randint(1, 50)),
                ("checkpoint_volume", rng.choice([None, volume])),
            ]
        )
        Job.objects.filter(pk=job.pk).update(**{field: value})

    def twice_in_one_savepoint():
        job = rng.choice(waiting())
        with transaction.atomic():
            Job.objects.filter(pk=job.pk).update(gpus=3)
            _same(_incremental(now_s), _full_read(now_s))
            Job.objects.filter(pk=job.pk).update(gpus=5)

    def hold_or_release():
        job = rng.choice(list(Job.objects.filter(state="PENDING")))
        Job.objects.filter(pk=job.pk).update(hold="" if job.hold else "user")

    def cancel():
        actions.cancel_job(rng.choice(waiting()), actor=alice, reason="test")

    def rename_user():
        user = rng.choice([alice, bob])
        get_user_model().objects.filter(pk=user.pk).update(username=f"u{rng.randint(0, 999)}")

    def tenant_active():
        tenant = rng.choice(tenants)
        active = Tenant.objects.get(pk=tenant.pk).active
        Tenant.objects.filter(pk=tenant.pk).update(active=not active)

    def rename_tenant():
        tenant = rng.choice(tenants)
        Tenant.objects.filter(pk=tenant.pk).update(slug=f"t{tenant.pk}-{rng.randint(0, 99)}")

    def rename_volume():
        Volume.objects.filter(pk=volume.pk).update(name=f"ckpt-{rng.randint(0, 99)}")

    def requeue():
        # An attempt that ends and sends the job back: its row changes, and so does the GPU
        # time of its earlier attempts, which lives in another table.
        candidates = [j for j in waiting() if j.gpus <= 8 and not j.hold]
        if not candidates:
            return
        job = rng.choice(candidates)
        attempt = actions.admit_job(
            job, node=node, gpus=list(node.gpus.all())[: job.gpus], borrowed=False
        )
        actions.mark_attempt_running(attempt)
        actions.request_stop(attempt, reason="preempted", message="reclaimed")
        attempt.refresh_from_db()
        actions.finish_attempt(attempt, exit_code=137)

    def earlier_service_only():
        attempt = JobAttempt.objects.filter(job__state="PENDING").exclude(state="RUNNING").first()
        if attempt is not None:
            JobAttempt.objects.filter(pk=attempt.pk).update(gpu_seconds=rng.randint(1, 10_000))

    def move_in_order():
        job = rng.choice(waiting())
        other = rng.choice(waiting())
        Job.objects.filter(pk=job.pk).update(submitted_at=other.submitted_at)

    def cycle():
        # Writes reasons and positions onto the waiting rows, and tells the loader what it wrote;
        # at a later time now and then, so that estimates and deep positions are rewritten too.
        # (Within the minute after the last full read: the loads in between keep rows.)
        at_s = now_s + rng.choice([0.0, 0.0, 30.0, loader.PENDING_FULL_READ_EVERY_S - 1])
        _cycle(at_s, django_capture_on_commit_callbacks, starts=False)

    def cycle_then_column():
        # A cycle's rows kept as written, then one of them changed by someone else.
        _cycle(now_s, django_capture_on_commit_callbacks, starts=False)
        column()

    def nothing():
        pass

    changes = [
        submit,
        column,
        column,
        column,
        twice_in_one_savepoint,
        hold_or_release,
        cancel,
        rename_user,
        tenant_active,
        rename_tenant,
        rename_volume,
        requeue,
        earlier_service_only,
        move_in_order,
        cycle,
        cycle,
        cycle_then_column,
        nothing,
    ]
    seen = set()
    for _ in range(150):
        change = rng.choice(changes)
        change()
        seen.add(change.__name__)
        _same(_incremental(now_s), _full_read(now_s))
        if len(waiting()) < 6:
            submit()
    assert seen == {c.__name__ for c in changes}


def test_a_row_changed_between_the_two_reads_is_kept_as_read_and_read_again_next_time(
    make_job, vision, alice, monkeypatch
):
    jobs = [make_job(vision, alice, gpus=1) for _ in range(4)]
    now_s = time.time()
    forget_pending()
    load_snapshot(now_s)
    Job.objects.filter(pk=jobs[0].pk).update(gpus=2)
    Job.objects.filter(pk=jobs[1].pk).update(gpus=2)
    real_rows = loader.raw_rows

    def racing_writer(queryset):
        # Commits (here: writes, in the load's own transaction) after the versions were read and
        # before the changed rows are: one job changes again, another leaves the queue.
        if queryset.model is not Job:
            return real_rows(queryset)
        monkeypatch.setattr(loader, "raw_rows", real_rows)
        Job.objects.filter(pk=jobs[0].pk).update(gpus=3)
        actions.cancel_job(Job.objects.get(pk=jobs[1].pk), actor=alice, reason="race")
        return real_rows(queryset)

    monkeypatch.setattr(loader, "raw_rows", racing_writer)
    loaded = _incremental(now_s)
    by_id = {p.job_id: p for p in loaded.snapshot.pending}
    assert by_id[jobs[0].pk].gpus == 3
    assert jobs[1].pk not in by_id
    _same(loaded, _full_read(now_s))
    # Nothing changed since: the next load keeps every row, and still agrees.
    again = _incremental(now_s)
    assert again.snapshot.pending == loaded.snapshot.pending
    _same(again, _full_read(now_s))


def test_the_kept_rows_are_read_whole_again_once_a_minute_and_when_the_clock_goes_back(
    make_job, vision, alice
):
    make_job(vision, alice, gpus=1)
    now_s = time.time()
    forget_pending()
    load_snapshot(now_s)

    def reads_whole(at_s: float) -> bool:
        with CaptureQueriesContext(connection) as queries:
            load_snapshot(at_s)
        return bool(_pending_reads(queries))

    assert not reads_whole(now_s + loader.PENDING_FULL_READ_EVERY_S - 1)
    assert reads_whole(now_s + loader.PENDING_FULL_READ_EVERY_S)
    assert reads_whole(now_s)  # earlier than the last full read
    assert not reads_whole(now_s + 1)


def test_the_rows_a_cycle_wrote_are_not_read_again_by_the_next_load(
    make_node, make_job, vision, alice, django_capture_on_commit_callbacks
):
    make_node("n1", gpus=1)
    for _ in range(30):
        make_job(vision, alice, gpus=1)
    now_s = time.time()
    forget_pending()
    # One starts (its prediction written), 29 wait (their reasons and positions written).
    assert _cycle(now_s, django_capture_on_commit_callbacks) == 30
    with CaptureQueriesContext(connection) as queries:
        loaded = load_snapshot(now_s)
    assert not _pending_reads(queries, by_id=True) and not _pending_reads(queries)
    _same(loaded, _full_read(now_s))
    # The rows as kept are the rows as stored: the next cycle finds nothing to write.
    assert _cycle(now_s, django_capture_on_commit_callbacks) == 0


def test_a_cycle_that_rolls_back_leaves_the_loader_reading_its_rows_again(
    make_node, make_job, vision, alice
):
    make_node("n1", gpus=1)
    jobs = [make_job(vision, alice, gpus=1) for _ in range(5)]
    now_s = time.time()
    forget_pending()
    with pytest.raises(RuntimeError), transaction.atomic():
        loaded = load_snapshot(now_s)
        assert apply_plan(make_plan(loaded.snapshot, m.Config()), loaded).pending_rows_written
        raise RuntimeError("the cycle dies before its commit")
    assert not Job.objects.exclude(pending_reason="").filter(pk__in=[j.pk for j in jobs]).exists()
    _same(_incremental(now_s), _full_read(now_s))


def test_a_waiting_row_changed_after_the_load_keeps_the_change_and_gets_its_reason_next_cycle(
    make_node, make_job, vision, alice, django_capture_on_commit_callbacks
):
    make_node("n1", gpus=1)
    jobs = [make_job(vision, alice, gpus=1) for _ in range(4)]
    now_s = time.time()
    forget_pending()
    with django_capture_on_commit_callbacks(execute=True):
        loaded = load_snapshot(now_s)
        decided = make_plan(loaded.snapshot, m.Config())
        # Someone else writes a waiting job between the cycle's load and its apply.
        changed = next(d.job_id for d in decided.pending)
        Job.objects.filter(pk=changed).update(priority="high", pending_reason="")
        apply_plan(decided, loaded)
    others = [d.job_id for d in decided.pending if d.job_id != changed]
    assert others and all(j.pending_reason for j in Job.objects.filter(pk__in=others))
    job = Job.objects.get(pk=changed)
    assert (job.priority, job.pending_reason) == ("high", "")
    _same(_incremental(now_s), _full_read(now_s))
    _cycle(now_s, django_capture_on_commit_callbacks)
    assert Job.objects.get(pk=changed).pending_reason != ""
    assert all(
        j.pending_reason for j in Job.objects.filter(pk__in=[j.pk for j in jobs], state="PENDING")
    )
