"""The frame every page shares (navigation, who is looking) and the cluster-admin gate.

A module of its own so the page modules beside views.py (invitations.py) use it without
importing views.py, which imports them.
"""

from __future__ import annotations

import functools

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.shortcuts import render

from controlplane.permissions import is_cluster_admin, tenant_roles
from controlplane.tenancy.models import Tenant

LIVE_POLL_S = 3


def staff_required(view):
    """Cluster-admin pages: anonymous visitors sign in first; everyone else gets 403."""

    @functools.wraps(view)
    @login_required
    def wrapped(request, *args, **kwargs):
        if not is_cluster_admin(request.user):
            raise PermissionDenied("This page is for cluster admins.")
        return view(request, *args, **kwargs)

    return wrapped


def page(request, template: str, context: dict | None = None, *, nav: str = "", status=200):
    """Render a full page with what the navigation needs."""
    user = request.user
    roles = tenant_roles(user)
    context = {
        "nav": nav,
        "nav_tenants": Tenant.objects.filter(pk__in=roles).order_by("slug"),
        "is_cluster_admin": is_cluster_admin(user),
        "poll_s": LIVE_POLL_S,
        **(context or {}),
    }
    return render(request, template, context, status=status)
