"""Periodic upkeep of the jobs app."""

import logging

from celery import shared_task

log = logging.getLogger(__name__)


@shared_task(ignore_result=True)
def delete_expired_submit_keys() -> int:
    """Delete the Idempotency-Keys older than IDEMPOTENCY_KEY_TTL_S (beat runs it hourly).

    Expired keys already replay nothing (submits look only at live ones); this only keeps the
    table small. Two overlapping runs delete the same rows once between them.
    """
    from controlplane.jobs import actions

    deleted = actions.delete_expired_submit_keys()
    if deleted:
        log.info("deleted %d expired submit keys", deleted)
    return deleted
