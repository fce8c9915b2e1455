"""Tenancy endpoints. Who may do what is declared here and enforced in controlplane.permissions."""

from django.db import transaction
from django.db.models import OuterRef, Subquery
from django.utils import timezone
from drf_spectacular.utils import extend_schema, extend_schema_view
from rest_framework import mixins

from controlplane.permissions import (
    SIGNED_IN,
    STAFF,
    Conflict,
    Need,
    OwnerScope,
    ScopedCreateMixin,
    ScopedDestroyMixin,
    ScopedViewSet,
    TenantScope,
    is_cluster_admin,
)
from controlplane.tenancy.api import schema  # noqa: F401  (registers the bearer scheme)
from controlplane.tenancy.api.serializers import (
    ApiTokenCreatedSerializer,
    ApiTokenSerializer,
    BudgetSerializer,
    MembershipSerializer,
    QuotaSerializer,
    TenantSerializer,
)
from controlplane.tenancy.filtersets import (
    ApiTokenFilterSet,
    BudgetFilterSet,
    MembershipFilterSet,
    QuotaFilterSet,
    TenantFilterSet,
)
from controlplane.tenancy.models import ApiToken, Budget, Membership, Quota, Role, Tenant


class TenantViewSet(
    ScopedCreateMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.UpdateModelMixin,
    ScopedDestroyMixin,
    ScopedViewSet,
):
    """Research teams. Members read their own tenants; cluster admins create and change them."""

    queryset = Tenant.objects.all()
    serializer_class = TenantSerializer
    filterset_class = TenantFilterSet
    lookup_field = "slug"
    ordering_fields = ["slug", "name", "created_at"]
    scope = TenantScope("pk")
    read_need = Need(Role.VIEWER)
    write_need = Need(STAFF)

    def get_queryset(self):
        mine = Membership.objects.filter(tenant=OuterRef("pk"), user=self.request.user.pk)
        return super().get_queryset().annotate(my_role=Subquery(mine.values("role")[:1]))

    def tenant_for_create(self):
        # A tenant is not inside a tenant: only cluster admins reach here (see write_need).
        return None


class MembershipViewSet(
    ScopedCreateMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.UpdateModelMixin,
    ScopedDestroyMixin,
    ScopedViewSet,
):
    """Who belongs to a tenant, and as what. Tenant admins manage their own tenant's members."""

    queryset = Membership.objects.select_related("tenant", "user")
    serializer_class = MembershipSerializer
    filterset_class = MembershipFilterSet
    ordering_fields = ["created_at", "role"]
    scope = TenantScope("tenant")
    read_need = Need(Role.VIEWER)
    write_need = Need(Role.ADMIN)

    def _refuse_leaving_no_admin(self, membership: Membership) -> None:
        # A tenant admin who demotes or removes the last admin locks the tenant out of managing
        # itself; a cluster admin may still do it on purpose.
        if is_cluster_admin(self.request.user) or membership.role != Role.ADMIN:
            return
        others = Membership.objects.filter(tenant_id=membership.tenant_id, role=Role.ADMIN).exclude(
            pk=membership.pk
        )
        if not others.exists():
            raise Conflict(
                f"{membership.user.username} is the last tenant admin of "
                f"{membership.tenant.slug}; make someone else admin first."
            )

    @transaction.atomic
    def perform_update(self, serializer):
        new_role = serializer.validated_data.get("role", serializer.instance.role)
        if new_role != Role.ADMIN:
            self._refuse_leaving_no_admin(serializer.instance)
        serializer.save()

    @transaction.atomic
    def perform_destroy(self, instance):
        self._refuse_leaving_no_admin(instance)
        super().perform_destroy(instance)


class QuotaViewSet(
    ScopedCreateMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.UpdateModelMixin,
    ScopedDestroyMixin,
    ScopedViewSet,
):
    """GPUs a tenant is guaranteed and may borrow up to, per type, with what it holds now."""

    queryset = Quota.objects.select_related("tenant")
    serializer_class = QuotaSerializer
    filterset_class = QuotaFilterSet
    ordering_fields = ["gpu_type", "limit_gpus"]
    scope = TenantScope("tenant")
    read_need = Need(Role.VIEWER)
    write_need = Need(STAFF)


class BudgetViewSet(
    ScopedCreateMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.UpdateModelMixin,
    ScopedDestroyMixin,
    ScopedViewSet,
):
    """A tenant's energy (kWh) or GPU-hour allowance per period, and what happens past it."""

    queryset = Budget.objects.select_related("tenant")
    serializer_class = BudgetSerializer
    filterset_class = BudgetFilterSet
    ordering_fields = ["kind", "amount"]
    scope = TenantScope("tenant")
    read_need = Need(Role.VIEWER)
    write_need = Need(STAFF)


@extend_schema_view(
    create=extend_schema(
        request=ApiTokenSerializer,
        responses={201: ApiTokenCreatedSerializer},
        description="Issue a token. The secret is in this answer only; store it now.",
    ),
    destroy=extend_schema(description="Revoke the token; the row stays so its use can be audited."),
)
class ApiTokenViewSet(
    ScopedCreateMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    ScopedDestroyMixin,
    ScopedViewSet,
):
    """Your own tokens for automation (`Authorization: Bearer <token>`). Nobody else sees them."""

    queryset = ApiToken.objects.all()
    serializer_class = ApiTokenSerializer
    filterset_class = ApiTokenFilterSet
    ordering_fields = ["created_at", "name"]
    scope = OwnerScope("user")
    read_need = Need(SIGNED_IN)
    write_need = Need(SIGNED_IN)

    def created_representation(self, serializer, instance):
        return ApiTokenCreatedSerializer(instance, context=self.get_serializer_context()).data

    def perform_destroy(self, instance):
        ApiToken.objects.filter(pk=instance.pk, revoked_at__isnull=True).update(
            revoked_at=timezone.now()
        )
