"""What a write to the tables of the job path costs PostgreSQL: no index the others make
redundant, and room on a job's page for the cycle's writes of its reason.

Each index of a table is one more write at each insert, and at each update that cannot stay on
the row's page (a HOT update). In a flood of short jobs these writes were a fifth of
PostgreSQL's CPU per job (issue 14).
"""

import time

import pytest
from django.db import connection, transaction

from controlplane.jobs import actions
from controlplane.jobs.models import AttemptState, JobAttempt
from controlplane.scheduling.applier import apply_plan
from controlplane.scheduling.loader import forget_pending, load_snapshot
from scheduler import model as m
from scheduler.policy import plan as make_plan

pytestmark = pytest.mark.django_db

# Written for every job (submit, admission, start, end, events, output) or at every heartbeat.
TABLES_WRITTEN_PER_JOB = (
    "jobs_job",
    "jobs_jobattempt",
    "jobs_attemptmember",
    "jobs_allocation",
    "jobs_jobevent",
    "jobs_logchunk",
    "cluster_node",
    "cluster_gpu",
    "cluster_gputelemetry",
)


def _indexes(table: str) -> list[tuple[str, tuple[str, ...], bool, bool]]:
    """(name, columns in order, unique, partial) of each index on the table."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT c.relname,
                   ARRAY(SELECT a.attname FROM unnest(i.indkey) WITH ORDINALITY k(att, ord)
                         JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.att
                         ORDER BY k.ord),
                   i.indisunique, i.indpred IS NOT NULL,
                   pg_get_indexdef(i.indexrelid) LIKE '%%pattern_ops%%'
            FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
            WHERE i.indrelid = %s::regclass
            """,
            [table],
        )
        rows = cursor.fetchall()
    # An index for LIKE 'prefix%' (varchar_pattern_ops) answers no equality the other does not.
    return [
        (name, tuple(cols), unique, partial or like) for name, cols, unique, partial, like in rows
    ]


@pytest.mark.parametrize("table", TABLES_WRITTEN_PER_JOB)
def test_no_index_of_a_table_written_per_job_is_covered_by_another(table):
    indexes = _indexes(table)
    assert indexes, f"{table} has no indexes: is the table name right?"
    redundant = [
        f"{name} {columns} is the leading part of {other} {other_columns}"
        for name, columns, unique, partial in indexes
        for other, other_columns, _, other_partial in indexes
        if other != name
        and not unique  # a unique index is a constraint as well
        and not partial
        and not other_partial  # a partial one answers only for some rows
        and other_columns[: len(columns)] == columns
    ]
    assert not redundant, redundant


def _job_writes() -> tuple[int, int]:
    """Rows of jobs_job this transaction updated, and how many of those stayed on their page."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_stat_get_xact_tuples_updated(%s::regclass),"
            " pg_stat_get_xact_tuples_hot_updated(%s::regclass)",
            ["jobs_job", "jobs_job"],
        )
        updated, hot = cursor.fetchone()
    return updated, hot


@pytest.mark.django_db(transaction=True)
def test_the_cycles_writes_of_waiting_jobs_stay_on_their_pages(make_node, make_job, vision, alice):
    """A flood of short jobs: at each cycle one ends and the next starts, and every job still
    waiting moves up one place in the queue, which the cycle writes to its row."""
    make_node("n1", gpus=1)
    waiting = 120  # rows on several pages, most of them sharing a page with others
    for _ in range(waiting):
        make_job(vision, alice, gpus=1)
    now_s = time.time()
    forget_pending()
    updated = hot = 0
    for cycle in range(4):
        with transaction.atomic():
            for attempt in JobAttempt.objects.filter(state=AttemptState.ADMITTED):
                actions.mark_attempt_running(attempt)
                actions.finish_attempt(attempt, exit_code=0)
        if cycle:
            _no_older_snapshot_in_this_database()
        with transaction.atomic():
            before = _job_writes()
            loaded = load_snapshot(now_s + cycle)
            written = apply_plan(make_plan(loaded.snapshot, m.Config()), loaded)
            after = _job_writes()
        assert written.pending_rows_written and written.started
        if cycle:  # the first cycle writes rows fresh from their insert
            updated += after[0] - before[0]
            hot += after[1] - before[1]
    assert updated >= 30
    # The job that starts leaves its page (its state is indexed); nearly all others stay. Had
    # the cycle's writes an indexed column (say, the queue position), none would.
    assert hot >= 0.8 * updated, f"{hot} of {updated} updates stayed on their page"


def _no_older_snapshot_in_this_database(timeout_s: float = 30.0) -> None:
    """Wait until no other session of this database holds a snapshot or a transaction.

    The versions the last cycle left are pruned, making room on their page for the next
    cycle's, only once no snapshot may still see them. In production a cycle's writes are
    spaced seconds apart; here they follow within milliseconds, and a snapshot someone else
    took before the last cycle committed (an autovacuum's ANALYZE of a table this suite just
    filled, another thread's transaction) would make the next cycle's writes leave their pages
    for a reason that is not the table's layout. One that stays is named.
    """
    deadline = time.monotonic() + timeout_s
    while holders := _horizon_holders():
        assert time.monotonic() < deadline, f"sessions that keep old row versions: {holders}"
        time.sleep(0.05)


def _horizon_holders() -> list[tuple]:
    """Other backends of this database with a snapshot or a transaction open: while one is,
    the versions a cycle left cannot be pruned, and the next cycle's writes find no room."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid, application_name, state, backend_xmin::text, left(query, 80)"
            " FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND (backend_xmin IS NOT NULL OR xact_start IS NOT NULL)"
        )
        return cursor.fetchall()


def test_the_first_cycle_after_a_burst_of_submits_leaves_most_of_them_on_their_pages(
    make_node, make_job, vision, alice, django_capture_on_commit_callbacks
):
    """Rows just inserted fill their pages up to the table's fillfactor. At the default (100)
    the reason each gets at the first cycle moved every one of them to another page, and into
    every index of the table: an array of 2,000 tasks paid that 2,000 times at once."""
    make_node("n1", gpus=1)
    jobs = [make_job(vision, alice, gpus=1) for _ in range(120)]
    now_s = time.time()
    forget_pending()
    before = _job_writes()
    with django_capture_on_commit_callbacks(execute=True):
        loaded = load_snapshot(now_s)
        written = apply_plan(make_plan(loaded.snapshot, m.Config()), loaded)
    updated, hot = (after - start for after, start in zip(_job_writes(), before, strict=True))
    assert written.pending_rows_written >= len(jobs) - 1
    # One cycle, one transaction: a version it replaces is still live to others and takes its
    # room until the cycle commits, so a page has room for only some of its rows' new versions.
    assert hot >= 0.2 * updated, f"{hot} of {updated} updates stayed on their page"
