"""Time-series charts rendered on the server as inline SVG.

Why not a JavaScript chart library: the pages must work without a JS build, the live parts are
refreshed by htmx swapping server-rendered HTML (an SVG is just more HTML, so the chart refreshes
with the numbers next to it), and a line chart of a few hundred points is ~100 lines of Python.
Why not matplotlib: it takes tens of milliseconds per figure, and its output ignores the page's
stylesheet (colours, fonts, dark-on-light contrast) and scales badly on a phone.

Colours come from CSS classes (.series-N, .threshold), so the stylesheet owns the look.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from django.utils.html import escape, format_html
from django.utils.safestring import SafeString, mark_safe

Point = tuple[dt.datetime, float | None]


@dataclass
class Series:
    name: str
    points: Sequence[Point]
    dashed: bool = False
    css_class: str = ""


@dataclass
class Threshold:
    """A horizontal line, such as a power budget."""

    name: str
    value: float


@dataclass
class Chart:
    title: str
    unit: str
    series: list[Series] = field(default_factory=list)
    thresholds: list[Threshold] = field(default_factory=list)
    y_max: float | None = None  # a fixed top (100 for percentages); else from the data
    width: int = 560
    height: int = 220
    empty: str = "No telemetry recorded yet."
    # The time axis: the data's own span unless given (a chosen window, such as the last 24
    # hours, stays that wide when only its last hour has data, so a gap reads as a gap).
    x_range: tuple[dt.datetime, dt.datetime] | None = None
    # What a screen reader hears of each series: its latest value, or (True) also its first,
    # lowest and highest, for charts whose point is a change over time.
    trend: bool = False


# Room for the axes' labels inside the viewBox. The unit sits above the plot: beside the top
# value's label it overlapped it at a phone's larger label size.
PAD_LEFT, PAD_RIGHT, PAD_TOP, PAD_BOTTOM = 52, 12, 26, 28
# Half the width of one label character at the phone font size (the larger of the two).
LABEL_HALF_CHAR_W = 5.5


def nice_step(span: float, ticks: int = 4) -> float:
    """A round tick spacing (1, 2 or 5 times a power of ten) giving about `ticks` intervals."""
    if span <= 0:
        return 1.0
    raw = span / ticks
    magnitude = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * magnitude:
            return m * magnitude
    return 10 * magnitude


def _fmt_value(v: float, thousands: bool) -> str:
    return f"{v / 1000:g}k" if thousands and v else f"{v:g}"


def _time_ticks(t0: float, t1: float, count: int = 5) -> list[float]:
    span = t1 - t0
    if span <= 0:
        return [t0]
    # Round steps a person reads at a glance: seconds to hours.
    steps = (10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 43200, 86400, 172800)
    for step in steps:
        if span / step <= count:
            break
    first = math.ceil(t0 / step) * step
    ticks: list[float] = []
    t = first
    while t <= t1:
        ticks.append(t)
        t += step
    return ticks


def _segments(points: Sequence[Point]) -> list[list[tuple[float, float]]]:
    """Split a series at missing values: a gap in telemetry is drawn as a gap, not a zero."""
    segments: list[list[tuple[float, float]]] = [[]]
    for at, value in points:
        if value is None:
            if segments[-1]:
                segments.append([])
            continue
        segments[-1].append((at.timestamp(), float(value)))
    return [s for s in segments if s]


def render(chart: Chart) -> SafeString:
    """The chart as a <figure>: an SVG with a text alternative, and a legend in HTML."""
    values = [v for s in chart.series for _, v in s.points if v is not None]
    times = [at.timestamp() for s in chart.series for at, v in s.points if v is not None]
    if not values:
        return format_html(
            '<figure class="chart chart-empty"><figcaption>{}</figcaption>'
            '<p class="empty">{}</p></figure>',
            chart.title,
            chart.empty,
        )
    t0, t1 = min(times), max(times)
    if chart.x_range is not None:
        t0, t1 = chart.x_range[0].timestamp(), chart.x_range[1].timestamp()
    if t1 == t0:
        t0 -= 30
        t1 += 30
    top = chart.y_max
    if top is None:
        top = max(values + [t.value for t in chart.thresholds]) * 1.1 or 1.0
    step = nice_step(top)
    top = math.ceil(top / step) * step

    w, h = chart.width, chart.height
    plot_w = w - PAD_LEFT - PAD_RIGHT
    plot_h = h - PAD_TOP - PAD_BOTTOM

    def x(t: float) -> float:
        return PAD_LEFT + (t - t0) / (t1 - t0) * plot_w

    def y(v: float) -> float:
        return PAD_TOP + plot_h - min(max(v, 0.0), top) / top * plot_h

    parts: list[str] = []
    # Grid and y labels.
    v = 0.0
    while v <= top + 1e-9:
        yy = y(v)
        parts.append(
            f'<line class="grid" x1="{PAD_LEFT}" x2="{w - PAD_RIGHT}" y1="{yy:.1f}" y2="{yy:.1f}"/>'
            f'<text class="axis" x="{PAD_LEFT - 6}" y="{yy + 4:.1f}" text-anchor="end">'
            f"{_fmt_value(v, top >= 10_000)}</text>"
        )
        v += step
    # Time labels (UTC, like every time on these pages).
    span = t1 - t0
    time_format = "%H:%M:%S" if span < 600 else "%H:%M" if span < 86400 * 2 else "%d %b"
    for t in _time_ticks(t0, t1):
        xx = x(t)
        label = dt.datetime.fromtimestamp(t, dt.UTC).strftime(time_format)
        parts.append(
            f'<line class="tick" x1="{xx:.1f}" x2="{xx:.1f}" y1="{PAD_TOP + plot_h}" '
            f'y2="{PAD_TOP + plot_h + 4}"/>'
        )
        # A label centred on a tick near the right edge would be cut off: the tick stays.
        if xx + len(label) * LABEL_HALF_CHAR_W <= w:
            parts.append(
                f'<text class="axis" x="{xx:.1f}" y="{h - 8}" text-anchor="middle">{label}</text>'
            )
    parts.append(
        f'<text class="axis unit" x="4" y="{PAD_TOP - 10}" text-anchor="start">'
        f"{escape(chart.unit)}</text>"
    )
    for th in chart.thresholds:
        yy = y(th.value)
        parts.append(
            f'<line class="threshold" x1="{PAD_LEFT}" x2="{w - PAD_RIGHT}" '
            f'y1="{yy:.1f}" y2="{yy:.1f}"><title>{escape(th.name)}: {th.value:g} '
            f"{escape(chart.unit)}</title></line>"
        )
    for i, s in enumerate(chart.series):
        css = s.css_class or f"series-{i % 8}"
        dash = " dashed" if s.dashed else ""
        for seg in _segments(s.points):
            if len(seg) == 1:
                (tt, vv) = seg[0]
                parts.append(
                    f'<circle class="line {css}" cx="{x(tt):.1f}" cy="{y(vv):.1f}" r="2.5"/>'
                )
                continue
            coords = " ".join(f"{x(tt):.1f},{y(vv):.1f}" for tt, vv in seg)
            parts.append(f'<polyline class="line {css}{dash}" points="{coords}"/>')

    summary = _summary(chart)
    legend = "".join(
        f'<li><span class="swatch {s.css_class or f"series-{i % 8}"}'
        f'{" dashed" if s.dashed else ""}" aria-hidden="true"></span>{escape(s.name)}</li>'
        for i, s in enumerate(chart.series)
    ) + "".join(
        f'<li><span class="swatch threshold" aria-hidden="true"></span>'
        f"{escape(th.name)} ({th.value:g} {escape(chart.unit)})</li>"
        for th in chart.thresholds
    )
    svg = (
        f'<svg viewBox="0 0 {w} {h}" role="img" aria-label="{escape(chart.title)}: '
        f'{escape(summary)}" preserveAspectRatio="xMidYMid meet">{"".join(parts)}</svg>'
    )
    return mark_safe(
        f'<figure class="chart"><figcaption>{escape(chart.title)}</figcaption>{svg}'
        f'<ul class="legend">{legend}</ul></figure>'
    )


def _summary(chart: Chart) -> str:
    """What a screen reader says instead of the picture: the latest value of each series."""
    said = []
    for s in chart.series:
        latest = next((v for _, v in reversed(s.points) if v is not None), None)
        if latest is None:
            continue
        if chart.trend:
            known = [v for _, v in s.points if v is not None]
            said.append(
                f"{s.name} from {known[0]:.0f} to {latest:.0f} {chart.unit}, "
                f"lowest {min(known):.0f}, highest {max(known):.0f}"
            )
        else:
            said.append(f"{s.name} latest {latest:.0f} {chart.unit}")
    return "; ".join(said) or "no data"
