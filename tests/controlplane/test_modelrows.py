"""controlplane.modelrows.insert writes the row Model.save would, with a statement written once.

Every column is compared with the same object saved by the ORM (read back from the database,
so the converters on both sides are the real ones), for the two models every submit inserts,
and for the cases where insert must hand over to the ORM."""

import datetime as dt

import pytest
from django.db import connection
from django.db.models import Subquery, signals
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from controlplane import modelrows
from controlplane.jobs.models import Job, JobEvent, JobState
from controlplane.storage.models import Volume


def _row(model, pk) -> dict:
    """Every column as the database holds it, but the key and the insert times."""
    got = model.objects.get(pk=pk)
    skip = {"id", "submitted_at", "at", "created_at", "updated_at"}
    return {
        f.attname: getattr(got, f.attname)
        for f in model._meta.concrete_fields
        if f.attname not in skip
    }


def _job(tenant, user, **fields):
    return Job(
        tenant=tenant,
        submitted_by=user,
        state=JobState.PENDING,
        name="sweep-7",
        image="registry.example.org/train:1",
        command=["python", "train.py", "--lr", "3e-4"],
        env={"SEED": "7", "TEXT": "é ✓"},
        gpus=2,
        priority="high",
        **fields,
    )


def test_a_job_and_its_event_are_the_rows_save_writes(vision, alice):
    by_insert, by_save = _job(vision, alice), _job(vision, alice)
    modelrows.insert(by_insert)
    by_save.save(force_insert=True)

    assert by_insert.pk is not None and by_insert.pk != by_save.pk
    assert _row(Job, by_insert.pk) == _row(Job, by_save.pk)
    stored = Job.objects.get(pk=by_insert.pk)
    assert stored.submitted_at is not None
    assert abs(stored.submitted_at - timezone.now()) < dt.timedelta(minutes=1)

    events = []
    for job, write in ((by_insert, modelrows.insert), (by_save, lambda e: e.save())):
        event = JobEvent(
            job=job,
            kind="submitted",
            to_state=JobState.PENDING,
            actor=alice,
            message="m",
            data={"batch": {"index": 3}, "deep": [[1, 2], {"x": None}]},
        )
        write(event)
        events.append(event)
    first, second = (_row(JobEvent, e.pk) for e in events)
    assert first.pop("job_id") == by_insert.pk and second.pop("job_id") == by_save.pk
    assert first == second
    assert first["data"] == {"batch": {"index": 3}, "deep": [[1, 2], {"x": None}]}


def test_an_inserted_instance_is_saved_state_a_later_save_updates_it(vision, alice):
    job = _job(vision, alice)
    modelrows.insert(job)
    assert not job._state.adding and job._state.db == "default"
    job.name = "renamed"
    job.save(update_fields=["name"])
    assert Job.objects.filter(name="renamed").count() == 1
    assert Job.objects.count() == 1


def test_one_statement_and_no_more(vision, alice):
    job = _job(vision, alice)
    with CaptureQueriesContext(connection) as queries:
        modelrows.insert(job)
    assert len(queries) == 1
    assert queries[0]["sql"].startswith('INSERT INTO "jobs_job"')


def test_an_expression_or_a_save_receiver_goes_through_the_orm(vision, alice):
    volume = Volume.objects.create(name="ckpt", checkpoints=True, source="/srv/ckpt")
    guarded = Subquery(Volume.objects.filter(pk=volume.pk, checkpoints=True).values("pk"))
    job = _job(vision, alice, checkpoint_volume_id=guarded)
    modelrows.insert(job)
    assert Job.objects.get(pk=job.pk).checkpoint_volume_id == volume.pk

    seen = []

    def receiver(sender, instance, created, **kwargs):
        seen.append((instance.pk, created))

    signals.post_save.connect(receiver, sender=Job, dispatch_uid="test-modelrows")
    try:
        other = _job(vision, alice)
        modelrows.insert(other)
    finally:
        signals.post_save.disconnect(sender=Job, dispatch_uid="test-modelrows")
    assert seen == [(other.pk, True)]


def test_an_unsaved_related_object_is_refused_as_save_refuses_it(vision, alice):
    unsaved = _job(vision, alice)
    event = JobEvent(job=unsaved, kind="submitted", to_state=JobState.PENDING, message="m")
    with pytest.raises(ValueError, match="unsaved related object"):
        modelrows.insert(event)


def _event(**fields):
    return JobEvent(
        kind="submitted",
        to_state=JobState.PENDING,
        message="m",
        data={"batch": {"index": 3}, "deep": [[1, 2], {"x": None}]},
        **fields,
    )


def _pair_rows(job, event) -> tuple[dict, dict]:
    event_row = _row(JobEvent, event.pk)
    assert event_row.pop("job_id") == job.pk
    return _row(Job, job.pk), event_row


@pytest.mark.parametrize("vendor", ["postgresql", "other"])
def test_a_job_and_its_event_in_one_statement_are_the_rows_two_saves_write(
    vision, alice, vendor, monkeypatch
):
    # One round trip on PostgreSQL (a data-modifying WITH); two inserts where the backend has
    # no INSERT inside WITH (SQLite). Either way the rows of two saves, linked.
    if vendor != connection.vendor:
        monkeypatch.setattr(connection, "vendor", vendor)
    job, event = _job(vision, alice), _event(actor=alice)
    with CaptureQueriesContext(connection) as queries:
        modelrows.insert_pair(job, event, "job_id")
    assert len(queries) == (1 if vendor == "postgresql" else 2)
    assert not job._state.adding and not event._state.adding
    assert event.job_id == job.pk

    saved_job = _job(vision, alice)
    saved_job.save(force_insert=True)
    saved_event = _event(actor=alice, job=saved_job)
    saved_event.save()
    assert _pair_rows(job, event) == _pair_rows(saved_job, saved_event)


def test_a_pair_that_needs_the_orms_save_goes_through_it_linked_all_the_same(vision, alice):
    volume = Volume.objects.create(name="ckpt", checkpoints=True, source="/srv/ckpt")
    guarded = Subquery(Volume.objects.filter(pk=volume.pk, checkpoints=True).values("pk"))
    job, event = _job(vision, alice, checkpoint_volume_id=guarded), _event()
    modelrows.insert_pair(job, event, "job_id")
    assert Job.objects.get(pk=job.pk).checkpoint_volume_id == volume.pk
    assert JobEvent.objects.get(pk=event.pk).job_id == job.pk

    seen = []

    def receiver(sender, instance, created, **kwargs):
        seen.append((instance.job_id, created))

    signals.post_save.connect(receiver, sender=JobEvent, dispatch_uid="test-modelrows-pair")
    try:
        other, other_event = _job(vision, alice), _event()
        modelrows.insert_pair(other, other_event, "job_id")
    finally:
        signals.post_save.disconnect(sender=JobEvent, dispatch_uid="test-modelrows-pair")
    assert seen == [(other.pk, True)]
