"""The configuration audit trail: one row per change an action made, whoever made it.

Below the apps: the foreign keys name their models by string, so this module imports no app and
every app's actions can write here. A job's own lifecycle (submitted, admitted, preempted...)
is not here: that is `jobs.JobEvent`, the timeline users read on the job's page.
"""

from django.conf import settings
from django.db import models
from django.utils import timezone


class AuditEvent(models.Model):
    at = models.DateTimeField(default=timezone.now)
    # The person who asked, when a person did; agents and sweeps leave it null and say who they
    # are in actor_label ("node gpu-3", "liveness sweep").
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="audit_events",
    )
    actor_label = models.CharField(max_length=200, blank=True, default="")
    # The tenant the change belongs to; null for cluster-wide objects (pools, nodes). Tenant
    # admins see their tenant's rows only. A deleted tenant's rows stay (the trail outlives it).
    tenant = models.ForeignKey(
        "tenancy.Tenant",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="audit_events",
    )
    # Dotted: "<object>.<verb>", e.g. "pool.update", "membership.delete", "budget.warning".
    action = models.CharField(max_length=64)
    object_type = models.CharField(max_length=64, blank=True, default="")
    object_id = models.CharField(max_length=64, blank=True, default="")
    object_repr = models.CharField(max_length=300, blank=True, default="")
    # The changed fields as they were and as they became (null: created / deleted).
    before = models.JSONField(null=True, blank=True)
    after = models.JSONField(null=True, blank=True)
    message = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [
            models.Index(fields=["tenant", "at"], name="audit_tenant_at"),
            models.Index(fields=["action", "at"], name="audit_action_at"),
        ]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.action} {self.object_repr}"
