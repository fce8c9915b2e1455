"""Small presentation helpers: badges, bars, durations, and links that keep the list's filters."""

from __future__ import annotations

import datetime as dt
import shlex

from django import template
from django.utils.html import format_html
from django.utils.http import urlencode

from controlplane.accounting.budgets import J_PER_KWH

register = template.Library()


@register.simple_tag
def state_badge(state: str, label: str = "") -> str:
    return format_html('<span class="badge {}">{}</span>', state, label or state)


@register.filter
def duration(seconds) -> str:
    """Seconds as a person reads them: 45s, 12m 03s, 3h 05m, 2d 04h."""
    if seconds is None or seconds == "":
        return "—"
    if isinstance(seconds, dt.timedelta):
        seconds = seconds.total_seconds()
    s = int(round(float(seconds)))
    if s < 60:
        return f"{s}s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{m}m {s:02d}s"
    h, m = divmod(m, 60)
    if h < 48:
        return f"{h}h {m:02d}m"
    d, h = divmod(h, 24)
    return f"{d}d {h:02d}h"


@register.filter
def elapsed(start, end) -> str:
    """The time from start to end as a duration ("12m 03s"), for times still counting."""
    if start is None or end is None:
        return "—"
    return duration(max(0.0, (end - start).total_seconds()))


@register.filter
def shell_join(argv) -> str:
    """A command as a person would type it in a shell (quotes where a word needs them)."""
    return shlex.join(str(a) for a in argv or [])


@register.filter
def kwh(joules) -> str:
    if joules is None:
        return "—"
    return f"{float(joules) / J_PER_KWH:.3f}"


@register.filter
def num(value, digits: int = 1) -> str:
    """A reading with its digits, or a dash for "not reported" (never a zero)."""
    if value is None or value == "":
        return "—"
    return f"{float(value):.{int(digits)}f}"


@register.filter
def percent(fraction) -> str:
    if fraction is None:
        return "—"
    return f"{float(fraction) * 100:.0f}%"


def _pct(part: float, whole: float) -> float:
    return 0.0 if whole <= 0 else max(0.0, min(100.0, part / whole * 100.0))


@register.inclusion_tag("frontend/partials/usage_bar.html")
def usage_bar(in_use: int, borrowed: int, guaranteed: int, limit: int, scale: int | None = None):
    """GPUs held against guarantee and limit. The bar's width is `scale` when bars share one
    (the cluster overview), else the limit (or what is held, when more)."""
    whole = max(scale if scale is not None else limit, in_use, 1)
    within = in_use - borrowed
    return {
        "within_pct": _pct(within, whole),
        "borrowed_pct": _pct(borrowed, whole),
        "guaranteed_pct": _pct(guaranteed, whole),
        "in_use": in_use,
        "borrowed": borrowed,
        "guaranteed": guaranteed,
        "limit": limit,
        "over": in_use > limit,
    }


@register.inclusion_tag("frontend/partials/budget_bar.html")
def budget_bar(used: float, amount: float, warn_at: float = 0.8):
    fraction = used / amount if amount else 0.0
    return {
        "pct": _pct(used, amount),
        "fraction": fraction,
        "level": "over" if fraction >= 1 else ("warn" if fraction >= warn_at else ""),
    }


@register.simple_tag(takes_context=True)
def query(context, **changes) -> str:
    """The current page's query string with some parameters changed (None or "" removes one).

    Changing anything but the page goes back to page 1: page 3 of another filter means nothing.
    """
    params = context["request"].GET.copy()
    params.pop("v", None)  # the live-update version marker is not part of a link
    if "page" not in changes:
        params.pop("page", None)
    for key, value in changes.items():
        if value is None or value == "":
            params.pop(key, None)
        else:
            params[key] = value
    encoded = urlencode(sorted(params.lists()), doseq=True)
    return f"?{encoded}" if encoded else "?"


@register.inclusion_tag("frontend/partials/sort_header.html", takes_context=True)
def sort_header(context, key: str, label: str, css: str = ""):
    current = context.get("sort", "")
    if current == key:
        direction, next_key = "ascending", f"-{key}"
    elif current == f"-{key}":
        direction, next_key = "descending", key
    else:
        direction, next_key = "", key
    return {
        "request": context["request"],
        "label": label,
        "direction": direction,
        "next_key": next_key,
        "css": css,
    }


@register.simple_tag
def widget(field, has_limit=False):
    """A form field's input, described by its errors, limit and help for screen readers."""
    ids = []
    if field.errors:
        ids.append(f"{field.auto_id}_errors")
    if has_limit:
        ids.append(f"{field.auto_id}_limit")
    if field.help_text:
        ids.append(f"{field.auto_id}_helptext")
    attrs = {}
    if ids:
        attrs["aria-describedby"] = " ".join(ids)
    if field.errors:
        attrs["aria-invalid"] = "true"
    return field.as_widget(attrs=attrs)
