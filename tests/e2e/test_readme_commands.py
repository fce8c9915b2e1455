"""Every command of README.md that talks to the control plane works as written.

The README's ```sh blocks that call the API (curl) run in bash as they are, with only what a
reader fills in substituted: the server's address, the token the text tells them to make, and
`docker-compose exec -T web python` (the image's Python) by this one. Blocks for `make run` go
to a live server in the embedded mode; blocks for production go to gunicorn in production mode
(docker-compose.yml's command), reached as through the TLS proxy. Each curl must get a 2xx, and
what the README says the commands do must be so. A README change that breaks an example, or an
API change that breaks the README, fails here.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from tests.controlplane import test_deploy_checks

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
EMBEDDED_URL = "http://127.0.0.1:8000"  # `make run`
PUBLIC_URL = "https://cp.example.org"  # production, through its TLS proxy
IMAGE_PYTHON = "docker-compose exec -T web python"

production_server = test_deploy_checks.production_server

# Each curl as the reader's shell runs it, but failing on an HTTP error (and saying why), and,
# for production, with the headers the TLS proxy adds on its way to gunicorn.
PREAMBLE = """set -euo pipefail
curl() { command curl --silent --show-error --fail-with-body --max-time 60 "${PROXY[@]}" "$@"; echo; }
"""


def api_blocks() -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", README, re.S)
    return [b for b in blocks if re.search(r"^\s*curl ", b, re.M)]


def blocks_for(url: str) -> list[str]:
    return [b for b in api_blocks() if url in b]


def test_every_api_example_of_the_readme_is_run_by_this_file():
    blocks = api_blocks()
    assert len(blocks) >= 2
    for block in blocks:
        # Each goes to one server this file knows how to stand in for.
        assert (EMBEDDED_URL in block) != (PUBLIC_URL in block), block


def run_block(block: str, *, url: str, env: dict, proxy: list[str], fill: dict[str, str]):
    script = block.replace(EMBEDDED_URL, url).replace(PUBLIC_URL, url)
    script = script.replace(IMAGE_PYTHON, shlex.quote(sys.executable))
    for placeholder, value in fill.items():
        script = script.replace(placeholder, value)
    assert "..." not in script, f"a placeholder this test cannot fill:\n{script}"
    proxy_array = "PROXY=(" + " ".join(shlex.quote(p) for p in proxy) + ")\n"
    result = subprocess.run(
        ["bash", "-c", PREAMBLE + proxy_array + script],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, f"{block}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


@pytest.fixture
def embedded_server(transactional_db):
    """`make run`'s server: the embedded mode's settings, serving HTTP on a free port."""
    from tests.frontend.live_system import start_server

    server = start_server()
    yield f"http://127.0.0.1:{server.port}"
    server.terminate()


def test_the_first_job_examples_submit_one_job_however_often_they_run(
    embedded_server, client, vision, make_user, make_node
):
    from controlplane.jobs.models import Job
    from controlplane.tenancy.models import Membership

    make_node("sim-node-1", gpus=4)  # `make run` starts simulated nodes
    researcher = make_user("vision-researcher")
    Membership.objects.create(user=researcher, tenant=vision, role="member")
    # "make an API token (web UI: *API tokens*)", as the reader would.
    client.force_login(researcher)
    made = client.post("/tokens/", {"name": "laptop"})
    assert made.status_code == 200, made.content[:2000]
    token = made.context["raw_token"]
    (block,) = blocks_for(EMBEDDED_URL)

    answers = []
    for _ in range(2):  # the Idempotency-Key makes a retry answer the first job
        (job,) = run_block(
            block, url=embedded_server, env=dict(os.environ), proxy=[], fill={"gcp_...": token}
        )
        answers.append(job)
    # The first answer is the job as created; the replay answers the same job
    # as it is now, which the in-process scheduler may already have admitted.
    assert answers[0]["name"] == "hello" and answers[0]["state"] == "PENDING"
    assert answers[1]["id"] == answers[0]["id"]
    assert Job.objects.filter(submitted_by=researcher).count() == 1

    # The endpoints the text after it names answer that researcher.
    paths = re.findall(r"`(?:GET )?(/api/[^`\s]+)`", README)
    assert "/api/v1/jobs/<id>/logs/" in paths
    headers = {"Authorization": f"Bearer {token}"}
    # An array's paths need an array of the researcher's: a small sweep, as the README has it.
    sweep = requests.post(
        f"{embedded_server}/api/v1/arrays/",
        json={
            "name": "sweep",
            "image": "localhost/busybox:latest",
            "command": ["true"],
            "gpus": 1,
            "array": "2",
        },
        headers=headers,
        timeout=60,
    )
    assert sweep.status_code == 201, sweep.text[:500]
    # A member's output (`?rank=1`) needs a job over two nodes, placed as the README has it:
    # more GPUs than one node has (two more nodes: the first one's GPUs are taken).
    make_node("sim-node-2", gpus=4)
    make_node("sim-node-3", gpus=4)
    gang = requests.post(
        f"{embedded_server}/api/v1/jobs/",
        json={"name": "wide", "image": "localhost/busybox:latest", "command": ["true"], "gpus": 8},
        headers=headers,
        timeout=60,
    )
    assert gang.status_code == 201, gang.text[:500]
    # The scheduling loop places it: run here, since this server has no loop of its own (the
    # session's production stack, on the same database, may run one first, or hold its lock).
    from controlplane.scheduling.cycle import run_scheduling_cycle

    placed = Job.objects.get(pk=gang.json()["id"])
    deadline = time.monotonic() + 60
    while placed.state == "PENDING" and time.monotonic() < deadline:
        run_scheduling_cycle()
        placed.refresh_from_db()
        time.sleep(0.1)
    assert placed.state != "PENDING", placed.pending_reason
    for path in paths:
        of = job["id"]
        if "/arrays/<id>" in path:
            of = sweep.json()["id"]
        elif "rank=" in path:
            of = placed.id
        response = requests.get(
            embedded_server + path.replace("<id>", str(of)), headers=headers, timeout=60
        )
        assert response.status_code == 200, (path, response.text[:500])


def test_the_production_examples_make_a_pool_and_a_join_token_through_the_tls_proxy(
    production_server, make_user
):
    from controlplane.cluster.models import JoinToken, Pool

    make_user("admin", staff=True)  # `manage.py createsuperuser`, the step before
    (block,) = blocks_for(PUBLIC_URL)

    pool, join_token = run_block(
        block,
        url=production_server.url,
        env=production_server.env,
        proxy=["-H", "X-Forwarded-Proto: https", "-H", f"Host: {PUBLIC_URL.split('//')[1]}"],
        fill={},
    )
    assert pool["name"] == "default" and pool["power_budget_w"] == 20000
    assert join_token["token"].startswith("gcpj_") and join_token["max_uses"] == 100
    stored = JoinToken.objects.get(pk=join_token["id"])
    assert stored.pool == Pool.objects.get(name="default")
    assert stored.is_usable


def test_the_whatif_command_of_the_readme_runs_as_written(
    transactional_db, vision, alice, make_node, make_job
):
    from controlplane.jobs import actions

    # History to replay: a job of vision that ran and finished this week.
    node = make_node("sim-node-1", gpus=8)
    job = make_job(vision, alice, gpus=2)
    attempt = actions.admit_job(job, node=node, gpus=list(node.gpus.all()[:2]), borrowed=False)
    actions.mark_attempt_running(attempt)
    actions.finish_attempt(attempt, exit_code=0)
    (command,) = re.findall(r"`\.venv/bin/python (manage\.py whatif [^`]+)`", README)
    env = {**os.environ, "DATABASE_URL": _test_database_url()}
    result = subprocess.run(
        [sys.executable, *shlex.split(command)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _test_database_url() -> str:
    from tests.e2e.conftest import database_url_of_test_db

    return database_url_of_test_db()
