"""Invitations in the web UI: a tenant admin invites from the members page (frontend.views
.tenant_members); the invitee accepts or declines on "Invitations". Every change goes through
controlplane.tenancy.actions, as the REST API's does."""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import get_object_or_404, redirect
from django.utils import timezone
from django.views.decorators.http import require_POST

from controlplane.permissions import visible_tenants
from controlplane.tenancy import actions, rules
from controlplane.tenancy.models import Invitation, Role
from frontend.forms import ActionForm
from frontend.pages import page


class InvitationForm(ActionForm):
    invitee = forms.CharField(
        label="Username or e-mail address",
        max_length=254,
        widget=forms.TextInput(attrs={"autocomplete": "off"}),
        help_text="They see the invitation when they sign in, and accept or decline it.",
    )
    role = forms.ChoiceField(choices=Role.choices, initial=Role.MEMBER)

    def clean_invitee(self):
        invitee = self.cleaned_data["invitee"].strip()
        if problem := rules.invitee_problem(invitee):
            raise forms.ValidationError(problem)
        return invitee

    def check(self, values):
        rules.check_new_invitation(self.tenant, values["invitee"])

    def write(self, values):
        return actions.invite(self.tenant, values["invitee"], values["role"], actor=self.actor)


def sent_by_tenant(tenant):
    """A tenant's open invitations, for its members page."""
    return (
        Invitation.objects.open()
        .filter(tenant=tenant)
        .select_related("invited_by")
        .order_by("-created_at")
    )


@login_required
def my_invitations(request):
    invitations = (
        Invitation.objects.open()
        .addressed_to(request.user)
        .select_related("tenant", "invited_by")
        .order_by("-created_at")
    )
    return page(
        request,
        "frontend/invitations.html",
        {"invitations": invitations, "now": timezone.now()},
        nav="invitations",
    )


@login_required
@require_POST
def invitation_answer(request, pk: int, verb: str):
    """accept or decline (the invitee), withdraw (the tenant's admins; others get 403)."""
    if verb not in ("accept", "decline", "withdraw"):
        raise Http404("No such answer to an invitation.")
    if verb == "withdraw":
        scope = Invitation.objects.filter(tenant__in=visible_tenants(request.user))
    else:
        scope = Invitation.objects.addressed_to(request.user)
    invitation = get_object_or_404(scope.select_related("tenant"), pk=pk)
    tenant = invitation.tenant
    try:
        if verb == "accept":
            membership = actions.accept_invitation(invitation, user=request.user)
            role = membership.get_role_display().lower()
            messages.success(request, f"You joined {tenant.name} as {role}.")
            return redirect("tenant-dashboard", slug=tenant.slug)
        actions.withdraw_invitation(invitation, actor=request.user)
    except (actions.InvitationClosed, actions.AlreadyMember) as exc:
        messages.error(request, str(exc))
    else:
        if verb == "decline":
            messages.info(request, f"You declined the invitation to {tenant.slug}.")
        else:
            messages.success(request, f"Invitation of {invitation.invitee} withdrawn.")
    if verb == "withdraw":
        return redirect("tenant-members", slug=tenant.slug)
    return redirect("my-invitations")
