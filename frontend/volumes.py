"""Volumes in the web UI: cluster admins define them (Manage → Volumes) and see which nodes have
each and how many checkpoint directories wait for their nodes to delete them; researchers see the
volumes their tenants may mount, by name. Every change goes through controlplane.storage.actions,
as the REST API's does."""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.db.models import Prefetch
from django.shortcuts import get_object_or_404, redirect
from django.urls import reverse

from controlplane.cluster.models import Pool
from controlplane.permissions import tenant_roles
from controlplane.storage import actions, queries, rules
from controlplane.storage.models import Volume, VolumeKind
from controlplane.tenancy.models import Tenant
from frontend.forms import ActionForm, choice_field, number_field
from frontend.pages import page, staff_required

DAY_S = 86400


class VolumeForm(ActionForm):
    model = Volume
    fixed_after_create = ("name",)
    name = forms.CharField(
        max_length=63,
        strip=False,
        help_text="What jobs name it in their mounts, e.g. datasets. Lower case, digits, '-'.",
    )
    description = forms.CharField(max_length=200, required=False)
    kind = choice_field("volume kind", VolumeKind)
    source = forms.CharField(
        max_length=rules.MAX_SOURCE_LENGTH,
        strip=False,
        help_text="host_path: the absolute directory every node of its pools has (e.g. an NFS "
        "mount). engine_volume: the container engine's volume name.",
    )
    pools = forms.ModelMultipleChoiceField(
        queryset=Pool.objects.order_by("name"),
        to_field_name="name",
        required=False,
        widget=forms.CheckboxSelectMultiple,
        help_text="None ticked: every pool.",
    )
    all_tenants = forms.BooleanField(required=False, label="Every tenant may mount it")
    tenants = forms.ModelMultipleChoiceField(
        queryset=Tenant.objects.order_by("slug"),
        to_field_name="slug",
        required=False,
        widget=forms.CheckboxSelectMultiple,
        label="Tenants that may mount it",
    )
    read_only = forms.BooleanField(required=False, help_text="Whatever a job asks.")
    per_tenant_subdir = forms.BooleanField(
        required=False,
        label="A directory per tenant",
        help_text="A job sees only <source>/tenants/<tenant>, never other tenants' files.",
    )
    checkpoints = forms.BooleanField(
        required=False,
        label="Checkpoint volume",
        help_text="Every job's GPUCP_CHECKPOINT_DIR lives here. Only one volume; writable "
        "host_path.",
    )
    checkpoint_retention_days = number_field(
        label="Keep checkpoints (days)",
        help_text="How long after its job ended a checkpoint directory is deleted.",
    )

    def __init__(self, *args, instance=None, **kwargs):
        retention_s = (
            instance.checkpoint_retention_s
            if instance is not None
            else Volume._meta.get_field("checkpoint_retention_s").get_default()
        )
        initial = {"checkpoint_retention_days": retention_s / DAY_S}
        if instance is not None:
            initial |= {
                "pools": list(instance.pools.all()),
                "tenants": list(instance.tenants.all()),
            }
        kwargs["initial"] = initial | (kwargs.get("initial") or {})
        super().__init__(*args, instance=instance, **kwargs)

    def values(self) -> dict:
        values = super().values()
        if "checkpoint_retention_days" in values:
            values["checkpoint_retention_s"] = round(
                values.pop("checkpoint_retention_days") * DAY_S
            )
        return values

    def check(self, values):
        fields = {k: v for k, v in values.items() if k not in actions.VOLUME_RELATIONS}
        try:
            rules.check_volume(fields, self.instance)
        except ValidationError as exc:
            errors = exc.message_dict
            if "checkpoint_retention_s" in errors:
                # The form asks in days, so say it in days, at its own field.
                errors.pop("checkpoint_retention_s")
                errors["checkpoint_retention_days"] = [
                    f"Between 0 and {rules.MAX_RETENTION_S // DAY_S} days (10 years)."
                ]
            raise ValidationError(errors) from None

    def write(self, values):
        if self.instance is None:
            return actions.create_volume(actor=self.actor, **values)
        return actions.update_volume(self.instance, actor=self.actor, **values)


@staff_required
def manage_volumes(request):
    volumes = Volume.objects.prefetch_related(
        Prefetch("pools", queryset=Pool.objects.order_by("name")),
        Prefetch("tenants", queryset=Tenant.objects.order_by("slug")),
    )
    nodes = queries.node_names_by_volume()
    rows = [(v, nodes.get(v.name, [])) for v in volumes]
    context = {
        "rows": rows,
        "due_deletions": queries.due_checkpoint_deletion_count(),
        "checkpoint_volume": next((v for v in volumes if v.checkpoints), None),
    }
    return page(request, "frontend/manage/volumes.html", context, nav="storage")


def _volume_form(request, *, instance):
    form = VolumeForm(request.POST or None, instance=instance, actor=request.user)
    if request.method == "POST" and form.is_valid():
        volume = form.save()
        messages.success(request, f"Volume {volume.name} saved.")
        return redirect("manage-volumes")
    return page(
        request,
        "frontend/manage/volume_form.html",
        {
            "form": form,
            "volume": instance,
            "title": f"Volume {instance.name}" if instance else "New volume",
        },
        nav="storage",
        status=400 if form.errors else 200,
    )


@staff_required
def volume_create(request):
    return _volume_form(request, instance=None)


@staff_required
def volume_edit(request, name: str):
    return _volume_form(request, instance=get_object_or_404(Volume, name=name))


@staff_required
def volume_delete(request, name: str):
    volume = get_object_or_404(Volume, name=name)
    back = reverse("manage-volume", args=[volume.name])
    if request.method == "POST":
        try:
            actions.delete_volume(volume, actor=request.user)
        except actions.VolumeInUse as exc:
            messages.error(request, f"Volume {volume.name} was not deleted: {exc}")
            return redirect(back)
        messages.success(request, f"Volume {volume.name} deleted.")
        return redirect("manage-volumes")
    return page(
        request,
        "frontend/manage/confirm_delete.html",
        {"what": f"Volume {volume.name}", "back": back},
        nav="storage",
    )


@login_required
def my_volumes(request):
    """The volumes each of the user's active tenants may mount: name, description, read-only,
    and how a job asks for one. Not the host path (the API does not show it either)."""
    tenants = Tenant.objects.filter(pk__in=tenant_roles(request.user), active=True).order_by("slug")
    sections = [(t, list(queries.volumes_for_tenant(t))) for t in tenants]
    return page(
        request,
        "frontend/volumes.html",
        {"sections": sections, "checkpoint_volume": queries.checkpoint_volume()},
        nav="volumes",
    )
