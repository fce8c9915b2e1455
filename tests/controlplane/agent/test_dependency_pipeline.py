"""Dependent jobs (`depends_on`) run end to end: submitted through the API, started by real
scheduling cycles, ended by a node's heartbeats (the bulk report path), and released or
cancelled in the transaction that ended what they waited for."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from controlplane.jobs.models import Job, JobAttempt, JobState
from controlplane.scheduling.cycle import run_scheduling_cycle

from .conftest import exited, readings, running

pytestmark = pytest.mark.django_db


@pytest.fixture
def api(alice):
    client = APIClient()
    client.force_authenticate(alice)
    return client


@pytest.fixture
def node(agent, node01):
    node, token = node01
    agent.heartbeat(token, readings(node))
    return node, token


def submit(api, name: str, *after: tuple[int, str]) -> int:
    body = {
        "name": name,
        "image": "registry.local/team/train:1",
        "command": ["python", "train.py"],
        "gpus": 1,
        "depends_on": [{"job": job, "condition": condition} for job, condition in after],
    }
    response = api.post("/api/v1/jobs/", body, format="json")
    assert response.status_code == 201, response.content
    return response.json()["id"]


def shown(api, job_id: int) -> dict:
    response = api.get(f"/api/v1/jobs/{job_id}/")
    assert response.status_code == 200
    return response.json()


def run_to_end(agent, node, job_id: int, exit_code: int) -> None:
    """The node starts the job's attempt and reports its exit, as an agent would."""
    node_row, token = node
    attempt = JobAttempt.objects.get(job_id=job_id, state__in=("ADMITTED", "RUNNING"))
    agent.heartbeat(token, readings(node_row), [running(attempt)])
    agent.heartbeat(token, readings(node_row), [exited(attempt, exit_code)])


def states(*job_ids: int) -> list[str]:
    found = dict(Job.objects.filter(pk__in=job_ids).values_list("pk", "state"))
    return [found[pk] for pk in job_ids]


def test_a_pipeline_of_three_runs_in_order(api, agent, node):
    a = submit(api, "prepare")
    b = submit(api, "train", (a, "succeeded"))
    c = submit(api, "evaluate", (b, "succeeded"))
    waiting = shown(api, b)
    assert waiting["hold"] == "dependency"
    assert waiting["pending_reason_code"] == "dependency"
    assert waiting["pending_reason"] == f"waiting for job {a} to succeed"
    assert waiting["depends_on"] == [{"job": a, "condition": "succeeded", "state": "waiting"}]

    run_scheduling_cycle()
    # Only the first step starts, though the node has room for all three.
    assert states(a, b, c) == [JobState.ADMITTED, JobState.PENDING, JobState.PENDING]
    run_to_end(agent, node, a, 0)
    assert shown(api, b)["hold"] == ""
    assert shown(api, b)["depends_on"][0]["state"] == "met"
    assert shown(api, c)["hold"] == "dependency"

    run_scheduling_cycle()
    assert states(a, b, c) == [JobState.SUCCEEDED, JobState.ADMITTED, JobState.PENDING]
    run_to_end(agent, node, b, 0)
    run_scheduling_cycle()
    assert states(c) == [JobState.ADMITTED]
    run_to_end(agent, node, c, 0)
    assert states(a, b, c) == [JobState.SUCCEEDED] * 3
    started = [Job.objects.get(pk=pk).started_at for pk in (a, b, c)]
    assert started == sorted(started)


def test_a_failed_first_step_cancels_what_needed_it_and_runs_what_was_for_failure(api, agent, node):
    a = submit(api, "prepare")
    train = submit(api, "train", (a, "succeeded"))
    evaluate = submit(api, "evaluate", (train, "succeeded"))
    report = submit(api, "report-failure", (a, "failed"))
    cleanup = submit(api, "cleanup", (a, "finished"))
    run_scheduling_cycle()
    run_to_end(agent, node, a, 3)

    assert states(a, train, evaluate) == [JobState.FAILED, JobState.CANCELLED, JobState.CANCELLED]
    cancelled = shown(api, train)
    assert cancelled["state_reason"] == (
        f"Dependency never satisfied: job {a} failed; it was to succeed"
    )
    assert cancelled["depends_on"][0]["state"] == "never"
    assert cancelled["hold"] == ""
    assert cancelled["events"][-1]["kind"] == "cancelled"
    # Cancelling train ended it too: what waited for train learns it in the same transaction.
    assert shown(api, evaluate)["state_reason"] == (
        f"Dependency never satisfied: job {train} was cancelled; it was to succeed"
    )
    run_scheduling_cycle()
    assert states(report, cleanup) == [JobState.ADMITTED, JobState.ADMITTED]


def test_a_success_cancels_the_failure_handler_and_runs_the_cleanup(api, agent, node):
    a = submit(api, "prepare")
    report = submit(api, "report-failure", (a, "failed"))
    cleanup = submit(api, "cleanup", (a, "finished"))
    run_scheduling_cycle()
    run_to_end(agent, node, a, 0)
    assert states(report) == [JobState.CANCELLED]
    assert shown(api, report)["state_reason"].endswith(f"job {a} succeeded; it was to fail")
    run_scheduling_cycle()
    assert states(cleanup) == [JobState.ADMITTED]


def test_a_job_waiting_for_two_names_both_and_starts_only_after_the_second(api, agent, node):
    a = submit(api, "one")
    b = submit(api, "two")
    both = submit(api, "both", (a, "succeeded"), (b, "finished"))
    assert shown(api, both)["pending_reason"] == (
        f"waiting for job {a} to succeed and job {b} to finish"
    )
    run_scheduling_cycle()
    run_to_end(agent, node, a, 0)
    assert shown(api, both)["pending_reason"] == f"waiting for job {b} to finish"
    run_scheduling_cycle()
    assert states(both) == [JobState.PENDING]
    run_to_end(agent, node, b, 1)
    run_scheduling_cycle()
    assert states(both) == [JobState.ADMITTED]
