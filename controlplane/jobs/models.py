"""Jobs, their attempts on nodes, the GPUs those hold, and the timeline of what happened.

Job.state is written only by controlplane.jobs.actions.
"""

from datetime import timedelta

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from controlplane.cluster.models import GPU, Node
from controlplane.tenancy.models import Tenant


class JobState(models.TextChoices):
    PENDING = "PENDING"
    ADMITTED = "ADMITTED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    PREEMPTED = "PREEMPTED"
    LOST = "LOST"


ACTIVE_JOB_STATES = (
    JobState.PENDING,
    JobState.ADMITTED,
    JobState.RUNNING,
    JobState.PREEMPTED,
    JobState.LOST,
)
FINISHED_JOB_STATES = (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


class PriorityClass(models.TextChoices):
    LOW = "low", "Low"
    NORMAL = "normal", "Normal"
    HIGH = "high", "High"


# The numbers the scheduler orders by; the gaps leave room for classes added later. Keyed by
# str: a PriorityClass is one (and hashes as its value), and rows and snapshots carry plain text.
PRIORITY_VALUE: dict[str, int] = {
    PriorityClass.LOW: 50,
    PriorityClass.NORMAL: 100,
    PriorityClass.HIGH: 200,
}


class Job(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="jobs")
    submitted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="jobs"
    )
    name = models.CharField(max_length=200)
    image = models.CharField(max_length=512)
    command = models.JSONField(default=list)
    env = models.JSONField(default=dict, blank=True)
    gpus = models.PositiveIntegerField(default=1)
    gpu_type = models.CharField(max_length=64, blank=True, default="")
    cpus = models.FloatField(default=1.0)
    memory_mib = models.PositiveIntegerField(default=4096)
    priority = models.CharField(
        max_length=16, choices=PriorityClass.choices, default=PriorityClass.NORMAL
    )
    preemptible = models.BooleanField(default=True)
    restartable = models.BooleanField(default=True)
    max_runtime_s = models.PositiveIntegerField(default=86400)
    estimated_duration_s = models.PositiveIntegerField(null=True, blank=True)

    state = models.CharField(
        max_length=16, choices=JobState.choices, default=JobState.PENDING, db_index=True
    )
    state_reason = models.TextField(blank=True, default="")
    # Written by the scheduling cycle for a job left pending.
    pending_reason_code = models.CharField(max_length=64, blank=True, default="")
    pending_reason = models.TextField(blank=True, default="")
    queue_position = models.PositiveIntegerField(null=True, blank=True)
    estimated_start_at = models.DateTimeField(null=True, blank=True)
    predicted_duration_s = models.FloatField(null=True, blank=True)

    submitted_at = models.DateTimeField(default=timezone.now, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    # Counts admissions, so a requeued job's attempts are numbered 1, 2, ...
    attempt_count = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["-submitted_at", "-id"]
        indexes = [
            models.Index(fields=["tenant", "state"]),
            models.Index(fields=["state", "submitted_at"]),
        ]

    def __str__(self) -> str:
        return f"job {self.pk} {self.name} ({self.state})"

    @property
    def is_finished(self) -> bool:
        return self.state in FINISHED_JOB_STATES


class AttemptState(models.TextChoices):
    ADMITTED = "ADMITTED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"  # stopped on purpose: preempted or cancelled
    LOST = "LOST"


ACTIVE_ATTEMPT_STATES = (AttemptState.ADMITTED, AttemptState.RUNNING)


class JobAttempt(models.Model):
    """One admission of a job onto a node. A requeued job gets a new attempt."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="attempts")
    number = models.PositiveIntegerField()
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="attempts")
    state = models.CharField(
        max_length=16, choices=AttemptState.choices, default=AttemptState.ADMITTED
    )
    # Set by preemption, cancellation or fencing: the agent must kill it. GPUs stay allocated until
    # the agent confirms the container is gone, so two jobs never share a GPU.
    stop_requested_at = models.DateTimeField(null=True, blank=True)
    stop_reason = models.CharField(max_length=32, blank=True, default="")
    borrowed = models.BooleanField(default=False)
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    # When the node's report of the end arrived. Null for an attempt the liveness sweep declared
    # lost until its node, back again, says how it really ended (a late report counts once).
    exit_reported_at = models.DateTimeField(null=True, blank=True)
    gpu_seconds = models.FloatField(default=0.0)
    energy_j = models.FloatField(default=0.0)
    energy_estimated = models.BooleanField(default=False)
    # Energy counter readings per GPU UUID at the attempt's start and latest report.
    energy_start_j = models.JSONField(default=dict, blank=True)
    energy_last_j = models.JSONField(default=dict, blank=True)
    log_bytes = models.PositiveBigIntegerField(default=0)

    class Meta:
        ordering = ["job", "number"]
        constraints = [
            models.UniqueConstraint(fields=["job", "number"], name="attempt_unique_number")
        ]
        indexes = [models.Index(fields=["node", "state"])]

    def __str__(self) -> str:
        return f"attempt {self.pk} of job {self.job_id} on {self.node_id} ({self.state})"

    @property
    def is_active(self) -> bool:
        return self.state in ACTIVE_ATTEMPT_STATES


class Allocation(models.Model):
    attempt = models.ForeignKey(JobAttempt, on_delete=models.CASCADE, related_name="allocations")
    gpu = models.ForeignKey(GPU, on_delete=models.PROTECT, related_name="allocations")
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)
    released_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            # The database, not Python, guarantees a GPU is never given to two live attempts.
            models.UniqueConstraint(
                fields=["gpu"], condition=Q(active=True), name="one_active_allocation_per_gpu"
            )
        ]


class JobEvent(models.Model):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events")
    at = models.DateTimeField(default=timezone.now)
    kind = models.CharField(max_length=32)
    from_state = models.CharField(max_length=16, blank=True, default="")
    to_state = models.CharField(max_length=16, blank=True, default="")
    message = models.TextField(blank=True, default="")
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["at", "id"]

    def __str__(self) -> str:
        return f"{self.kind} {self.from_state}->{self.to_state}"


class OutputBytesField(models.BinaryField):
    """Bytes (bytea): a program's output is bytes, and text columns refuse some (NUL) or would
    need them decoded. Accepts str too, as UTF-8; always reads back as bytes."""

    # The value types django-stubs gives the model attribute and its queries (a BinaryField's
    # say memoryview too, which from_db_value below never returns).
    _pyi_private_set_type: bytes | bytearray | memoryview | str
    _pyi_private_get_type: bytes

    def get_db_prep_value(self, value, connection, prepared=False):
        if isinstance(value, str):
            value = value.encode()
        return super().get_db_prep_value(value, connection, prepared)

    def from_db_value(self, value, expression, connection):
        if isinstance(value, str):  # a row SQLite kept as text
            return value.encode()
        return None if value is None else bytes(value)


class LogChunk(models.Model):
    """A piece of an attempt's output, keyed by byte offset so a resent chunk is stored once.

    `data` holds the bytes exactly as the program wrote them (controlplane.jobs.logs decides
    how they are shown)."""

    attempt = models.ForeignKey(JobAttempt, on_delete=models.CASCADE, related_name="log_chunks")
    offset = models.PositiveBigIntegerField()
    data = OutputBytesField()
    received_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["attempt", "offset"]
        constraints = [
            models.UniqueConstraint(fields=["attempt", "offset"], name="log_chunk_unique_offset")
        ]


class SubmitKeyQuerySet(models.QuerySet):
    """Keys live IDEMPOTENCY_KEY_TTL_S; an expired one replays nothing and is deleted."""

    def live(self, now=None):
        return self.filter(created_at__gt=_submit_key_cutoff(now))

    def expired(self, now=None):
        return self.filter(created_at__lte=_submit_key_cutoff(now))


def _submit_key_cutoff(now=None):
    return (now or timezone.now()) - timedelta(seconds=settings.IDEMPOTENCY_KEY_TTL_S)


class SubmitKey(models.Model):
    """An Idempotency-Key a user sent with a submit, and the job that submit created.

    Written in the job's own transaction (jobs.actions.submit_job_once), so a job whose answer
    was lost always has its key, and a retry gets that job back instead of a second one. The
    unique constraint, not a look-up, is what makes two requests racing with one key create
    one job.
    """

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="submit_keys"
    )
    key = models.CharField(max_length=255)
    # SHA-256 of the request body as canonical JSON: the same key with another body is refused.
    request_sha256 = models.CharField(max_length=64)
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="submit_keys")
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    objects = SubmitKeyQuerySet.as_manager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user", "key"], name="submit_key_unique_per_user")
        ]

    def __str__(self) -> str:
        return f"submit key {self.key!r} of user {self.user_id} -> job {self.job_id}"
