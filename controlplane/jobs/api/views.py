"""The jobs endpoint: submit, list, detail, cancel, logs. Every write goes through jobs.actions."""

from django.db.models import Prefetch
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import mixins, serializers
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
from controlplane.jobs.logs import read_log
from controlplane.jobs.models import Allocation, Job, JobAttempt, JobEvent
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


@extend_schema_view(
    create=extend_schema(
        request=JobSubmitSerializer,
        responses={201: JobDetailSerializer},
        description="Submit a job. It is stored PENDING; 400 names every field at fault.",
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
        text, size_bytes, truncated = ("", 0, False) if chosen is None else read_log(chosen, tail)
        return Response(
            {
                "job": job.pk,
                "attempt": chosen.number if chosen else None,
                "attempts": [a.number for a in attempts],
                "node": chosen.node.name if chosen else None,
                "tail": tail,
                "size_bytes": size_bytes,
                "truncated": truncated,
                "text": text,
            }
        )
