"""Health codes in words on the node pages (frontend.node_health has the words)."""

from __future__ import annotations

from django import template

from frontend.node_health import throttle_words

register = template.Library()


@register.filter
def throttle_reason_words(code: str) -> str:
    """One GPU's clock-event reason as a phrase: "slowed by the hardware: it is too hot"."""
    phrase = throttle_words(str(code)).one
    return phrase.removeprefix("is ").removeprefix("has ")
