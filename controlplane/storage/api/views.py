"""/api/v1/volumes/: cluster admins define volumes; researchers read the ones their tenants may
mount."""

from __future__ import annotations

from django.db.models import Q, QuerySet
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import mixins

from controlplane.permissions import (
    SIGNED_IN,
    STAFF,
    Conflict,
    Need,
    ScopedCreateMixin,
    ScopedDestroyMixin,
    ScopedViewSet,
    is_cluster_admin,
)
from controlplane.storage import actions, queries
from controlplane.storage.api.serializers import VolumeSerializer, VolumeSummarySerializer
from controlplane.storage.filtersets import VolumeFilterSet
from controlplane.storage.models import Volume
from controlplane.tenancy.models import Membership


class VolumeScope:
    """Cluster admins see every volume; anyone else the ones an active tenant of theirs may
    mount. Any other volume is a 404, as another tenant's object is."""

    def filter(self, queryset: QuerySet, user) -> QuerySet:
        if is_cluster_admin(user):
            return queryset
        if not user.is_authenticated:
            return queryset.none()
        mine = Membership.objects.filter(user=user, tenant__active=True).values("tenant_id")
        # all_tenants means every active tenant's members: someone in none sees none.
        if not mine.exists():
            return queryset.none()
        return queryset.filter(Q(all_tenants=True) | Q(tenants__in=mine)).distinct()


@extend_schema_view(
    destroy=extend_schema(
        responses={204: None, 409: OpenApiResponse(description="Jobs still use the volume")}
    ),
)
class VolumeViewSet(
    ScopedCreateMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.UpdateModelMixin,
    ScopedDestroyMixin,
    ScopedViewSet,
):
    """Storage jobs mount by name. Cluster admins see and write everything (host paths
    included); researchers see the volumes their tenants may mount, without host paths."""

    queryset = Volume.objects.prefetch_related("pools", "tenants")
    serializer_class = VolumeSerializer
    filterset_class = VolumeFilterSet
    lookup_field = "name"
    ordering_fields = ["name", "created_at"]
    scope = VolumeScope()
    read_need = Need(SIGNED_IN)
    write_need = Need(STAFF)

    def get_serializer_class(self):
        request = getattr(self, "request", None)
        if request is not None and not is_cluster_admin(getattr(request, "user", None)):
            return VolumeSummarySerializer
        return VolumeSerializer

    def get_serializer_context(self):
        context = super().get_serializer_context()
        if self.get_serializer_class() is VolumeSerializer:
            context["nodes_by_volume"] = queries.node_names_by_volume()
        return context

    def delete_instance(self, instance):
        try:
            actions.delete_volume(instance, actor=self.request.user)
        except actions.VolumeInUse as exc:
            raise Conflict(str(exc)) from None
