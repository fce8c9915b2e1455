"""Query filters of the cluster endpoints: pools, nodes, GPUs, join tokens."""

import django_filters
from django.db.models import F, Q
from django.utils import timezone

from controlplane.cluster.models import GPU, JoinToken, Node, NodeState, Pool
from controlplane.filters import FilterSet


class PoolFilterSet(FilterSet):
    name = django_filters.CharFilter()

    class Meta:
        model = Pool
        fields = ["name"]


class NodeFilterSet(FilterSet):
    pool = django_filters.CharFilter(field_name="pool__name")
    state = django_filters.ChoiceFilter(choices=NodeState.choices, help_text="The admin state")
    ready = django_filters.BooleanFilter(help_text="False: the node stopped answering")
    gpu_model = django_filters.CharFilter(
        method="filter_gpu_model", help_text="Nodes with at least one GPU of this model"
    )

    class Meta:
        model = Node
        fields = ["pool", "state", "ready"]

    def filter_gpu_model(self, queryset, name, value):
        return queryset.filter(pk__in=GPU.objects.filter(model=value).values("node_id"))


class GpuFilterSet(FilterSet):
    node = django_filters.CharFilter(field_name="node__name")
    pool = django_filters.CharFilter(field_name="node__pool__name")
    model = django_filters.CharFilter()
    healthy = django_filters.BooleanFilter()

    class Meta:
        model = GPU
        fields = ["node", "pool", "model", "healthy"]


class JoinTokenFilterSet(FilterSet):
    pool = django_filters.CharFilter(field_name="pool__name")
    usable = django_filters.BooleanFilter(
        method="filter_usable", label="Not revoked, not expired, uses left"
    )

    class Meta:
        model = JoinToken
        fields = ["pool", "usable"]

    def filter_usable(self, queryset, name, value):
        usable = Q(revoked_at__isnull=True, expires_at__gt=timezone.now(), uses__lt=F("max_uses"))
        return queryset.filter(usable) if value else queryset.exclude(usable)
