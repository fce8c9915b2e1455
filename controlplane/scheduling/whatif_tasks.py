"""What-if runs in the background: a Celery task, or a thread in the embedded mode.

A run goes queued -> running -> done (or failed). Only the worker that moves it from queued to
running works on it (a conditional UPDATE whose row count says who got there first), so a
message delivered twice replays once. Progress is written as the replays advance, at most a few
times a second, so that the web page's progress bar moves without hammering the database.
"""

from __future__ import annotations

import logging
import threading
import time

from celery import shared_task
from django.conf import settings
from django.db import connections, transaction
from django.utils import timezone

from controlplane.scheduling.models import WhatIfRun, WhatIfState
from controlplane.scheduling.whatif.params import WhatIfParams
from controlplane.scheduling.whatif.replay import run_whatif as replay_history
from controlplane.scheduling.whatif.report import report_of, summary_json

log = logging.getLogger(__name__)

# Progress is written when it moved at least this much and this long after the last write.
PROGRESS_STEP = 0.01
PROGRESS_MIN_INTERVAL_S = 0.25


@shared_task(acks_late=True, ignore_result=True)
def run_whatif(run_id: int) -> str:
    """Run the what-if WhatIfRun run_id describes and store its report; returns its end state."""
    return execute_run(run_id)


def execute_run(run_id: int) -> str:
    claimed = WhatIfRun.objects.filter(pk=run_id, state=WhatIfState.QUEUED).update(
        state=WhatIfState.RUNNING, started_at=timezone.now(), progress=0.0
    )
    if not claimed:
        log.info("what-if %s is not queued (another worker took it, or it is gone)", run_id)
        return "skipped"
    run = WhatIfRun.objects.get(pk=run_id)
    written = [0.0, 0.0]  # last fraction written, when (monotonic)

    def progress(fraction: float) -> None:
        now = time.monotonic()
        if fraction - written[0] < PROGRESS_STEP or now - written[1] < PROGRESS_MIN_INTERVAL_S:
            return
        written[:] = [fraction, now]
        WhatIfRun.objects.filter(pk=run_id, state=WhatIfState.RUNNING).update(progress=fraction)

    try:
        params = WhatIfParams.from_json(run.params)
        summary = summary_json(replay_history(params, progress=progress))
        # The text is written from the summary, as the page is: the same figures in the same words.
        markdown = report_of(params, summary).markdown()
    except Exception as exc:
        log.exception("what-if %s failed", run_id)
        WhatIfRun.objects.filter(pk=run_id).update(
            state=WhatIfState.FAILED, finished_at=timezone.now(), error=str(exc) or repr(exc)
        )
        return WhatIfState.FAILED
    WhatIfRun.objects.filter(pk=run_id).update(
        state=WhatIfState.DONE,
        finished_at=timezone.now(),
        progress=1.0,
        report_markdown=markdown,
        summary=summary,
        error="",
    )
    return WhatIfState.DONE


def runs_in_thread() -> bool:
    """The embedded mode has no worker; nor is there one without a broker a worker could read."""
    return settings.SCHEDULER_EMBEDDED or not settings.REDIS_URL


@transaction.atomic
def launch_whatif(params: WhatIfParams, *, requested_by=None) -> WhatIfRun:
    """Store a queued run for params and start it once the row is committed."""
    run = WhatIfRun.objects.create(requested_by=requested_by, params=params.to_json())
    transaction.on_commit(lambda: _dispatch(run.pk))
    return run


def _dispatch(run_id: int) -> None:
    if runs_in_thread():
        threading.Thread(
            target=_run_in_thread, args=(run_id,), name=f"whatif-{run_id}", daemon=True
        ).start()
        return
    try:
        run_whatif.delay(run_id)
    except Exception as exc:
        log.exception("could not queue what-if %s", run_id)
        WhatIfRun.objects.filter(pk=run_id, state=WhatIfState.QUEUED).update(
            state=WhatIfState.FAILED,
            finished_at=timezone.now(),
            error=f"could not queue the run: {exc}",
        )


def _run_in_thread(run_id: int) -> None:
    try:
        execute_run(run_id)
    finally:
        # This thread's own connections; the request threads keep theirs.
        connections.close_all()
