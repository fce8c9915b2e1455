"""Tenancy endpoints. Who may do what is declared here and enforced in controlplane.permissions."""

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
)
from controlplane.tenancy import actions
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

    def perform_update(self, serializer):
        # Only the role may change after creation (tenant and user are fixed).
        role = serializer.validated_data.get("role", serializer.instance.role)
        try:
            actions.change_membership_role(serializer.instance, role, actor=self.request.user)
        except actions.LastTenantAdmin as exc:
            raise Conflict(str(exc)) from None

    def perform_destroy(self, instance):
        try:
            actions.remove_membership(instance, actor=self.request.user)
        except actions.LastTenantAdmin as exc:
            raise Conflict(str(exc)) from None


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
