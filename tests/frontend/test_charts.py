"""The server-rendered SVG charts: honest about gaps, scaled to round numbers, readable aloud."""

import datetime as dt
import re

from frontend import charts

T0 = dt.datetime(2026, 1, 5, 12, 0, tzinfo=dt.UTC)


def minutes(values):
    return [(T0 + dt.timedelta(minutes=i), v) for i, v in enumerate(values)]


def test_a_gap_in_telemetry_is_drawn_as_a_gap_not_a_zero():
    chart = charts.Chart(
        title="power", unit="W", series=[charts.Series("gpu0", minutes([100, 200, None, 300, 400]))]
    )
    svg = str(charts.render(chart))
    lines = re.findall(r'<polyline class="line series-0" points="([^"]+)"', svg)
    assert len(lines) == 2
    assert all(len(points.split()) == 2 for points in lines)


def test_a_lone_reading_is_a_dot():
    chart = charts.Chart(
        title="power", unit="W", series=[charts.Series("gpu0", minutes([None, 250, None]))]
    )
    assert str(charts.render(chart)).count("<circle") == 1


def test_the_axis_ends_on_a_round_number_above_the_data_and_the_budget():
    chart = charts.Chart(
        title="pool",
        unit="W",
        series=[charts.Series("draw", minutes([3100, 4700]))],
        thresholds=[charts.Threshold("budget", 6000)],
    )
    labels = re.findall(r'text-anchor="end">([^<]+)</text>', str(charts.render(chart)))
    assert labels == ["0", "2000", "4000", "6000", "8000"]


def test_percentages_use_a_fixed_scale():
    chart = charts.Chart(
        title="util", unit="%", y_max=100, series=[charts.Series("gpu0", minutes([3, 7]))]
    )
    labels = re.findall(r'text-anchor="end">([^<]+)</text>', str(charts.render(chart)))
    assert labels[-1] == "100"


def test_values_beyond_the_axis_are_clipped_to_the_plot():
    chart = charts.Chart(
        title="util", unit="%", y_max=100, series=[charts.Series("gpu0", minutes([50, 180]))]
    )
    points = re.search(r'points="([^"]+)"', str(charts.render(chart))).group(1)
    ys = [float(p.split(",")[1]) for p in points.split()]
    assert min(ys) >= charts.PAD_TOP


def test_a_chart_without_data_says_so():
    html = str(charts.render(charts.Chart(title="util", unit="%", empty="Nothing yet.")))
    assert "<svg" not in html
    assert "Nothing yet." in html


def test_a_screen_reader_hears_the_latest_value_of_each_series():
    chart = charts.Chart(
        title="GPU power",
        unit="W",
        series=[
            charts.Series("GPU 0", minutes([300, 410])),
            charts.Series("GPU 1", minutes([200, None])),
        ],
    )
    svg = str(charts.render(chart))
    assert 'role="img"' in svg
    assert 'aria-label="GPU power: GPU 0 latest 410 W; GPU 1 latest 200 W"' in svg


def test_names_are_escaped():
    chart = charts.Chart(
        title="<b>t</b>", unit="W", series=[charts.Series("<script>", minutes([1, 2]))]
    )
    html = str(charts.render(chart))
    assert "<script>" not in html and "&lt;script&gt;" in html


def test_time_labels_are_round_utc_clock_times():
    chart = charts.Chart(title="t", unit="W", series=[charts.Series("s", minutes(range(60)))])
    labels = re.findall(r'text-anchor="middle">([^<]+)</text>', str(charts.render(chart)))
    assert labels == ["12:00", "12:15", "12:30", "12:45"]


def test_a_chosen_window_keeps_its_width_when_only_its_end_has_data():
    window = (T0 - dt.timedelta(hours=1), T0 + dt.timedelta(minutes=1))
    chart = charts.Chart(
        title="q", unit="jobs", x_range=window, series=[charts.Series("s", minutes([3, 4]))]
    )
    svg = str(charts.render(chart))
    labels = re.findall(r'text-anchor="middle">([^<]+)</text>', svg)
    assert labels[0] == "11:00"
    xs = [float(p.split(",")[0]) for p in re.search(r'points="([^"]+)"', svg).group(1).split()]
    # The data sits at the right end of the plot, not stretched across it.
    assert min(xs) > charts.PAD_LEFT + 0.9 * (chart.width - charts.PAD_LEFT - charts.PAD_RIGHT)


def test_a_trend_chart_reads_out_where_each_series_went():
    chart = charts.Chart(
        title="Queue",
        unit="jobs",
        trend=True,
        series=[charts.Series("waiting", minutes([2, None, 0, 9, 5]))],
    )
    assert 'aria-label="Queue: waiting from 2 to 5 jobs, lowest 0, highest 9"' in str(
        charts.render(chart)
    )


def test_a_week_has_day_labels_that_fit():
    week = [(T0 + dt.timedelta(hours=h), 1.0) for h in range(0, 7 * 24, 2)]
    chart = charts.Chart(title="t", unit="W", series=[charts.Series("s", week)])
    labels = re.findall(r'text-anchor="middle">([^<]+)</text>', str(charts.render(chart)))
    assert 2 <= len(labels) <= 5
    assert all(re.fullmatch(r"\d{2} [A-Z][a-z]{2}", label) for label in labels)
