"""Django admin for ops: tenants with their members, quotas and budgets; people's API tokens.

Every save and delete goes through controlplane.tenancy.actions, as the API's do: the rules are
checked (a refusal shows at its field), the change is audited, and the scheduler hears of it.
"""

from collections.abc import Callable
from typing import Any, ClassVar

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError

from controlplane.audit.trail import Kind
from controlplane.tenancy import actions, rules
from controlplane.tenancy.models import (
    ApiToken,
    Budget,
    Invitation,
    Membership,
    Quota,
    Tenant,
)


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


def _show_refusal(form, check) -> None:
    """Run a rule and show what it refuses at the fields it names."""
    try:
        check()
    except ValidationError as exc:
        for field, problems in exc.message_dict.items():
            form.add_error(field if field in form.fields else None, problems)


def _set_values(form, fields) -> dict:
    """What a form sets, as the actions take it: for a new object all its fields, else the changed."""
    names = fields if form.instance.pk is None else [f for f in form.changed_data if f in fields]
    return {name: form.cleaned_data[name] for name in names if name in form.cleaned_data}


class TenantAdminForm(forms.ModelForm):
    def clean(self):
        cleaned = super().clean()
        instance = self.instance if self.instance.pk else None
        _show_refusal(
            self, lambda: rules.check_tenant(_set_values(self, actions.TENANT_FIELDS), instance)
        )
        return cleaned


class _TenantRowForm(forms.ModelForm):
    """A quota's or a budget's inline form: the rule its actions check, shown at its fields."""

    kind: ClassVar[Kind]
    check: ClassVar[Callable[..., None]]

    def clean(self):
        cleaned = super().clean()
        tenant = cleaned.get("tenant") or getattr(self.instance, "tenant", None)
        if tenant is not None and tenant.pk is not None:
            instance = self.instance if self.instance.pk else None
            values = _set_values(self, self.kind.fields if instance is None else self.kind.settable)
            _show_refusal(self, lambda: type(self).check(tenant, values, instance))
        return cleaned


class QuotaAdminForm(_TenantRowForm):
    kind = actions.QUOTA
    check = staticmethod(rules.check_quota)


class BudgetAdminForm(_TenantRowForm):
    kind = actions.BUDGET
    check = staticmethod(rules.check_budget)


class QuotaInline(admin.TabularInline):
    model = Quota
    form = QuotaAdminForm
    extra = 0


class BudgetInline(admin.TabularInline):
    model = Budget
    form = BudgetAdminForm
    extra = 0


# A tenant's quotas and budgets: (what is audited, create, update, delete), all actions.
TENANT_ROWS: dict[type, tuple[Kind, Callable[..., Any], Callable[..., Any], Callable[..., Any]]] = {
    Quota: (actions.QUOTA, actions.create_quota, actions.update_quota, actions.delete_quota),
    Budget: (actions.BUDGET, actions.create_budget, actions.update_budget, actions.delete_budget),
}


def save_tenant_row(request, form, obj: Quota | Budget) -> None:
    kind, create, update, _ = TENANT_ROWS[type(obj)]
    if obj.pk is None:
        obj.pk = create(obj.tenant, actor=request.user, **_set_values(form, kind.fields)).pk
    else:
        stored = type(obj).objects.select_related("tenant").get(pk=obj.pk)
        update(stored, actor=request.user, **_set_values(form, kind.settable))


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
    form = TenantAdminForm
    list_display = ["slug", "name", "weight", "active", "created_at"]
    list_filter = ["active"]
    search_fields = ["slug", "name"]
    inlines = [MembershipInline, QuotaInline, BudgetInline]

    def save_model(self, request, obj, form, change):
        if not change:
            values = _set_values(form, actions.TENANT_FIELDS)
            created = actions.create_tenant(actor=request.user, **values)
            obj.pk, obj.created_at = created.pk, created.created_at
            return
        stored = Tenant.objects.get(pk=obj.pk)
        actions.update_tenant(
            stored, actor=request.user, **_set_values(form, actions.TENANT_FIELDS)
        )

    def delete_model(self, request, obj):
        actions.delete_tenant(obj, actor=request.user)

    def delete_queryset(self, request, queryset):
        for tenant in queryset:
            actions.delete_tenant(tenant, actor=request.user)

    def save_formset(self, request, form, formset, change):
        saved = formset.save(commit=False)
        if formset.model is Membership:
            for gone in formset.deleted_objects:
                actions.remove_membership(gone, actor=request.user)
            for membership in saved:
                save_membership(request, membership)
            return
        delete = TENANT_ROWS[formset.model][3]
        for gone in formset.deleted_objects:
            delete(gone, actor=request.user)
        forms_by_obj = {id(f.instance): f for f in formset.forms}
        for obj in saved:
            save_tenant_row(request, forms_by_obj[id(obj)], obj)


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
    form = QuotaAdminForm
    list_display = ["tenant", "gpu_type", "guaranteed_gpus", "limit_gpus", "max_running_jobs"]
    list_filter = ["tenant", "gpu_type"]
    list_select_related = ["tenant"]

    def get_readonly_fields(self, request, obj=None):
        # Fixed once made, as in the API: a quota moves by being recreated.
        return ["tenant", "gpu_type"] if obj is not None else []

    def save_model(self, request, obj, form, change):
        save_tenant_row(request, form, obj)

    def delete_model(self, request, obj):
        actions.delete_quota(obj, actor=request.user)

    def delete_queryset(self, request, queryset):
        for quota in queryset.select_related("tenant"):
            actions.delete_quota(quota, actor=request.user)


@admin.register(Budget)
class BudgetAdmin(admin.ModelAdmin):
    form = BudgetAdminForm
    list_display = ["tenant", "kind", "period", "amount", "action", "warn_at_fraction"]
    list_filter = ["kind", "period", "action"]
    list_select_related = ["tenant"]

    def get_readonly_fields(self, request, obj=None):
        return ["tenant", "kind"] if obj is not None else []

    def save_model(self, request, obj, form, change):
        save_tenant_row(request, form, obj)

    def delete_model(self, request, obj):
        actions.delete_budget(obj, actor=request.user)

    def delete_queryset(self, request, queryset):
        for budget in queryset.select_related("tenant"):
            actions.delete_budget(budget, actor=request.user)


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
        revoked = sum(actions.revoke_token(token, actor=request.user) for token in queryset)
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
