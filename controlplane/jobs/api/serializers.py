"""Jobs as the API shows them, and the submit form whose rules live in jobs.validation."""

import functools

from django.contrib.auth.models import User
from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from controlplane.cluster.models import Node
from controlplane.jobs import actions, dependencies, validation
from controlplane.jobs.models import (
    Allocation,
    AttemptMember,
    DependencyState,
    Job,
    JobAttempt,
    JobEvent,
    PriorityClass,
)
from controlplane.storage.paths import CHECKPOINT_TARGET
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


# Built with type(): a field named read_only shadows Field.read_only for the type checker,
# though DRF's metaclass takes declared fields out of the class attributes.
MountSerializer: type[serializers.Serializer] = type(
    "MountSerializer",
    (serializers.Serializer,),
    {
        "__module__": __name__,
        "__doc__": "A volume mounted into the job's container.",
        "volume": serializers.CharField(help_text="A volume's name"),
        "path": serializers.CharField(help_text="Where the job sees it: an absolute path"),
        "read_only": serializers.BooleanField(
            required=False, help_text="Left out: as the volume is (a read-only volume stays so)"
        ),
    },
)


DependencySerializer: type[serializers.Serializer] = type(
    "DependencySerializer",
    (serializers.Serializer,),
    {
        "__module__": __name__,
        "__doc__": "A job or array this job waits for; exactly one of job and array is given.",
        "job": serializers.IntegerField(required=False, help_text="A job of the same tenant"),
        "array": serializers.IntegerField(required=False, help_text="An array of the same tenant"),
        "condition": serializers.ChoiceField(
            choices=dependencies.CONDITIONS,
            default="succeeded",
            help_text="succeeded (every task, for an array), failed, or finished (either)",
        ),
        "state": serializers.ChoiceField(
            choices=[s.value for s in DependencyState],
            read_only=True,
            help_text="waiting; met; never: it can no longer be met (the job was cancelled)",
        ),
    },
)


def dependencies_shown(job: Job) -> list[dict]:
    shown = []
    for row in job.dependencies.all():
        target = {"job": row.on_job_id} if row.on_job_id is not None else {"array": row.on_array_id}
        shown.append({**target, "condition": row.condition, "state": row.state})
    return shown


class JobSerializer(serializers.ModelSerializer):
    mounts = MountSerializer(many=True, read_only=True)
    depends_on = serializers.SerializerMethodField()
    checkpoint_dir = serializers.SerializerMethodField()
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
            "mounts",
            "stop_signal",
            "preemption_grace_s",
            "checkpoint_interval_s",
            "checkpoint_dir",
            "checkpoint_bytes",
            "depends_on",
            "hold",
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
            "preemptions",
            "array",
            "array_index",
        ]
        read_only_fields = fields
        extra_kwargs = {
            "array": {"help_text": "The job array it is a task of; null: a job of its own"},
            "array_index": {"help_text": "Its index in its array (GPUCP_ARRAY_INDEX)"},
            "pending_reason": {"help_text": "Why it is still waiting, in words"},
            "queue_position": {"help_text": "1 = next in line"},
            "preemptions": {"help_text": "Times it was preempted and requeued"},
            "predicted_duration_s": {"help_text": "The scheduler's prediction from history"},
            "checkpoint_bytes": {"help_text": "Size of its checkpoint directory, as last measured"},
            "hold": {
                "help_text": "Why a PENDING job is kept from the scheduler: dependency (it waits "
                "for depends_on), array (its array's max_parallel); empty: not held"
            },
        }

    @extend_schema_field(
        {
            "type": "string",
            "nullable": True,
            "description": "Where the job finds its checkpoint directory ($GPUCP_CHECKPOINT_DIR "
            "in a container); null: the cluster has no checkpoint volume",
        }
    )
    @extend_schema_field(DependencySerializer(many=True))
    def get_depends_on(self, job: Job) -> list[dict]:
        return dependencies_shown(job)

    def get_checkpoint_dir(self, job: Job) -> str | None:
        return CHECKPOINT_TARGET if job.checkpoint_volume_id is not None else None


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


class AttemptMemberSerializer(serializers.ModelSerializer):
    node: serializers.SlugRelatedField[Node] = serializers.SlugRelatedField(
        slug_field="name", read_only=True
    )

    class Meta:
        model = AttemptMember
        fields = [
            "rank",
            "node",
            "address",
            "gpus",
            "state",
            "started_at",
            "finished_at",
            "exit_code",
            "message",
            "log_bytes",
        ]
        read_only_fields = fields


class JobAttemptSerializer(serializers.ModelSerializer):
    node: serializers.SlugRelatedField[Node] = serializers.SlugRelatedField(
        slug_field="name", read_only=True
    )
    gpus = AllocatedGpuSerializer(source="allocations", many=True, read_only=True)
    members = AttemptMemberSerializer(many=True, read_only=True)

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
            "last_checkpoint_at",
            "stop_signal_at",
            "killed_after_grace",
            "checkpoint_read_only",
            "master_port",
            "members",
        ]
        read_only_fields = fields


class JobDetailSerializer(JobSerializer):
    attempts = JobAttemptSerializer(many=True, read_only=True)
    events = JobEventSerializer(many=True, read_only=True)

    class Meta(JobSerializer.Meta):
        fields = [*JobSerializer.Meta.fields, "attempts", "events"]
        read_only_fields = fields


@functools.cache
def _representers() -> tuple[JobDetailSerializer, JobSerializer, JobEventSerializer]:
    # A serializer builds its fields (a ModelSerializer: from the model, every time) when first
    # asked; that was most of the cost of answering a submit. These fields only read the object
    # they are given, so one set per process serves every request and thread.
    return JobDetailSerializer(), JobSerializer(), JobEventSerializer()


def job_detail(job: Job) -> dict:
    """JobDetailSerializer's answer for a job read with its attempts and events."""
    return _representers()[0].to_representation(job)


def submitted_job_detail(submitted: actions.Submitted) -> dict:
    """The same answer for a job just submitted, from what was written: no attempt yet, and
    its one event (the tests hold it equal to a GET of the job)."""
    _, job, event = _representers()
    return {
        **job.to_representation(submitted.job),
        "attempts": [],
        "events": [event.to_representation(submitted.event)],
    }


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
        help_text="May be preempted when it runs on borrowed GPUs; false: it runs only within its "
        "tenant's guarantee",
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
    mounts = MountSerializer(  # type: ignore[call-arg]
        many=True,
        required=False,
        max_length=validation.MAX_MOUNTS,
        help_text="Volumes to mount; errors name the item, e.g. mounts[0].path",
    )
    stop_signal = serializers.ChoiceField(
        choices=validation.STOP_SIGNALS,
        default=validation.DEFAULTS["stop_signal"],
        help_text="Sent before any stop; SIGKILL follows after preemption_grace_s",
    )
    preemption_grace_s = serializers.IntegerField(
        min_value=0,
        max_value=validation.grace_max_s(),
        required=False,
        allow_null=True,
        help_text="Seconds between the stop signal and SIGKILL (left out: the cluster default)",
    )
    checkpoint_interval_s = serializers.IntegerField(
        min_value=1,
        max_value=validation.MAX_CHECKPOINT_INTERVAL_S,
        required=False,
        allow_null=True,
        help_text="How often the job checkpoints, by its own account",
    )
    depends_on = DependencySerializer(
        many=True,
        required=False,
        help_text="Jobs or arrays of the same tenant it waits for (at most "
        f"{dependencies.MAX_DEPENDENCIES}); held until all are met, cancelled if one never can be",
    )

    def run_validators(self, value):
        # DRF's step builds every field (a deep copy of all of them) to find read-only defaults
        # before it runs the serializer's validators; this one has none (clean_submission is the
        # whole check), and the copy was a tenth of a submit's Python.
        if self.validators:
            super().run_validators(value)

    def to_internal_value(self, data):
        try:
            return validation.clean_submission(data, self.context["tenant"])
        except DjangoValidationError as exc:
            raise serializers.ValidationError(exc.message_dict) from None


class JobLogsQuerySerializer(serializers.Serializer):
    attempt = serializers.IntegerField(
        required=False, min_value=1, help_text="Attempt number; the latest when left out"
    )
    tail = serializers.IntegerField(
        required=False, min_value=0, max_value=100_000, help_text="Only the last N lines"
    )
    offset = serializers.IntegerField(
        required=False,
        min_value=0,
        max_value=2**62,
        help_text=(
            "Only the output from this byte on: pass the next_offset of the previous answer to "
            "get what came since (not with tail)"
        ),
    )
    follow = serializers.BooleanField(
        default=False,
        help_text=(
            "While the attempt runs, wait (up to about 15 s) until there is output past "
            "offset or the attempt ends, then answer; ask again from next_offset until "
            "finished is true. Not with tail."
        ),
    )
    rank = serializers.IntegerField(
        required=False,
        min_value=0,
        max_value=100_000,
        default=0,
        help_text="Whose output, in a job over several nodes: the member of this node rank",
    )
    encoding = serializers.ChoiceField(
        choices=["text", "base64"],
        default="text",
        help_text=(
            "text: the output as text, with NUL and bytes that are not UTF-8 written \\xNN; "
            "base64: also the exact bytes, in data_b64"
        ),
    )

    def validate(self, attrs):
        if attrs.get("tail") is not None:
            for name in ("offset", "follow"):
                if attrs.get(name):
                    raise serializers.ValidationError(
                        {name: ["Give either tail or offset/follow, not both."]}
                    )
        return attrs


class JobLogsSerializer(serializers.Serializer):
    job = serializers.IntegerField()
    attempt = serializers.IntegerField(allow_null=True, help_text="null: no attempt yet")
    attempts = serializers.ListField(
        child=serializers.IntegerField(), help_text="Numbers of every attempt of the job"
    )
    node = serializers.CharField(allow_null=True, help_text="The node of the member shown")
    rank = serializers.IntegerField(help_text="The node rank of the member shown")
    ranks = serializers.ListField(
        child=serializers.IntegerField(), help_text="The node ranks of the attempt's members"
    )
    tail = serializers.IntegerField(allow_null=True)
    size_bytes = serializers.IntegerField(help_text="Bytes of output the attempt shipped so far")
    truncated = serializers.BooleanField(
        help_text="True when the start was cut off to keep the answer small"
    )
    text = serializers.CharField(allow_blank=True)
    offset = serializers.IntegerField(help_text="The byte of the output the text starts at")
    next_offset = serializers.IntegerField(
        help_text="The offset to ask for next to get only what comes after this answer"
    )
    attempt_finished = serializers.BooleanField(
        help_text="The attempt has ended (its output may still be arriving for a moment)"
    )
    finished = serializers.BooleanField(
        help_text=(
            "Nothing more will come: the job has ended, this is its last attempt and its "
            "output up to next_offset is all there is"
        )
    )
    data_b64 = serializers.CharField(
        required=False,
        allow_blank=True,
        help_text="With encoding=base64: exactly the bytes the program wrote, base64",
    )
