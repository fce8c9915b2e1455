"""The same life of a job through the docker runtime, against a real engine (Podman's Docker API).

Where no engine can be had (scripts/podman-setup.sh fails), these tests skip and say why.
"""

import pytest

from .conftest import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.container]


@pytest.fixture
def docker_node(cluster, engine, engine_url):
    """A node whose agent runs attempts as containers; its containers are removed afterwards."""
    from agents.runtime.base import NODE_LABEL

    name = f"e2e-docker-{cluster.marker[:8]}"
    cluster.start_agent(name, runtime="docker", extra_env={"GPUCP_DOCKER_URL": engine_url})
    yield name
    for container in engine.containers.list(all=True, filters={"label": f"{NODE_LABEL}={name}"}):
        container.remove(force=True)


def containers_of(engine, node: str, attempt_id: int, *, running_only: bool = False) -> list:
    # The node's label too: attempt ids repeat, and the other xdist worker's tests share the
    # engine.
    from agents.runtime.base import ATTEMPT_LABEL, NODE_LABEL

    labels = [f"{NODE_LABEL}={node}", f"{ATTEMPT_LABEL}={attempt_id}"]
    return engine.containers.list(all=not running_only, filters={"label": labels})


def test_a_job_runs_as_a_container_and_succeeds_with_its_output_in_the_logs(cluster, docker_node):
    job_id = cluster.submit(["sh", "-c", "echo hello from a container; echo job $GPUCP_JOB_ID"])

    job = cluster.wait_for_state(job_id, "SUCCEEDED", "FAILED", timeout_s=180)
    assert job["state"] == "SUCCEEDED"
    assert job["attempts"][0]["node"] == docker_node
    text = wait_until(
        lambda: (lambda t: t if "job" in t else None)(cluster.logs(job_id)["text"]),
        60,
        "the container's output in the logs API",
    )
    assert text == f"hello from a container\njob {job_id}\n"


def test_a_failing_container_ends_failed_with_its_exit_code(cluster, docker_node):
    job_id = cluster.submit(["sh", "-c", "exit 7"], restartable=False)

    job = cluster.wait_for_state(job_id, "SUCCEEDED", "FAILED", timeout_s=180)
    assert job["state"] == "FAILED"
    assert job["exit_code"] == 7


def test_a_missing_image_fails_to_start_with_the_reason(cluster, docker_node):
    job_id = cluster.submit(["true"], image="localhost/no-such-image:1")

    job = cluster.wait_for_state(job_id, "SUCCEEDED", "FAILED", timeout_s=180)
    assert job["state"] == "FAILED"
    assert job["exit_code"] is None
    assert "no-such-image" in job["state_reason"]


def test_cancel_kills_the_container(cluster, docker_node, engine):
    job_id = cluster.submit(["sh", "-c", "echo started; exec sleep 300"])
    job = cluster.wait_for_state(job_id, "RUNNING", timeout_s=180)
    attempt_id = job["attempts"][0]["id"]
    wait_until(
        lambda: containers_of(engine, docker_node, attempt_id, running_only=True),
        60,
        "a running container",
    )

    cluster.cancel(job_id)

    job = cluster.wait_for_job(
        job_id, lambda j: j["attempts"][0]["state"] == "STOPPED", "its attempt stopped", 120
    )
    assert job["state"] == "CANCELLED"
    assert not containers_of(engine, docker_node, attempt_id, running_only=True)
