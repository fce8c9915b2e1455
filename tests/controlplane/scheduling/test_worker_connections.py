"""The worker's database connection from one cycle to the next, as production runs it.

The worker here keeps its connections as production's does (DB_CONN_MAX_AGE above 0; the other
suites' workers close theirs after each task, which would hide what this checks).
"""

from pathlib import Path

import pytest
from django.conf import settings

from controlplane.jobs.models import JobState
from controlplane.scheduling.models import SchedulingCycle
from tests.celery_worker import running_worker
from tests.controlplane.scheduling.conftest import purge_queue, read, submit, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture(scope="module")
def lasting_worker(django_db_setup, django_db_blocker, tmp_path_factory):
    log_dir = Path(tmp_path_factory.mktemp("celery-lasting"))
    env = {"SCHEDULER_DEBOUNCE_S": str(settings.SCHEDULER_DEBOUNCE_S), "DB_CONN_MAX_AGE": "60"}
    with running_worker(django_db_blocker, log_dir, "lasting", env=env) as worker:
        yield worker
    purge_queue(None)


def _worker_backends() -> set[int]:
    """The PostgreSQL backends connected to this test database, other than the test's own."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        )
        return {pid for (pid,) in cursor.fetchall()}


def _admitted_by_a_cycle(client, token, job_id, worker) -> None:
    admitted = wait_until(
        lambda: read(client, token, job_id)["state"] == JobState.ADMITTED, timeout_s=60
    )
    assert admitted, worker.log_path.read_text()[-3000:]


def _backends_after_a_first_cycle(redis_conn, client, token, make_node, worker) -> set[int]:
    """A node, one job admitted by the worker, and the backends the worker then holds."""
    purge_queue(redis_conn)
    make_node("n1", gpus=8)
    _admitted_by_a_cycle(client, token, submit(client, token, gpus=1), worker)
    backends = _worker_backends()
    assert backends, "the worker holds no connection between cycles"
    return backends


def test_the_worker_keeps_its_database_connection_from_one_cycle_to_the_next(
    lasting_worker, redis_conn, client, alice_token, make_node
):
    # Celery's Django fixup would close it after every task: a new PostgreSQL backend per
    # cycle, and every statement of the cycle planned again.
    first = _backends_after_a_first_cycle(
        redis_conn, client, alice_token, make_node, lasting_worker
    )
    _admitted_by_a_cycle(client, alice_token, submit(client, alice_token, gpus=1), lasting_worker)
    assert _worker_backends() == first


def test_a_worker_connection_killed_between_cycles_costs_no_cycle(
    lasting_worker, redis_conn, client, alice_token, make_node
):
    from django.db import connection

    killed = _backends_after_a_first_cycle(
        redis_conn, client, alice_token, make_node, lasting_worker
    )
    with connection.cursor() as cursor:
        for pid in killed:
            # What a PostgreSQL restart does to every connection it had.
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
    assert wait_until(lambda: not (_worker_backends() & killed), timeout_s=10)
    log_before = lasting_worker.log_path.read_text()
    job_id = submit(client, alice_token, gpus=1)
    # The very cycle this submit asks for admits it: the worker saw the dead connection before
    # the task used it, and connected again.
    _admitted_by_a_cycle(client, alice_token, job_id, lasting_worker)
    cycle = SchedulingCycle.objects.order_by("-pk").first()
    assert cycle is not None and cycle.trigger == "submit"
    new_lines = lasting_worker.log_path.read_text()[len(log_before) :]
    assert "OperationalError" not in new_lines and "terminat" not in new_lines, new_lines
