"""The arrays endpoint: submit a sweep of tasks in one request, list, detail, cancel.

Its submit takes every field of a job submit plus `array` and `max_parallel`, and checks them
all at once: the answer names every field at fault, and nothing is written unless all pass.
Writes go through jobs.arrays (the actions of arrays).
"""

from collections.abc import Mapping

import django_filters
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_field,
    extend_schema_view,
)
from rest_framework import exceptions, mixins, serializers, status
from rest_framework.decorators import action
from rest_framework.response import Response

from controlplane.filters import FilterSet
from controlplane.jobs import arrays, dependencies, validation
from controlplane.jobs.api.not_found import UnknownTargetsAreNotFound
from controlplane.jobs.api.serializers import JobSubmitSerializer
from controlplane.jobs.api.views import (
    IDEMPOTENCY_KEY,
    REPLAYED,
    ConflictSerializer,
    IdempotencyKeyReused,
    _memberships_with_tenants,
    idempotency_key,
    request_sha256,
)
from controlplane.jobs.models import Job, JobArray, SubmitKey
from controlplane.permissions import Conflict, Need, ScopedViewSet, TenantScope, request_body
from controlplane.tenancy.models import Role, Tenant

ARRAY_FIELDS = ("array", "max_parallel", "depends_on")


class CountsSerializer(serializers.Serializer):
    pending = serializers.IntegerField(help_text="Waiting for GPUs")
    held = serializers.IntegerField(
        help_text="Waiting for a slot of the array (max_parallel) or for dependencies"
    )
    running = serializers.IntegerField(help_text="Admitted or running (or being requeued)")
    succeeded = serializers.IntegerField()
    failed = serializers.IntegerField()
    cancelled = serializers.IntegerField()


class ArraySerializer(serializers.ModelSerializer):
    tenant: serializers.SlugRelatedField[Tenant] = serializers.SlugRelatedField(
        slug_field="slug", read_only=True
    )
    submitted_by: serializers.SlugRelatedField[User] = serializers.SlugRelatedField(
        slug_field="username", read_only=True
    )
    counts = serializers.SerializerMethodField()
    state = serializers.SerializerMethodField()
    template = serializers.SerializerMethodField()

    class Meta:
        model = JobArray
        fields = [
            "id",
            "name",
            "tenant",
            "submitted_by",
            "spec",
            "size",
            "max_parallel",
            "submitted_at",
            "cancelled_at",
            "counts",
            "state",
            "template",
        ]
        read_only_fields = fields
        extra_kwargs = {
            "spec": {"help_text": "The indexes as submitted: a count, or indexes and ranges"},
            "max_parallel": {"help_text": "At most this many tasks at once; null: no limit"},
        }

    @extend_schema_field(CountsSerializer)
    def get_counts(self, obj: JobArray) -> dict[str, int]:
        return arrays.counts_of(obj)

    @extend_schema_field(
        serializers.ChoiceField(choices=["pending", "running", "succeeded", "failed", "cancelled"])
    )
    def get_state(self, obj: JobArray) -> str:
        return arrays.state_of(obj, arrays.counts_of(obj))

    @extend_schema_field(
        {
            "type": "object",
            "additionalProperties": True,
            "description": "The job fields the array was submitted with, placeholders kept",
        }
    )
    def get_template(self, obj: JobArray) -> dict:
        templates = self.context.get("templates")
        if templates is None:
            templates = arrays.templates_of([obj.pk])
        return templates.get(obj.pk, {})


class ArraySubmitSerializer(JobSubmitSerializer):
    """A job submit's fields, plus the array's. For the schema: jobs.arrays and jobs.validation
    check them."""

    array = serializers.JSONField(
        help_text=(
            'The task indexes: a count N (0..N-1, e.g. 100 or "100"), or indexes and ranges, '
            'e.g. "0-99", "1,3,5-9", "0-99:2" (every second). At most the tenant\'s '
            "max_array_size tasks. Command items and env values may contain {{array_index}} "
            "and {{array_size}}."
        )
    )
    max_parallel = serializers.IntegerField(
        min_value=1,
        required=False,
        allow_null=True,
        help_text="At most this many tasks run at once (Slurm's %); left out: no limit",
    )


class ArrayFilterSet(FilterSet):
    tenant = django_filters.CharFilter(field_name="tenant__slug", help_text="Tenant slug")
    user = django_filters.CharFilter(
        field_name="submitted_by__username", help_text="Username of the submitter"
    )

    class Meta:
        model = JobArray
        fields = ["tenant", "user"]


@extend_schema_view(
    create=extend_schema(
        request=ArraySubmitSerializer,
        parameters=[
            OpenApiParameter(
                IDEMPOTENCY_KEY,
                str,
                OpenApiParameter.HEADER,
                description="As for a job submit: a retry with the key creates nothing and "
                "answers the array the first submit created.",
            ),
            OpenApiParameter(REPLAYED, str, OpenApiParameter.HEADER, response=[201], enum=["true"]),
        ],
        responses={
            201: ArraySerializer,
            422: OpenApiResponse(
                ConflictSerializer,
                description="The Idempotency-Key was used before with a different body",
            ),
        },
        description=(
            "Submit a job array: one task per index, each an ordinary job with "
            "GPUCP_ARRAY_ID, GPUCP_ARRAY_INDEX and GPUCP_ARRAY_SIZE in its environment. All "
            "tasks are created in one transaction, or none; 400 names every field at fault."
        ),
    ),
)
class ArrayViewSet(
    UnknownTargetsAreNotFound, mixins.ListModelMixin, mixins.RetrieveModelMixin, ScopedViewSet
):
    """Job arrays of the tenants you belong to."""

    queryset = JobArray.objects.select_related("tenant", "submitted_by")
    serializer_class = ArraySerializer
    filterset_class = ArrayFilterSet
    ordering_fields = ["submitted_at", "id", "name", "size"]
    scope = TenantScope("tenant")
    read_need = Need(Role.VIEWER)
    write_need = Need(Role.MEMBER)
    # As a job's: a member cancels their own arrays; a tenant admin any of the tenant.
    action_needs = {"cancel": Need(Role.MEMBER, own=True)}
    owner_field = "submitted_by"

    def get_queryset(self):
        return arrays.with_counts(super().get_queryset())

    def get_serializer_class(self):
        return ArraySubmitSerializer if self.action == "create" else ArraySerializer

    def list(self, request, *args, **kwargs):
        queryset = self.filter_queryset(self.get_queryset())
        page = self.paginate_queryset(queryset)
        shown = list(page if page is not None else queryset)
        context = {
            **self.get_serializer_context(),
            "templates": arrays.templates_of(a.pk for a in shown),
        }
        data = ArraySerializer(shown, many=True, context=context).data
        return self.get_paginated_response(data) if page is not None else Response(data)

    def _tenant(self, slug) -> Tenant:
        memberships = _memberships_with_tenants(self.request.user)
        self._tenant_roles = {m.tenant_id: m.role for m in memberships}
        if not isinstance(slug, str | None):
            raise serializers.ValidationError({"tenant": ["Give the tenant's slug."]})
        try:
            return validation.resolve_submit_tenant(
                self.request.user,
                slug,
                self._tenant_roles,
                {m.tenant_id: m.tenant for m in memberships},
            )
        except DjangoValidationError as exc:
            raise serializers.ValidationError(exc.message_dict) from None

    def _cleaned(self, body: Mapping, tenant: Tenant) -> dict:
        """Every argument of arrays.submit_array, or a 400 naming every field at fault."""
        errors: dict[str, list[str]] = {}
        job_fields = {k: v for k, v in body.items() if k not in ARRAY_FIELDS}
        indexes: list[int] = []
        spec = ""
        if "array" not in body:
            errors["array"] = ["This field is required."]
        else:
            try:
                spec, indexes = arrays.parse_spec(body["array"], limit=arrays.limit_for(tenant))
            except DjangoValidationError as exc:
                errors.update(exc.message_dict)
        max_parallel = None
        if indexes:
            try:
                max_parallel = arrays.parse_max_parallel(body.get("max_parallel"), len(indexes))
            except DjangoValidationError as exc:
                errors.update(exc.message_dict)
        fields: dict = {}
        try:
            fields = validation.clean_submission(job_fields, tenant)
        except DjangoValidationError as exc:
            errors.update(exc.message_dict)
        depends_on: list[dependencies.DependencySpec] = []
        try:
            depends_on = dependencies.parse(
                body.get("depends_on"), tenant=tenant, user=self.request.user
            )
        except DjangoValidationError as exc:
            errors.update(exc.message_dict)
        except serializers.ValidationError as exc:
            found = serializers.as_serializer_error(exc)
            errors.update({name: list(messages) for name, messages in found.items()})
        if fields and indexes:
            try:
                arrays.check_templates(fields, indexes)
            except DjangoValidationError as exc:
                errors.update(exc.message_dict)
        if errors:
            raise serializers.ValidationError(errors)
        return {
            "tenant": tenant,
            "fields": fields,
            "spec": spec,
            "indexes": indexes,
            "max_parallel": max_parallel,
            "depends_on": depends_on,
        }

    def create(self, request, *args, **kwargs):
        body = request_body(request)
        key = idempotency_key(request)
        fingerprint = request_sha256(body) if key is not None else ""
        if key is not None:
            earlier = SubmitKey.objects.live().filter(user=request.user, key=key).first()
            if earlier is not None:
                return self._replay(earlier, fingerprint)
        tenant = self._tenant(body.get("tenant"))
        cleaned = self._cleaned(body, tenant)
        if key is None:
            submitted = arrays.submit_array(user=request.user, **cleaned)
        else:
            row, done = arrays.submit_array_once(
                user=request.user, key=key, request_sha256=fingerprint, **cleaned
            )
            if done is None:
                return self._replay(row, fingerprint)
            submitted = done
        return Response(self._shown(submitted.array.pk), status=status.HTTP_201_CREATED)

    def _replay(self, earlier: SubmitKey, fingerprint: str) -> Response:
        if earlier.request_sha256 != fingerprint:
            raise IdempotencyKeyReused(
                {
                    IDEMPOTENCY_KEY: [
                        "This key was used with a different request body. Send that body again "
                        "to get its array, or use a new key for a new one."
                    ]
                }
            )
        array_id = Job.objects.filter(pk=earlier.job_id).values_list("array_id", flat=True).first()
        try:
            if array_id is None:
                raise JobArray.DoesNotExist
            data = self._shown(array_id)
        except JobArray.DoesNotExist:
            raise exceptions.NotFound(
                "The array this Idempotency-Key created is not visible to you any more."
            ) from None
        return Response(data, status=status.HTTP_201_CREATED, headers={REPLAYED: "true"})

    def _shown(self, pk: int) -> dict:
        array = self.get_queryset().get(pk=pk)
        return ArraySerializer(array, context=self.get_serializer_context()).data

    @extend_schema(
        request=None,
        responses={
            200: ArraySerializer,
            409: OpenApiResponse(
                ConflictSerializer, description="Every task of the array has ended already"
            ),
        },
    )
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        """Cancel every unfinished task: running ones are told to stop, the others end at once."""
        array = self.get_object()
        try:
            arrays.cancel_array(array, actor=request.user)
        except arrays.NothingToCancel:
            raise Conflict(
                f"Array {array.pk} has no unfinished task left; there is nothing to cancel."
            ) from None
        return Response(self._shown(array.pk))
