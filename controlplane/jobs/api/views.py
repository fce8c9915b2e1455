"""The jobs endpoint: submit, list, detail, cancel, logs. Every write goes through jobs.actions.

A submit may carry an `Idempotency-Key` header (draft-ietf-httpapi-idempotency-key-header, as
Stripe does it): a retry with the same key gets the first job back, with `Idempotent-Replayed:
true`, never a second job; the same key with another body is a 422.
"""

import base64
import hashlib
import json
import re
from collections.abc import Mapping

from django.db.models import Prefetch
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_view,
)
from rest_framework import exceptions, mixins, serializers, status
from rest_framework.decorators import action
from rest_framework.response import Response

from controlplane.jobs import actions, validation
from controlplane.jobs.api.serializers import (
    JobDetailSerializer,
    JobLogsQuerySerializer,
    JobLogsSerializer,
    JobSerializer,
    JobSubmitSerializer,
)
from controlplane.jobs.filtersets import JobFilterSet
from controlplane.jobs.logs import display_text, read_log_bytes
from controlplane.jobs.models import Allocation, Job, JobAttempt, JobEvent, SubmitKey
from controlplane.permissions import (
    Conflict,
    Need,
    ScopedCreateMixin,
    ScopedViewSet,
    TenantScope,
    request_body,
)
from controlplane.tenancy.models import Role


class ConflictSerializer(serializers.Serializer):
    detail = serializers.CharField()


IDEMPOTENCY_KEY = "Idempotency-Key"
REPLAYED = "Idempotent-Replayed"
_PRINTABLE_ASCII = re.compile(r"[\x20-\x7e]{1,255}")


class IdempotencyKeyReused(exceptions.APIException):
    status_code = status.HTTP_422_UNPROCESSABLE_ENTITY
    default_detail = "This Idempotency-Key was used with a different request body."
    default_code = "idempotency_key_reused"


def idempotency_key(request) -> str | None:
    """The request's Idempotency-Key, None without one; a 400 naming the header if malformed.

    The draft sends the key as a structured-field string ("..."), Stripe's clients send it
    bare: both name the same key.
    """
    raw = request.headers.get(IDEMPOTENCY_KEY)
    if raw is None:
        return None
    key = raw.strip()
    if len(key) >= 2 and key[0] == key[-1] == '"':
        key = re.sub(r'\\(["\\])', r"\1", key[1:-1])
    if not _PRINTABLE_ASCII.fullmatch(key):
        raise serializers.ValidationError(
            {IDEMPOTENCY_KEY: ["Must be 1 to 255 printable ASCII characters, e.g. a UUID."]}
        )
    return key


def request_sha256(body: Mapping) -> str:
    """The fingerprint of a request body: SHA-256 of its JSON with sorted keys, no spaces."""
    canonical = json.dumps(
        body, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


@extend_schema_view(
    create=extend_schema(
        request=JobSubmitSerializer,
        parameters=[
            OpenApiParameter(
                IDEMPOTENCY_KEY,
                str,
                OpenApiParameter.HEADER,
                description=(
                    "A key of your choice (1-255 printable ASCII characters, e.g. a UUID) that "
                    "makes the submit safe to retry: a submit with a key you used in the last "
                    "24 hours (IDEMPOTENCY_KEY_TTL_S) creates nothing and answers the job the "
                    "first one created, with Idempotent-Replayed: true. Keys are per user."
                ),
            ),
            OpenApiParameter(
                REPLAYED,
                str,
                OpenApiParameter.HEADER,
                response=[201],
                enum=["true"],
                description="Present when the answer is the job an earlier submit with the "
                "same Idempotency-Key created.",
            ),
        ],
        responses={
            201: JobDetailSerializer,
            422: OpenApiResponse(
                OpenApiTypes.OBJECT,
                description="The Idempotency-Key was used before with a different body",
            ),
        },
        description=(
            "Submit a job. It is stored PENDING; 400 names every field at fault. With an "
            "Idempotency-Key header, retrying is safe: the same key never creates a second job."
        ),
    ),
)
class JobViewSet(
    ScopedCreateMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, ScopedViewSet
):
    """Jobs of the tenants you belong to."""

    queryset = Job.objects.select_related("tenant", "submitted_by")
    serializer_class = JobSerializer
    filterset_class = JobFilterSet
    ordering_fields = ["submitted_at", "id", "state", "name", "started_at", "finished_at"]
    scope = TenantScope("tenant")
    read_need = Need(Role.VIEWER)
    write_need = Need(Role.MEMBER)
    # A member cancels their own jobs; a tenant admin any job of the tenant.
    action_needs = {"cancel": Need(Role.MEMBER, own=True), "logs": Need(Role.VIEWER)}
    owner_field = "submitted_by"

    def get_queryset(self):
        queryset = super().get_queryset()
        return self._with_detail(queryset) if self.action == "retrieve" else queryset

    @staticmethod
    def _with_detail(queryset):
        allocations = Allocation.objects.select_related("gpu__node").order_by("gpu__index")
        attempts = JobAttempt.objects.select_related("node").prefetch_related(
            Prefetch("allocations", queryset=allocations)
        )
        return queryset.prefetch_related(
            Prefetch("attempts", queryset=attempts),
            Prefetch("events", queryset=JobEvent.objects.select_related("actor")),
        )

    def get_serializer_class(self):
        if self.action == "create":
            return JobSubmitSerializer
        if self.action in ("retrieve", "cancel"):
            return JobDetailSerializer
        return JobSerializer

    def tenant_for_create(self):
        self._tenant = validation.resolve_submit_tenant(
            self.request.user, request_body(self.request).get("tenant"), self.tenant_roles()
        )
        return self._tenant

    def get_serializer_context(self):
        context = super().get_serializer_context()
        context["tenant"] = getattr(self, "_tenant", None)
        return context

    def create(self, request, *args, **kwargs):
        key = idempotency_key(request)
        if key is None:
            return super().create(request, *args, **kwargs)
        fingerprint = request_sha256(request_body(request))
        # Before any validation: a retry gets its job back even if the same body would be
        # refused now (a quota lowered, a node removed since).
        earlier = SubmitKey.objects.live().filter(user=request.user, key=key).first()
        if earlier is None:
            tenant = self.tenant_for_create()
            serializer = self.get_serializer(data=request.data)
            serializer.is_valid(raise_exception=True)
            earlier, created = actions.submit_job_once(
                tenant=tenant,
                user=request.user,
                key=key,
                request_sha256=fingerprint,
                **serializer.validated_data,
            )
            if created:
                return Response(self._detail(earlier.job_id), status=status.HTTP_201_CREATED)
        return self._replay(earlier, fingerprint)

    def _replay(self, earlier: SubmitKey, fingerprint: str) -> Response:
        if earlier.request_sha256 != fingerprint:
            raise IdempotencyKeyReused(
                {
                    IDEMPOTENCY_KEY: [
                        "This key was used with a different request body. Send that body again "
                        "to get its job, or use a new key for a new job."
                    ]
                }
            )
        try:
            data = self._detail(earlier.job_id)
        except Job.DoesNotExist:
            # Submitted to a tenant the user has left since: it is not theirs to see any more.
            raise exceptions.NotFound(
                "The job this Idempotency-Key created is not visible to you any more."
            ) from None
        return Response(data, status=status.HTTP_201_CREATED, headers={REPLAYED: "true"})

    def perform_create(self, serializer, **extra):
        # The tenant is in the serializer's context already; submit_job gets it from there.
        return serializer.save()

    def created_representation(self, serializer, instance):
        return self._detail(instance.pk)

    def _detail(self, pk):
        job = self._with_detail(self.get_queryset()).get(pk=pk)
        return JobDetailSerializer(job, context=self.get_serializer_context()).data

    @extend_schema(
        request=None,
        responses={
            200: JobDetailSerializer,
            409: OpenApiResponse(ConflictSerializer, description="The job already finished"),
        },
    )
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        """Cancel a job. A running attempt is told to stop; its GPUs free when the agent confirms."""
        job = self.get_object()
        if job.is_finished:
            raise Conflict(
                f"Job {job.pk} already finished ({job.state}); there is nothing to cancel."
            )
        try:
            actions.cancel_job(job, actor=request.user)
        except (actions.IllegalTransition, actions.ConcurrentUpdate):
            job.refresh_from_db(fields=["state"])
            raise Conflict(
                f"Job {job.pk} changed while cancelling and is now {job.state}; nothing was cancelled."
            ) from None
        return Response(self._detail(job.pk))

    @extend_schema(parameters=[JobLogsQuerySerializer], responses={200: JobLogsSerializer})
    @action(detail=True, methods=["get"])
    def logs(self, request, pk=None):
        """The output of one attempt (the latest by default), whole or its last `tail` lines."""
        job = self.get_object()
        query = JobLogsQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        attempts = list(job.attempts.select_related("node").order_by("number"))
        wanted = query.validated_data.get("attempt")
        tail = query.validated_data.get("tail")
        if wanted is not None:
            chosen = next((a for a in attempts if a.number == wanted), None)
            if chosen is None:
                raise serializers.ValidationError(
                    {"attempt": [f"Job {job.pk} has no attempt {wanted}."]}
                )
        else:
            chosen = attempts[-1] if attempts else None
        raw, size_bytes, truncated = (
            (b"", 0, False) if chosen is None else read_log_bytes(chosen, tail)
        )
        answer = {
            "job": job.pk,
            "attempt": chosen.number if chosen else None,
            "attempts": [a.number for a in attempts],
            "node": chosen.node.name if chosen else None,
            "tail": tail,
            "size_bytes": size_bytes,
            "truncated": truncated,
            "text": display_text(raw),
        }
        if query.validated_data["encoding"] == "base64":
            # The text is for reading; a program that printed "\x00" literally reads the same
            # there as one that wrote a NUL. These are the bytes themselves.
            answer["data_b64"] = base64.b64encode(raw).decode("ascii")
        return Response(answer)
