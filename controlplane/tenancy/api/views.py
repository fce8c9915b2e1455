"""Tenancy endpoints. Who may do what is declared here and enforced in controlplane.permissions."""

from django.db.models import OuterRef, Q, Subquery
from drf_spectacular.utils import OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import exceptions, mixins, status
from rest_framework.decorators import action
from rest_framework.response import Response

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
from controlplane.storage.queries import checkpoint_usage_subquery
from controlplane.tenancy import actions
from controlplane.tenancy.api import schema  # noqa: F401  (registers the bearer scheme)
from controlplane.tenancy.api.serializers import (
    ApiTokenCreatedSerializer,
    ApiTokenSerializer,
    BudgetSerializer,
    InvitationSerializer,
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
from controlplane.tenancy.models import (
    ApiToken,
    Budget,
    Invitation,
    Membership,
    Quota,
    Role,
    Tenant,
    TokenScope,
)


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
        return (
            super()
            .get_queryset()
            .annotate(
                my_role=Subquery(mine.values("role")[:1]),
                checkpoint_usage_bytes=checkpoint_usage_subquery("pk"),
            )
        )

    def tenant_for_create(self):
        # A tenant is not inside a tenant: only cluster admins reach here (see write_need).
        return None

    def delete_instance(self, instance):
        actions.delete_tenant(instance, actor=self.request.user)


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

    def tenant_for_create(self):
        tenant = super().tenant_for_create()
        # Refused before the body is validated, so "no such user" and "that user exists" cannot be
        # told apart: tenant admins invite instead (InvitationViewSet).
        if not is_cluster_admin(self.request.user):
            raise exceptions.PermissionDenied(actions.DIRECT_ADD_REFUSED)
        return tenant

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

    def delete_instance(self, instance):
        actions.delete_quota(instance, actor=self.request.user)


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

    def delete_instance(self, instance):
        actions.delete_budget(instance, actor=self.request.user)


@extend_schema_view(
    create=extend_schema(
        request=ApiTokenSerializer,
        responses={201: ApiTokenCreatedSerializer},
        description=(
            "Issue a token. The secret is in this answer only; store it now. With a token "
            "(rather than signed in), that token needs the tokens scope, and the new one expires "
            "no later than it and holds none of the scopes it lacks."
        ),
    ),
    destroy=extend_schema(
        description="Revoke the token and every token made with it (transitively); the rows "
        "stay so their use can be audited. With a token, that token needs the tokens scope "
        "unless it revokes itself."
    ),
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

    def _require_tokens_scope(self, target: ApiToken | None = None) -> None:
        using = self.request.auth
        if not isinstance(using, ApiToken) or using.allows(TokenScope.TOKENS):
            return
        if target is not None and target.pk == using.pk:
            return  # a token may always retire itself
        raise exceptions.PermissionDenied(
            "This token may not issue or revoke tokens (it lacks the tokens scope); "
            "sign in, or use a token that has it."
        )

    def create(self, request, *args, **kwargs):
        self._require_tokens_scope()
        return super().create(request, *args, **kwargs)

    def created_representation(self, serializer, instance):
        return ApiTokenCreatedSerializer(instance, context=self.get_serializer_context()).data

    def perform_destroy(self, instance):
        self._require_tokens_scope(instance)
        actions.revoke_token(instance, actor=self.request.user)


class InvitationScope(TenantScope):
    """A tenant's invitations, as its members see them, and those addressed to you."""

    def filter(self, queryset, user):
        if is_cluster_admin(user) or not user.is_authenticated:
            return super().filter(queryset, user)
        mine = Membership.objects.filter(user=user).values("tenant_id")
        return queryset.filter(Q(tenant__in=mine) | Invitation.addressed_to_q(user))


@extend_schema_view(
    create=extend_schema(
        description="Invite a person, named by username or e-mail address, to a tenant you are "
        "admin of. The answer is the same whether or not such a person exists."
    ),
    destroy=extend_schema(
        description="Withdraw an open invitation (tenant admins), or decline it (its invitee). "
        "The row stays, withdrawn."
    ),
    accept=extend_schema(
        request=None,
        responses={
            201: MembershipSerializer,
            403: OpenApiResponse(description="Addressed to someone else"),
            409: OpenApiResponse(description="Accepted, withdrawn or expired; or already a member"),
        },
        description="Accept an invitation addressed to you: you join its tenant in its role.",
    ),
    decline=extend_schema(
        request=None,
        responses={200: InvitationSerializer, 409: OpenApiResponse(description="Not open")},
        description="Decline an invitation addressed to you.",
    ),
)
class InvitationViewSet(
    ScopedCreateMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    ScopedDestroyMixin,
    ScopedViewSet,
):
    """How tenant admins add people: an invitation the invitee accepts.

    A tenant's members see its invitations, as they see its memberships, and its admins make and
    withdraw them; everyone sees those addressed to them (by username or e-mail address) and
    accepts or declines them. Cluster admins see all.
    """

    queryset = Invitation.objects.select_related("tenant", "invited_by")
    serializer_class = InvitationSerializer
    ordering_fields = ["created_at", "expires_at"]
    scope = InvitationScope("tenant")
    # The scope narrows reads to one's tenants' invitations and one's own.
    read_need = Need(SIGNED_IN)
    write_need = Need(Role.ADMIN)
    # Withdrawing is for the tenant's admins and declining for the invitee: the action tells
    # which (withdraw_invitation), and the scope hides the invitation from everyone else.
    action_needs = {
        "accept": Need(SIGNED_IN),
        "decline": Need(SIGNED_IN),
        "destroy": Need(SIGNED_IN),
    }

    def perform_destroy(self, instance):
        try:
            actions.withdraw_invitation(instance, actor=self.request.user)
        except actions.InvitationClosed as exc:
            raise Conflict(str(exc)) from None

    @action(detail=True, methods=["post"])
    def accept(self, request, pk=None):
        invitation = self.get_object()
        try:
            membership = actions.accept_invitation(invitation, user=request.user)
        except (actions.InvitationClosed, actions.AlreadyMember) as exc:
            raise Conflict(str(exc)) from None
        return Response(
            MembershipSerializer(membership, context=self.get_serializer_context()).data,
            status=status.HTTP_201_CREATED,
        )

    @action(detail=True, methods=["post"])
    def decline(self, request, pk=None):
        invitation = self.get_object()
        if not invitation.is_addressed_to(request.user):
            raise exceptions.PermissionDenied("This invitation is addressed to someone else.")
        try:
            invitation = actions.withdraw_invitation(invitation, actor=request.user)
        except actions.InvitationClosed as exc:
            raise Conflict(str(exc)) from None
        return Response(self.get_serializer(invitation).data)
