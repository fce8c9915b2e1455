"""A submit outside any transaction writes its job and first event in one statement, without a
transaction around it: both rows or neither, and the cycle is asked for once they are in.
On real PostgreSQL connections (no test transaction around the test)."""

from __future__ import annotations

import pytest
from django.db import connection, transaction

from controlplane import wakeups
from controlplane.jobs import actions
from controlplane.jobs.dependencies import DependencyCondition, DependencySpec
from controlplane.jobs.models import Job, JobEvent, JobState

pytestmark = pytest.mark.django_db(transaction=True)

FIELDS = {"name": "one", "image": "registry.example.org/train:1", "command": ["true"], "gpus": 1}


@pytest.fixture
def cycle_requests(monkeypatch):
    """The reasons of the cycle requests made, each with whether the job rows were visible to
    another connection at that moment (the request must come after they are in)."""
    seen: list[tuple[str, int]] = []

    def request_cycle(reason, queue=None):
        # A fresh connection of its own: what the scheduler's worker would read now.
        from django.db import connections

        other = connections.create_connection("default")
        try:
            with other.cursor() as cursor:
                cursor.execute("SELECT count(*) FROM jobs_job")
                seen.append((reason, cursor.fetchone()[0]))
        finally:
            other.close()

    monkeypatch.setattr(wakeups, "request_cycle", request_cycle)
    return seen


def test_a_submit_outside_a_transaction_is_its_rows_and_then_a_cycle_request(
    vision, alice, cycle_requests
):
    assert connection.get_autocommit() and not connection.in_atomic_block
    submitted = actions.submit_one(tenant=vision, user=alice, **FIELDS)
    assert not connection.in_atomic_block  # none was left open
    job = Job.objects.get(pk=submitted.job.pk)
    assert job.state == JobState.PENDING and job.submitted_by_id == alice.pk
    event = JobEvent.objects.get(job=job)
    assert (event.kind, event.to_state, event.actor_id) == ("submitted", JobState.PENDING, alice.pk)
    assert submitted.event.pk == event.pk and submitted.event.job is submitted.job
    assert cycle_requests == [("submit", 1)]


def test_a_submit_whose_event_cannot_be_written_leaves_no_job(
    vision, alice, cycle_requests, monkeypatch
):
    # The event's kind is longer than its column: PostgreSQL refuses the statement, and with it
    # the job that the same statement inserted.
    real = actions.JobEvent

    def too_long(**fields):
        return real(**{**fields, "kind": "k" * 200})

    monkeypatch.setattr(actions, "JobEvent", too_long)
    with pytest.raises(Exception, match="value too long"):
        actions.submit_one(tenant=vision, user=alice, **FIELDS)
    assert not Job.objects.exists() and not JobEvent.objects.exists()
    assert cycle_requests == []


def test_a_submit_with_dependencies_or_inside_a_transaction_is_written_with_it(
    vision, alice, cycle_requests
):
    first = actions.submit_one(tenant=vision, user=alice, **FIELDS).job
    waiting = actions.submit_one(
        tenant=vision,
        user=alice,
        depends_on=[DependencySpec(DependencyCondition.SUCCEEDED, first.pk)],
        **FIELDS,
    ).job
    assert Job.objects.get(pk=waiting.pk).hold == "dependency"
    assert cycle_requests == [("submit", 1), ("submit", 2)]

    # Inside the caller's transaction the submit is part of it: rolled back with it.
    with pytest.raises(RuntimeError), transaction.atomic():
        actions.submit_one(tenant=vision, user=alice, **FIELDS)
        raise RuntimeError("the caller changes its mind")
    assert Job.objects.count() == 2 and JobEvent.objects.count() == 2
    assert cycle_requests == [("submit", 1), ("submit", 2)]  # no request for a rollback
