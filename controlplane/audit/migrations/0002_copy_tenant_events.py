"""Copy tenancy.TenantEvent (the tenant's trail before this app) into AuditEvent, so the tenant's
"Recent events" keep showing what they showed; tenancy 0003 then drops TenantEvent."""

from django.conf import settings
from django.db import migrations

# The old kinds as the actions now name them.
ACTIONS = {
    "member_added": "membership.create",
    "member_role_changed": "membership.update",
    "member_removed": "membership.delete",
    "invitation_sent": "invitation.create",
    "invitation_withdrew": "invitation.withdraw",
    "invitation_declined": "invitation.decline",
    "budget_warning": "budget.warning",
    "budget_exhausted": "budget.exhausted",
}


def copy(apps, schema_editor):
    TenantEvent = apps.get_model("tenancy", "TenantEvent")
    AuditEvent = apps.get_model("audit", "AuditEvent")
    User = apps.get_model(*settings.AUTH_USER_MODEL.split("."))
    users = {}
    rows = []
    for e in TenantEvent.objects.order_by("id").iterator():
        data = dict(e.data or {})
        username = data.pop("actor", None)
        if username and username not in users:
            users[username] = User.objects.filter(username=username).first()
        action = ACTIONS.get(e.kind, e.kind)
        if e.kind == "member_added" and "invitation" in data:
            action = "invitation.accept"
        rows.append(
            AuditEvent(
                at=e.at,
                actor=users.get(username) if username else None,
                actor_label=username or ("budget check" if e.kind.startswith("budget") else ""),
                tenant_id=e.tenant_id,
                action=action,
                object_type=action.split(".")[0],
                object_id=str(data.get("invitation") or data.get("budget") or ""),
                object_repr=data.get("user") or data.get("invitee") or "",
                after=data,
                message=e.message,
            )
        )
    AuditEvent.objects.bulk_create(rows, batch_size=1000)


class Migration(migrations.Migration):
    dependencies = [
        ("audit", "0001_initial"),
        ("tenancy", "0002_token_scopes_and_invitations"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [migrations.RunPython(copy, migrations.RunPython.noop)]
