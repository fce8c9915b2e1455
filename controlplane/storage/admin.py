"""Django admin for ops: volumes. Saves and deletes go through controlplane.storage.actions, as
the API's do: the rules are checked (a refusal shows at its field), the change is audited, and
the scheduler hears of it."""

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import ValidationError

from controlplane.storage import actions, rules
from controlplane.storage.models import Volume


class VolumeAdminForm(forms.ModelForm):
    class Meta:
        model = Volume
        fields = [
            "name",
            "description",
            "kind",
            "source",
            "pools",
            "all_tenants",
            "tenants",
            "read_only",
            "per_tenant_subdir",
            "checkpoints",
            "checkpoint_retention_s",
        ]

    def values(self) -> dict:
        names = (
            actions.VOLUME_FIELDS
            if self.instance.pk is None
            else [f for f in self.changed_data if f in actions.VOLUME_FIELDS]
        )
        return {n: self.cleaned_data[n] for n in names if n in self.cleaned_data}

    def clean(self):
        cleaned = super().clean()
        try:
            rules.check_volume(self.values(), self.instance if self.instance.pk else None)
        except ValidationError as exc:
            for field, problems in exc.message_dict.items():
                self.add_error(field if field in self.fields else None, problems)
        return cleaned


@admin.register(Volume)
class VolumeAdmin(admin.ModelAdmin):
    form = VolumeAdminForm
    list_display = ["name", "kind", "source", "read_only", "per_tenant_subdir", "checkpoints"]
    list_filter = ["kind", "checkpoints"]
    search_fields = ["name", "source"]
    filter_horizontal = ["pools", "tenants"]

    def save_model(self, request, obj, form, change):
        # The relations are saved with the fields, by the action: nothing is left for
        # save_related to write outside it.
        relations = {name: list(form.cleaned_data[name]) for name in actions.VOLUME_RELATIONS}
        if not change:
            created = actions.create_volume(actor=request.user, **form.values(), **relations)
            obj.pk, obj.created_at = created.pk, created.created_at
            return
        stored = Volume.objects.get(pk=obj.pk)
        actions.update_volume(stored, actor=request.user, **form.values(), **relations)

    def save_related(self, request, form, formsets, change):
        for formset in formsets:
            self.save_formset(request, form, formset, change=change)

    def delete_model(self, request, obj):
        try:
            actions.delete_volume(obj, actor=request.user)
        except actions.VolumeInUse as exc:
            self.message_user(request, str(exc), messages.ERROR)

    def delete_queryset(self, request, queryset):
        for volume in queryset:
            self.delete_model(request, volume)
