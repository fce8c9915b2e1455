"""The audit trail in the Django admin: listed, filtered and searched; never written here."""

from django.contrib import admin

from controlplane.audit.models import AuditEvent


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    list_display = ["at", "actor_label", "action", "object_repr", "tenant", "message"]
    list_filter = ["action", "object_type", "tenant", ("actor", admin.RelatedOnlyFieldListFilter)]
    search_fields = ["actor_label", "object_repr", "object_id", "message"]
    list_select_related = ["tenant", "actor"]
    date_hierarchy = "at"
    readonly_fields = [
        "at",
        "actor",
        "actor_label",
        "tenant",
        "action",
        "object_type",
        "object_id",
        "object_repr",
        "before",
        "after",
        "message",
    ]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        # A trail someone can prune is no trail.
        return False
