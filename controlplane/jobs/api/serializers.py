"""Jobs as the API shows them, and the submit form whose rules live in jobs.validation."""

from django.contrib.auth.models import User
from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from controlplane.cluster.models import Node
from controlplane.jobs import actions, validation
from controlplane.jobs.models import Allocation, Job, JobAttempt, JobEvent, PriorityClass
from controlplane.tenancy.models import Tenant


@extend_schema_field(
    {
        "type": "string",
        "pattern": validation.IMAGE_PATTERN,
        "maxLength": validation.MAX_IMAGE_CHARS,
    }
)
class ImageReferenceField(serializers.CharField):
    """An image reference; the schema states the rule that validation.clean_image applies."""


class JobSerializer(serializers.ModelSerializer):
    tenant: serializers.SlugRelatedField[Tenant] = serializers.SlugRelatedField(
        slug_field="slug", read_only=True
    )
    submitted_by: serializers.SlugRelatedField[User] = serializers.SlugRelatedField(
        slug_field="username", read_only=True
    )

    class Meta:
        model = Job
        fields = [
            "id",
            "tenant",
            "submitted_by",
            "name",
            "image",
            "command",
            "env",
            "gpus",
            "gpu_type",
            "cpus",
            "memory_mib",
            "priority",
            "preemptible",
            "restartable",
            "max_runtime_s",
            "estimated_duration_s",
            "state",
            "state_reason",
            "pending_reason_code",
            "pending_reason",
            "queue_position",
            "estimated_start_at",
            "predicted_duration_s",
            "submitted_at",
            "started_at",
            "finished_at",
            "exit_code",
            "attempt_count",
        ]
        read_only_fields = fields
        extra_kwargs = {
            "pending_reason": {"help_text": "Why it is still waiting, in words"},
            "queue_position": {"help_text": "1 = next in line"},
            "predicted_duration_s": {"help_text": "The scheduler's prediction from history"},
        }


class JobEventSerializer(serializers.ModelSerializer):
    actor: serializers.SlugRelatedField[User] = serializers.SlugRelatedField(
        slug_field="username", read_only=True
    )

    class Meta:
        model = JobEvent
        fields = ["id", "at", "kind", "from_state", "to_state", "message", "actor", "data"]
        read_only_fields = fields


class AllocatedGpuSerializer(serializers.ModelSerializer):
    uuid = serializers.CharField(source="gpu.uuid", read_only=True)
    node = serializers.CharField(source="gpu.node.name", read_only=True)
    index = serializers.IntegerField(source="gpu.index", read_only=True)
    model = serializers.CharField(source="gpu.model", read_only=True)

    class Meta:
        model = Allocation
        fields = ["uuid", "node", "index", "model", "active"]
        read_only_fields = fields


class JobAttemptSerializer(serializers.ModelSerializer):
    node: serializers.SlugRelatedField[Node] = serializers.SlugRelatedField(
        slug_field="name", read_only=True
    )
    gpus = AllocatedGpuSerializer(source="allocations", many=True, read_only=True)

    class Meta:
        model = JobAttempt
        fields = [
            "id",
            "number",
            "node",
            "gpus",
            "state",
            "borrowed",
            "created_at",
            "started_at",
            "finished_at",
            "exit_code",
            "stop_requested_at",
            "stop_reason",
            "gpu_seconds",
            "energy_j",
            "energy_estimated",
            "log_bytes",
        ]
        read_only_fields = fields


class JobDetailSerializer(JobSerializer):
    attempts = JobAttemptSerializer(many=True, read_only=True)
    events = JobEventSerializer(many=True, read_only=True)

    class Meta(JobSerializer.Meta):
        fields = [*JobSerializer.Meta.fields, "attempts", "events"]
        read_only_fields = fields


class JobSubmitSerializer(serializers.Serializer):
    """The fields of a submit. They describe the schema; the checking and the defaults are
    jobs.validation's (DEFAULTS), the same the web form runs, so no rule differs between the two."""

    tenant = serializers.CharField(
        required=False, help_text="Tenant slug; a member of exactly one tenant may leave it out"
    )
    name = serializers.CharField(
        required=False, allow_blank=True, help_text="Defaults to the image's name"
    )
    image = ImageReferenceField(help_text=validation.IMAGE_HELP)
    command = serializers.ListField(
        child=serializers.CharField(allow_blank=True, trim_whitespace=False),
        help_text='The program and its arguments, e.g. ["python", "train.py"]',
    )
    env = serializers.DictField(
        child=serializers.CharField(allow_blank=True, trim_whitespace=False), required=False
    )
    gpus = serializers.IntegerField(min_value=0, default=validation.DEFAULTS["gpus"])
    gpu_type = serializers.CharField(
        required=False, allow_blank=True, help_text="A GPU model; empty for any type"
    )
    cpus = serializers.FloatField(min_value=0, default=validation.DEFAULTS["cpus"])
    memory_mib = serializers.IntegerField(min_value=1, default=validation.DEFAULTS["memory_mib"])
    priority = serializers.ChoiceField(
        choices=PriorityClass.choices, default=validation.DEFAULTS["priority"]
    )
    preemptible = serializers.BooleanField(
        default=validation.DEFAULTS["preemptible"],
        help_text="May be preempted when it runs on borrowed GPUs",
    )
    restartable = serializers.BooleanField(
        default=validation.DEFAULTS["restartable"],
        help_text="Checkpoints: may be requeued after a preemption or a lost node",
    )
    max_runtime_s = serializers.IntegerField(
        min_value=1,
        max_value=validation.MAX_RUNTIME_S,
        default=validation.DEFAULTS["max_runtime_s"],
    )
    estimated_duration_s = serializers.IntegerField(
        min_value=1, max_value=validation.MAX_RUNTIME_S, required=False, allow_null=True
    )

    def to_internal_value(self, data):
        try:
            return validation.clean_submission(data, self.context["tenant"])
        except DjangoValidationError as exc:
            raise serializers.ValidationError(exc.message_dict) from None

    def create(self, validated_data):
        return actions.submit_job(
            tenant=self.context["tenant"], user=self.context["request"].user, **validated_data
        )


class JobLogsQuerySerializer(serializers.Serializer):
    attempt = serializers.IntegerField(
        required=False, min_value=1, help_text="Attempt number; the latest when left out"
    )
    tail = serializers.IntegerField(
        required=False, min_value=0, max_value=100_000, help_text="Only the last N lines"
    )
    encoding = serializers.ChoiceField(
        choices=["text", "base64"],
        default="text",
        help_text=(
            "text: the output as text, with NUL and bytes that are not UTF-8 written \\xNN; "
            "base64: also the exact bytes, in data_b64"
        ),
    )


class JobLogsSerializer(serializers.Serializer):
    job = serializers.IntegerField()
    attempt = serializers.IntegerField(allow_null=True, help_text="null: no attempt yet")
    attempts = serializers.ListField(
        child=serializers.IntegerField(), help_text="Numbers of every attempt of the job"
    )
    node = serializers.CharField(allow_null=True)
    tail = serializers.IntegerField(allow_null=True)
    size_bytes = serializers.IntegerField(help_text="Bytes of output the attempt shipped so far")
    truncated = serializers.BooleanField(
        help_text="True when the start was cut off to keep the answer small"
    )
    text = serializers.CharField(allow_blank=True)
    data_b64 = serializers.CharField(
        required=False,
        allow_blank=True,
        help_text="With encoding=base64: exactly the bytes the program wrote, base64",
    )
