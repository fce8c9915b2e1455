"""Chargeback (usage per tenant and period, JSON or CSV) and the Prometheus endpoint."""

from __future__ import annotations

import csv
import datetime as dt
import hmac
import io

from django.conf import settings
from django.http import HttpResponse
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from prometheus_client.exposition import choose_encoder
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.accounting.budgets import (
    PeriodOutOfRange,
    budget_states,
    period_bounds,
    usage_by_tenant,
)
from controlplane.accounting.metrics import REGISTRY
from controlplane.api import CSV_RENDERERS, QueryParamsBoundary
from controlplane.permissions import visible_tenants
from controlplane.tenancy.models import BudgetKind, BudgetPeriod


class UsageQuery(serializers.Serializer):
    period = serializers.ChoiceField(choices=BudgetPeriod.choices, default=BudgetPeriod.MONTH)
    at = serializers.DateField(
        required=False, help_text="Any day inside the period (UTC); default today."
    )
    tenant = serializers.SlugField(required=False)

    def validate(self, attrs):
        # The period around `at` must fit the calendar: the week of 9999-12-31 ends in 10000.
        try:
            period_bounds(attrs["period"], moment(attrs.get("at")))
        except PeriodOutOfRange as exc:
            raise serializers.ValidationError({"at": [str(exc)]}) from None
        return attrs


def moment(at: dt.date | None) -> dt.datetime:
    """Noon UTC of the day asked for (any time inside it would do), or now."""
    return dt.datetime.combine(at, dt.time(12), tzinfo=dt.UTC) if at else timezone.now()


class UsageRow(serializers.Serializer):
    tenant = serializers.CharField()
    period = serializers.CharField()
    period_start = serializers.DateTimeField()
    period_end = serializers.DateTimeField()
    gpu_hours = serializers.FloatField()
    energy_kwh = serializers.FloatField()
    gpu_hours_budget = serializers.FloatField(allow_null=True)
    energy_kwh_budget = serializers.FloatField(allow_null=True)


CSV_FIELDS = list(UsageRow().fields)


def usage_rows(user, period: str, at: dt.date | None, tenant_slug: str | None) -> list[dict]:
    visible = visible_tenants(user)
    if tenant_slug:
        visible = visible.filter(slug=tenant_slug)
    tenants = list(visible)
    when = moment(at)
    start, end = period_bounds(period, when)
    usage = usage_by_tenant(start, end, tenant_ids=[t.pk for t in tenants])
    budgets = {(s.tenant_id, s.kind): s.amount for s in budget_states(when, period)}
    rows = []
    for tenant in tenants:
        u = usage.get(tenant.pk)
        rows.append(
            {
                "tenant": tenant.slug,
                "period": period,
                "period_start": start,
                "period_end": end,
                "gpu_hours": round(u.gpu_hours, 6) if u else 0.0,
                "energy_kwh": round(u.energy_kwh, 6) if u else 0.0,
                "gpu_hours_budget": budgets.get((tenant.pk, BudgetKind.GPU_HOURS)),
                "energy_kwh_budget": budgets.get((tenant.pk, BudgetKind.ENERGY_KWH)),
            }
        )
    return rows


class UsageView(QueryParamsBoundary, APIView):
    """GPU-hours and kWh per tenant for a day, week or month, against its budgets."""

    @extend_schema(parameters=[UsageQuery], responses=UsageRow(many=True))
    def get(self, request):
        query = UsageQuery(data=request.query_params)
        query.is_valid(raise_exception=True)
        rows = usage_rows(
            request.user,
            query.validated_data["period"],
            query.validated_data.get("at"),
            query.validated_data.get("tenant"),
        )
        return Response(UsageRow(rows, many=True).data)


class UsageCsvView(UsageView):
    """The same as usage, as CSV for chargeback spreadsheets."""

    renderer_classes = CSV_RENDERERS

    @extend_schema(
        parameters=[UsageQuery, OpenApiParameter("format", exclude=True)],
        responses={(200, "text/csv"): str},
    )
    def get(self, request):
        query = UsageQuery(data=request.query_params)
        query.is_valid(raise_exception=True)
        data = query.validated_data
        rows = UsageRow(
            usage_rows(request.user, data["period"], data.get("at"), data.get("tenant")), many=True
        ).data
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
        response = HttpResponse(buf.getvalue(), content_type="text/csv")
        response["Content-Disposition"] = f'attachment; filename="usage-{data["period"]}.csv"'
        return response


def metrics_view(request):
    """Prometheus scrape endpoint: a METRICS_TOKEN bearer, or a cluster admin's session."""
    token = getattr(settings, "METRICS_TOKEN", "")
    header = request.headers.get("Authorization", "")
    by_token = bool(token) and hmac.compare_digest(header, f"Bearer {token}")
    if not by_token and not (request.user.is_authenticated and request.user.is_staff):
        return HttpResponse(
            "metrics need a METRICS_TOKEN bearer or an admin session\n",
            status=401,
            content_type="text/plain",
        )
    # OpenMetrics for a scraper that asks for it (Prometheus does by default), else text 0.0.4.
    encoder, content_type = choose_encoder(request.META.get("HTTP_ACCEPT"))
    return HttpResponse(encoder(REGISTRY), content_type=content_type)
