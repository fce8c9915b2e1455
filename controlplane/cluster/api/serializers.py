"""Pools, nodes and GPUs as members see them (a summary: which jobs hold a GPU is not shown),
and join tokens for cluster admins."""

from collections import Counter

from django.contrib.auth.models import User
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from controlplane.cluster import actions, rules
from controlplane.cluster.models import (
    GPU,
    GpuClaimConflict,
    GpuClaimResolution,
    JoinToken,
    Node,
    Pool,
)
from controlplane.permissions import is_cluster_admin


class PoolSerializer(serializers.ModelSerializer):
    nodes = serializers.IntegerField(source="node_count", read_only=True, default=0)
    gpus = serializers.IntegerField(source="gpu_count", read_only=True, default=0)
    power_max_w = serializers.FloatField(
        read_only=True,
        allow_null=True,
        default=None,
        help_text="Sum of the GPUs' maximum power caps",
    )
    power_draw_w = serializers.FloatField(
        read_only=True, allow_null=True, default=None, help_text="Sum of the GPUs' reported draw"
    )

    class Meta:
        model = Pool
        fields = ["id", "name", "power_budget_w", "nodes", "gpus", "power_max_w", "power_draw_w"]
        extra_kwargs = {
            "power_budget_w": {
                "help_text": "Most watts the pool's GPUs may draw together; null: none"
            }
        }

    def validate_power_budget_w(self, value):
        if problem := rules.power_budget_problem(value):
            raise serializers.ValidationError(problem)
        return value

    # Writes go through the actions (audited, and the scheduler hears of a new budget at once).

    def create(self, validated_data):
        return actions.create_pool(actor=self.context["request"].user, **validated_data)

    def update(self, instance, validated_data):
        return actions.update_pool(instance, actor=self.context["request"].user, **validated_data)


class NodeSerializer(serializers.ModelSerializer):
    pool: serializers.SlugRelatedField[Pool] = serializers.SlugRelatedField(
        slug_field="name", read_only=True
    )
    status = serializers.CharField(read_only=True, help_text="The admin state, or down")
    gpus_total = serializers.SerializerMethodField()
    gpus_allocated = serializers.SerializerMethodField()
    gpus_free = serializers.SerializerMethodField()
    gpu_models = serializers.SerializerMethodField(help_text="GPU model -> how many")
    power_draw_w = serializers.SerializerMethodField(help_text="Sum of its GPUs' reported draw")

    class Meta:
        model = Node
        fields = [
            "id",
            "name",
            "pool",
            "status",
            "state",
            "ready",
            "last_heartbeat_at",
            "labels",
            "cpus",
            "memory_mib",
            "agent_version",
            "runtime",
            "advertise_address",
            "job_port_min",
            "job_port_max",
            "conditions",
            "gpus_total",
            "gpus_allocated",
            "gpus_free",
            "gpu_models",
            "power_draw_w",
            "deregistered_at",
        ]
        read_only_fields = fields
        extra_kwargs = {
            "deregistered_at": {
                "help_text": "When an admin deregistered it (gone for good); null: it was not"
            }
        }

    # The node's GPUs are prefetched with an `allocated` flag (see NodeViewSet).

    def get_gpus_total(self, obj) -> int:
        return len(obj.gpus.all())

    def get_gpus_allocated(self, obj) -> int:
        return sum(1 for g in obj.gpus.all() if getattr(g, "allocated", False))

    def get_gpus_free(self, obj) -> int:
        return sum(1 for g in obj.gpus.all() if g.healthy and not getattr(g, "allocated", False))

    @extend_schema_field({"type": "object", "additionalProperties": {"type": "integer"}})
    def get_gpu_models(self, obj) -> dict:
        return dict(Counter(g.model for g in obj.gpus.all()))

    @extend_schema_field(serializers.FloatField(allow_null=True))
    def get_power_draw_w(self, obj) -> float | None:
        draws = [g.power_draw_w for g in obj.gpus.all() if g.power_draw_w is not None]
        return sum(draws) if draws else None


class GpuSerializer(serializers.ModelSerializer):
    """A GPU as everyone sees it, but for its UUID, which only cluster admins see.

    The UUID is the GPU's hardware identity: agents report by it, and a registration that
    lists another node's UUIDs claims those GPUs (controlplane.cluster.gpu_claims refuses it
    while their node is not gone for good). Nobody else needs it, so the API does not hand the
    whole cluster's list to every signed-in user. (A job can still read its own GPUs' UUIDs
    through nvidia-smi: hiding them is a second line, the claim rule is the first.)
    """

    node: serializers.SlugRelatedField[Node] = serializers.SlugRelatedField(
        slug_field="name", read_only=True
    )
    pool = serializers.CharField(source="node.pool.name", read_only=True)
    allocated = serializers.BooleanField(
        read_only=True, default=False, help_text="Held by a job's attempt now"
    )

    class Meta:
        model = GPU
        fields = [
            "id",
            "uuid",
            "node",
            "pool",
            "index",
            "model",
            "memory_mib",
            "healthy",
            "allocated",
            "power_min_w",
            "power_max_w",
            "power_default_w",
            "desired_power_cap_w",
            "power_cap_w",
            "utilization_pct",
            "memory_used_mib",
            "power_draw_w",
            "energy_j",
            "temperature_c",
            "sm_clock_mhz",
            "throttle_reasons",
            "ecc_errors",
            "telemetry_at",
        ]
        read_only_fields = fields
        extra_kwargs = {
            "throttle_reasons": {
                "help_text": "Why the clocks are held down now ([]: they are not); null: unknown"
            },
            "ecc_errors": {
                "help_text": "Uncorrected ECC errors since the driver loaded; null: unknown"
            },
            "uuid": {"help_text": "Hardware identity; in answers to cluster admins only"},
        }

    def to_representation(self, instance):
        data = super().to_representation(instance)
        request = self.context.get("request")
        if request is None or not is_cluster_admin(request.user):
            data.pop("uuid", None)
        return data


class JoinTokenSerializer(serializers.ModelSerializer):
    pool = serializers.SlugRelatedField(slug_field="name", queryset=Pool.objects.all())
    created_by: serializers.SlugRelatedField[User] = serializers.SlugRelatedField(
        slug_field="username", read_only=True
    )
    usable = serializers.BooleanField(source="is_usable", read_only=True)
    expires_at = serializers.DateTimeField(
        required=False, help_text="At most 30 days ahead; a day from now when left out"
    )

    class Meta:
        model = JoinToken
        fields = [
            "id",
            "prefix",
            "pool",
            "created_by",
            "created_at",
            "expires_at",
            "max_uses",
            "node_name",
            "uses",
            "revoked_at",
            "usable",
        ]
        read_only_fields = ["prefix", "created_by", "created_at", "uses", "revoked_at"]
        extra_kwargs = {
            "max_uses": {
                "min_value": 1,
                "max_value": rules.MAX_JOIN_TOKEN_USES,
                "help_text": "How many nodes may register with it",
            },
            "node_name": {
                "help_text": "Blank: new nodes only. A node's name: that node only, and it may "
                "register again (to re-join a node whose agent lost its state)"
            },
        }

    def validate_node_name(self, value):
        if problem := rules.join_token_node_name_problem(value):
            raise serializers.ValidationError(problem)
        return value

    def validate_expires_at(self, value):
        if problem := rules.join_token_expiry_problem(value, timezone.now()):
            raise serializers.ValidationError(problem)
        return value

    def create(self, validated_data):
        values = dict(validated_data)
        token, raw = actions.create_join_token(
            values.pop("pool"), actor=self.context["request"].user, **values
        )
        token.raw_token = raw
        return token


class JoinTokenCreatedSerializer(JoinTokenSerializer):
    token = serializers.SerializerMethodField(
        help_text="The secret, shown this once: only its hash is stored"
    )

    class Meta(JoinTokenSerializer.Meta):
        fields = [*JoinTokenSerializer.Meta.fields, "token"]

    @extend_schema_field(OpenApiTypes.STR)
    def get_token(self, obj) -> str:
        return obj.raw_token


class GpuClaimConflictSerializer(serializers.ModelSerializer):
    holder = serializers.CharField(
        source="holder_name", read_only=True, help_text="The node that holds the GPU"
    )
    join_token = serializers.CharField(
        source="join_token.prefix",
        read_only=True,
        allow_null=True,
        default=None,
        help_text="Prefix of the join token the refused registration used",
    )
    resolved_by: serializers.SlugRelatedField[User] = serializers.SlugRelatedField(
        slug_field="username", read_only=True
    )
    open = serializers.SerializerMethodField(help_text="Not resolved yet")

    class Meta:
        model = GpuClaimConflict
        fields = [
            "id",
            "gpu_uuid",
            "claimant",
            "holder",
            "reason",
            "join_token",
            "refusals",
            "first_refused_at",
            "last_refused_at",
            "open",
            "resolved_at",
            "resolved_by",
            "resolution",
        ]
        read_only_fields = fields
        extra_kwargs = {
            "claimant": {"help_text": "The node name the refused registration asked for"},
            "reason": {"help_text": "Why the holder still counts as holding the GPU"},
            "refusals": {"help_text": "How many registrations were refused for it"},
        }

    def get_open(self, obj) -> bool:
        return obj.resolved_at is None


class GpuClaimResolveSerializer(serializers.Serializer):
    resolution = serializers.ChoiceField(
        choices=[
            (GpuClaimResolution.HOLDER_DEREGISTERED.value, "Deregister the holder node"),
            (GpuClaimResolution.DISMISSED.value, "Dismiss the claim"),
        ],
        help_text="holder_deregistered: the GPU really moved, its old node is gone for good "
        "(refused while that node runs work); the claimant's next registration takes it. "
        "dismissed: the claim was wrong or hostile; nothing else changes (revoke its join "
        "token if need be).",
    )
