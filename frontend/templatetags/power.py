"""Power figures, each marked with what it is a figure of.

Every watt figure a page shows is written by the `watts` tag as
``<data class="watts" value="183.2" data-of="gpu:GPU-abc:draw">183 W</data>``: the exact value
for machines and the figure it claims to be (a GPU's draw, cap or requested cap; a pool's draw,
budget or worst case), so the browser test (tests/frontend/test_power_figures.py) can check every
figure on every page against what the GPUs report at that instant, and a figure written any other
way is caught there as unchecked.
"""

from __future__ import annotations

from django import template
from django.utils.html import format_html

register = template.Library()


@register.simple_tag
def watts(value, of: str, unit: str = "W") -> str:
    """value in watts (None: not reported, shown as a dash, never as zero); `of` names it."""
    if value is None or value == "":
        return format_html('<data class="watts" value="" data-of="{}">—</data>', of)
    shown = f"{float(value):,.0f}"
    text = f"{shown} {unit}" if unit else shown
    return format_html(
        '<data class="watts" value="{}" data-of="{}">{}</data>', repr(float(value)), of, text
    )
