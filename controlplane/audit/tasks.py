"""Periodic upkeep of the audit trail."""

import logging

from celery import shared_task
from django.conf import settings
from django.utils import timezone

log = logging.getLogger(__name__)


@shared_task(ignore_result=True)
def prune_audit_trail() -> int:
    """Delete audit rows past AUDIT_RETENTION_DAYS (beat runs it hourly)."""
    from controlplane.audit import trail

    deleted = trail.prune(timezone.now(), settings.AUDIT_RETENTION_DAYS)
    if deleted:
        log.info("deleted %d audit rows older than %g days", deleted, settings.AUDIT_RETENTION_DAYS)
    return deleted
