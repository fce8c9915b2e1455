"""One fault at a time, on a private deployment, with the jobs' own ledger as the witness.

The control plane's own outage must never cost a running job anything: PostgreSQL stopped for
longer than the lost-node threshold (lease + margin) while jobs run on live agents, then started
again, loses no attempt, and every job ends as its process did, having run exactly once.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.chaos.harness import Deployment, Timings
from tests.chaos.invariants import read_ledger
from tests.chaos.scenario import LEDGER_JOB, Api, HttpLog, provision_tenant
from tests.chaos.test_chaos_short import _missing_prerequisite
from tests.e2e.conftest import wait_until as wait_for

pytestmark = [pytest.mark.slow]

LEASE_S = 10.0
MARGIN_S = 2.0


@pytest.fixture(params=[0, 16], ids=["connection-per-thread", "pooled"])
def deployment(tmp_path, request):
    missing = _missing_prerequisite()
    if missing:
        pytest.skip(missing)
    d = Deployment(
        run_dir=tmp_path / "run",
        agents_count=2,
        gpus_per_agent=1,
        timings=Timings(lease_s=LEASE_S, lease_margin_s=MARGIN_S),
        # The web processes as docker-compose runs them by default, and with DB_POOL_MAX_SIZE.
        web_db_pool_max_size=request.param,
    ).start()
    try:
        yield d
    finally:
        d.teardown()


def ledger_job(ledger: Path, duration_s: float, exit_code: int) -> list[str]:
    return [sys.executable, "-I", str(LEDGER_JOB), str(ledger), str(duration_s), str(exit_code)]


def test_a_database_outage_longer_than_the_lost_node_threshold_loses_nothing(deployment, tmp_path):
    d = deployment
    api = Api(d.url, provision_tenant(d, 2), HttpLog(), "test")
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    jobs = {}
    for restartable, exit_code in ((True, 0), (False, 3)):
        body = {
            "image": "localhost/busybox:latest",
            "command": ledger_job(ledger, 45.0, exit_code),
            "gpus": 1,
            "restartable": restartable,
        }
        response = api.request("POST", "/jobs/", json=body)
        assert response is not None and response.status_code == 201, response
        jobs[response.json()["id"]] = exit_code

    def states():
        return {j: (api.get_json(f"/jobs/{j}/") or {}).get("state") for j in jobs}

    wait_for(lambda: set(states().values()) == {"RUNNING"}, 60, "both jobs to run")
    # Down for three times the lost-node threshold (and past the agents' own fence time).
    outage_s = 3 * (LEASE_S + MARGIN_S)
    d.postgres.hold("test")
    time.sleep(outage_s)
    assert {a.name: a.alive() for a in d.agents} == {a.name: True for a in d.agents}
    d.postgres.release("test")

    finals = wait_for(
        lambda: (lambda s: s if all(v in ("SUCCEEDED", "FAILED") for v in s.values()) else None)(
            states()
        ),
        120,
        "both jobs to end",
    )
    runs = read_ledger(ledger)
    for job_id, exit_code in jobs.items():
        job = api.get_json(f"/jobs/{job_id}/")
        assert finals[job_id] == ("SUCCEEDED" if exit_code == 0 else "FAILED"), job
        assert job["exit_code"] == exit_code
        assert [a["state"] for a in job["attempts"]] == [finals[job_id]], job["attempts"]
        assert "lost" not in [e["kind"] for e in job["events"]]
        (run,) = [r for r in runs.values() if r.job_id == job_id]  # ran once
        assert len(run.ends) == 1 and not run.terms, "stopped, or ran twice"
        # It ran straight through the outage.
        assert run.last - run.start >= 45.0 - 1.0
