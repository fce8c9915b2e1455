"""Django admin for ops: tenants with their members, quotas and budgets; people's API tokens."""

from django.contrib import admin, messages

from controlplane.tenancy import actions
from controlplane.tenancy.models import (
    ApiToken,
    Budget,
    Invitation,
    Membership,
    Quota,
    Tenant,
    TenantEvent,
)


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


class QuotaInline(admin.TabularInline):
    model = Quota
    extra = 0


class BudgetInline(admin.TabularInline):
    model = Budget
    extra = 0


def save_membership(request, membership: Membership) -> None:
    """An admin's add or role change, through the actions the API uses (so it is audited)."""
    if membership.pk is None:
        created = actions.add_member(
            membership.tenant, membership.user, membership.role, actor=request.user
        )
        # The admin goes on with its own object (its change message, its redirect).
        membership.pk, membership.created_at = created.pk, created.created_at
        return
    stored = Membership.objects.select_related("tenant", "user").get(pk=membership.pk)
    if (stored.tenant_id, stored.user_id) != (membership.tenant_id, membership.user_id):
        # Moving a membership to another person or tenant is a removal and an addition.
        actions.remove_membership(stored, actor=request.user)
        membership.pk = None
        save_membership(request, membership)
    else:
        actions.change_membership_role(stored, membership.role, actor=request.user)


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["slug", "name", "weight", "active", "created_at"]
    list_filter = ["active"]
    search_fields = ["slug", "name"]
    inlines = [MembershipInline, QuotaInline, BudgetInline]

    def save_formset(self, request, form, formset, change):
        if formset.model is not Membership:
            return super().save_formset(request, form, formset, change)
        memberships = formset.save(commit=False)
        for gone in formset.deleted_objects:
            actions.remove_membership(gone, actor=request.user)
        for membership in memberships:
            save_membership(request, membership)


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["user", "tenant", "role", "created_at"]
    list_filter = ["role", "tenant"]
    search_fields = ["user__username", "tenant__slug"]
    autocomplete_fields = ["user", "tenant"]
    list_select_related = ["user", "tenant"]

    def save_model(self, request, obj, form, change):
        save_membership(request, obj)

    def delete_model(self, request, obj):
        actions.remove_membership(obj, actor=request.user)

    def delete_queryset(self, request, queryset):
        for membership in queryset.select_related("tenant", "user"):
            actions.remove_membership(membership, actor=request.user)


@admin.register(Quota)
class QuotaAdmin(admin.ModelAdmin):
    list_display = ["tenant", "gpu_type", "guaranteed_gpus", "limit_gpus", "max_running_jobs"]
    list_filter = ["tenant", "gpu_type"]
    list_select_related = ["tenant"]


@admin.register(Budget)
class BudgetAdmin(admin.ModelAdmin):
    list_display = ["tenant", "kind", "period", "amount", "action", "warn_at_fraction"]
    list_filter = ["kind", "period", "action"]
    list_select_related = ["tenant"]


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """Tokens are issued by their owners (API or web UI), who alone see the secret; ops revoke.

    Nothing else about a token can be changed here: a longer expiry or another scope would
    undo the limits it was issued under (token_grant).
    """

    list_display = [
        "prefix",
        "name",
        "user",
        "scopes",
        "created_at",
        "expires_at",
        "last_used_at",
        "revoked_at",
    ]
    list_filter = ["revoked_at"]
    search_fields = ["user__username", "name", "prefix"]
    list_select_related = ["user"]
    readonly_fields = [
        "user",
        "name",
        "prefix",
        "scopes",
        "parent",
        "created_at",
        "expires_at",
        "last_used_at",
        "revoked_at",
    ]
    exclude = ["token_hash"]
    actions = ["revoke"]

    def has_add_permission(self, request):
        return False

    @admin.action(description="Revoke the selected tokens and those minted from them")
    def revoke(self, request, queryset):
        revoked = sum(actions.revoke_token(token) for token in queryset)
        self.message_user(request, f"Revoked {revoked} token(s).", messages.SUCCESS)


@admin.register(Invitation)
class InvitationAdmin(admin.ModelAdmin):
    """Read-only: invitations are made by tenant admins and accepted by their invitees (API,
    web UI); cluster admins add people directly with a membership instead."""

    list_display = ["invitee", "tenant", "role", "invited_by", "created_at", "expires_at", "state"]
    list_filter = ["role", "tenant"]
    search_fields = ["invitee", "tenant__slug", "invited_by__username"]
    list_select_related = ["tenant", "invited_by"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(TenantEvent)
class TenantEventAdmin(admin.ModelAdmin):
    list_display = ["at", "tenant", "kind", "message"]
    list_filter = ["kind", "tenant"]
    list_select_related = ["tenant"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
