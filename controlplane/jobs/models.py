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


class Hold(models.TextChoices):
    """Why a PENDING job is kept from the scheduler (controlplane.jobs.holds): the scheduler
    never reads held jobs, so thousands of them cost a cycle nothing."""

    NONE = "", "Not held"
    DEPENDENCY = "dependency", "Waiting for its dependencies"
    ARRAY = "array", "Waiting for a slot of its array (max_parallel)"


class JobArray(models.Model):
    """One submission of many tasks (a sweep). Each task is an ordinary Job with its index."""

    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="job_arrays")
    submitted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="job_arrays"
    )
    name = models.CharField(max_length=200)
    # The indexes as submitted ("0-99", "1,3,5-9", or a count N meaning 0..N-1), and how many.
    spec = models.CharField(max_length=1000)
    size = models.PositiveIntegerField()
    # At most this many of its tasks hold GPUs or may be admitted at once (Slurm's `%`);
    # null: no limit beyond the tenant's quotas.
    max_parallel = models.PositiveIntegerField(null=True, blank=True)
    submitted_at = models.DateTimeField(default=timezone.now, db_index=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    # Some job depends on the array as a whole: the end of its last task must resolve them.
    has_dependents = models.BooleanField(default=False)

    class Meta:
        ordering = ["-submitted_at", "-id"]
        indexes = [models.Index(fields=["tenant", "submitted_at"])]

    def __str__(self) -> str:
        return f"array {self.pk} {self.name} ({self.size} tasks)"


class Job(models.Model):
    # No index of its own: (tenant, state) below leads with it. Every index is one more write
    # at each insert, and at each update that moves a row off its page, of the table written
    # most (issue 14: a job's row is written about eight times between submit and its end).
    tenant = models.ForeignKey(
        Tenant, on_delete=models.PROTECT, related_name="jobs", db_index=False
    )
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
    # [{"volume": name, "path": container path, "read_only": bool}], validated at submit.
    mounts = models.JSONField(default=list, blank=True)
    # The notice it gets before it is stopped for any reason: this signal, then the grace, then
    # SIGKILL. Stored as resolved at submit (the admin's default filled in).
    stop_signal = models.CharField(max_length=16, default="SIGTERM")
    preemption_grace_s = models.PositiveIntegerField(default=30)
    # What the job says of itself: it checkpoints about this often (predicts the work a
    # preemption would lose).
    checkpoint_interval_s = models.PositiveIntegerField(null=True, blank=True)
    # Where its GPUCP_CHECKPOINT_DIR lives (<source>/checkpoints/<tenant>/<job id>), fixed at
    # submit so every attempt sees the same one; null: no checkpoint volume was defined.
    checkpoint_volume = models.ForeignKey(
        "storage.Volume", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    checkpoint_bytes = models.PositiveBigIntegerField(default=0)  # as last reported
    checkpoint_deleted_at = models.DateTimeField(null=True, blank=True)
    # A task of an array, with its index in it.
    array = models.ForeignKey(  # indexed by (array, state) and the unique (array, index)
        JobArray,
        null=True,
        blank=True,
        on_delete=models.CASCADE,
        related_name="tasks",
        db_index=False,
    )
    array_index = models.PositiveIntegerField(null=True, blank=True)
    # PENDING but kept from the scheduler, and why (Hold); "" for every other job.
    hold = models.CharField(max_length=16, choices=Hold.choices, blank=True, default="")
    # Some job depends on this one: its end must resolve them (no query for the others).
    has_dependents = models.BooleanField(default=False)

    # Indexed by (state, submitted_at), which also answers every query on the state alone.
    state = models.CharField(max_length=16, choices=JobState.choices, default=JobState.PENDING)
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
    # Times an attempt of it was preempted (or drained away) and the job requeued: the
    # scheduler's bound on restarts per job (SCHEDULER_POLICY max_preemptions) reads it.
    preemptions = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["-submitted_at", "-id"]
        indexes = [
            models.Index(fields=["tenant", "state"]),
            models.Index(fields=["state", "submitted_at"]),
            # What the scheduler reads: pending jobs that are not held, in submit order.
            models.Index(
                fields=["submitted_at", "id"],
                condition=Q(state="PENDING", hold=""),
                name="job_schedulable",
            ),
            # The live jobs that received GPU time in attempts that ended (preempted, lost,
            # requeued): the scheduler reads their earlier service every cycle, and without
            # this it joined every attempt ever made to every waiting job.
            models.Index(
                fields=["id"],
                condition=Q(state="PENDING", attempt_count__gt=0)
                | Q(state__in=["ADMITTED", "RUNNING"], attempt_count__gt=1),
                name="job_with_earlier_attempts",
            ),
            models.Index(fields=["array", "state"]),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["array", "array_index"],
                condition=Q(array__isnull=False),
                name="job_array_index_unique",
            )
        ]

    def __str__(self) -> str:
        return f"job {self.pk} {self.name} ({self.state})"

    @property
    def is_finished(self) -> bool:
        return self.state in FINISHED_JOB_STATES


class DependencyCondition(models.TextChoices):
    SUCCEEDED = "succeeded"  # Slurm's afterok
    FAILED = "failed"  # afternotok
    FINISHED = "finished"  # afterany: succeeded, failed or cancelled


class DependencyState(models.TextChoices):
    WAITING = "waiting"
    MET = "met"
    NEVER = "never"  # can no longer be met: the dependent job is cancelled, saying so


class JobDependency(models.Model):
    """`job` may start only once `on_job` (or every task of `on_array`) ended as `condition` says."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="dependencies")
    on_job = models.ForeignKey(
        Job, null=True, blank=True, on_delete=models.CASCADE, related_name="dependents"
    )
    on_array = models.ForeignKey(
        JobArray, null=True, blank=True, on_delete=models.CASCADE, related_name="dependents"
    )
    condition = models.CharField(max_length=16, choices=DependencyCondition.choices)
    state = models.CharField(
        max_length=16, choices=DependencyState.choices, default=DependencyState.WAITING
    )
    resolved_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["job", "id"]
        constraints = [
            models.CheckConstraint(
                condition=Q(on_job__isnull=False, on_array__isnull=True)
                | Q(on_job__isnull=True, on_array__isnull=False),
                name="dependency_one_target",
            )
        ]
        indexes = [models.Index(fields=["job", "state"])]

    def __str__(self) -> str:
        target = f"job {self.on_job_id}" if self.on_job_id else f"array {self.on_array_id}"
        return f"job {self.job_id} after {target} {self.condition} ({self.state})"


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

    # Neither key has an index of its own: the unique (job, number) and (node, state) lead
    # with them (each index is one more write per insert and per non-HOT update).
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="attempts", db_index=False)
    number = models.PositiveIntegerField()
    node = models.ForeignKey(
        Node, on_delete=models.PROTECT, related_name="attempts", db_index=False
    )
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
    # The last checkpoint the job reported during this attempt (a marker file or a log line).
    last_checkpoint_at = models.DateTimeField(null=True, blank=True)
    # How a stop went, as the node reports it: when the job got its signal, and whether it had to
    # be killed at the end of its grace (null: not stopped by the node, or not known).
    stop_signal_at = models.DateTimeField(null=True, blank=True)
    killed_after_grace = models.BooleanField(null=True, blank=True)
    # Admitted while its tenant was past its checkpoint storage limit: the attempt may read its
    # checkpoint directory but not write to it.
    checkpoint_read_only = models.BooleanField(default=False)
    # The job contract's rendezvous (docs/job-contract.md), fixed at admission: the port its
    # rank-0 node keeps for it (from that node's job port range), and every member's address in
    # rank order (the first is the master address). Copied from its members so that a
    # heartbeat's answer reads them with the attempt.
    master_port = models.PositiveIntegerField(null=True, blank=True)
    node_addrs = models.JSONField(default=list, blank=True)

    class Meta:
        ordering = ["job", "number"]
        constraints = [
            models.UniqueConstraint(fields=["job", "number"], name="attempt_unique_number")
        ]
        indexes = [
            models.Index(fields=["node", "state"]),
            # The scheduler's duration history: the latest successful attempts, read every
            # cycle from the newest end backwards (controlplane/scheduling/loader.py).
            models.Index(
                fields=["finished_at", "id"],
                condition=Q(state="SUCCEEDED", started_at__isnull=False),
                name="attempt_succeeded_by_end",
            ),
        ]

    def __str__(self) -> str:
        return f"attempt {self.pk} of job {self.job_id} on {self.node_id} ({self.state})"

    @property
    def is_active(self) -> bool:
        return self.state in ACTIVE_ATTEMPT_STATES


class AttemptMember(models.Model):
    """An attempt's part on one node: every attempt has one per node holding its GPUs (a one-node
    attempt, one: rank 0). Each node reports its own member; the attempt ends once all have.

    Rank 0 is the node holding the most of the attempt's GPUs (ties: the attempt's own node,
    then node name): its address is the job's master address.
    """

    # Indexed by the unique (attempt, rank) and by (node, state), which lead with them.
    attempt = models.ForeignKey(
        JobAttempt, on_delete=models.CASCADE, related_name="members", db_index=False
    )
    node = models.ForeignKey(
        Node, on_delete=models.PROTECT, related_name="attempt_members", db_index=False
    )
    rank = models.PositiveIntegerField()
    # The node's advertised address at admission: what the other members reach it at.
    address = models.CharField(max_length=255)
    gpus = models.PositiveIntegerField(default=0)
    state = models.CharField(
        max_length=16, choices=AttemptState.choices, default=AttemptState.ADMITTED
    )
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    # How it ended, in words (a failure to start, a loss, the stop of its gang).
    message = models.TextField(blank=True, default="")
    # Bytes of its output stored (each node ships its member's own output: LogChunk.member).
    log_bytes = models.PositiveBigIntegerField(default=0)

    class Meta:
        ordering = ["attempt", "rank"]
        constraints = [
            models.UniqueConstraint(fields=["attempt", "rank"], name="member_unique_rank"),
            models.UniqueConstraint(fields=["attempt", "node"], name="member_unique_node"),
        ]
        indexes = [models.Index(fields=["node", "state"])]

    def __str__(self) -> str:
        return f"rank {self.rank} of attempt {self.attempt_id} on {self.node_id} ({self.state})"

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

    # Indexed by the unique (attempt, member, offset), which leads with it.
    attempt = models.ForeignKey(
        JobAttempt, on_delete=models.CASCADE, related_name="log_chunks", db_index=False
    )
    # Whose output: each member's is its own byte stream (null: stored before members existed).
    member = models.ForeignKey(
        AttemptMember, null=True, blank=True, on_delete=models.CASCADE, related_name="log_chunks"
    )
    offset = models.PositiveBigIntegerField()
    data = OutputBytesField()
    received_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["attempt", "offset"]
        constraints = [
            models.UniqueConstraint(
                fields=["attempt", "member", "offset"],
                name="log_chunk_unique_offset",
                nulls_distinct=False,
            )
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
