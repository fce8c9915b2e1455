"""Query filters of the jobs endpoint: by state, tenant, submitter, name, type and time."""

import django_filters

from controlplane.filters import FilterSet
from controlplane.jobs.models import Job, JobState, PriorityClass


class JobFilterSet(FilterSet):
    state = django_filters.MultipleChoiceFilter(
        choices=JobState.choices, help_text="Repeat to match any of several states"
    )
    tenant = django_filters.CharFilter(field_name="tenant__slug", help_text="Tenant slug")
    user = django_filters.CharFilter(
        field_name="submitted_by__username", help_text="Username of the submitter"
    )
    name = django_filters.CharFilter(help_text="Exact job name")
    name_contains = django_filters.CharFilter(
        field_name="name", lookup_expr="icontains", help_text="Part of the job name, any case"
    )
    array = django_filters.NumberFilter(
        field_name="array_id", help_text="Only the tasks of this job array (its id)"
    )
    gpu_type = django_filters.CharFilter()
    priority = django_filters.ChoiceFilter(choices=PriorityClass.choices)
    submitted_after = django_filters.IsoDateTimeFilter(field_name="submitted_at", lookup_expr="gte")
    submitted_before = django_filters.IsoDateTimeFilter(field_name="submitted_at", lookup_expr="lt")

    class Meta:
        model = Job
        fields = ["state", "tenant", "user", "name", "gpu_type", "priority", "array"]
