from django.conf import settings
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


class WhatIfState(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    DONE = "done", "Done"
    FAILED = "failed", "Failed"


class WhatIfRun(models.Model):
    """A replay of the cluster's own history under a changed config, launched by an admin.

    params is what controlplane.scheduling.whatif.params.WhatIfParams.to_json() writes; summary
    holds the figures of every row of the report (what really happened, and the simulated runs),
    what changes and the notes, as controlplane.scheduling.whatif.report.summary_json writes them:
    the pages render it. report_markdown is the same report as text, written from the summary.
    """

    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="whatif_runs",
    )
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    params = models.JSONField(default=dict)
    state = models.CharField(max_length=16, choices=WhatIfState.choices, default=WhatIfState.QUEUED)
    progress = models.FloatField(default=0.0)  # fraction of the replays done, 0..1
    report_markdown = models.TextField(blank=True, default="")
    summary = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"what-if {self.pk} ({self.state})"

    @property
    def is_finished(self) -> bool:
        return self.state in (WhatIfState.DONE, WhatIfState.FAILED)
