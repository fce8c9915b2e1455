"""LOG_FORMAT=json as an operator meets it: every line the control plane's processes write is a
JSON object, and a line about one job, attempt or node carries their ids (agents.logcontext).

The scheduling cycle and the heartbeat are driven in this process first, with a handler set up
as settings.LOGGING sets its own; then gunicorn and a Celery worker run as deployed, and every
line they write is parsed.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import requests
from django.conf import settings

from agents.logcontext import ContextFilter, JsonFormatter
from controlplane.jobs import actions
from controlplane.jobs.models import JobAttempt, JobState
from controlplane.scheduling.applier import apply_plan
from controlplane.scheduling.cycle import run_scheduling_cycle
from controlplane.scheduling.loader import load_snapshot
from scheduler import model as m
from tests import ports
from tests.celery_worker import running_worker
from tests.controlplane.agent.conftest import AgentClient, exited, readings, running
from tests.controlplane.test_deploy_checks import compose_web_command

REPO = settings.BASE_DIR
# This file's ports (no other suite uses 18450-18499).
PORTS = range(18450, 18500)


class JsonLines:
    """What the root logger's lines would be with LOG_FORMAT=json, from now on."""

    def __init__(self) -> None:
        self.stream = io.StringIO()
        self.handler = logging.StreamHandler(self.stream)
        self.handler.addFilter(ContextFilter())
        self.handler.setFormatter(JsonFormatter())

    def __call__(self) -> list[dict]:
        return [json.loads(line) for line in self.stream.getvalue().splitlines()]

    def clear(self) -> None:
        self.stream.seek(0)
        self.stream.truncate()


@pytest.fixture
def json_lines():
    lines = JsonLines()
    root = logging.getLogger()
    level = root.level
    root.addHandler(lines.handler)
    root.setLevel(logging.INFO)
    yield lines
    root.removeHandler(lines.handler)
    root.setLevel(level)


def parsed_lines(text: str, what: str) -> list[dict]:
    """Every line as JSON: a line that is not fails the test, naming it."""
    objects = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            objects.append(json.loads(line))
        except ValueError:
            pytest.fail(f"line {number} of {what} is not JSON: {line!r}\n{text[-3000:]}")
    return objects


# In this process -----------------------------------------------------------------------------


@pytest.mark.django_db
def test_a_cycle_that_admits_a_job_logs_a_line_with_the_jobs_ids_and_tenant(
    json_lines, make_node, make_job, vision, alice, django_capture_on_commit_callbacks
):
    make_node("n1", gpus=8)
    job = make_job(vision, alice, gpus=2)

    # The admissions are logged once committed (the test's transaction never commits).
    with django_capture_on_commit_callbacks(execute=True):
        summary = run_scheduling_cycle(trigger="test")

    attempt = JobAttempt.objects.get(job=job)
    lines = json_lines()
    (admitted,) = [line for line in lines if line["message"].startswith("admitted to")]
    assert admitted["message"] == "admitted to n1 (2 GPUs)"
    assert admitted["logger"] == "controlplane.scheduling.applier"
    assert (admitted["job_id"], admitted["attempt_id"]) == (job.pk, attempt.pk)
    assert (admitted["node"], admitted["tenant"]) == ("n1", "vision")
    # The cycle's own line comes after, naming the cycle and no job.
    (cycle,) = [line for line in lines if line["message"].startswith("scheduling cycle")]
    assert cycle["cycle_id"] == summary["cycle"]
    assert not {"job_id", "attempt_id", "node", "tenant"} & cycle.keys()


@pytest.mark.django_db
def test_a_preempted_attempt_is_logged_with_its_ids_and_tenant_once_committed(
    json_lines, make_node, make_job, nlp, vision, bob, alice, django_capture_on_commit_callbacks
):
    make_node("n1", gpus=1)
    borrower = make_job(nlp, bob)
    start = m.Start(job_id=borrower.pk, placements=(("n1", ("GPU-n1-0",)),), borrowed=True)
    apply_plan(m.Plan(starts=(start,)), load_snapshot())
    attempt = JobAttempt.objects.get(job=borrower)
    actions.mark_attempt_running(attempt)
    owner = make_job(vision, alice)
    preemption = m.Preemption(
        attempt_id=attempt.pk, job_id=borrower.pk, reason="vision wants it", for_job_id=owner.pk
    )
    json_lines.clear()

    with django_capture_on_commit_callbacks(execute=False) as on_commit:
        apply_plan(m.Plan(preemptions=(preemption,)), load_snapshot())
    assert json_lines() == []  # nothing said before the commit
    for callback in on_commit:
        callback()

    (line,) = [line for line in json_lines() if line["message"].startswith("preempted")]
    assert line["message"] == f"preempted (for job {owner.pk}): vision wants it"
    assert (line["job_id"], line["attempt_id"]) == (borrower.pk, attempt.pk)
    assert (line["node"], line["tenant"]) == ("n1", "nlp")


@pytest.mark.django_db
def test_a_heartbeat_reporting_an_exit_logs_a_line_naming_its_node_job_and_attempt(
    json_lines, client, pool, make_job, vision, alice, settings
):
    from django.utils import timezone

    from controlplane.cluster.agent_auth import issue_join_token
    from controlplane.cluster.models import Node

    settings.TELEMETRY_FLUSH_INTERVAL_S = 0  # readings written in the request, as in agent/
    _, join_token = issue_join_token(pool, expires_at=timezone.now() + dt.timedelta(hours=1))
    agent = AgentClient(client, join_token)
    token = agent.register("logs-node-1", gpus=2)
    node = Node.objects.get(name="logs-node-1")
    job = make_job(vision, alice)
    attempt = actions.admit_job(job, node=node, gpus=[node.gpus.get(index=0)], borrowed=False)
    json_lines.clear()

    agent.heartbeat(token, readings(node), [running(attempt)])
    agent.heartbeat(token, readings(node), [exited(attempt, 3)])

    job.refresh_from_db()
    assert job.state == JobState.FAILED
    lines = json_lines()
    assert lines, "the heartbeats logged nothing"
    assert {line.get("node") for line in lines} == {"logs-node-1"}, lines
    ids = (job.pk, attempt.pk, "vision")
    (started,) = [line for line in lines if line["message"] == "attempt running"]
    assert (started["job_id"], started["attempt_id"], started["tenant"]) == ids
    (ended,) = [line for line in lines if line["message"] == "attempt exited with code 3"]
    assert (ended["job_id"], ended["attempt_id"], ended["tenant"]) == ids


def test_an_unknown_log_format_stops_a_process_at_start_naming_the_option():
    result = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=REPO,
        env={**os.environ, "LOG_FORMAT": "xml"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0
    assert "LOG_FORMAT must be plain or json, not 'xml'" in result.stderr, result.stderr


# Real processes -----------------------------------------------------------------------------


@pytest.mark.slow
def test_gunicorn_as_deployed_writes_only_json_and_a_heartbeats_lines_name_the_attempt(
    transactional_db, tmp_path, pool, make_job, vision, alice
):
    from django.utils import timezone

    from controlplane.cluster.agent_auth import issue_join_token
    from controlplane.cluster.models import Node
    from tests.e2e.conftest import database_url_of_test_db

    port = ports.free_port(PORTS)
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "DATABASE_URL": database_url_of_test_db(),
        "REDIS_URL": settings.REDIS_URL,
        "DB_CONN_MAX_AGE": "0",
        "LOG_FORMAT": "json",
        # The access log too, which compose leaves to GUNICORN_CMD_ARGS; a control socket of
        # its own, not the one every gunicorn of the machine would share.
        "GUNICORN_CMD_ARGS": "--access-logfile=- --no-control-socket",
    }
    log_path = tmp_path / "gunicorn.log"
    with open(log_path, "wb") as out:
        web = subprocess.Popen(
            compose_web_command(port),
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert web.poll() is None, f"gunicorn exited:\n{log_path.read_text()[-3000:]}"
            try:
                requests.get(f"{url}/login/", timeout=2)
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.2)
        assert requests.get(f"{url}/no-such-page/", timeout=10).status_code == 404

        _, join_token = issue_join_token(pool, expires_at=timezone.now() + dt.timedelta(hours=1))
        agent = requests.Session()
        body = {
            "name": "logs-node-2",
            "cpus": 8,
            "memory_mib": 65536,
            "labels": {},
            "agent_version": "0.1.0",
            "runtime": "process",
            "gpus": [
                {
                    "index": 0,
                    "uuid": "GPU-logs-node-2-0",
                    "model": "H100-SXM-80GB",
                    "memory_mib": 81559,
                    "power_min_w": 200.0,
                    "power_max_w": 700.0,
                    "power_default_w": 700.0,
                }
            ],
        }
        registered = agent.post(
            f"{url}/api/agent/v1/register",
            json=body,
            headers={"Authorization": f"Bearer {join_token}"},
            timeout=10,
        )
        assert registered.status_code == 201, registered.text
        node_token = registered.json()["node_token"]
        node = Node.objects.get(name="logs-node-2")
        job = make_job(vision, alice)
        attempt = actions.admit_job(job, node=node, gpus=list(node.gpus.all()), borrowed=False)
        for seq, report in enumerate((running(attempt), exited(attempt, 0)), 1):
            answer = agent.post(
                f"{url}/api/agent/v1/heartbeat",
                json={
                    "seq": seq,
                    "sent_at": time.time(),
                    "gpus": readings(node),
                    "attempts": [report],
                },
                headers={"Authorization": f"Bearer {node_token}"},
                timeout=10,
            )
            assert answer.status_code == 200, answer.text
        assert JobAttempt.objects.get(pk=attempt.pk).exit_code == 0
    finally:
        os.killpg(web.pid, signal.SIGTERM)
        try:
            web.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(web.pid, signal.SIGKILL)
            web.wait()

    lines = parsed_lines(log_path.read_text(), "gunicorn's output")
    loggers = {line["logger"] for line in lines}
    assert {"gunicorn.error", "gunicorn.access", "django.request"} <= loggers, loggers
    assert all(line["time"].endswith("Z") and line["level"] for line in lines)
    (not_found,) = [line for line in lines if line["logger"] == "django.request"]
    assert (not_found["message"], not_found["status_code"]) == ("Not Found: /no-such-page/", 404)
    (ended,) = [line for line in lines if line["message"] == "attempt exited with code 0"]
    assert ended["node"] == "logs-node-2"
    assert (ended["job_id"], ended["attempt_id"], ended["tenant"]) == (job.pk, attempt.pk, "vision")


@pytest.mark.slow
def test_a_celery_worker_writes_only_json_and_its_cycle_names_the_job_it_admits(
    transactional_db, django_db_blocker, tmp_path, make_node, make_job, vision, alice
):
    make_node("n1", gpus=8)
    with running_worker(django_db_blocker, tmp_path, "json", env={"LOG_FORMAT": "json"}) as worker:
        job = make_job(vision, alice)  # asks the worker for a cycle
        deadline = time.monotonic() + 60
        while job.state != JobState.ADMITTED:
            assert time.monotonic() < deadline, worker.log_path.read_text()[-3000:]
            time.sleep(0.2)
            job.refresh_from_db()
        # Read while it runs: Celery prints its shutdown notice, it does not log it.
        deadline = time.monotonic() + 30
        while b"scheduling cycle" not in worker.log_path.read_bytes():
            assert time.monotonic() < deadline, worker.log_path.read_text()[-3000:]
            time.sleep(0.2)
        output = worker.log_path.read_text()

    lines = parsed_lines(output, "the worker's output")
    assert any(line["message"].endswith(" ready.") for line in lines)
    (admitted,) = [line for line in lines if line["message"].startswith("admitted to")]
    attempt = job.attempts.get()
    assert (admitted["job_id"], admitted["attempt_id"]) == (job.pk, attempt.pk)
    assert (admitted["tenant"], admitted["node"]) == ("vision", "n1")
