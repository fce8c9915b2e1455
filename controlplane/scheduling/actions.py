"""Writes of the scheduling app outside the cycle itself."""

from __future__ import annotations

import datetime as dt

from django.db import transaction

from controlplane.scheduling.models import SchedulingCycle


@transaction.atomic
def prune_cycles(now: dt.datetime, retention_days: float) -> int:
    """Delete the SchedulingCycle rows older than SCHEDULER_CYCLE_RETENTION_DAYS.

    A cycle row every few seconds is some 17,000 a day: kept for good they would grow the
    table without end, and the overview's charts and operators read the last days only.
    """
    deleted, _ = SchedulingCycle.objects.filter(
        started_at__lt=now - dt.timedelta(days=retention_days)
    ).delete()
    return deleted
