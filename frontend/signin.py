"""What the sign-in pages (ours and the Django admin's) answer once django-axes locks a username
out from an address (settings: AXES_*): the sign-in form again, saying why and for how long."""

from __future__ import annotations

import math

from axes.helpers import get_cool_off
from django.contrib.auth.forms import AuthenticationForm
from django.shortcuts import render


def locked_out(request, original_response=None, credentials=None):
    cool_off = get_cool_off(request)
    wait_s = math.ceil(cool_off.total_seconds()) if cool_off else None
    response = render(
        request,
        "frontend/login.html",
        {
            # Unbound: a bound form would validate, that is try the password once more.
            "form": AuthenticationForm(request),
            "locked_out": True,
            "wait_minutes": math.ceil(wait_s / 60) if wait_s else None,
            "username": (credentials or {}).get("username") or request.POST.get("username", ""),
            "next": request.POST.get("next", request.GET.get("next", "")),
        },
        status=429,
    )
    if wait_s:
        response["Retry-After"] = str(wait_s)
    return response
