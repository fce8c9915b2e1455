"""Who may see and do what: the one place tenant isolation is enforced.

Every REST viewset derives from `ScopedViewSet` and declares, instead of checking:

- `scope`: how its queryset is narrowed to what the requesting person may see
  (`TenantScope("tenant")` for a tenant's objects, `OwnerScope("user")` for one's own,
  `ClusterScope()` for shared cluster objects such as nodes);
- `read_need` / `write_need` / `action_needs`: the role an action needs on the object's tenant.

The rules that follow from that, for every endpoint alike:
- anonymous: 401; a node token on a user endpoint: 401 (the authentication class refuses it);
- an object of a tenant you do not belong to (or naming such a tenant in a create): 404, never
  403, so ids and slugs leak nothing;
- a member of the object's tenant whose role is too low: 403;
- a cluster admin (Django staff) sees and may do everything.

The functions at the top raise Django's own exceptions (Http404, PermissionDenied), so the web UI
views reuse them unchanged; DRF turns those into its 404 / 403 answers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol

from django.core.exceptions import PermissionDenied, ValidationError
from django.db import IntegrityError, transaction
from django.db.models import ProtectedError, QuerySet
from django.http import Http404
from rest_framework import exceptions, mixins, permissions, status, viewsets
from rest_framework.response import Response

from controlplane.api import QueryParamsBoundary
from controlplane.tenancy.models import ROLE_RANK, Membership, Role, Tenant
from controlplane.validators import text_problem

# What an action needs, besides being signed in. Roles are tenant roles (viewer < member < admin);
# STAFF is a cluster admin; SIGNED_IN is anyone authenticated (cluster-wide reads, own tokens).
STAFF = "staff"
SIGNED_IN = "signed_in"


@dataclass(frozen=True)
class Need:
    """The role an action needs; with `own`, a member may act only on objects they own."""

    role: str
    own: bool = False


class Conflict(exceptions.APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "The request conflicts with the current state of the resource."
    default_code = "conflict"


def is_cluster_admin(user) -> bool:
    return bool(user is not None and user.is_authenticated and user.is_staff)


def tenant_roles(user) -> dict[int, str]:
    """tenant id -> the user's role there, in one query."""
    if user is None or not user.is_authenticated:
        return {}
    return dict(Membership.objects.filter(user=user).values_list("tenant_id", "role"))


def role_at_least(role: str | None, needed: str) -> bool:
    return role is not None and ROLE_RANK[Role(role)] >= ROLE_RANK[Role(needed)]


def visible_tenants(user) -> QuerySet[Tenant]:
    if is_cluster_admin(user):
        return Tenant.objects.all()
    return Tenant.objects.filter(pk__in=Membership.objects.filter(user=user).values("tenant_id"))


def tenant_for_write(user, slug, needed: str, roles: dict[int, str] | None = None) -> Tenant:
    """The tenant a create names, once the user may write there with role `needed`.

    A tenant that does not exist and one the user does not belong to give the same 404.
    """
    if not isinstance(slug, str) or not slug:
        raise ValidationError({"tenant": ["Give the tenant's slug."]})
    if text_problem(slug) is not None:  # before the query, which it would break
        raise ValidationError({"tenant": [f"The slug {text_problem(slug)}."]})
    tenant = visible_tenants(user).filter(slug=slug).first()
    if tenant is None:
        raise Http404(f"No tenant {slug!r}.")
    require_role(user, tenant, needed, roles)
    return tenant


def require_role(user, tenant: Tenant, needed: str, roles: dict[int, str] | None = None) -> None:
    """403 unless the user holds `needed` in `tenant` (or is a cluster admin)."""
    if is_cluster_admin(user):
        return
    if needed == STAFF:
        raise PermissionDenied("Only a cluster admin may do this.")
    role = (tenant_roles(user) if roles is None else roles).get(tenant.pk)
    if role is None:
        raise Http404(f"No tenant {tenant.slug!r}.")
    if not role_at_least(role, needed):
        raise PermissionDenied(
            f"Your role in {tenant.slug} is {role}; this needs {Role(needed).label.lower()}."
        )


class Scope(Protocol):
    """How a viewset narrows its queryset to what the requesting person may see."""

    def filter(self, queryset: QuerySet, user) -> QuerySet: ...


class TenantScope:
    """Objects that belong to a tenant, reached from the model by `path` ("tenant", "pk")."""

    def __init__(self, path: str):
        self.path = path

    def filter(self, queryset: QuerySet, user) -> QuerySet:
        if is_cluster_admin(user):
            return queryset
        if not user.is_authenticated:
            return queryset.none()
        tenant_ids = Membership.objects.filter(user=user).values("tenant_id")
        return queryset.filter(**{f"{self.path}__in": tenant_ids})

    def tenant_id_of(self, obj) -> int:
        if self.path == "pk":
            return obj.pk
        return getattr(obj, f"{self.path}_id")


class OwnerScope:
    """Objects that belong to one person (API tokens): nobody else sees them, admins included."""

    def __init__(self, path: str):
        self.path = path

    def filter(self, queryset: QuerySet, user) -> QuerySet:
        if not user.is_authenticated:
            return queryset.none()
        return queryset.filter(**{self.path: user})


class ClusterScope:
    """Shared cluster objects (pools, nodes, GPUs): not tenant data, so nothing to narrow."""

    def filter(self, queryset: QuerySet, user) -> QuerySet:
        return queryset


class ScopedPermission(permissions.BasePermission):
    """Applies the view's declared needs. Tenant checks are per object, so they can answer 404."""

    def has_permission(self, request, view) -> bool:
        if not (request.user and request.user.is_authenticated):
            return False
        need = view.need_for_action()
        if need is None:
            return False
        if is_cluster_admin(request.user):
            return True
        if need.role == STAFF and not isinstance(view.scope, TenantScope):
            # Cluster-wide admin endpoints (join tokens, node actions): no tenant to hide behind.
            self.message = "Only a cluster admin may do this."
            return False
        return True

    def has_object_permission(self, request, view, obj) -> bool:
        user = request.user
        need = view.need_for_action()
        if is_cluster_admin(user) or need.role == SIGNED_IN:
            return True
        if not isinstance(view.scope, TenantScope):
            return False
        if need.role == STAFF:
            self.message = "Only a cluster admin may do this."
            return False
        role = view.tenant_roles().get(view.scope.tenant_id_of(obj))
        if role is None:
            # Not reachable through the scoped queryset; kept so a view that bypasses it fails shut.
            raise exceptions.NotFound()
        if not role_at_least(role, need.role):
            self.message = (
                f"Your role in this tenant is {role}; this needs {Role(need.role).label.lower()}."
            )
            return False
        if need.own and not role_at_least(role, Role.ADMIN):
            if getattr(obj, view.owner_field + "_id") != user.pk:
                self.message = "Only its owner or a tenant admin may do this."
                return False
        return True


def request_body(request) -> Mapping:
    """The parsed body as a mapping; a JSON array or scalar is a 400, not a crash."""
    if not isinstance(request.data, Mapping):
        raise exceptions.ValidationError(
            {"non_field_errors": ["Send a JSON object with the fields as keys."]}
        )
    return request.data


READ_ACTIONS = frozenset({"list", "retrieve"})
WRITE_ACTIONS = frozenset({"create", "update", "partial_update", "destroy"})


class ScopedViewSet(QueryParamsBoundary, viewsets.GenericViewSet):
    """Base of every /api/v1/ viewset: scoping, needs, and the create that resolves the tenant.

    Subclasses set `queryset`, `serializer_class`, `filterset_class`, `scope` and needs, and mix
    in DRF's list / retrieve / update mixins and ScopedCreateMixin / ScopedDestroyMixin for what
    they offer.
    """

    scope: ClassVar[Scope] = ClusterScope()
    read_need = Need(SIGNED_IN)
    write_need = Need(STAFF)
    action_needs: dict[str, Need] = {}
    owner_field = "user"
    permission_classes = [ScopedPermission]

    def need_for_action(self) -> Need | None:
        action = self.action
        if action in self.action_needs:
            return self.action_needs[action]
        if action in READ_ACTIONS or action is None or action == "metadata":
            return self.read_need
        if action in WRITE_ACTIONS:
            return self.write_need
        return None

    def get_queryset(self):
        return self.scope.filter(super().get_queryset(), self.request.user)

    def tenant_roles(self) -> dict[int, str]:
        """The requesting user's roles, read once per request (a view instance is per request)."""
        if not hasattr(self, "_tenant_roles"):
            self._tenant_roles = tenant_roles(self.request.user)
        return self._tenant_roles


class ScopedCreateMixin:
    """POST on a list: resolve (and authorize) the tenant from the body, then validate, then save.

    A tenant-scoped create reads the tenant slug first, so another tenant's slug is a 404 and a
    role too low a 403 before any field is validated.
    """

    def tenant_for_create(self):
        if not isinstance(self.scope, TenantScope):
            return None
        return tenant_for_write(
            self.request.user,
            request_body(self.request).get("tenant"),
            self.need_for_action().role,
            self.tenant_roles(),
        )

    def create(self, request, *args, **kwargs):
        request_body(request)
        tenant = self.tenant_for_create()
        if tenant is None and self.need_for_action().role == STAFF:
            if not is_cluster_admin(request.user):
                raise exceptions.PermissionDenied("Only a cluster admin may do this.")
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        extra = {"tenant": tenant} if tenant is not None else {}
        instance = self.perform_create(serializer, **extra)
        return Response(
            self.created_representation(serializer, instance), status=status.HTTP_201_CREATED
        )

    def perform_create(self, serializer, **extra):
        try:
            with transaction.atomic():
                return serializer.save(**extra)
        except IntegrityError:
            # The serializer checked uniqueness; a concurrent create of the same thing won.
            raise Conflict("An identical object was created at the same moment; reload.") from None

    def created_representation(self, serializer, instance):
        return serializer.data


class ScopedDestroyMixin(mixins.DestroyModelMixin):
    """DELETE of an object others still depend on is a 409 that says which, not a 500."""

    def delete_instance(self, instance) -> None:
        """The write itself: viewsets whose app has a delete action call it here."""
        instance.delete()

    def perform_destroy(self, instance):
        try:
            self.delete_instance(instance)
        except ProtectedError as exc:
            kinds = sorted({str(type(o)._meta.verbose_name_plural) for o in exc.protected_objects})
            raise Conflict(
                f"{instance} is still referenced by {', '.join(kinds)}; remove those first."
            ) from None
