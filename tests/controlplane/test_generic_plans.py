"""The hot reads keep their indexes once PostgreSQL plans them for any parameters.

psycopg prepares a statement a connection runs often, and PostgreSQL then settles on one plan
for every call (a generic plan). A constant sent as a parameter (`state = $2`) hides from that
plan which partial index applies and how few rows match, so a heartbeat read every attempt the
database ever kept, and each cycle read its waiting jobs through the index of every state.
These tests give the database a history of finished work and look at what the plans read:
each hot read's forced generic plan, then a steady cycle and a heartbeat with the plans
PostgreSQL settles on by itself.
"""

from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from controlplane.cluster import desired_state
from controlplane.cluster.models import Node
from controlplane.jobs import actions
from controlplane.jobs.models import Allocation, AttemptMember, Job, JobAttempt, JobState
from controlplane.scheduling import loader
from controlplane.scheduling.rows import fixed_statement, literal_sql

pytestmark = pytest.mark.django_db

FINISHED = 10_000  # attempts of history: enough that reading them all costs more than an index
WAITING = 40


@pytest.fixture
def history(make_node, vision, alice):
    """node-01 with two running attempts and FINISHED finished ones; WAITING waiting jobs, half
    of them with a failed attempt behind them."""
    if connection.vendor != "postgresql":
        pytest.skip("the plans are PostgreSQL's (CI runs these tests on PostgreSQL)")
    node = make_node("node-01")
    make_node("node-02")
    now = timezone.now()

    def job(i: int, state: str, attempts: int) -> Job:
        return Job(
            tenant=vision,
            submitted_by=alice,
            name=f"j{i}",
            image="registry.local/t:1",
            command=["true"],
            gpus=1,
            state=state,
            attempt_count=attempts,
            submitted_at=now - timedelta(seconds=FINISHED - i),
        )

    done = Job.objects.bulk_create(
        [job(i, JobState.SUCCEEDED, 1) for i in range(FINISHED)], batch_size=5000
    )
    running = Job.objects.bulk_create([job(FINISHED + i, JobState.RUNNING, 1) for i in range(2)])
    requeued = Job.objects.bulk_create(
        [job(FINISHED + 2 + i, JobState.PENDING, i % 2) for i in range(WAITING)]
    )
    attempts = JobAttempt.objects.bulk_create(
        [
            JobAttempt(
                job=j,
                number=1,
                node=node,
                state="SUCCEEDED",
                started_at=now - timedelta(hours=2, seconds=i),
                finished_at=now - timedelta(hours=1, seconds=i),
                gpu_seconds=3600.0,
                master_port=29500,
            )
            for i, j in enumerate(done)
        ]
        + [
            JobAttempt(job=j, number=1, node=node, state="FAILED", gpu_seconds=60.0)
            for j in requeued
            if j.attempt_count
        ]
        + [
            JobAttempt(job=j, number=1, node=node, state="RUNNING", started_at=now) for j in running
        ],
        batch_size=5000,
    )
    gpus = list(node.gpus.order_by("index"))
    Allocation.objects.bulk_create(
        [Allocation(attempt=a, gpu=g) for a, g in zip(attempts[-2:], gpus, strict=False)]
    )
    # Each attempt's member on its node, as every admission writes one; both nodes on one host.
    AttemptMember.objects.bulk_create(
        [
            AttemptMember(attempt=a, node=node, rank=0, address="127.0.0.1", gpus=1, state=a.state)
            for a in attempts
        ],
        batch_size=5000,
    )
    Node.objects.update(advertise_address="127.0.0.1")
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    return node


def _generic_plan(sql: str, params) -> dict:
    """The plan PostgreSQL keeps for `sql` once it plans it for any parameters, run, with what
    each of its steps read (EXPLAIN ANALYZE)."""
    numbered = iter(range(1, 1_000))
    text = re.sub(r"%s", lambda _m: f"${next(numbered)}", sql).replace("%%", "%")
    with connection.cursor() as cursor:
        cursor.execute("SET plan_cache_mode = force_generic_plan")
        try:
            cursor.execute(f"PREPARE gpucp_plan_check AS {text}")
            args = ", ".join(literal_sql(connection, "%s", [p]) for p in params or ())
            cursor.execute(
                "EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE gpucp_plan_check"
                + (f"({args})" if args else "")
            )
            (plan,) = cursor.fetchone()
        finally:
            cursor.execute("DEALLOCATE gpucp_plan_check")
            cursor.execute("RESET plan_cache_mode")
    if isinstance(plan, str):
        plan = json.loads(plan)
    return plan[0]["Plan"]


def _rows_read(plan: dict, table: str) -> int:
    """Rows of `table` the plan's steps went through: those they passed on and those they
    looked at and dropped, over all their loops."""
    read = 0
    if plan.get("Relation Name") == table:
        per_loop = (
            plan.get("Actual Rows", 0)
            + plan.get("Rows Removed by Filter", 0)
            + plan.get("Rows Removed by Index Recheck", 0)
        )
        read += per_loop * plan.get("Actual Loops", 1)
    return read + sum(_rows_read(child, table) for child in plan.get("Plans", ()))


# However the planner goes about it, a read of the live work stays far below the history.
BOUND = FINISHED // 10

CYCLE_READS = {
    "waiting jobs": loader._pending_rows,
    "service of earlier attempts": loader._earlier_service_rows,
    "running attempts": loader._running_rows,
}


def test_the_hot_reads_go_through_the_live_work_not_the_history(history):
    """One test, one history: building it is most of the time."""
    plan = _generic_plan(desired_state.work_sql(), [history.pk] * 4)
    for table in ("jobs_jobattempt", "jobs_job"):
        assert _rows_read(plan, table) < BOUND, ("heartbeat", table, plan)
    # ...and still finds the node's work through that plan.
    assert len(desired_state.load_work(history.pk)) == 2

    for name, build in CYCLE_READS.items():
        sql, params = fixed_statement(build)
        assert params is None and "%s" not in sql, name
        plan = _generic_plan(sql, params)
        for table in ("jobs_jobattempt", "jobs_job"):
            assert _rows_read(plan, table) < BOUND, (name, table, plan)
        # Writing the constants in changes the plan, not the rows.
        with connection.cursor() as cursor:
            cursor.execute(*build().query.sql_with_params())
            expected = cursor.fetchall()
            cursor.execute(sql)
            got = cursor.fetchall()
        assert got == expected and len(got) > 0, name


def _rows_touched() -> dict[str, int]:
    """Rows of the job, attempt and member tables this transaction has read so far, by table."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT relname, coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) "
            "FROM pg_stat_xact_user_tables "
            "WHERE relname IN ('jobs_job', 'jobs_jobattempt', 'jobs_attemptmember')"
        )
        return dict(cursor.fetchall())


def test_a_steady_cycle_and_a_heartbeat_read_the_live_work_not_the_history(history):
    """Whatever statement a cycle or a heartbeat runs, with its plans as PostgreSQL settles
    them in the servers, none goes through the history: the statements of tomorrow too."""
    from controlplane.scheduling.cycle import run_scheduling_cycle

    connection.ensure_connection()
    driver = connection.connection
    threshold = driver.prepare_threshold
    # Every statement prepared at its first run, then left to PostgreSQL's own choice between
    # one plan and a plan per call, which it makes after five runs: as in the servers.
    driver.prepare_threshold = 0
    try:
        # The first cycle reads the whole window of the duration history (at most
        # HISTORY_MAX_RECORDS, once a minute): not the steady state.
        for _ in range(6):
            run_scheduling_cycle(trigger="test")
        for _ in range(6):
            desired_state.load_work(history.pk)
        gpu = history.gpus.order_by("index").last()
        for name, step in (
            ("cycle", lambda: run_scheduling_cycle(trigger="test")),
            ("heartbeat work", lambda: desired_state.load_work(history.pk)),
            # What an admission reads to give a job its master port.
            ("rendezvous", lambda: actions.plan_rendezvous([(history, [gpu])])),
        ):
            before = _rows_touched()
            step()
            after = _rows_touched()
            read = {t: after.get(t, 0) - before.get(t, 0) for t in after}
            assert all(n < BOUND for n in read.values()), (name, read)
    finally:
        driver.prepare_threshold = threshold
