"""The audit trail, read: `GET /api/v1/audit/` (JSON, paginated, filtered) and `/csv/`.

Above the apps (it scopes rows by membership), while controlplane.audit stays below them. Who
sees what: a cluster admin every row; a tenant admin the rows of their tenants; anyone else
none (an empty list, as for any collection one may not read into). Rows are only ever written
by the actions (controlplane.audit.trail.record) and deleted by the retention sweep.
"""

from __future__ import annotations

import csv
import io
import json
from typing import ClassVar

import django_filters.rest_framework
from django.db.models import QuerySet
from django.http import HttpResponse
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, serializers
from rest_framework.decorators import action

from controlplane.api import CSV_RENDERERS
from controlplane.audit.models import AuditEvent
from controlplane.filters import FilterSet
from controlplane.permissions import SIGNED_IN, Need, ScopedViewSet, is_cluster_admin
from controlplane.tenancy.models import Membership, Role, Tenant

# The most rows one CSV export holds (newest first); narrow the filters for older ones.
AUDIT_CSV_MAX_ROWS = 100_000
CSV_FIELDS = (
    "id",
    "at",
    "actor",
    "tenant",
    "action",
    "object_type",
    "object_id",
    "object_repr",
    "before",
    "after",
    "message",
)


class AdminTenantScope:
    """Rows of the tenants the user administers (all of them for a cluster admin)."""

    def filter(self, queryset: QuerySet, user) -> QuerySet:
        if is_cluster_admin(user):
            return queryset
        if not user.is_authenticated:
            return queryset.none()
        administered = Membership.objects.filter(user=user, role=Role.ADMIN).values("tenant_id")
        return queryset.filter(tenant_id__in=administered)


class AuditEventSerializer(serializers.ModelSerializer):
    actor = serializers.SerializerMethodField(help_text="Who: a username, or what acted")
    tenant: serializers.SlugRelatedField[Tenant] = serializers.SlugRelatedField(
        slug_field="slug", read_only=True, allow_null=True
    )

    class Meta:
        model = AuditEvent
        fields = list(CSV_FIELDS)
        read_only_fields = fields

    def get_actor(self, event: AuditEvent) -> str:
        return event.actor.username if event.actor is not None else event.actor_label


class AuditFilterSet(FilterSet):
    action = django_filters.CharFilter(
        field_name="action",
        lookup_expr="startswith",
        help_text='The action or its start: "quota" matches quota.create, quota.update...',
    )
    object_type = django_filters.CharFilter(help_text="e.g. quota, pool, node, membership")
    object_id = django_filters.CharFilter()
    tenant = django_filters.CharFilter(field_name="tenant__slug", help_text="Tenant slug")
    actor = django_filters.CharFilter(
        field_name="actor__username", help_text="Username of the person who acted"
    )
    after = django_filters.IsoDateTimeFilter(field_name="at", lookup_expr="gte")
    before = django_filters.IsoDateTimeFilter(field_name="at", lookup_expr="lt")

    class Meta:
        model = AuditEvent
        fields = ["action", "object_type", "object_id", "tenant", "actor"]


class AuditEventViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, ScopedViewSet):
    """Who changed which quota, budget, pool, node, membership or token, with before and after.

    Newest first. A cluster admin sees every row; a tenant admin those of their tenants.
    """

    queryset = AuditEvent.objects.select_related("actor", "tenant").order_by("-at", "-id")
    serializer_class = AuditEventSerializer
    filterset_class = AuditFilterSet
    ordering_fields = ["at", "id", "action", "object_type"]
    scope: ClassVar = AdminTenantScope()
    action_needs = {"csv": Need(SIGNED_IN)}

    @extend_schema(
        responses={(200, "text/csv"): str},
        filters=True,
        parameters=[OpenApiParameter("format", exclude=True)],
    )
    @action(detail=False, methods=["get"], renderer_classes=CSV_RENDERERS)
    def csv(self, request):
        """The same rows as CSV (before and after as JSON), newest first, at most
        AUDIT_CSV_MAX_ROWS."""
        rows = self.filter_queryset(self.get_queryset())[:AUDIT_CSV_MAX_ROWS]
        buf = io.StringIO()
        writer = csv.writer(buf)
        writer.writerow(CSV_FIELDS)
        for row in AuditEventSerializer(rows, many=True).data:
            writer.writerow(
                [
                    json.dumps(row[f])
                    if f in ("before", "after") and row[f] is not None
                    else row[f]
                    for f in CSV_FIELDS
                ]
            )
        response = HttpResponse(buf.getvalue(), content_type="text/csv; charset=utf-8")
        response["Content-Disposition"] = 'attachment; filename="audit.csv"'
        return response
