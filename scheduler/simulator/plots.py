"""How the simulator's reports draw: one colour per policy in every figure of every report, ties
drawn as one line, and the figures themselves.

- Colours: the presets have fixed ones (``POLICY_COLORS``); any other name (a what-if row, a
  variant) gets one from a hash of its name, so it too is the same in every report. Presets that
  know the future (an oracle) are drawn dashed.
- Ties: policies whose series are equal as shown are one line labelled with all their names,
  ``fifo-shared = ours``, in the first one's colour; otherwise the later line hides the earlier
  and a reader sees one policy missing. "As shown": to the decimals of the table beside the
  figure where there is one (the load sweep), else to ``TIE_DIGITS`` significant digits (a CDF
  on a log axis cannot show more apart).

matplotlib is imported only when a figure is drawn, so the simulator runs without it.
"""

from __future__ import annotations

import colorsys
import hashlib
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scheduler.simulator.policies import PRESETS, Oracle

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

POLICY_COLORS: dict[str, str] = {
    "fifo-static": "#7f7f7f",
    "fifo-strict": "#b0b0b0",
    "fifo-shared": "#1f77b4",
    "sjf": "#c5b0d5",
    "sjf-strict": "#dbc8e8",
    "sjf-shared": "#9467bd",
    "srtf": "#ff9896",
    "srtf-shared": "#d62728",
    "tiresias": "#98df8a",
    "tiresias-shared": "#2ca02c",
    "qssf": "#bcbd22",
    "ours": "#ff7f0e",
    "ours-oracle": "#8c564b",
}
TIE_DIGITS = 3
# A figure's CDF is drawn through this many quantiles at most (a 74k-job line draws no better).
CDF_POINTS = 2000


def policy_color(name: str) -> str:
    """The colour of ``name`` in every figure: fixed for the presets, from a hash otherwise."""
    known = POLICY_COLORS.get(name)
    if known:
        return known
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    hue = int.from_bytes(digest[:2], "big") / 65536
    saturation = 0.55 + 0.35 * digest[2] / 255
    value = 0.55 + 0.3 * digest[3] / 255
    r, g, b = colorsys.hsv_to_rgb(hue, saturation, value)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


def policy_linestyle(name: str) -> str:
    """Dashed for a preset that is told durations (an oracle), solid otherwise."""
    p = PRESETS.get(name)
    return "--" if p is not None and p.oracle is not Oracle.NONE else "-"


def round_sig(value: float, digits: int = TIE_DIGITS) -> float | None:
    """``value`` to ``digits`` significant digits; None for NaN (so that NaNs tie)."""
    if math.isnan(value):
        return None
    if value == 0 or math.isinf(value):
        return value
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


def tie_groups(
    series: Mapping[str, Sequence[float]],
    digits: int = TIE_DIGITS,
    *,
    decimals: int | None = None,
) -> list[tuple[str, ...]]:
    """The names of ``series`` grouped by equal series, in first-seen order: equal to ``digits``
    significant digits, or to ``decimals`` decimals when given."""
    groups: dict[tuple[float | None, ...], list[str]] = {}
    for name, values in series.items():
        if decimals is None:
            key = tuple(round_sig(float(v), digits) for v in values)
        else:
            key = tuple(None if math.isnan(v) else round(float(v), decimals) for v in values)
        groups.setdefault(key, []).append(name)
    return [tuple(names) for names in groups.values()]


def tie_label(names: Sequence[str]) -> str:
    return " = ".join(names)


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def draw_lines(
    ax: Axes,
    xs: Mapping[str, Sequence[float]],
    ys: Mapping[str, Sequence[float]],
    *,
    marker: str | None = None,
    lw: float = 1.5,
    step: bool = False,
    decimals: int | None = None,
) -> list[tuple[str, ...]]:
    """One line per group of tied series (ties judged on x and y together, see ``tie_groups``);
    returns the groups."""
    keyed = {name: [*xs[name], math.inf, *ys[name]] for name in ys}
    groups = tie_groups(keyed, decimals=decimals)
    for names in groups:
        first = names[0]
        kwargs: dict[str, Any] = {
            "label": tie_label(names),
            "color": policy_color(first),
            "ls": policy_linestyle(first),
            "lw": lw,
        }
        if marker:
            kwargs["marker"] = marker
        if step:
            ax.step(xs[first], ys[first], where="post", **kwargs)
        else:
            ax.plot(xs[first], ys[first], **kwargs)
    return groups


def cdf_points(
    values: Sequence[float], points: int = CDF_POINTS
) -> tuple[list[float], list[float]]:
    """(x, share of values <= x) through at most ``points`` order statistics."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        return [], []
    if n <= points:
        return ordered, [(i + 1) / n for i in range(n)]
    picks = sorted({min(n - 1, round(k * (n - 1) / (points - 1))) for k in range(points)})
    return [ordered[i] for i in picks], [(i + 1) / n for i in picks]


def cdf_figure(
    path: Path,
    values: Mapping[str, Sequence[float]],
    *,
    xlabel: str,
    title: str,
    xscale: str = "linear",
    vline: float | None = None,
    step: bool = False,
) -> list[tuple[str, ...]]:
    """A CDF per policy (ties as one line) into ``path``; returns the tie groups."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs: dict[str, list[float]] = {}
    ys: dict[str, list[float]] = {}
    for name, vals in values.items():
        xs[name], ys[name] = cdf_points(vals)
    groups = draw_lines(ax, xs, ys, step=step)
    if xscale == "symlog":
        ax.set_xscale("symlog", linthresh=1.0)
    else:
        ax.set_xscale(xscale)
    if vline is not None:
        ax.axvline(vline, color="black", lw=0.8, ls=":")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("share")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, path)
    return groups


def grid(count: int, *, columns: int = 4, size: tuple[float, float] = (3.6, 2.6)) -> Any:
    """A figure of ``count`` small panels; returns (figure, flat list of axes), extras hidden."""
    plt = pyplot()
    cols = max(1, min(columns, count))
    rows = max(1, math.ceil(count / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(size[0] * cols, size[1] * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[count:]:
        ax.set_visible(False)
    return fig, flat[:count]
