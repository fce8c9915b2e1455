"""Django admin for ops: pools and their power budgets, nodes (cordon / drain / uncordon /
deregister), GPUs, join tokens, whose secret is shown once when one is added, and the GPU claims
registrations were refused for."""

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.utils import timezone

from controlplane.cluster import actions, gpu_claims, rules
from controlplane.cluster.models import (
    GPU,
    GpuClaimConflict,
    GpuClaimResolution,
    JoinToken,
    Node,
    NodeState,
    Pool,
)


class PoolAdminForm(forms.ModelForm):
    class Meta:
        model = Pool
        fields = ["name", "power_budget_w"]

    def clean(self):
        cleaned = super().clean()
        try:
            rules.check_pool(
                {k: cleaned[k] for k in ("power_budget_w",) if k in cleaned},
                self.instance if self.instance.pk else None,
            )
        except ValidationError as exc:
            for field, messages_ in exc.message_dict.items():
                self.add_error(field, messages_)
        return cleaned


@admin.register(Pool)
class PoolAdmin(admin.ModelAdmin):
    form = PoolAdminForm
    list_display = ["name", "power_budget_w"]
    search_fields = ["name"]

    # Through the actions the API uses: audited, and the scheduler hears of a budget at once.

    def save_model(self, request, obj, form, change):
        values = {name: form.cleaned_data[name] for name in form.changed_data}
        if not change:
            created = actions.create_pool(actor=request.user, **form.cleaned_data)
            obj.pk = created.pk
            return
        stored = Pool.objects.get(pk=obj.pk)
        actions.update_pool(stored, actor=request.user, **values)

    def delete_model(self, request, obj):
        actions.delete_pool(obj, actor=request.user)

    def delete_queryset(self, request, queryset):
        for pool in queryset:
            actions.delete_pool(pool, actor=request.user)


class GpuInline(admin.TabularInline):
    model = GPU
    extra = 0
    can_delete = False
    fields = ("index", "uuid", "model", "healthy", "power_cap_w", "power_draw_w", "utilization_pct")
    readonly_fields = fields

    def has_add_permission(self, request, obj=None):
        return False


def _state_action(state: str, description: str):
    def act(modeladmin, request, queryset):
        changed = sum(actions.set_node_state(node, state, actor=request.user) for node in queryset)
        modeladmin.message_user(request, f"{changed} node(s) now {state}.", messages.SUCCESS)

    act.__name__ = f"set_{state}"
    return admin.action(description=description)(act)


@admin.action(description="Deregister: gone for good (its GPUs may join another node)")
def deregister_nodes(modeladmin, request, queryset):
    done = 0
    for node in queryset:
        try:
            actions.deregister_node(node, actor=request.user)
            done += 1
        except gpu_claims.NodeBusy as exc:
            modeladmin.message_user(request, str(exc), messages.ERROR)
    if done:
        modeladmin.message_user(request, f"{done} node(s) deregistered.", messages.SUCCESS)


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "pool",
        "state",
        "ready",
        "last_heartbeat_at",
        "cpus",
        "memory_mib",
        "agent_version",
    ]
    list_filter = ["state", "ready", "pool"]
    search_fields = ["name"]
    list_select_related = ["pool"]
    # Inventory and liveness come from the agent; the admin state from the actions below.
    readonly_fields = [
        "state",
        "ready",
        "last_heartbeat_at",
        "heartbeat_interval_s",
        "cpus",
        "memory_mib",
        "agent_version",
        "runtime",
        "conditions",
        "token_prefix",
        "created_at",
        "deregistered_at",
        "registered_at",
        "registration_join_token",
        "registration_try",
    ]
    # Secrets, even hashed: the node token's and the registration key's.
    exclude = ["token_hash", "registration_key_hash"]
    inlines = [GpuInline]
    actions = [
        _state_action(NodeState.CORDONED, "Cordon: no new work"),
        _state_action(NodeState.DRAINING, "Drain: no new work, preempt borrowed work"),
        _state_action(NodeState.READY, "Uncordon: take new work again"),
        deregister_nodes,
    ]

    def has_add_permission(self, request):
        # Nodes join by their agent registering with a join token.
        return False


@admin.register(GPU)
class GpuAdmin(admin.ModelAdmin):
    list_display = ["uuid", "node", "index", "model", "healthy", "power_cap_w", "power_draw_w"]
    list_filter = ["model", "healthy", "node__pool"]
    search_fields = ["uuid", "node__name"]
    list_select_related = ["node"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


class JoinTokenAdminForm(forms.ModelForm):
    class Meta:
        model = JoinToken
        fields = ["pool", "expires_at", "max_uses"]

    def clean_expires_at(self):
        value = self.cleaned_data["expires_at"]
        if problem := rules.join_token_expiry_problem(value, timezone.now()):
            raise ValidationError(problem)
        return value

    def clean_max_uses(self):
        value = self.cleaned_data["max_uses"]
        if not 1 <= value <= rules.MAX_JOIN_TOKEN_USES:
            raise ValidationError(f"From 1 to {rules.MAX_JOIN_TOKEN_USES}.")
        return value


@admin.register(JoinToken)
class JoinTokenAdmin(admin.ModelAdmin):
    form = JoinTokenAdminForm
    list_display = [
        "prefix",
        "pool",
        "created_by",
        "created_at",
        "expires_at",
        "uses",
        "max_uses",
        "revoked_at",
    ]
    list_filter = ["pool"]
    list_select_related = ["pool", "created_by"]
    fields = [
        "pool",
        "expires_at",
        "max_uses",
        "prefix",
        "uses",
        "created_by",
        "created_at",
        "revoked_at",
    ]
    readonly_fields = ["prefix", "uses", "created_by", "created_at", "revoked_at"]
    actions = ["revoke"]

    def get_readonly_fields(self, request, obj=None):
        # Issued once, then only revoked (as in the API): a longer life or more uses would be a
        # new credential under an old name.
        if obj is not None:
            return [*self.fields]
        return self.readonly_fields

    def save_model(self, request, obj, form, change):
        if change:
            return
        token, raw = actions.create_join_token(
            obj.pool, actor=request.user, expires_at=obj.expires_at, max_uses=obj.max_uses
        )
        obj.pk = token.pk
        self.message_user(
            request,
            f"Join token (shown this once, only its hash is kept): {raw}",
            messages.WARNING,
        )

    def has_delete_permission(self, request, obj=None):
        # Revoked, never deleted (as in the API): the row tells which nodes joined with it.
        return False

    @admin.action(description="Revoke the selected join tokens")
    def revoke(self, request, queryset):
        revoked = sum(actions.revoke_join_token(t, actor=request.user) for t in queryset)
        self.message_user(request, f"Revoked {revoked} join token(s).", messages.SUCCESS)


def _resolve_action(resolution: str, description: str):
    def act(modeladmin, request, queryset):
        done = 0
        for conflict in queryset.filter(resolved_at__isnull=True):
            try:
                actions.resolve_gpu_claim(conflict, resolution, actor=request.user)
                done += 1
            except gpu_claims.NodeBusy as exc:
                modeladmin.message_user(request, str(exc), messages.ERROR)
        modeladmin.message_user(request, f"{done} conflict(s) resolved.", messages.SUCCESS)

    act.__name__ = f"resolve_{resolution}"
    return admin.action(description=description)(act)


@admin.register(GpuClaimConflict)
class GpuClaimConflictAdmin(admin.ModelAdmin):
    """Registrations refused because they listed GPUs other nodes hold (read-only; resolved by
    the actions)."""

    list_display = [
        "gpu_uuid",
        "claimant",
        "holder_name",
        "reason",
        "refusals",
        "last_refused_at",
        "resolved_at",
        "resolution",
    ]
    list_filter = [("resolved_at", admin.EmptyFieldListFilter), "resolution"]
    search_fields = ["gpu_uuid", "claimant", "holder_name"]
    list_select_related = ["join_token", "resolved_by"]
    actions = [
        _resolve_action(
            GpuClaimResolution.HOLDER_DEREGISTERED,
            "Deregister the holder node (the GPU really moved), so the claimant may take it",
        ),
        _resolve_action(GpuClaimResolution.DISMISSED, "Dismiss (a wrong or hostile claim)"),
    ]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
