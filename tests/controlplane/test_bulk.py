"""The bulk-write helper: insert_rows writes exactly the rows bulk_create writes, update_rows
what bulk_update writes, each in one statement, on PostgreSQL and on SQLite alike."""

import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from django.db import IntegrityError, connection, transaction
from django.forms.models import model_to_dict
from django.test.utils import CaptureQueriesContext

from controlplane.bulk import execute_for_ids, insert_rows, rows_for_ids, sqlite_chunk, update_rows
from controlplane.jobs.models import Allocation, Job, JobAttempt, JobEvent, JobState

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


def test_each_row_gets_its_own_values_in_one_statement(make_job, vision, alice):
    jobs = [make_job(vision, alice) for _ in range(3)]
    rows = [
        (jobs[0].pk, "QUOTA", "waits for quota", 1, AT, 12.5),
        (jobs[1].pk, "NODES", 'quotes " and 日本語', None, None, float("inf")),
        (jobs[2].pk, "QUOTA", "", 1000, AT, None),
    ]
    fields = ["pending_reason_code", "pending_reason", "queue_position"]
    fields += ["estimated_start_at", "predicted_duration_s"]
    with CaptureQueriesContext(connection) as queries:
        written = update_rows(Job, fields, rows, only_if={"state": JobState.PENDING})
    assert (written, len(queries)) == (3, 1)
    for row in rows:
        job = Job.objects.get(pk=row[0])
        assert tuple(getattr(job, f) for f in fields) == row[1:]


def test_a_row_no_longer_in_the_wanted_state_is_left_alone_and_not_counted(make_job, vision, alice):
    waiting, cancelled = make_job(vision, alice), make_job(vision, alice)
    Job.objects.filter(pk=cancelled.pk).update(state=JobState.CANCELLED)
    written = update_rows(
        Job,
        ["pending_reason"],
        [(waiting.pk, "waits"), (cancelled.pk, "waits")],
        only_if={"state": JobState.PENDING},
    )
    assert written == 1
    assert Job.objects.get(pk=cancelled.pk).pending_reason == ""
    assert Job.objects.get(pk=waiting.pk).pending_reason == "waits"


def test_json_and_booleans_update_as_they_insert(make_node, make_job, vision, alice):
    node = make_node("n1", gpus=1)
    attempt = JobAttempt.objects.create(job=make_job(vision, alice), number=1, node=node)
    counters = {"GPU-n1-0": 1234.5}
    update_rows(
        JobAttempt,
        ["energy_j", "energy_estimated", "energy_last_j"],
        [(attempt.pk, 10, True, counters)],
    )
    attempt.refresh_from_db()
    assert (attempt.energy_j, attempt.energy_estimated, attempt.energy_last_j) == (
        10.0,
        True,
        counters,
    )


def test_a_fixed_statement_touches_exactly_the_rows_of_the_ids_given(make_job, vision, alice):
    """execute_for_ids and rows_for_ids: only the ids given, none twice, whatever their number
    (more than SQLite takes in one statement included); an empty list runs nothing."""
    jobs = [make_job(vision, alice, name=f"j{i}") for i in range(4)]
    table = Job._meta.db_table
    many = [jobs[0].pk, jobs[2].pk, *range(10**9, 10**9 + sqlite_chunk(1) + 5)]
    sql = f'UPDATE "{table}" SET "queue_position" = 7 WHERE "id" {{among}}'
    assert execute_for_ids(sql, many) == 2
    assert [j.queue_position for j in Job.objects.order_by("pk")] == [7, None, 7, None]
    select = f'SELECT "id", "name" FROM "{table}" WHERE "id" {{among}}'
    assert sorted(rows_for_ids(select, many)) == [(jobs[0].pk, "j0"), (jobs[2].pk, "j2")]
    with CaptureQueriesContext(connection) as queries:
        assert execute_for_ids(sql, []) == 0 and rows_for_ids(select, []) == []
    assert len(queries) == 0


def _prepared_count() -> int:
    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_prepared_statements")
        return cur.fetchone()[0]


@pytest.mark.parametrize("allowed", [True, False])
def test_nothing_is_prepared_behind_a_pooler_that_cannot_keep_prepared_statements(
    settings, allowed
):
    # DB_PREPARED_STATEMENTS=0 leaves psycopg's threshold at None (Django's default); the fixed
    # statements' prepare=True must then prepare nothing either, or a transaction-mode pooler
    # hands the next transaction a server connection without them ("prepared statement does
    # not exist").
    if connection.vendor != "postgresql":
        pytest.skip("prepared statements are PostgreSQL's")
    settings.DB_PREPARED_STATEMENTS = allowed
    connection.ensure_connection()
    raw = connection.connection
    kept = raw.prepare_threshold
    raw.prepare_threshold = None
    try:
        before = _prepared_count()
        for _ in range(3):
            rows_for_ids("SELECT id FROM jobs_job WHERE id {among}", [1, 2])
        assert _prepared_count() - before == (1 if allowed else 0)
    finally:
        raw.prepare_threshold = kept


_PREPARED_IN_A_FRESH_PROCESS = """
import django
django.setup()
from django.db import connection
from controlplane.bulk import rows_for_ids
for _ in range(3):
    rows_for_ids("SELECT relnatts FROM pg_class WHERE oid::bigint {among}", [1259, 1247])
with connection.cursor() as cur:
    cur.execute("SELECT count(*) FROM pg_prepared_statements")
    print(cur.fetchone()[0])
"""


@pytest.mark.parametrize(("setting", "prepared"), [("0", "0"), ("1", "1")])
def test_the_setting_reaches_the_fixed_statements_in_a_process_configured_from_its_environment(
    setting, prepared
):
    if connection.vendor != "postgresql":
        pytest.skip("prepared statements are PostgreSQL's")
    url = os.environ["DATABASE_URL"].rsplit("/", 1)[0] + "/postgres"
    env = {
        "PATH": os.environ["PATH"],
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "DATABASE_URL": url,
        "DB_PREPARED_STATEMENTS": setting,
    }
    done = subprocess.run(
        [sys.executable, "-c", _PREPARED_IN_A_FRESH_PROCESS],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == prepared
