"""The record of scheduling cycles (a row every few seconds) is kept for
SCHEDULER_CYCLE_RETENTION_DAYS, by beat in production and by the loop itself in the embedded
mode: it never grows without end."""

import datetime as dt

import pytest
from django.utils import timezone

from controlplane.audit import trail
from controlplane.audit.models import AuditEvent
from controlplane.scheduling.embedded import SchedulingLoop
from controlplane.scheduling.models import SchedulingCycle
from controlplane.scheduling.tasks import prune_scheduling_cycles
from tests.controlplane.scheduling.conftest import wait_until


def _cycles(*ages_days: float) -> list[int]:
    now = timezone.now()
    return [
        SchedulingCycle.objects.create(started_at=now - dt.timedelta(days=age)).pk
        for age in ages_days
    ]


@pytest.mark.django_db
def test_cycle_rows_past_the_retention_are_deleted_and_the_rest_kept(settings):
    settings.SCHEDULER_CYCLE_RETENTION_DAYS = 2.0
    old, older, recent, fresh = _cycles(2.01, 30, 1.99, 0)
    assert prune_scheduling_cycles() == 2
    assert set(SchedulingCycle.objects.values_list("pk", flat=True)) == {recent, fresh}
    assert prune_scheduling_cycles() == 0


def test_beat_runs_the_cycle_retention_hourly(settings):
    from controlplane.celery import app

    app.loader.import_default_modules()
    entry = next(
        e
        for e in settings.CELERY_BEAT_SCHEDULE.values()
        if e["task"] == "controlplane.scheduling.tasks.prune_scheduling_cycles"
    )
    assert entry["schedule"] == 3600.0
    assert entry["task"] in app.tasks


@pytest.mark.django_db(transaction=True)
def test_the_embedded_loop_runs_beats_hourly_upkeep_itself(settings):
    settings.SCHEDULER_EMBEDDED = True
    settings.SCHEDULER_CYCLE_RETENTION_DAYS = 1.0
    settings.AUDIT_RETENTION_DAYS = 1.0
    (old_cycle,) = _cycles(3)
    old_audit = trail.record("test.old", actor_label="test")
    AuditEvent.objects.filter(pk=old_audit.pk).update(at=timezone.now() - dt.timedelta(days=3))
    loop = SchedulingLoop(interval_s=0.1, debounce_s=0.05, liveness_interval_s=0.2).start()
    try:
        assert wait_until(
            lambda: not SchedulingCycle.objects.filter(pk=old_cycle).exists(), timeout_s=30
        )
        assert wait_until(lambda: not AuditEvent.objects.filter(pk=old_audit.pk).exists())
        assert loop.failures == 0
    finally:
        loop.stop()
    # Its own cycles, recorded just now, are kept.
    assert SchedulingCycle.objects.exists()
