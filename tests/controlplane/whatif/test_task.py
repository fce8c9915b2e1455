"""The what-if task as production runs it: launched into Redis, run by a real Celery worker."""

import pytest

from controlplane.scheduling.models import WhatIfRun, WhatIfState
from controlplane.scheduling.whatif.params import build_params
from controlplane.scheduling.whatif.replay import REAL_LABEL, WHATIF_LABEL
from controlplane.scheduling.whatif_tasks import execute_run, launch_whatif, runs_in_thread
from controlplane.tenancy.models import Quota
from tests.controlplane.whatif.conftest import SINCE, UNTIL, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

ORDER = [WhatIfState.QUEUED, WhatIfState.RUNNING, WhatIfState.DONE]


@pytest.fixture
def history(vision, alice, make_node, finished_job):
    node = make_node("n1", gpus=4)
    Quota.objects.filter(tenant=vision).update(guaranteed_gpus=1, limit_gpus=2)
    # Enough jobs that the replays report progress on the way.
    for i in range(60):
        finished_job(vision, alice, node, submit_s=30 * i, wait_s=0, run_s=20 + (i % 7) * 5)


@pytest.mark.slow
def test_the_celery_worker_moves_a_run_from_queued_through_running_to_done(history, celery_worker):
    # history before celery_worker: the worker starts once the history is written.
    assert not runs_in_thread(), "REDIS_URL is set and the embedded mode off: Celery runs it"
    params = build_params(
        since=SINCE, until=UNTIL, quotas=["vision:H100-SXM-80GB=4:4"], weights=["vision=2"]
    )
    run = launch_whatif(params)
    seen: list[str] = []
    progress: list[float] = []

    def finished():
        row = WhatIfRun.objects.values("state", "progress").get(pk=run.pk)
        if not seen or seen[-1] != row["state"]:
            seen.append(row["state"])
        progress.append(row["progress"])
        return row["state"] in (WhatIfState.DONE, WhatIfState.FAILED)

    assert wait_until(finished, timeout_s=180, interval_s=0.02), celery_worker.log_path.read_text()[
        -3000:
    ]
    run.refresh_from_db()
    assert run.state == WhatIfState.DONE, run.error
    # Whatever the polls caught, the states came in order and never went back.
    assert seen == [s for s in ORDER if s in seen]
    assert run.created_at <= run.started_at <= run.finished_at
    assert progress == sorted(progress) and run.progress == 1.0
    assert f"| {REAL_LABEL} |" in run.report_markdown
    assert f"| {WHATIF_LABEL} |" in run.report_markdown
    labels = [row["policy"] for row in run.summary["rows"]]
    assert labels[0] == REAL_LABEL and labels[-1] == WHATIF_LABEL
    assert "run_whatif[" in celery_worker.log_path.read_text()


def test_a_run_that_another_worker_took_is_not_run_twice(vision, alice, make_node):
    make_node("n1", gpus=2)
    run = WhatIfRun.objects.create(
        params=build_params(since=SINCE, until=UNTIL).to_json(), state=WhatIfState.RUNNING
    )
    assert execute_run(run.pk) == "skipped"
    run.refresh_from_db()
    assert (run.state, run.report_markdown) == (WhatIfState.RUNNING, "")


def test_a_run_over_a_period_without_jobs_fails_and_says_why(vision, make_node):
    make_node("n1", gpus=2)
    run = WhatIfRun.objects.create(params=build_params(since=SINCE, until=UNTIL).to_json())
    assert execute_run(run.pk) == WhatIfState.FAILED
    run.refresh_from_db()
    assert run.state == WhatIfState.FAILED
    assert "no finished job was submitted" in run.error
    assert run.finished_at is not None
