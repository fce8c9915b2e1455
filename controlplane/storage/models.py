"""Storage an admin defines for jobs: volumes mounted into containers, and the volume that holds
every job's checkpoint directory.

A volume is what every node of its pools has at the same place (an NFS or Lustre mount point, or
a named volume of the container engine); nodes report which volumes they really have
(Node.volumes), and the scheduler places a job only where every volume it asks for is.
"""

from django.db import models
from django.db.models import Q
from django.utils import timezone

from controlplane.cluster.models import Pool
from controlplane.tenancy.models import Tenant


class VolumeKind(models.TextChoices):
    HOST_PATH = "host_path", "Host path (the same directory on every node, e.g. an NFS mount)"
    ENGINE_VOLUME = "engine_volume", "Named volume of the container engine"


# Where a tenant's share of a per-tenant volume lives, under the volume's source.
TENANT_SUBDIR = "tenants"
# Where checkpoint directories live on a checkpoint volume: <source>/checkpoints/<tenant>/<job id>.
CHECKPOINT_SUBDIR = "checkpoints"


class Volume(models.Model):
    name = models.SlugField(max_length=63, unique=True)
    description = models.CharField(max_length=200, blank=True, default="")
    kind = models.CharField(max_length=16, choices=VolumeKind.choices, default=VolumeKind.HOST_PATH)
    # An absolute host path (host_path) or the engine's volume name (engine_volume).
    source = models.CharField(max_length=1024)
    # The pools whose nodes have it; none listed: every pool.
    pools = models.ManyToManyField(Pool, blank=True, related_name="volumes")
    # Who may mount it: every tenant, or the ones listed.
    all_tenants = models.BooleanField(default=False)
    tenants = models.ManyToManyField(Tenant, blank=True, related_name="volumes")
    # Mounted read-only whatever a job asks.
    read_only = models.BooleanField(default=False)
    # A job sees only <source>/tenants/<tenant slug>, so tenants never see each other's files.
    per_tenant_subdir = models.BooleanField(default=False)
    # Every job's GPUCP_CHECKPOINT_DIR lives here (host_path, read-write), and is deleted this
    # long after its job ended.
    checkpoints = models.BooleanField(default=False)
    checkpoint_retention_s = models.PositiveIntegerField(default=7 * 86400)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]
        constraints = [
            # One place for checkpoints, so a requeued job finds what its last attempt wrote.
            models.UniqueConstraint(
                fields=["checkpoints"],
                condition=Q(checkpoints=True),
                name="one_checkpoint_volume",
            ),
            models.CheckConstraint(
                condition=Q(checkpoints=False) | Q(kind="host_path", read_only=False),
                name="checkpoint_volume_is_writable_host_path",
            ),
        ]

    def __str__(self) -> str:
        return self.name
