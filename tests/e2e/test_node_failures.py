"""Agents that die: a restarted agent adopts its jobs; a dead node's work moves elsewhere, once."""

import signal

import pytest

from controlplane.jobs.models import JobEvent

from .conftest import job_processes, wait_until

pytestmark = pytest.mark.slow


def test_an_agent_killed_while_its_job_runs_adopts_it_on_restart_and_it_finishes_once(cluster):
    agent = cluster.start_agent("e2e-a")
    job_id = cluster.submit(["sh", "-c", "echo begin; sleep 6; echo end"])
    job = cluster.wait_for_state(job_id, "RUNNING")
    attempt_id = job["attempts"][0]["id"]
    wait_until(lambda: job_processes(attempt_id), 30, "the job's process")

    agent.kill(signal.SIGKILL)
    assert job_processes(attempt_id), "the job must outlive its agent"
    agent.start()

    job = cluster.wait_for_state(job_id, "SUCCEEDED", "FAILED", "PENDING")
    assert job["state"] == "SUCCEEDED"
    assert [(a["id"], a["state"]) for a in job["attempts"]] == [(attempt_id, "SUCCEEDED")]
    assert [e.kind for e in JobEvent.objects.filter(job_id=job_id, kind="running")] == ["running"]
    text = wait_until(
        lambda: (lambda t: t if "end" in t else None)(cluster.logs(job_id)["text"]),
        30,
        "the whole output",
    )
    # Ran once: one beginning, one end.
    assert text == "begin\nend\n"


def test_a_dead_nodes_restartable_job_runs_elsewhere_and_the_stale_attempt_is_stopped(
    cluster, tmp_path
):
    old = cluster.start_agent("e2e-old")
    # The first attempt outlasts the whole test (it is the one cut off); the next one is short.
    first_run = tmp_path / "first-run"
    script = (
        f"echo begin; if mkdir {first_run} 2>/dev/null; then sleep 300; else sleep 2; fi; echo end"
    )
    job_id = cluster.submit(["sh", "-c", script], restartable=True)
    job = cluster.wait_for_state(job_id, "RUNNING")
    stale_attempt = job["attempts"][0]["id"]
    assert job["attempts"][0]["node"] == "e2e-old"
    wait_until(lambda: job_processes(stale_attempt), 30, "the first attempt's process")
    cluster.start_agent("e2e-new")

    # Cut off for good: the agent is gone, its job (like a partitioned host's) keeps running.
    old.kill(signal.SIGKILL)

    from controlplane.cluster.models import Node

    wait_until(
        lambda: not Node.objects.get(name="e2e-old").ready, 60, "e2e-old to become not ready"
    )
    job = cluster.wait_for_job(
        job_id,
        lambda j: len(j["attempts"]) == 2 and j["attempts"][1]["state"] == "RUNNING",
        "a second attempt running on e2e-new",
    )
    first, second = job["attempts"]
    assert (first["state"], second["node"]) == ("LOST", "e2e-new")
    assert job_processes(stale_attempt), "the stale attempt still runs on the cut-off node"

    # The old agent returns: it reports the stale attempt, and is told to stop it.
    old.start()
    wait_until(lambda: not job_processes(stale_attempt), 60, "the stale attempt to be stopped")

    job = cluster.wait_for_state(job_id, "SUCCEEDED", "FAILED")
    assert job["state"] == "SUCCEEDED"
    assert [(a["node"], a["state"]) for a in job["attempts"]] == [
        ("e2e-old", "LOST"),
        ("e2e-new", "SUCCEEDED"),
    ]
    kinds = [e["kind"] for e in job["events"]]
    assert kinds.count("lost") == 1
    assert kinds.count("succeeded") == 1
    assert Node.objects.get(name="e2e-old").ready is True
