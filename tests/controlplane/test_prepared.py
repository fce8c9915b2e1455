"""Prepared queries (controlplane.prepared) return what their querysets return, compiled once."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from controlplane.jobs.models import Job
from controlplane.prepared import Prepared

pytestmark = pytest.mark.django_db

JOBS = Prepared(
    lambda ids, tenant: (
        Job.objects.filter(pk__in=ids, tenant__slug=tenant)
        .order_by("pk")
        .values("pk", "name", "submitted_at", "mounts", "command", "tenant__slug")
    )
)


def _expected(ids, tenant):
    return list(
        Job.objects.filter(pk__in=ids, tenant__slug=tenant)
        .order_by("pk")
        .values("pk", "name", "submitted_at", "mounts", "command", "tenant__slug")
    )


def test_every_shape_reads_what_its_queryset_reads_timestamps_and_json_included(
    make_job, vision, nlp, alice, bob
):
    mine = [
        make_job(vision, alice, name=f"v{i}", mounts=[{"name": "d", "path": f"/d{i}"}])
        for i in range(4)
    ]
    theirs = make_job(nlp, bob, name="other")
    for ids in ([mine[0].pk], [mine[2].pk, mine[0].pk], [m.pk for m in mine] + [theirs.pk]):
        for tenant in ("vision", "nlp"):
            got = JOBS.values(ids, tenant)
            assert got == _expected(ids, tenant)
    rows = JOBS.values([mine[1].pk], "vision")
    assert rows[0]["mounts"] == [{"name": "d", "path": "/d1"}]
    assert rows[0]["submitted_at"] == mine[1].submitted_at
    # The same shape again runs one statement and compiles nothing new.
    with CaptureQueriesContext(connection) as queries:
        JOBS.values([mine[3].pk], "vision")
    assert len(queries) == 1
    assert JOBS.rows([mine[3].pk], "vision")[0][:2] == (mine[3].pk, "v3")


def test_an_empty_list_reads_nothing_and_runs_nothing():
    with CaptureQueriesContext(connection) as queries:
        assert JOBS.values([], "vision") == [] and JOBS.rows([], "vision") == []
    assert len(queries) == 0


def test_a_builder_that_changes_its_argument_is_refused():
    """startswith sends 'x%', not 'x': a stand-in it cannot find would be read stale."""
    prefixed = Prepared(lambda prefix: Job.objects.filter(name__startswith=prefix).values("pk"))
    with pytest.raises(ValueError, match="unchanged"):
        prefixed.values("train")
    by_flag = Prepared(lambda flag: Job.objects.filter(preemptible=flag).values("pk"))
    with pytest.raises(TypeError, match="integers, text"):
        by_flag.values(True)


@pytest.mark.django_db(transaction=True)
def test_a_query_compiled_on_one_thread_runs_on_anothers_connection(make_job, vision, alice):
    """Compiled once for the whole process: another web thread runs it on its own connection
    and gets the same rows, converted the same way."""
    import threading

    job = make_job(vision, alice, name="threaded")
    expected = _expected([job.pk], "vision")
    assert JOBS.values([job.pk], "vision") == expected
    seen = []

    def other():
        try:
            seen.append(JOBS.values([job.pk], "vision"))
        finally:
            connection.close()

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == [expected]


def test_a_long_list_reads_what_its_queryset_reads_without_a_form_kept(make_job, vision, alice):
    from controlplane.prepared import MAX_CACHED_LENGTH

    job = make_job(vision, alice, name="long")
    ids = [job.pk, *range(10**9, 10**9 + MAX_CACHED_LENGTH)]
    forms = len(JOBS._cache)
    assert JOBS.values(ids, "vision") == _expected(ids, "vision") != []
    assert len(JOBS._cache) == forms
