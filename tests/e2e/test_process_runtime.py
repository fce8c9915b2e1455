"""A job's whole life through the real processes: REST API, scheduler, agent, process runtime."""

import time

import pytest

from .conftest import job_processes, wait_until

pytestmark = pytest.mark.slow


def test_a_job_submitted_through_the_api_runs_and_succeeds_with_its_output_in_the_logs(cluster):
    cluster.start_agent("e2e-a")

    job_id = cluster.submit(
        ["sh", "-c", "echo hello from $GPUCP_JOB_ID; echo on GPU $CUDA_VISIBLE_DEVICES"]
    )

    job = cluster.wait_for_state(job_id, "SUCCEEDED", "FAILED")
    assert job["state"] == "SUCCEEDED"
    assert job["exit_code"] == 0
    (attempt,) = job["attempts"]
    assert attempt["node"] == "e2e-a"
    assert attempt["state"] == "SUCCEEDED"
    logs = wait_until(
        lambda: (lambda out: out if "on GPU" in out["text"] else None)(cluster.logs(job_id)),
        30,
        "the job's output in the logs API",
    )
    assert f"hello from {job_id}\n" in logs["text"]
    assert "on GPU 0\n" in logs["text"] or "on GPU GPU-" in logs["text"]
    assert cluster.logs(job_id, tail=1)["text"].startswith("on GPU")


def test_a_failing_command_ends_failed_with_its_exit_code(cluster):
    cluster.start_agent("e2e-a")

    job_id = cluster.submit(["sh", "-c", "echo about to fail; exit 3"], restartable=False)

    job = cluster.wait_for_state(job_id, "SUCCEEDED", "FAILED")
    assert job["state"] == "FAILED"
    assert job["exit_code"] == 3
    assert "code 3" in job["state_reason"]
    assert [a["state"] for a in job["attempts"]] == ["FAILED"]


def test_a_command_that_cannot_start_fails_with_the_reason(cluster):
    cluster.start_agent("e2e-a")

    job_id = cluster.submit(["/nonexistent/program", "--flag"])

    job = cluster.wait_for_state(job_id, "SUCCEEDED", "FAILED")
    assert job["state"] == "FAILED"
    # Either the runtime refused to start it, or the shell-less exec failed with 126/127.
    assert job["exit_code"] in (None, 126, 127)


def test_cancel_kills_the_running_job(cluster):
    cluster.start_agent("e2e-a")
    job_id = cluster.submit(["sh", "-c", "echo started; exec sleep 300"])
    job = cluster.wait_for_state(job_id, "RUNNING")
    attempt_id = job["attempts"][0]["id"]
    wait_until(lambda: job_processes(attempt_id), 30, "the job's process")

    started = time.monotonic()
    assert cluster.cancel(job_id)["state"] == "CANCELLED"

    job = cluster.wait_for_job(
        job_id, lambda j: j["attempts"][0]["state"] == "STOPPED", "its attempt stopped"
    )
    assert job["state"] == "CANCELLED"
    wait_until(lambda: not job_processes(attempt_id), 30, "the job's process to be gone")
    # Told through the watch, not found at a periodic heartbeat minutes later.
    assert time.monotonic() - started < 60
    assert job["attempts"][0]["gpus"][0]["active"] is False


def test_a_submit_retried_with_the_same_idempotency_key_runs_one_job(cluster):
    """A client that lost the answer to its POST sends it again: one job, run once."""
    import requests

    cluster.start_agent("e2e-a")
    body = {"image": "localhost/busybox:latest", "command": ["sh", "-c", "echo once"], "gpus": 1}
    headers = {**cluster._headers(), "Idempotency-Key": "e2e-retry-1"}
    answers = [
        requests.post(f"{cluster.api}/jobs/", json=body, headers=headers, timeout=30)
        for _ in range(3)
    ]

    assert [a.status_code for a in answers] == [201, 201, 201]
    assert len({a.json()["id"] for a in answers}) == 1
    assert [a.headers.get("Idempotent-Replayed") for a in answers] == [None, "true", "true"]
    job = cluster.wait_for_state(answers[0].json()["id"], "SUCCEEDED", "FAILED")
    assert len(job["attempts"]) == 1
    mine = requests.get(
        f"{cluster.api}/jobs/", params={"limit": 100}, headers=cluster._headers(), timeout=30
    ).json()["results"]
    assert len(mine) == 1
