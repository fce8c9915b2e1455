"""insert_rows writes exactly the rows bulk_create writes, in one statement, ids in row order."""

from datetime import UTC, datetime

import pytest
from django.db import IntegrityError, connection, transaction
from django.forms.models import model_to_dict
from django.test.utils import CaptureQueriesContext

from controlplane.jobs.bulk_insert import insert_rows
from controlplane.jobs.models import Allocation, JobAttempt, JobEvent

pytestmark = pytest.mark.django_db

AT = datetime(2026, 11, 30, 12, 0, 0, 123456, tzinfo=UTC)


def _row(obj, *leave_out):
    values = model_to_dict(obj)
    for name in ("id", *leave_out):
        values.pop(name, None)
    return values


def test_rows_read_back_as_bulk_create_writes_them_defaults_included(
    make_node, make_job, vision, alice
):
    node = make_node("n1", gpus=4)
    jobs = [make_job(vision, alice) for _ in range(4)]
    made = JobAttempt.objects.bulk_create(
        [
            JobAttempt(job=jobs[i], number=1, node=node, borrowed=bool(i), created_at=AT)
            for i in range(2)
        ]
    )
    with CaptureQueriesContext(connection) as queries:
        ids = insert_rows(
            JobAttempt,
            [
                {"job_id": jobs[i].pk, "number": 1, "node_id": node.pk, "borrowed": bool(i - 2)}
                for i in range(2, 4)
            ],
            common={"created_at": AT},
            returning="job_id",
        )
    assert len(queries) == 1
    inserted = JobAttempt.objects.in_bulk(ids)
    # The ids come back in the order of the rows, matched on the job.
    assert [inserted[pk].job_id for pk in ids] == [jobs[2].pk, jobs[3].pk]
    for by_django, by_insert in zip(made, (inserted[pk] for pk in ids), strict=True):
        by_django.refresh_from_db()
        assert _row(by_django, "job") == _row(by_insert, "job")


def test_json_text_and_timestamps_survive_the_trip(make_node, make_job, vision, alice):
    job = make_job(vision, alice)
    data = {"gpus": ["GPU-n1-0", "GPU-n1-1"], "node": "n1", "nested": {"ratio": 0.5, "ok": None}}
    message = 'quotes " \\ backslash, accents é, and 日本語'
    insert_rows(
        JobEvent,
        [{"job_id": job.pk, "message": message, "data": data, "at": AT}],
        common={"kind": "admitted"},
    )
    event = JobEvent.objects.get(job=job, kind="admitted")
    assert (event.message, event.data, event.at) == (message, data, AT)
    assert (event.from_state, event.to_state, event.actor_id) == ("", "", None)


def test_the_unique_index_still_refuses_a_gpu_given_twice(make_node, make_job, vision, alice):
    node = make_node("n1", gpus=1)
    gpu = node.gpus.get()
    job = make_job(vision, alice)
    attempt = JobAttempt.objects.create(job=job, number=1, node=node)
    insert_rows(Allocation, [{"attempt_id": attempt.pk, "gpu_id": gpu.pk}])
    with pytest.raises(IntegrityError), transaction.atomic():
        insert_rows(Allocation, [{"attempt_id": attempt.pk, "gpu_id": gpu.pk}])
    assert Allocation.objects.filter(gpu=gpu, active=True).count() == 1
