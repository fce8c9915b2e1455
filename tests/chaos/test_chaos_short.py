"""The chaos run, short, for CI: every kind of fault at least once, and every promise kept.

About 2-3 minutes: a private deployment (its own PostgreSQL and Redis, gunicorn, a Celery worker,
beat, 3 agents with 2 simulated GPUs each), a stream of short ledger jobs, one fault every
5-10 s (seeded, each kind once before random draws), a drain, then the invariants of
tests.chaos.invariants, each of which must be 0. The liveness timings are shortened with the
outages; the first PostgreSQL outage and the first agent stop last 20 s, past L + m = 14 s, so
the run always includes the outages the node lease exists for.

It uses no pytest-django database (the harness has its own PostgreSQL), so no `db` fixture.
The long form is `python -m tests.chaos.run` (see its docstring).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import pytest

from tests.chaos.harness import Timings
from tests.chaos.scenario import KIND_WEIGHTS, Config, run

pytestmark = [pytest.mark.slow]


def _missing_prerequisite() -> str | None:
    if os.geteuid() != 0:
        return "the chaos harness runs PostgreSQL as the postgres user: it needs root"
    if not shutil.which("runuser") or not shutil.which("redis-server"):
        return "the chaos harness needs runuser and redis-server"
    if not list(Path("/usr/lib/postgresql").glob("*/bin/initdb")):
        return "the chaos harness needs PostgreSQL's server binaries (/usr/lib/postgresql)"
    return None


SHORT = Config(
    minutes=2.0,
    seed=1,
    agents=3,
    gpus_per_agent=2,
    injections_every_s=(5.0, 10.0),
    each_kind_first=True,
    # Twelve heartbeats, as in production (120 s of 10 s): a job stopped by its fence after
    # 12 - 1 - 3 (its default grace) = 8 s of silence rides out every web outage below.
    timings=Timings(lease_s=12.0, lease_margin_s=2.0),
    down_s={
        "web_master": (1.0, 4.0),
        "worker_main": (1.0, 4.0),
        "beat": (1.0, 4.0),
        "agent_kill": (0.0, 10.0),
        "agent_stop": (2.0, 20.0),
        "redis": (1.0, 6.0),
        # Up to 20 s, past L + m = 14 s: the control plane's own outage must not count.
        "postgres": (2.0, 20.0),
        "all": (5.0, 10.0),
    },
    job_duration_s=(3.0, 12.0),
    drain_timeout_s=120.0,
)


def test_a_short_chaos_run_keeps_every_promise(tmp_path):
    missing = _missing_prerequisite()
    if missing:
        pytest.skip(missing)
    cfg = dataclasses.replace(SHORT, out=tmp_path / "chaos")
    result = run(cfg, log=lambda line: None)

    kinds = {i["kind"] for i in result.injections if "error" not in i["detail"]}
    assert kinds == set(KIND_WEIGHTS), (
        f"kinds never injected: {sorted(set(KIND_WEIGHTS) - kinds)}\n{result.summary}"
    )
    counts = {name: len(items) for name, items in result.report.violations.items()}
    assert not any(counts.values()), f"invariants violated: {counts}\n{result.summary}"
