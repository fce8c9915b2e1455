from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import serializers

from controlplane.cluster.models import Pool
from controlplane.storage import actions, rules
from controlplane.storage.models import Volume
from controlplane.tenancy.models import Tenant


class VolumeSerializer(serializers.ModelSerializer):
    """A volume as cluster admins see and write it, host path included."""

    # Plain text fields: the rules, not the model's validators, say what a name and a source
    # may be (one wording for the API, the pages and the admin). Whitespace is kept so that a
    # path with a stray space is refused, not silently changed.
    name = serializers.CharField(max_length=63, trim_whitespace=False)
    # (The metaclass takes declared fields off the class, so this never shadows Field.source.)
    source = serializers.CharField(  # type: ignore[assignment]
        max_length=rules.MAX_SOURCE_LENGTH,
        trim_whitespace=False,
        help_text="An absolute host path (host_path) or the container engine's volume name",
    )
    pools: serializers.SlugRelatedField[Pool] = serializers.SlugRelatedField(
        slug_field="name",
        queryset=Pool.objects.all(),
        many=True,
        required=False,
        help_text="The pools whose nodes have it; empty: every pool",
    )
    tenants: serializers.SlugRelatedField[Tenant] = serializers.SlugRelatedField(
        slug_field="slug",
        queryset=Tenant.objects.all(),
        many=True,
        required=False,
        help_text="The tenants that may mount it (besides all_tenants)",
    )
    checkpoint_retention_s = serializers.IntegerField(
        required=False, min_value=0, max_value=rules.MAX_RETENTION_S
    )
    nodes = serializers.SerializerMethodField(help_text="The nodes that reported having it")

    class Meta:
        model = Volume
        fields = [
            "id",
            "name",
            "description",
            "kind",
            "source",
            "pools",
            "all_tenants",
            "tenants",
            "read_only",
            "per_tenant_subdir",
            "checkpoints",
            "checkpoint_retention_s",
            "created_at",
            "nodes",
        ]
        read_only_fields = ["created_at"]
        # The one-checkpoint-volume constraint is checked by the rules, in their words.
        extra_kwargs: dict[str, dict[str, Any]] = {"checkpoints": {"validators": []}}

    def get_nodes(self, obj) -> list[str]:
        return self.context.get("nodes_by_volume", {}).get(obj.name, [])

    def validate(self, attrs):
        values = {k: v for k, v in attrs.items() if k not in actions.VOLUME_RELATIONS}
        try:
            rules.check_volume(values, self.instance)
        except DjangoValidationError as exc:
            raise serializers.ValidationError(exc.message_dict) from None
        return attrs

    # Writes go through the actions: audited, and the scheduler hears of a change at once.

    def create(self, validated_data: dict[str, Any]):
        return actions.create_volume(actor=self.context["request"].user, **validated_data)

    def update(self, instance, validated_data: dict[str, Any]):
        return actions.update_volume(instance, actor=self.context["request"].user, **validated_data)


class VolumeSummarySerializer(serializers.ModelSerializer):
    """What a researcher sees of a volume their tenant may mount. Not the host path: it says
    where the cluster's storage lives, which a job never needs (it names the volume)."""

    class Meta:
        model = Volume
        fields = ["name", "description", "kind", "read_only", "per_tenant_subdir", "checkpoints"]
        read_only_fields = fields
