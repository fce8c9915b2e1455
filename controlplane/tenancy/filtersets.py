"""Query filters of the tenancy endpoints. Tenants are named by slug, people by username."""

import django_filters

from controlplane.filters import FilterSet
from controlplane.tenancy.models import (
    ApiToken,
    Budget,
    BudgetAction,
    BudgetKind,
    BudgetPeriod,
    Membership,
    Quota,
    Role,
    Tenant,
    usable_token_q,
)


class TenantFilterSet(FilterSet):
    slug = django_filters.CharFilter()
    name = django_filters.CharFilter(lookup_expr="icontains")
    active = django_filters.BooleanFilter()

    class Meta:
        model = Tenant
        fields = ["slug", "name", "active"]


class MembershipFilterSet(FilterSet):
    tenant = django_filters.CharFilter(field_name="tenant__slug")
    user = django_filters.CharFilter(field_name="user__username")
    role = django_filters.ChoiceFilter(choices=Role.choices)

    class Meta:
        model = Membership
        fields = ["tenant", "user", "role"]


class QuotaFilterSet(FilterSet):
    tenant = django_filters.CharFilter(field_name="tenant__slug")
    gpu_type = django_filters.CharFilter()

    class Meta:
        model = Quota
        fields = ["tenant", "gpu_type"]


class BudgetFilterSet(FilterSet):
    tenant = django_filters.CharFilter(field_name="tenant__slug")
    kind = django_filters.ChoiceFilter(choices=BudgetKind.choices)
    period = django_filters.ChoiceFilter(choices=BudgetPeriod.choices)
    action = django_filters.ChoiceFilter(choices=BudgetAction.choices)

    class Meta:
        model = Budget
        fields = ["tenant", "kind", "period", "action"]


class ApiTokenFilterSet(FilterSet):
    usable = django_filters.BooleanFilter(
        method="filter_usable", label="Neither revoked nor expired"
    )

    class Meta:
        model = ApiToken
        fields = ["usable"]

    def filter_usable(self, queryset, name, value):
        usable = usable_token_q()
        return queryset.filter(usable) if value else queryset.exclude(usable)
