"""The audit trail's page (Manage → Audit): every configuration change an action made, newest
first, filtered as the API filters it (controlplane.audit_views), with the same rows as CSV."""

from __future__ import annotations

from django.conf import settings
from django.core.paginator import Paginator

from controlplane.audit.models import AuditEvent
from controlplane.audit_views import AuditFilterSet
from frontend.pages import page, staff_required

PAGE_SIZE = 50


@staff_required
def audit_list(request):
    rows = AuditEvent.objects.select_related("actor", "tenant").order_by("-at", "-id")
    filters = AuditFilterSet(request.GET, queryset=rows)
    valid = filters.is_valid()
    events = Paginator(filters.qs if valid else rows.none(), PAGE_SIZE).get_page(
        request.GET.get("page")
    )
    query = request.GET.copy()
    query.pop("page", None)
    return page(
        request,
        "frontend/manage/audit.html",
        {
            "filters": filters,
            "events": events,
            "query": query.urlencode(),
            "retention_days": settings.AUDIT_RETENTION_DAYS,
        },
        nav="audit",
        status=200 if valid else 400,
    )
