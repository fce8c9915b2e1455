"""Where a volume's files are on a node's host: the one place these paths are built, so the
heartbeat's mounts, the agent's deletions and the pages never disagree on a directory."""

from __future__ import annotations

import posixpath

from controlplane.storage.models import CHECKPOINT_SUBDIR, TENANT_SUBDIR, Volume

# Where a job finds its checkpoint directory inside its container.
CHECKPOINT_TARGET = "/gpucp/checkpoint"


def mount_source(volume: Volume, tenant_slug: str) -> str:
    """What a job of this tenant mounts: the volume's source, or for a per-tenant volume the
    tenant's own directory under it (<source>/tenants/<slug>), so tenants never see each
    other's files. An engine volume has no directories of its own to split, so per-tenant
    only applies to host paths."""
    if volume.per_tenant_subdir and volume.kind == "host_path":
        return posixpath.join(volume.source, TENANT_SUBDIR, tenant_slug)
    return volume.source


def checkpoint_host_path(volume: Volume, tenant_slug: str, job_id: int) -> str:
    """A job's checkpoint directory on the host: <source>/checkpoints/<tenant slug>/<job id>,
    the same for every attempt so a requeued job finds what the last one wrote."""
    return posixpath.join(volume.source, CHECKPOINT_SUBDIR, tenant_slug, str(int(job_id)))
