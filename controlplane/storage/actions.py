"""Every write to storage: an admin's volumes, a node's report of the volumes it has, and the
checkpoint directories nodes deleted. The REST API, the web UI, the Django admin and the agent
API call these; none of them writes these rows itself.

Each action is atomic, checks its rule (`controlplane.storage.rules`), leaves one audit row
(`controlplane.audit`) and, where it changes where jobs can go (a volume's pools, a node's
volumes), asks for a scheduling cycle once it has committed.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.utils import timezone

from controlplane import wakeups
from controlplane.audit import trail
from controlplane.cluster.models import Node, Pool
from controlplane.jobs.models import ACTIVE_JOB_STATES, FINISHED_JOB_STATES, Job
from controlplane.storage import queries, rules
from controlplane.storage.models import Volume
from controlplane.tenancy.models import Tenant

VOLUME_FIELDS = (
    "name",
    "description",
    "kind",
    "source",
    "all_tenants",
    "read_only",
    "per_tenant_subdir",
    "checkpoints",
    "checkpoint_retention_s",
)
# The relations an admin sets alongside the fields, as names in the trail.
VOLUME_RELATIONS = ("pools", "tenants")


class VolumeInUse(Exception):
    """The volume cannot be deleted: jobs still need it. The message says which."""


def _cycle_on_commit(reason: str) -> None:
    transaction.on_commit(lambda: wakeups.request_cycle(reason))


def _relations(volume: Volume) -> dict[str, list[str]]:
    return {
        "pools": sorted(volume.pools.values_list("name", flat=True)),
        "tenants": sorted(volume.tenants.values_list("slug", flat=True)),
    }


def _state(volume: Volume) -> dict:
    return {**trail.snapshot(volume, VOLUME_FIELDS), **_relations(volume)}


def _save(volume: Volume, **update) -> None:
    try:
        with transaction.atomic():
            volume.save(**update)
    except IntegrityError as exc:
        # The rules checked both; another admin's write committed in between.
        if "one_checkpoint_volume" in str(exc):
            raise ValidationError(
                {"checkpoints": ["Another volume became the checkpoint volume at the same moment."]}
            ) from None
        raise ValidationError(
            {"name": ["A volume with this name was created at the same moment."]}
        ) from None


def _prune_node_volumes(volume_name: str, keep_pool_ids: set[int] | None) -> None:
    """Drop the name from the reports of nodes it no longer applies to (all nodes when
    keep_pool_ids is None), so the scheduler stops sending its jobs there before the nodes
    report again."""
    nodes = Node.objects.select_for_update().filter(volumes__contains=[volume_name])
    if keep_pool_ids is not None:
        nodes = nodes.exclude(pool_id__in=keep_pool_ids)
    for node in nodes.only("id", "volumes"):
        node.volumes = [v for v in node.volumes if v != volume_name]
        node.save(update_fields=["volumes"])


@transaction.atomic
def create_volume(
    *,
    actor,
    pools: Iterable[Pool] = (),
    tenants: Iterable[Tenant] = (),
    **values,
) -> Volume:
    rules.check_volume(values)
    volume = Volume(**values)
    _save(volume)
    volume.pools.set(list(pools))
    volume.tenants.set(list(tenants))
    trail.record(
        "volume.create",
        actor=actor,
        obj=volume,
        after=_state(volume),
        message=f"Volume {volume.name} created.",
    )
    _cycle_on_commit("volume_created")
    return volume


@transaction.atomic
def update_volume(
    volume: Volume,
    *,
    actor,
    pools: Iterable[Pool] | None = None,
    tenants: Iterable[Tenant] | None = None,
    **values,
) -> Volume:
    """Change the fields and relations given (the others stay). The name is fixed."""
    volume = Volume.objects.select_for_update().get(pk=volume.pk)
    rules.check_volume(values, volume)
    before = _state(volume)
    for name, value in values.items():
        if name not in VOLUME_FIELDS:
            raise TypeError(f"Volume has no settable field {name!r}")
        setattr(volume, name, value)
    _save(volume)
    if pools is not None:
        volume.pools.set(list(pools))
    if tenants is not None:
        volume.tenants.set(list(tenants))
    before, after = trail.changes(before, _state(volume))
    if not after:
        return volume
    if "pools" in after and after["pools"]:
        _prune_node_volumes(volume.name, set(volume.pools.values_list("pk", flat=True)))
    trail.record(
        "volume.update",
        actor=actor,
        obj=volume,
        before=before,
        after=after,
        message=f"Volume {volume.name} changed: {trail.describe(before, after)}.",
    )
    if set(after) - {"description"}:
        _cycle_on_commit("volume_changed")
    return volume


def _active_jobs_mounting(volume: Volume) -> int:
    return Job.objects.filter(
        state__in=ACTIVE_JOB_STATES, mounts__contains=[{"volume": volume.name}]
    ).count()


@transaction.atomic
def delete_volume(volume: Volume, *, actor) -> None:
    """Raises VolumeInUse while unfinished jobs mount it, or while any job's checkpoint
    directory is on it (nothing is written then)."""
    volume = Volume.objects.select_for_update().get(pk=volume.pk)
    mounting = _active_jobs_mounting(volume)
    if mounting:
        raise VolumeInUse(
            f"{mounting} unfinished job(s) mount {volume.name}; delete it once they have "
            "finished or been cancelled."
        )
    holding = Job.objects.filter(checkpoint_volume=volume).count()
    if holding:
        raise VolumeInUse(
            f"{volume.name} holds the checkpoint directories of {holding} job(s); it stays "
            "while any job refers to it. Stop using it for new jobs by unticking checkpoints."
        )
    before = _state(volume)
    pk, name = volume.pk, volume.name
    volume.delete()
    _prune_node_volumes(name, None)
    trail.record(
        "volume.delete",
        actor=actor,
        object_type="volume",
        object_id=pk,
        object_repr=name,
        before=before,
        message=f"Volume {name} deleted.",
    )
    _cycle_on_commit("volume_deleted")


# --- what nodes report ----------------------------------------------------------------------


@transaction.atomic
def record_node_volumes(
    node_id: int, present: Iterable[str], *, now: dt.datetime | None = None
) -> bool:
    """Store the volumes a node found on its host: only names of volumes that exist and apply
    to its pool, sorted. True when the set changed (then a scheduling cycle is asked for)."""
    now = now or timezone.now()
    node = Node.objects.select_for_update().only("id", "name", "pool_id", "volumes").get(pk=node_id)
    applicable = set(queries.volumes_for_pool(node.pool_id).values_list("name", flat=True))
    volumes = sorted(applicable.intersection(present))
    changed = volumes != sorted(node.volumes or [])
    update: dict[str, object] = {"volumes_reported_at": now}
    if changed:
        update["volumes"] = volumes
        trail.record(
            "node.volumes",
            actor_label=f"node {node.name}",
            obj=node,
            before={"volumes": node.volumes},
            after={"volumes": volumes},
            message=f"Node {node.name} has volumes: {', '.join(volumes) or 'none'}.",
        )
        _cycle_on_commit("node_volumes")
    Node.objects.filter(pk=node.pk).update(**update)
    return changed


@transaction.atomic
def mark_checkpoints_deleted(
    node_id: int, job_ids: Iterable[int], *, now: dt.datetime | None = None
) -> list[int]:
    """Record that a node deleted these jobs' checkpoint directories; the ids of those marked.

    Only finished jobs whose checkpoint volume the node has (as it last reported): a node
    cannot strike out directories on a volume it does not have, nor a running job's."""
    ids = sorted({int(i) for i in job_ids})
    if not ids:
        return []
    node = Node.objects.only("id", "name", "volumes").get(pk=node_id)
    jobs = Job.objects.select_for_update(of=("self",)).filter(
        pk__in=ids,
        state__in=FINISHED_JOB_STATES,
        checkpoint_volume__name__in=list(node.volumes or []),
        checkpoint_deleted_at__isnull=True,
    )
    marked = sorted(jobs.values_list("pk", flat=True))
    if marked:
        Job.objects.filter(pk__in=marked).update(checkpoint_deleted_at=now or timezone.now())
        trail.record(
            "job.checkpoints_deleted",
            actor_label=f"node {node.name}",
            object_type="node",
            object_id=node.pk,
            object_repr=node.name,
            after={"jobs": marked},
            message=f"Node {node.name} deleted the checkpoint directories of jobs "
            f"{', '.join(map(str, marked))}.",
        )
    return marked
