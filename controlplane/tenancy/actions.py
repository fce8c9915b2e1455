"""Changes to who belongs to a tenant, and as what, and to people's API tokens: the REST API, the
web UI and the Django admin all call these.

Each action is atomic and keeps the rules a person relies on in one place, so the API (which
answers a refusal with 4xx) and the web UI (which shows it as a message) can never disagree.
Membership changes leave a TenantEvent, the tenant's audit trail.
"""

from __future__ import annotations

import logging

from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.utils import timezone

from controlplane.permissions import is_cluster_admin, require_role
from controlplane.tenancy.models import (
    ApiToken,
    Invitation,
    Membership,
    Role,
    Tenant,
    TenantEvent,
    TokenRequestRefused,
    invitation_ttl,
)

log = logging.getLogger(__name__)


class LastTenantAdmin(Exception):
    """The change would leave a tenant without a tenant admin."""

    def __init__(self, membership: Membership):
        self.membership = membership
        super().__init__(
            f"{membership.user.username} is the last tenant admin of "
            f"{membership.tenant.slug}; make someone else admin first."
        )


class InvitationClosed(Exception):
    """The invitation can no longer be accepted (accepted, withdrawn, declined or expired)."""


class AlreadyMember(Exception):
    """The person accepting an invitation already belongs to its tenant."""


DIRECT_ADD_REFUSED = (
    "Only a cluster admin adds people directly; tenant admins invite them "
    "(POST /api/v1/invitations/ or the members page) and they accept."
)


def _audit(tenant_id: int, kind: str, message: str, actor, **data) -> None:
    TenantEvent.objects.create(
        tenant_id=tenant_id,
        kind=kind,
        message=message,
        data={"actor": getattr(actor, "username", None), **data},
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
def add_member(tenant: Tenant, user, role: str, *, actor) -> Membership:
    """Put a person straight into a tenant: cluster admins only (everyone else invites).

    A tenant admin who could add any username would learn which usernames exist and could pull
    another tenant's people into theirs; an invitation does neither (see invite()).
    """
    if not is_cluster_admin(actor):
        raise PermissionDenied(DIRECT_ADD_REFUSED)
    membership = Membership.objects.create(tenant=tenant, user=user, role=role)
    _audit(
        tenant.pk,
        "member_added",
        f"{actor.username} added {user.username} as {Role(role).label.lower()}.",
        actor,
        user=user.username,
        role=role,
    )
    return membership


@transaction.atomic
def change_membership_role(membership: Membership, role: str, *, actor) -> Membership:
    """Give a member another role, or raise LastTenantAdmin if that would leave no tenant admin."""
    if role != Role.ADMIN:
        _refuse_leaving_no_admin(membership, actor)
    before = membership.role
    membership.role = role
    membership.save(update_fields=["role"])
    if before != role:
        _audit(
            membership.tenant_id,
            "member_role_changed",
            f"{actor.username} made {membership.user.username} "
            f"{Role(role).label.lower()} (was {Role(before).label.lower()}).",
            actor,
            user=membership.user.username,
            role=role,
            was=before,
        )
    return membership


@transaction.atomic
def remove_membership(membership: Membership, *, actor) -> None:
    """Take a person out of a tenant, or raise LastTenantAdmin if they are its last tenant admin."""
    _refuse_leaving_no_admin(membership, actor)
    tenant_id, username = membership.tenant_id, membership.user.username
    membership.delete()
    _audit(
        tenant_id, "member_removed", f"{actor.username} removed {username}.", actor, user=username
    )


# --- invitations --------------------------------------------------------------------------------


@transaction.atomic
def invite(tenant: Tenant, invitee: str, role: str, *, actor) -> Invitation:
    """Offer `invitee` (a username or e-mail address, as typed) a role in `tenant`.

    No account is looked up: the answer, and the work done to give it, are the same whether or
    not such a person exists, so inviting tells a tenant admin nothing about who has an account.
    """
    require_role(actor, tenant, Role.ADMIN)
    now = timezone.now()
    invitation = Invitation.objects.create(
        tenant=tenant,
        invitee=invitee,
        role=role,
        invited_by=actor,
        created_at=now,
        expires_at=now + invitation_ttl(),
    )
    _audit(
        tenant.pk,
        "invitation_sent",
        f"{actor.username} invited {invitee} as {Role(role).label.lower()}.",
        actor,
        invitation=invitation.pk,
        invitee=invitee,
        role=role,
    )
    return invitation


def _lock_open(invitation: Invitation) -> Invitation:
    """The invitation re-read under a row lock; InvitationClosed unless it is still open."""
    invitation = (
        Invitation.objects.select_for_update().select_related("tenant").get(pk=invitation.pk)
    )
    if invitation.accepted_at is not None:
        raise InvitationClosed("This invitation was already accepted.")
    if invitation.revoked_at is not None:
        raise InvitationClosed("This invitation was withdrawn or declined.")
    if invitation.expires_at <= timezone.now():
        raise InvitationClosed(
            f"This invitation expired at {invitation.expires_at:%Y-%m-%d %H:%M} UTC; "
            "ask a tenant admin for a new one."
        )
    return invitation


@transaction.atomic
def accept_invitation(invitation: Invitation, *, user) -> Membership:
    """The invitee joins the tenant with the invitation's role."""
    if not invitation.is_addressed_to(user):
        raise PermissionDenied("This invitation is addressed to someone else.")
    invitation = _lock_open(invitation)
    tenant = invitation.tenant
    if Membership.objects.filter(tenant=tenant, user=user).exists():
        raise AlreadyMember(f"You already belong to {tenant.slug}.")
    membership = Membership.objects.create(tenant=tenant, user=user, role=invitation.role)
    invitation.accepted_at = timezone.now()
    invitation.accepted_by = user
    invitation.save(update_fields=["accepted_at", "accepted_by"])
    inviter = invitation.invited_by.username if invitation.invited_by else "someone"
    _audit(
        tenant.pk,
        "member_added",
        f"{user.username} joined as {Role(invitation.role).label.lower()} (invited by {inviter}).",
        user,
        user=user.username,
        role=invitation.role,
        invitation=invitation.pk,
    )
    return membership


@transaction.atomic
def withdraw_invitation(invitation: Invitation, *, actor) -> Invitation:
    """A tenant admin takes an open invitation back, or its invitee declines it."""
    declining = invitation.is_addressed_to(actor)
    if not declining:
        require_role(actor, invitation.tenant, Role.ADMIN)
    invitation = _lock_open(invitation)
    invitation.revoked_at = timezone.now()
    invitation.save(update_fields=["revoked_at"])
    verb = "declined" if declining else "withdrew"
    who = actor.username
    message = (
        f"{who} declined the invitation."
        if declining
        else f"{who} withdrew the invitation of {invitation.invitee}."
    )
    _audit(
        invitation.tenant_id,
        f"invitation_{verb}",
        message,
        actor,
        invitation=invitation.pk,
        invitee=invitation.invitee,
    )
    return invitation


# --- API tokens ---------------------------------------------------------------------------------


@transaction.atomic
def issue_token(
    user, name: str, *, expires_at=None, scopes=None, using: ApiToken | None = None
) -> tuple[ApiToken, str]:
    """Issue a token for `user`; `using` is the token the request came with (None: a session).

    Raises TokenRequestRefused for an expiry or scopes beyond what the issuer may give.
    """
    parent = None
    if using is not None:
        # Locked, so a revocation of the parent either sees this child (and revokes it too) or
        # happens first (and this refuses): a child never survives its parent's revocation.
        parent = ApiToken.objects.select_for_update().get(pk=using.pk)
        if not parent.is_usable:
            raise TokenRequestRefused(
                {"non_field_errors": ["The token you are using was revoked or expired."]}
            )
    token, raw = ApiToken.issue(user, name, expires_at, scopes=scopes, parent=parent)
    log.info(
        "API token %s issued to %s (scopes %s, expires %s, minted with %s)",
        token.prefix,
        user.username,
        ",".join(token.scopes),
        token.expires_at.isoformat(),
        parent.prefix if parent else "a session",
    )
    return token, raw


@transaction.atomic
def revoke_token(token: ApiToken) -> int:
    """Revoke a token and every token minted from it, transitively; return how many stopped working.

    Level by level, each level's rows updated before its children are read: a child being minted
    meanwhile holds its parent's row lock (issue_token), so the update waits for it to commit and
    the next read sees it.
    """
    now = timezone.now()
    revoked = 0
    level = [token.pk]
    seen: set[int] = set()
    while level:
        seen.update(level)
        revoked += ApiToken.objects.filter(pk__in=level, revoked_at__isnull=True).update(
            revoked_at=now
        )
        level = [
            pk
            for pk in ApiToken.objects.filter(parent_id__in=level).values_list("pk", flat=True)
            if pk not in seen
        ]
    if revoked:
        log.info("Revoked %d API token(s): %s and those minted from it", revoked, token.prefix)
    return revoked
