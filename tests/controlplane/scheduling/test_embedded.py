"""The embedded mode: the loop thread in-process, and `manage.py embedded` as `make run` runs it."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from django.conf import settings
from django.db import connection

from controlplane.jobs.models import Job, JobState
from controlplane.scheduling.embedded import SchedulingLoop
from controlplane.scheduling.models import SchedulingCycle
from controlplane.wakeups import embedded_wakeup_event
from tests.controlplane.scheduling.conftest import wait_until

EMBEDDED_PORT = 18510


@pytest.mark.django_db(transaction=True)
def test_a_submit_wakes_the_embedded_loop_long_before_its_next_tick(
    settings, make_node, make_job, vision, alice
):
    settings.SCHEDULER_EMBEDDED = True
    make_node("n1", gpus=8)
    embedded_wakeup_event().clear()
    loop = SchedulingLoop(interval_s=600, debounce_s=0.05, liveness_interval_s=600).start()
    try:
        job = make_job(vision, alice, gpus=2)
        admitted = wait_until(
            lambda: Job.objects.filter(pk=job.pk, state=JobState.ADMITTED).exists(), timeout_s=30
        )
        assert admitted
        assert wait_until(lambda: SchedulingCycle.objects.filter(trigger="request").exists())
        assert loop.failures == 0
    finally:
        loop.stop()
        connection.close()
    assert not loop.alive


def _agent_pids(agents_dir: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"agents" in cmdline and str(agents_dir).encode() in cmdline:
            pids.append(int(proc.name))
    return pids


def _manage(env, *args, timeout_s=120):
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        env=env,
        cwd=settings.BASE_DIR,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=True,
    )


@pytest.mark.slow
def test_make_run_serves_schedules_and_runs_a_job_on_a_simulated_node_then_stops_its_agents(
    tmp_path,
):
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{tmp_path / 'embedded.sqlite3'}",
        "REDIS_URL": "",
        "SCHEDULER_CYCLE_INTERVAL_S": "1",
        "LOG_LEVEL": "WARNING",
    }
    agents_dir = tmp_path / "agents"
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log_file:
        server = subprocess.Popen(
            [
                sys.executable,
                "manage.py",
                "embedded",
                "--addr",
                f"127.0.0.1:{EMBEDDED_PORT}",
                "--agents",
                "1",
                "--agents-dir",
                str(agents_dir),
            ],
            env=env,
            cwd=settings.BASE_DIR,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{EMBEDDED_PORT}"
    try:
        assert wait_until(lambda: b"Started simulated agent" in log_path.read_bytes(), 90), (
            log_path.read_text()
        )
        token = _manage(
            env,
            "shell",
            "-c",
            "from django.contrib.auth import get_user_model;"
            "from controlplane.tenancy.models import ApiToken;"
            "print(ApiToken.issue(get_user_model().objects.get(username='vision-researcher'),"
            " 'test')[1])",
        ).stdout.split()[-1]
        headers = {"Authorization": f"Bearer {token}"}
        created = requests.post(
            f"{base}/api/v1/jobs/",
            json={
                "tenant": "vision",
                "name": "hello",
                "image": "registry.local/demo/hello:1",
                "command": ["sh", "-c", "echo hello from the embedded mode"],
                "gpus": 2,
                "gpu_type": "H100-SXM-80GB",
            },
            headers=headers,
            timeout=30,
        )
        assert created.status_code == 201, created.text

        def state():
            job = requests.get(
                f"{base}/api/v1/jobs/{created.json()['id']}/", headers=headers, timeout=30
            )
            return job.json()["state"]

        assert wait_until(lambda: state() == "SUCCEEDED", timeout_s=90), (
            state(),
            log_path.read_text()[-3000:],
        )
        assert _agent_pids(agents_dir)

        # A fresh install has a past to show: the generated week, on the node that registered,
        # in the researcher's own job list next to the job just run.
        assert wait_until(lambda: b"Seeded a generated past week" in log_path.read_bytes(), 60)
        past = requests.get(
            f"{base}/api/v1/jobs/", params={"state": "SUCCEEDED"}, headers=headers, timeout=30
        ).json()
        assert past["count"] > 5, past

        # A mistyped address gets the product's page, with its navigation and its styles,
        # not Django's debug page listing every URL pattern.
        missing = requests.get(f"{base}/jobz/", timeout=30)
        assert missing.status_code == 404
        assert "URLconf" not in missing.text and "<h1>Not found</h1>" in missing.text
        stylesheet = re.search(r'href="(/static/[^"]+\.css)"', missing.text)
        assert stylesheet and requests.get(base + stylesheet.group(1), timeout=30).ok
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    assert wait_until(lambda: not _agent_pids(agents_dir), timeout_s=20)
