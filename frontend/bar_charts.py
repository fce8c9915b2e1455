"""Grouped horizontal bar charts as inline SVG (the what-if report's comparison).

The same approach as frontend.charts (server-side SVG, colours from the stylesheet's .series-N
classes, a text alternative, a legend in HTML): horizontal bars because their labels stay
legible on a phone, where a column chart's would have to be turned on their side.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

from frontend.charts import nice_step


@dataclass(frozen=True)
class Group:
    """One quantity (a row of bars), one value per series; None = not known for that series."""

    label: str
    values: Sequence[float | None]


@dataclass
class BarChart:
    title: str
    unit: str
    series: Sequence[str]
    groups: Sequence[Group]
    fmt: Callable[[float], str] = lambda v: f"{v:,.1f}"
    width: int = 560
    bar_h: int = 14
    label_w: int = 150


GROUP_GAP = 12
VALUE_W = 70  # room right of the longest bar for its value
LABEL_CHARS = 12  # what fits left of the bars at a phone's font size


def render_bars(chart: BarChart) -> SafeString:
    values = [v for g in chart.groups for v in g.values if v is not None]
    if not values:
        return mark_safe(
            f'<figure class="chart chart-empty"><figcaption>{escape(chart.title)}</figcaption>'
            '<p class="empty">Nothing to compare.</p></figure>'
        )
    top = max(values) or 1.0
    step = nice_step(top)
    top = -(-top // step) * step
    n = len(chart.series)
    group_h = n * chart.bar_h + GROUP_GAP
    height = 8 + len(chart.groups) * group_h
    plot_w = chart.width - chart.label_w - VALUE_W
    parts: list[str] = []
    for gi, group in enumerate(chart.groups):
        y0 = 8 + gi * group_h
        # A long name would run off the left edge: shortened, whole in its tooltip.
        short = (
            group.label if len(group.label) <= LABEL_CHARS else group.label[: LABEL_CHARS - 1] + "…"
        )
        parts.append(
            f'<text class="axis" x="{chart.label_w - 8}" y="{y0 + n * chart.bar_h / 2 + 4:.1f}" '
            f'text-anchor="end"><title>{escape(group.label)}</title>{escape(short)}</text>'
        )
        for si, value in enumerate(group.values):
            y = y0 + si * chart.bar_h
            name = chart.series[si]
            if value is None:
                parts.append(
                    f'<text class="axis" x="{chart.label_w + 4}" y="{y + chart.bar_h - 3}">'
                    f"<title>{escape(name)}: not known</title>-</text>"
                )
                continue
            w = max(value, 0.0) / top * plot_w
            text = f"{chart.fmt(value)} {chart.unit}".strip()
            parts.append(
                f'<rect class="bar series-{si % 8}" x="{chart.label_w}" y="{y + 1}" '
                f'width="{w:.1f}" height="{chart.bar_h - 2}">'
                f"<title>{escape(group.label)}, {escape(name)}: {escape(text)}</title></rect>"
                f'<text class="axis" x="{chart.label_w + w + 4:.1f}" y="{y + chart.bar_h - 3}">'
                f"{escape(chart.fmt(value))}</text>"
            )
    summary = "; ".join(
        f"{g.label}: "
        + ", ".join(
            f"{s} {'not known' if v is None else chart.fmt(v)}"
            for s, v in zip(chart.series, g.values, strict=True)
        )
        for g in chart.groups
    )
    legend = "".join(
        f'<li><span class="swatch series-{i % 8}" aria-hidden="true"></span>{escape(s)}</li>'
        for i, s in enumerate(chart.series)
    )
    unit = f" ({escape(chart.unit)})" if chart.unit else ""
    svg = (
        f'<svg viewBox="0 0 {chart.width} {height}" role="img" '
        f'aria-label="{escape(chart.title)}: {escape(summary)}" '
        f'preserveAspectRatio="xMidYMid meet">{"".join(parts)}</svg>'
    )
    return mark_safe(
        f'<figure class="chart bar-chart"><figcaption>{escape(chart.title)}{unit}</figcaption>'
        f'{svg}<ul class="legend">{legend}</ul></figure>'
    )
