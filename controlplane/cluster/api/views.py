"""Cluster endpoints: pools, nodes (with cordon / drain / uncordon / deregister), GPUs, join
tokens, and the GPU claims registrations were refused for."""

import django_filters
from django.db.models import Count, Exists, F, OuterRef, Prefetch, Sum
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import mixins
from rest_framework.decorators import action
from rest_framework.response import Response

from controlplane.cluster import actions, gpu_claims
from controlplane.cluster.api.serializers import (
    GpuClaimConflictSerializer,
    GpuClaimResolveSerializer,
    GpuSerializer,
    JoinTokenCreatedSerializer,
    JoinTokenSerializer,
    NodeSerializer,
    PoolSerializer,
)
from controlplane.cluster.filtersets import (
    GpuFilterSet,
    JoinTokenFilterSet,
    NodeFilterSet,
    PoolFilterSet,
)
from controlplane.cluster.models import GPU, GpuClaimConflict, JoinToken, Node, Pool
from controlplane.cluster.rules import NODE_ACTION_STATES
from controlplane.filters import FilterSet
from controlplane.jobs.models import Allocation
from controlplane.permissions import (
    SIGNED_IN,
    STAFF,
    Conflict,
    Need,
    ScopedCreateMixin,
    ScopedDestroyMixin,
    ScopedViewSet,
    request_body,
)


def _gpus_with_allocated_flag():
    held = Allocation.objects.filter(gpu=OuterRef("pk"), active=True)
    return GPU.objects.annotate(allocated=Exists(held))


class PoolViewSet(
    ScopedCreateMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.UpdateModelMixin,
    ScopedDestroyMixin,
    ScopedViewSet,
):
    """Groups of nodes with a shared power budget. Everyone reads; cluster admins write."""

    queryset = Pool.objects.annotate(
        node_count=Count("nodes", distinct=True),
        gpu_count=Count("nodes__gpus"),
        power_max_w=Sum("nodes__gpus__power_max_w"),
        power_draw_w=Sum("nodes__gpus__power_draw_w"),
    )
    serializer_class = PoolSerializer
    filterset_class = PoolFilterSet
    lookup_field = "name"
    ordering_fields = ["name", "power_budget_w"]
    read_need = Need(SIGNED_IN)
    write_need = Need(STAFF)

    def delete_instance(self, instance):
        actions.delete_pool(instance, actor=self.request.user)


class NodeViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, ScopedViewSet):
    """GPU hosts. Everyone reads a summary; cluster admins cordon, drain and uncordon.

    Nodes are created by their agent registering with a join token, not here.
    """

    queryset = Node.objects.select_related("pool").prefetch_related(
        Prefetch("gpus", queryset=_gpus_with_allocated_flag())
    )
    serializer_class = NodeSerializer
    filterset_class = NodeFilterSet
    lookup_field = "name"
    # Host names have dots; the default lookup pattern stops at one.
    lookup_value_regex = "[^/]+"
    ordering_fields = ["name", "last_heartbeat_at", "state"]
    read_need = Need(SIGNED_IN)
    action_needs = {**{name: Need(STAFF) for name in NODE_ACTION_STATES}, "deregister": Need(STAFF)}

    def _set_state(self, request, action_name: str):
        node = self.get_object()
        actions.set_node_state(node, NODE_ACTION_STATES[action_name], actor=request.user)
        return Response(NodeSerializer(self.get_queryset().get(pk=node.pk)).data)

    @extend_schema(request=None, responses={200: NodeSerializer})
    @action(detail=True, methods=["post"])
    def cordon(self, request, name=None):
        """No new work starts on the node; what runs there keeps running."""
        return self._set_state(request, "cordon")

    @extend_schema(request=None, responses={200: NodeSerializer})
    @action(detail=True, methods=["post"])
    def drain(self, request, name=None):
        """No new work, and the scheduler preempts the borrowed work running there."""
        return self._set_state(request, "drain")

    @extend_schema(request=None, responses={200: NodeSerializer})
    @action(detail=True, methods=["post"])
    def uncordon(self, request, name=None):
        """The node takes new work again."""
        return self._set_state(request, "uncordon")

    @extend_schema(
        request=None,
        responses={200: NodeSerializer, 409: OpenApiResponse(description="Attempts still active")},
    )
    @action(detail=True, methods=["post"])
    def deregister(self, request, name=None):
        """The node is gone for good: its token stops working, it gets no work, and its GPUs may
        join another node (a registration listing them is no longer refused). Refused (409)
        while any attempt is active there. Re-joining it with a join token issued for its name
        undoes this."""
        node = self.get_object()
        try:
            actions.deregister_node(node, actor=request.user)
        except gpu_claims.NodeBusy as exc:
            raise Conflict(str(exc)) from None
        return Response(NodeSerializer(self.get_queryset().get(pk=node.pk)).data)


class GpuViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, ScopedViewSet):
    """Every GPU with its power limits and latest telemetry. Read-only: agents report them.

    Looked up by UUID, which only cluster admins are shown (GpuSerializer says why)."""

    queryset = _gpus_with_allocated_flag().select_related("node__pool")
    serializer_class = GpuSerializer
    filterset_class = GpuFilterSet
    lookup_field = "uuid"
    lookup_value_regex = "[^/]+"
    ordering_fields = ["node__name", "index", "model", "power_draw_w"]
    read_need = Need(SIGNED_IN)


@extend_schema_view(
    create=extend_schema(
        request=JoinTokenSerializer,
        responses={201: JoinTokenCreatedSerializer},
        description="Create a token an agent registers its node with. The secret is in this "
        "answer only.",
    ),
    destroy=extend_schema(description="Revoke the token: no node can register with it any more."),
)
class JoinTokenViewSet(
    ScopedCreateMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    ScopedDestroyMixin,
    ScopedViewSet,
):
    """Tokens that let a new node join a pool. Cluster admins only."""

    queryset = JoinToken.objects.select_related("pool", "created_by")
    serializer_class = JoinTokenSerializer
    filterset_class = JoinTokenFilterSet
    ordering_fields = ["created_at", "expires_at"]
    read_need = Need(STAFF)
    write_need = Need(STAFF)

    def created_representation(self, serializer, instance):
        return JoinTokenCreatedSerializer(instance, context=self.get_serializer_context()).data

    def delete_instance(self, instance):
        actions.revoke_join_token(instance, actor=self.request.user)


class GpuClaimConflictFilterSet(FilterSet):
    open = django_filters.BooleanFilter(
        field_name="resolved_at", lookup_expr="isnull", label="Not resolved yet"
    )
    claimant = django_filters.CharFilter()
    gpu_uuid = django_filters.CharFilter()
    holder = django_filters.CharFilter(field_name="holder_name")

    class Meta:
        model = GpuClaimConflict
        fields = ["open", "claimant", "gpu_uuid", "holder"]


class GpuClaimConflictViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, ScopedViewSet):
    """Registrations refused for listing GPUs another node holds. Cluster admins only.

    Open ones first. Resolve one by deregistering the holder (the GPU really moved; its old node
    is gone for good) or by dismissing it (the claim was a mistake or an attack).
    """

    queryset = GpuClaimConflict.objects.select_related("join_token", "resolved_by").order_by(
        F("resolved_at").desc(nulls_first=True), "-last_refused_at", "-id"
    )
    serializer_class = GpuClaimConflictSerializer
    filterset_class = GpuClaimConflictFilterSet
    ordering_fields = ["last_refused_at", "first_refused_at", "refusals"]
    read_need = Need(STAFF)
    write_need = Need(STAFF)
    action_needs = {"resolve": Need(STAFF)}

    @extend_schema(
        request=GpuClaimResolveSerializer,
        responses={
            200: GpuClaimConflictSerializer,
            409: OpenApiResponse(description="The holder still has active attempts"),
        },
    )
    @action(detail=True, methods=["post"])
    def resolve(self, request, pk=None):
        """Close the conflict: `holder_deregistered` deregisters the node that holds the GPU
        (409 while attempts are active there), after which the claimant registers with it;
        `dismissed` changes nothing else. Resolving a closed conflict changes nothing."""
        conflict = self.get_object()
        body = GpuClaimResolveSerializer(data=request_body(request))
        body.is_valid(raise_exception=True)
        try:
            conflict = actions.resolve_gpu_claim(
                conflict, body.validated_data["resolution"], actor=request.user
            )
        except gpu_claims.NodeBusy as exc:
            raise Conflict(str(exc)) from None
        return Response(GpuClaimConflictSerializer(self.get_queryset().get(pk=conflict.pk)).data)
