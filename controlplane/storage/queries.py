"""The read side of storage: which volumes a tenant may mount and a node should have, the
checkpoint volume, a tenant's checkpoint usage, and the checkpoint directories due for deletion.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass

from django.db.models import (
    BigIntegerField,
    DateTimeField,
    DurationField,
    ExpressionWrapper,
    F,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    Sum,
)
from django.db.models.functions import Coalesce
from django.utils import timezone

from controlplane.cluster.models import Node
from controlplane.jobs.models import FINISHED_JOB_STATES, Job
from controlplane.storage.models import Volume
from controlplane.storage.paths import checkpoint_host_path

# What one answer to an agent lists at most; the rest come in the next ones.
DELETIONS_PER_ANSWER = 100


def volumes_for_tenant(tenant) -> QuerySet[Volume]:
    """The volumes this tenant's jobs may mount: none for an inactive tenant."""
    if tenant is None or not tenant.active:
        return Volume.objects.none()
    return Volume.objects.filter(Q(all_tenants=True) | Q(tenants=tenant)).distinct()


def tenant_may_use(volume: Volume, tenant) -> bool:
    return volumes_for_tenant(tenant).filter(pk=volume.pk).exists()


def volumes_for_pool(pool_id: int | None) -> QuerySet[Volume]:
    """The volumes every node of this pool should have: those listing it, and those listing no
    pool at all."""
    applies = Q(pools=None)
    if pool_id is not None:
        applies |= Q(pools=pool_id)
    return Volume.objects.filter(applies).distinct()


def volumes_for_node(node) -> QuerySet[Volume]:
    return volumes_for_pool(node.pool_id)


def checkpoint_volume() -> Volume | None:
    return Volume.objects.filter(checkpoints=True).first()


def _stored_checkpoints() -> QuerySet[Job]:
    return Job.objects.filter(checkpoint_volume__isnull=False, checkpoint_deleted_at__isnull=True)


def checkpoint_usage_bytes(tenant) -> int:
    """What this tenant's checkpoint directories hold, as their nodes last measured them."""
    total = _stored_checkpoints().filter(tenant=tenant).aggregate(b=Sum("checkpoint_bytes"))["b"]
    return int(total or 0)


def checkpoint_usage_by_tenant(tenant_ids: Iterable[int] | None = None) -> dict[int, int]:
    """tenant id -> checkpoint bytes, in one query (tenants with none are absent)."""
    rows = _stored_checkpoints()
    if tenant_ids is not None:
        rows = rows.filter(tenant_id__in=list(tenant_ids))
    return {
        tenant_id: int(total or 0)
        for tenant_id, total in rows.values("tenant_id")
        .annotate(total=Sum("checkpoint_bytes"))
        .values_list("tenant_id", "total")
        .order_by()
    }


def checkpoint_usage_subquery(tenant_ref: str):
    """checkpoint_usage_bytes as an expression, for annotating a queryset of tenants (or of rows
    whose `tenant_ref` is a tenant id)."""
    total = (
        _stored_checkpoints()
        .filter(tenant=OuterRef(tenant_ref))
        .order_by()
        .values("tenant")
        .annotate(total=Sum("checkpoint_bytes"))
        .values("total")
    )
    return Coalesce(Subquery(total, output_field=BigIntegerField()), 0)


@dataclass(frozen=True)
class DueDeletion:
    job_id: int
    volume_id: int
    host_path: str


def _due_jobs(now: dt.datetime) -> QuerySet[Job]:
    # The retention is the volume's, so the cut-off is worked out per row by the database.
    keep_until = ExpressionWrapper(
        F("finished_at")
        + ExpressionWrapper(
            F("checkpoint_volume__checkpoint_retention_s") * dt.timedelta(seconds=1),
            output_field=DurationField(),
        ),
        output_field=DateTimeField(),
    )
    return (
        _stored_checkpoints()
        .filter(state__in=FINISHED_JOB_STATES, finished_at__isnull=False)
        .annotate(keep_until=keep_until)
        .filter(keep_until__lte=now)
    )


def due_checkpoint_deletions(
    *,
    volume_names: Iterable[str] | None = None,
    now: dt.datetime | None = None,
    limit: int | None = DELETIONS_PER_ANSWER,
) -> list[DueDeletion]:
    """Checkpoint directories whose job finished longer than their volume's retention ago and
    that no node has deleted yet, oldest first; with `volume_names`, only on those volumes (a
    node is told only of directories on volumes it has)."""
    rows = _due_jobs(now or timezone.now())
    if volume_names is not None:
        rows = rows.filter(checkpoint_volume__name__in=list(volume_names))
    rows = rows.select_related("checkpoint_volume").order_by("finished_at", "pk")
    rows = rows.only(
        "id",
        "tenant__slug",
        "checkpoint_volume__source",
        "checkpoint_volume__kind",
        "checkpoint_volume__per_tenant_subdir",
    ).select_related("tenant")
    if limit is not None:
        rows = rows[:limit]
    out = []
    for job in rows:
        volume = job.checkpoint_volume
        assert volume is not None  # the filter above
        out.append(
            DueDeletion(
                job_id=job.pk,
                volume_id=volume.pk,
                host_path=checkpoint_host_path(volume, job.tenant.slug, job.pk),
            )
        )
    return out


def due_checkpoint_deletion_count(now: dt.datetime | None = None) -> int:
    return _due_jobs(now or timezone.now()).count()


def node_names_by_volume() -> dict[str, list[str]]:
    """volume name -> the nodes that last reported having it (deregistered nodes left out)."""
    out: dict[str, list[str]] = {}
    for name, volumes in (
        Node.objects.filter(deregistered_at__isnull=True)
        .order_by("name")
        .values_list("name", "volumes")
    ):
        for volume in volumes or ():
            if isinstance(volume, str):
                out.setdefault(volume, []).append(name)
    return out
