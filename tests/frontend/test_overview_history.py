"""The cluster overview over time: the queue from the scheduling cycles, GPU allocation from
allocations and utilization from telemetry, bucketed over a chosen window and read aloud."""

from __future__ import annotations

import datetime as dt
import html
import re

import pytest
from django.urls import reverse
from django.utils import timezone

from controlplane import queries
from tests.frontend.test_researcher_pages import text_of

pytestmark = pytest.mark.django_db

HOUR = queries.HISTORY_WINDOWS["1h"]
# A fixed clock half a minute into a minute: buckets are whole minutes of the hour window.
NOW = dt.datetime(2026, 12, 1, 12, 0, 30, tzinfo=dt.UTC)


@pytest.fixture
def admin(client, cluster_admin):
    client.force_login(cluster_admin)
    return client


def cycle(minutes_ago: float, *, now=None, **fields):
    from controlplane.scheduling.models import SchedulingCycle

    at = (now or timezone.now()) - dt.timedelta(minutes=minutes_ago)
    return SchedulingCycle.objects.create(started_at=at, **fields)


def chart_labels(response) -> list[str]:
    return [
        html.unescape(a)
        for a in re.findall(r'<svg [^>]*aria-label="([^"]+)"', response.content.decode())
    ]


def value_at(points, at: dt.datetime):
    return dict(points)[at]


def test_the_queue_chart_shows_pending_jobs_rising(admin):
    for minutes_ago, pending in ((50, 0), (40, 2), (20, 5), (2, 9)):
        cycle(minutes_ago, pending=pending)
    response = admin.get(reverse("cluster-overview"), {"window": "1h"})
    assert response.status_code == 200
    [queue] = [label for label in chart_labels(response) if label.startswith("Jobs waiting")]
    assert "waiting (most at once) from 0 to 9 jobs, lowest 0, highest 9" in queue


def test_a_bucket_has_the_longest_queue_and_every_start_of_its_cycles():
    for seconds, pending, starts in ((0, 4, 1), (10, 7, 2), (20, 3, 3)):
        cycle(0, now=NOW - dt.timedelta(minutes=5, seconds=seconds), pending=pending, starts=starts)
    history = queries.cluster_history(HOUR, NOW)
    minute = dt.datetime(2026, 12, 1, 11, 55, tzinfo=dt.UTC)
    assert value_at(history.pending_max, minute) == 7
    assert value_at(history.starts, minute) == 6
    # A minute without a cycle is a gap (the loop was not running), not an empty queue.
    assert value_at(history.pending_max, minute - dt.timedelta(minutes=1)) is None
    assert history.cycles_from == minute


def test_the_window_is_bucketed_into_round_clock_times():
    history = queries.cluster_history(queries.HISTORY_WINDOWS["24h"], NOW)
    stamps = [at for at, _ in history.pending_max]
    assert all(at.minute % 15 == 0 and at.second == 0 for at in stamps)
    assert stamps[-1] == dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
    assert len(stamps) == 96


def test_allocation_is_the_time_weighted_share_of_the_gpus(running_job, node):
    from controlplane.jobs.models import Allocation

    # running_job holds 2 of the node's 4 GPUs: from 11:50:00 to 11:55:30, then released.
    Allocation.objects.filter(attempt__job=running_job).update(
        created_at=dt.datetime(2026, 12, 1, 11, 50, tzinfo=dt.UTC),
        released_at=dt.datetime(2026, 12, 1, 11, 55, 30, tzinfo=dt.UTC),
        active=False,
    )
    history = queries.cluster_history(HOUR, NOW)
    at = dt.datetime(2026, 12, 1, 11, 52, tzinfo=dt.UTC)
    assert value_at(history.allocated_pct, at) == pytest.approx(50.0)  # 2 of 4 all minute
    assert value_at(history.allocated_pct, at.replace(minute=55)) == pytest.approx(25.0)  # half
    assert value_at(history.allocated_pct, at.replace(minute=57)) == pytest.approx(0.0)
    assert history.gpus_now == 4


def test_utilization_is_the_mean_of_the_gpus_that_reported(admin, running_job):
    from controlplane.jobs.models import Allocation

    Allocation.objects.filter(attempt__job=running_job).update(
        created_at=timezone.now() - dt.timedelta(minutes=10)
    )
    # running_job's two GPUs reported 90, 91, 92 % in turn for ten minutes; the others nothing.
    response = admin.get(reverse("cluster-overview"), {"window": "1h"})
    [gpus] = [label for label in chart_labels(response) if label.startswith("GPUs allocated")]
    assert "busy (mean utilization) from 90 to " in gpus
    assert "highest 92" in gpus
    # The job holds 2 of the 4 GPUs now.
    assert re.search(r"allocated to jobs \(% of the 4 GPUs now\) from \d+ to 50 %", gpus), gpus


def test_the_window_links_choose_the_span(admin):
    cycle(3 * 24 * 60, pending=1)
    week = text_of(admin.get(reverse("cluster-overview"), {"window": "7d"}))
    assert "Over the last 7 days" in week
    assert "No scheduling cycle was recorded" not in week
    day = text_of(admin.get(reverse("cluster-overview")))
    assert "Over the last 24 hours" in day  # the default
    assert (
        "No scheduling cycle was recorded in the last 24 hours; cycle records are kept 7 days"
        in day
    )
    links = re.findall(
        r'href="\?window=(\w+)"', admin.get(reverse("cluster-overview")).content.decode()
    )
    assert links == ["1h", "6h", "7d"]


def test_the_page_says_from_when_the_queue_is_known_when_records_start_late(admin):
    cycle(10, pending=3)
    text = text_of(admin.get(reverse("cluster-overview"), {"window": "24h"}))
    assert re.search(
        r"The queue is known from \w{3} \d{2} \d{2}:\d{2} UTC, the oldest cycle record in this "
        r"window \(records are kept 7 days",
        text,
    )


@pytest.mark.parametrize("window", ["2y", "", "1H", "<b>"])
def test_a_window_it_does_not_know_says_so_and_shows_the_default(admin, window):
    response = admin.get(reverse("cluster-overview"), {"window": window})
    assert response.status_code == 200
    text = " ".join(text_of(response).split())
    assert "Over the last 24 hours" in text
    if window:
        assert f"There is no window “{window}”; showing the last 24 hours." in html.unescape(text)


def test_the_live_parts_refresh_without_the_charts(admin, running_job):
    cycle(1, pending=2, starts=1, duration_ms=4.0)
    live = admin.get(reverse("cluster-overview"), HTTP_HX_REQUEST="true").content.decode()
    assert "Last cycle" in live and "GPUs by tenant" in live
    assert "Jobs waiting" not in live and 'class="stats"' not in live
    stats = admin.get(reverse("cluster-overview"), {"part": "stats"}, HTTP_HX_REQUEST="true")
    assert 'class="stats"' in stats.content.decode()
    assert "2 / 4" in text_of(stats)  # GPUs allocated
    assert "Last cycle" not in stats.content.decode()
