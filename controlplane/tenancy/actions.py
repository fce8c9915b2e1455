"""Changes to who belongs to a tenant, and as what: the REST API and the web UI both call these.

Each action is atomic and keeps the rules a person relies on in one place, so the API (which
answers a refusal with 409) and the web UI (which shows it as a message) can never disagree.
"""

from __future__ import annotations

from django.db import transaction

from controlplane.permissions import is_cluster_admin
from controlplane.tenancy.models import Membership, Role, Tenant


class LastTenantAdmin(Exception):
    """The change would leave a tenant without a tenant admin."""

    def __init__(self, membership: Membership):
        self.membership = membership
        super().__init__(
            f"{membership.user.username} is the last tenant admin of "
            f"{membership.tenant.slug}; make someone else admin first."
        )


def _refuse_leaving_no_admin(membership: Membership, actor) -> None:
    # A tenant admin who demotes or removes the last admin locks the tenant out of managing
    # itself; a cluster admin may still do it on purpose (e.g. to wind a tenant down).
    if is_cluster_admin(actor):
        return
    # The tenant row is the lock: two admins demoting each other at the same moment would each
    # see the other still admin and both succeed. Serialized, the second sees the first's change.
    Tenant.objects.select_for_update().filter(pk=membership.tenant_id).first()
    current_role = (
        Membership.objects.filter(pk=membership.pk).values_list("role", flat=True).first()
    )
    if current_role != Role.ADMIN:
        return
    others = Membership.objects.filter(tenant_id=membership.tenant_id, role=Role.ADMIN).exclude(
        pk=membership.pk
    )
    if not others.exists():
        raise LastTenantAdmin(membership)


@transaction.atomic
def change_membership_role(membership: Membership, role: str, *, actor) -> Membership:
    """Give a member another role, or raise LastTenantAdmin if that would leave no tenant admin."""
    if role != Role.ADMIN:
        _refuse_leaving_no_admin(membership, actor)
    membership.role = role
    membership.save(update_fields=["role"])
    return membership


@transaction.atomic
def remove_membership(membership: Membership, *, actor) -> None:
    """Take a person out of a tenant, or raise LastTenantAdmin if they are its last tenant admin."""
    _refuse_leaving_no_admin(membership, actor)
    membership.delete()
