"""The cluster overview's charts over time: GPU use and the queue over a chosen window.

Drawn from what the control plane keeps anyway (controlplane.queries.cluster_history): the
scheduling loop's cycle records for the queue, allocations for the GPUs held, telemetry for how
busy they were. Each of those is pruned on its own schedule, so the page says from when each
chart has data when that is later than the window's start.
"""

from __future__ import annotations

import datetime as dt

from django.utils.safestring import SafeString

from controlplane import queries
from frontend import charts
from frontend.templatetags.gpucp import duration


def _span(delta: dt.timedelta) -> str:
    days = delta.total_seconds() / 86400
    if days >= 1 and days == int(days):
        return f"{int(days)} day{'s' if days != 1 else ''}"
    return duration(delta)


def _bucket_words(bucket: dt.timedelta) -> str:
    minutes = int(bucket.total_seconds() // 60)
    if minutes % 60 == 0:
        hours = minutes // 60
        return "hour" if hours == 1 else f"{hours} hours"
    return "minute" if minutes == 1 else f"{minutes} min"


def gpu_chart(h: queries.ClusterHistory) -> charts.Chart:
    chart = charts.Chart(
        title="GPUs allocated and busy",
        unit="%",
        y_max=100,
        x_range=(h.start, h.end),
        trend=True,
        empty="No GPUs yet: nodes add theirs when their agent joins.",
    )
    if h.gpus_now:
        chart.series.append(
            charts.Series(
                f"allocated to jobs (% of the {h.gpus_now} GPUs now)",
                h.allocated_pct,
                css_class="series-0",
            )
        )
        # Beside allocation, the same GPUs' utilization shows what the jobs make of them.
        chart.series.append(
            charts.Series("busy (mean utilization)", h.utilization_pct, css_class="series-1")
        )
    return chart


def queue_chart(h: queries.ClusterHistory) -> charts.Chart:
    per = _bucket_words(h.window.bucket)
    chart = charts.Chart(
        title=f"Jobs waiting, started and preempted (per {per})",
        unit="jobs",
        x_range=(h.start, h.end),
        trend=True,
        empty=f"No scheduling cycle recorded in {h.window.label}.",
    )
    # The longest queue a cycle saw in the interval: a mean would hide a burst that drained.
    chart.series.append(
        charts.Series("waiting (most at once)", h.pending_max, css_class="series-3")
    )
    chart.series.append(charts.Series("started", h.starts, css_class="series-2"))
    chart.series.append(charts.Series("preempted", h.preemptions, css_class="series-1"))
    return chart


def coverage_notes(h: queries.ClusterHistory) -> list[str]:
    """Where the window reaches past what is kept, say from when each chart has data."""
    notes = []
    late = h.start + h.window.bucket
    if h.cycles_from is None:
        notes.append(
            f"No scheduling cycle was recorded in {h.window.label}; cycle records are kept "
            f"{_span(h.cycle_retention)} (SCHEDULER_CYCLE_RETENTION_DAYS)."
        )
    elif h.cycles_from > late:
        notes.append(
            f"The queue is known from {h.cycles_from:%b %d %H:%M} UTC, the oldest cycle record "
            f"in this window (records are kept {_span(h.cycle_retention)}, "
            "SCHEDULER_CYCLE_RETENTION_DAYS)."
        )
    if h.gpus_now and h.telemetry_from is None:
        notes.append(
            f"No GPU reading in {h.window.label}; readings are kept "
            f"{_span(h.telemetry_retention)} (TELEMETRY_RETENTION_S)."
        )
    elif h.gpus_now and h.telemetry_from is not None and h.telemetry_from > late:
        notes.append(
            f"Utilization is known from {h.telemetry_from:%b %d %H:%M} UTC, the oldest GPU "
            f"reading in this window (readings are kept {_span(h.telemetry_retention)}, "
            "TELEMETRY_RETENTION_S)."
        )
    return notes


def history_context(window_key: str | None, now: dt.datetime) -> dict[str, object]:
    """The charts of the chosen window (?window=), and a word when the key was not one."""
    problem = ""
    key = window_key or queries.DEFAULT_HISTORY_WINDOW
    if key not in queries.HISTORY_WINDOWS:
        problem = (
            f"There is no window “{key[:20]}”; showing "
            f"{queries.HISTORY_WINDOWS[queries.DEFAULT_HISTORY_WINDOW].label}."
        )
        key = queries.DEFAULT_HISTORY_WINDOW
    history = queries.cluster_history(queries.HISTORY_WINDOWS[key], now)
    rendered: list[SafeString] = [
        charts.render(gpu_chart(history)),
        charts.render(queue_chart(history)),
    ]
    return {
        "history": history,
        "history_charts": rendered,
        "history_notes": coverage_notes(history),
        "history_bucket": _bucket_words(history.window.bucket),
        "history_windows": list(queries.HISTORY_WINDOWS.values()),
        "history_window": key,
        "history_problem": problem,
    }
