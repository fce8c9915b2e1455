"""Pools, nodes, their GPUs, telemetry, and the tokens nodes join and talk with."""

import re

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

# What a node may be called: a host name, loosely (agents register under theirs).
NODE_NAME_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?$")


class Pool(models.Model):
    name = models.SlugField(max_length=63, unique=True)
    # The most watts the pool's GPUs may draw together (a PDU or facility limit); null = none.
    power_budget_w = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=Q(power_budget_w__isnull=True) | Q(power_budget_w__gt=0),
                name="pool_budget_positive",
            )
        ]

    def __str__(self) -> str:
        return self.name


class NodeState(models.TextChoices):
    """What an admin wants of a node. Liveness is kept apart, in Node.ready."""

    READY = "ready", "Ready"
    CORDONED = "cordoned", "Cordoned (no new work)"
    DRAINING = "draining", "Draining (no new work, borrowed work is preempted)"


class Node(models.Model):
    name = models.CharField(max_length=253, unique=True)
    pool = models.ForeignKey(Pool, on_delete=models.PROTECT, related_name="nodes")
    labels = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=16, choices=NodeState.choices, default=NodeState.READY)
    # Liveness, owned by the heartbeat and the liveness sweep: a node that stopped answering is
    # "down" whatever its admin state, and comes back in that same admin state.
    ready = models.BooleanField(default=True)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    heartbeat_interval_s = models.FloatField(default=10.0)
    cpus = models.PositiveIntegerField(default=0)
    memory_mib = models.PositiveBigIntegerField(default=0)
    agent_version = models.CharField(max_length=64, blank=True, default="")
    runtime = models.CharField(max_length=32, blank=True, default="")
    # Problems the agent reported that need a person (a cap it could not apply, a lost GPU).
    conditions = models.JSONField(default=list, blank=True)
    # The names of the volumes (controlplane.storage) the agent found on the host, as it last
    # reported them: the scheduler places a job only where every volume it asks for is.
    volumes = models.JSONField(default=list, blank=True)
    volumes_reported_at = models.DateTimeField(null=True, blank=True)
    # The address the node's jobs reach each other at (its agent's --advertise-address, by
    # default the source address of its route to the control plane), and the ports it keeps
    # for its jobs' rendezvous (--job-port-range): each as its agent last reported them.
    advertise_address = models.CharField(max_length=255, blank=True, default="")
    job_port_min = models.PositiveIntegerField(default=29500)
    job_port_max = models.PositiveIntegerField(default=29999)
    token_hash = models.CharField(max_length=64, unique=True, null=True, blank=True)
    token_prefix = models.CharField(max_length=16, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    # Set by an admin for a node that is gone for good (controlplane.cluster.gpu_claims): its
    # token is revoked and its GPUs may join another node. A re-join clears it.
    deregistered_at = models.DateTimeField(null=True, blank=True)
    # The last registration: when, with which join token, and the hash of the key its agent
    # sent, so that the agent's retry of it (its answer lost on the way) gets a node token again
    # instead of a refusal for a join token it already spent (actions.register_node).
    registered_at = models.DateTimeField(null=True, blank=True)
    registration_join_token = models.ForeignKey(
        "JoinToken", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    registration_key_hash = models.CharField(max_length=64, blank=True, default="")
    # The number of the agent's latest try of it that got a node token: an earlier try that
    # reaches the control plane later (still in flight when the agent gave up on it) gets none.
    registration_try = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def status(self) -> str:
        if self.deregistered_at is not None:
            return "deregistered"
        return self.state if self.ready else "down"

    @property
    def schedulable(self) -> bool:
        return self.ready and self.state == NodeState.READY


class GPU(models.Model):
    # Indexed by the unique (node, index), which leads with it.
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus", db_index=False)
    index = models.PositiveIntegerField()
    uuid = models.CharField(max_length=96, unique=True)
    model = models.CharField(max_length=64)
    memory_mib = models.PositiveIntegerField()
    power_min_w = models.FloatField()
    power_max_w = models.FloatField()
    power_default_w = models.FloatField()
    # What the scheduler wants the cap to be, and what the agent last saw enforced.
    desired_power_cap_w = models.FloatField(null=True, blank=True)
    power_cap_w = models.FloatField(null=True, blank=True)
    healthy = models.BooleanField(default=True)
    # Latest telemetry. Null means "not reported" (NVML NotSupported), never zero.
    utilization_pct = models.FloatField(null=True, blank=True)
    memory_used_mib = models.FloatField(null=True, blank=True)
    power_draw_w = models.FloatField(null=True, blank=True)
    energy_j = models.FloatField(null=True, blank=True)
    temperature_c = models.FloatField(null=True, blank=True)
    sm_clock_mhz = models.FloatField(null=True, blank=True)
    # Health as the agent last reported it: why the clocks are held down (NVML's reasons as
    # names, [] = none), and uncorrected ECC errors since the driver loaded. Null: unknown.
    throttle_reasons = models.JSONField(null=True, blank=True)
    ecc_errors = models.BigIntegerField(null=True, blank=True)
    telemetry_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["node__name", "index"]
        constraints = [
            models.UniqueConstraint(fields=["node", "index"], name="gpu_unique_index_per_node"),
            models.CheckConstraint(
                condition=Q(power_min_w__lte=models.F("power_max_w")),
                name="gpu_power_limits_ordered",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.node.name}/gpu{self.index} ({self.model})"


class GpuTelemetry(models.Model):
    """Downsampled history: one row per GPU per bucket (the bucket is a setting)."""

    # Indexed by the unique (gpu, bucket_at), which leads with it: this table is written at
    # every heartbeat, and each index is one more write.
    gpu = models.ForeignKey(GPU, on_delete=models.CASCADE, related_name="telemetry", db_index=False)
    bucket_at = models.DateTimeField()
    utilization_pct = models.FloatField(null=True)
    memory_used_mib = models.FloatField(null=True)
    power_draw_w = models.FloatField(null=True)
    power_cap_w = models.FloatField(null=True)
    temperature_c = models.FloatField(null=True)
    samples = models.PositiveIntegerField(default=1)

    class Meta:
        ordering = ["gpu", "bucket_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["gpu", "bucket_at"], name="telemetry_one_row_per_bucket"
            )
        ]
        # The pool and cluster charts and the retention prune read a time range over every GPU:
        # the unique index leads with the GPU and cannot serve them.
        indexes = [models.Index(fields=["bucket_at"], name="telemetry_bucket_at")]


class JoinToken(models.Model):
    """Lets a new agent register its node once (or a few times) before it expires."""

    token_hash = models.CharField(max_length=64, unique=True)
    prefix = models.CharField(max_length=16)
    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="join_tokens")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    max_uses = models.PositiveIntegerField(default=1)
    uses = models.PositiveIntegerField(default=0)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # Blank: the token registers new nodes only. A name: it registers that node alone, and may
    # register it again (a host whose state directory, and so its node token, was lost).
    node_name = models.CharField(max_length=253, blank=True, default="")

    class Meta:
        ordering = ["-created_at"]

    @property
    def is_usable(self) -> bool:
        return (
            self.revoked_at is None
            and self.expires_at > timezone.now()
            and self.uses < self.max_uses
        )


class NodeGeneration(models.Model):
    """How many times a node's desired state (its work, its caps) has changed.

    Kept by PostgreSQL triggers on the attempt, allocation and GPU tables (migration 0002), so
    no writer can forget to count a change; a heartbeat reads it with the node and answers from
    its cached answer while it has not moved (controlplane.cluster.heartbeat). A plain table
    beside the node rows, so counting a change never waits on a node's lock or liveness write.
    """

    node = models.OneToOneField(
        Node, on_delete=models.CASCADE, primary_key=True, db_constraint=False, related_name="+"
    )
    generation = models.BigIntegerField(default=0)


class LivenessClock(models.Model):
    """Since when the control plane has been able to hear its nodes without a break (one row).

    The liveness sweep counts a node's silence from the later of its last heartbeat and
    `hearing_since`. Whenever the control plane itself could not hear (no sweep ran for a while:
    the database, the broker or the worker was down; or no node at all was heard: the web tier
    was down), `hearing_since` moves to the moment it could again, so that every node gets a
    whole lease from then before any of its attempts is declared lost.
    """

    id = models.PositiveSmallIntegerField(primary_key=True, default=1)
    last_sweep_at = models.DateTimeField(null=True, blank=True)
    hearing_since = models.DateTimeField(null=True, blank=True)
    # Why the last sweep found the control plane deaf ("" when it could hear), for the operator
    # who wonders why nothing is declared lost.
    deaf_reason = models.CharField(max_length=200, blank=True, default="")


class GpuClaimResolution(models.TextChoices):
    HOLDER_DEREGISTERED = "holder_deregistered", "The holder was deregistered"
    DISMISSED = "dismissed", "Dismissed by an admin"
    CLAIMED = "claimed", "The GPU joined the claimant"


class GpuClaimConflict(models.Model):
    """A registration refused because it listed a GPU that another node still holds.

    One open row per (GPU, claimant name), however often the agent retries; an admin resolves it
    (controlplane.cluster.gpu_claims), or it resolves itself when the claimant registers with the
    GPU once its holder is gone for good.
    """

    gpu_uuid = models.CharField(max_length=96)
    # The node name the refused registration asked for (no node row exists for a new one).
    claimant = models.CharField(max_length=253)
    holder = models.ForeignKey(
        Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    holder_name = models.CharField(max_length=253)
    reason = models.CharField(max_length=300)
    join_token = models.ForeignKey(
        JoinToken, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    first_refused_at = models.DateTimeField(default=timezone.now)
    last_refused_at = models.DateTimeField(default=timezone.now)
    refusals = models.PositiveIntegerField(default=1)
    resolved_at = models.DateTimeField(null=True, blank=True)
    resolved_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    resolution = models.CharField(
        max_length=32, choices=GpuClaimResolution.choices, blank=True, default=""
    )

    class Meta:
        ordering = ["-last_refused_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["gpu_uuid", "claimant"],
                condition=Q(resolved_at__isnull=True),
                name="gpu_claim_conflict_one_open",
            )
        ]

    def __str__(self) -> str:
        return f"{self.claimant} claims {self.gpu_uuid} of {self.holder_name}"
