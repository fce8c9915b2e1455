from django.db import models
from django.utils import timezone


class SchedulingCycle(models.Model):
    """One run of the scheduling loop, kept so operators can see what it decided and how fast."""

    started_at = models.DateTimeField(default=timezone.now, db_index=True)
    duration_ms = models.FloatField(default=0.0)
    starts = models.PositiveIntegerField(default=0)
    preemptions = models.PositiveIntegerField(default=0)
    pending = models.PositiveIntegerField(default=0)
    skipped_rows = models.PositiveIntegerField(default=0)
    slowest_step = models.CharField(max_length=32, blank=True, default="")
    step_ms = models.JSONField(default=dict, blank=True)
    decisions = models.JSONField(default=dict, blank=True)
    trigger = models.CharField(max_length=32, blank=True, default="tick")

    class Meta:
        ordering = ["-started_at", "-id"]
