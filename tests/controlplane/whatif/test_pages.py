"""The what-if pages: cluster admins launch a run and read its report; nobody else gets in."""

import re

import pytest
from django.urls import reverse

from controlplane.scheduling.models import WhatIfRun, WhatIfState
from controlplane.scheduling.whatif.params import WhatIfParams
from controlplane.scheduling.whatif.report import report_of
from controlplane.tenancy.models import Quota
from tests.controlplane.whatif.conftest import SINCE, UNTIL, wait_until

LAUNCH = {
    "since": SINCE,
    "until": UNTIL,
    "policy": "ours",
    "weights": "vision=2",
    "quotas": "vision:H100-SXM-80GB=2:2",
    "power_budgets": "",
}


@pytest.fixture
def history(vision, alice, make_node, finished_job):
    node = make_node("n1", gpus=2)
    Quota.objects.filter(tenant=vision).update(guaranteed_gpus=1, limit_gpus=1)
    finished_job(vision, alice, node, submit_s=0, wait_s=0, run_s=600)
    finished_job(vision, alice, node, submit_s=0, wait_s=600, run_s=600)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_an_admin_launches_a_what_if_and_reads_its_report_when_the_run_is_done(
    client, settings, cluster_admin, history
):
    # The embedded mode has no Celery worker: the run goes to a thread of the web process.
    settings.SCHEDULER_EMBEDDED = True
    client.force_login(cluster_admin)
    launched = client.post(reverse("whatif-list"), LAUNCH)
    run = WhatIfRun.objects.get()
    assert launched.status_code == 302
    assert launched["Location"] == reverse("whatif-detail", args=[run.pk])
    assert run.requested_by == cluster_admin
    assert run.params["quotas"] == [
        {"tenant": "vision", "gpu_type": "H100-SXM-80GB", "guaranteed_gpus": 2, "limit_gpus": 2}
    ]

    def fragment():
        response = client.get(reverse("whatif-detail", args=[run.pk]), HTTP_HX_REQUEST="true")
        return response if "hx-trigger" not in response.content.decode() else None

    done = wait_until(fragment, timeout_s=120, interval_s=0.2)
    assert done, WhatIfRun.objects.get().error
    run.refresh_from_db()
    assert (run.state, run.progress, run.error) == (WhatIfState.DONE, 1.0, "")
    html = client.get(reverse("whatif-detail", args=[run.pk])).content.decode()
    assert "<h2>What-if on 2026-11-01 00:00 to 2026-12-01 00:00 UTC</h2>" in html
    assert '<th scope="row">what really happened</th>' in html
    assert '<th scope="row">simulated: what-if</th>' in html
    assert "vision: weight 1 -&gt; 2" in html
    # The download is the text the command prints, from the same summary.
    download = client.get(reverse("whatif-markdown", args=[run.pk]))
    assert download["Content-Type"] == "text/markdown; charset=utf-8"
    assert download.content.decode() == run.report_markdown
    assert "| what really happened |" in run.report_markdown
    listing = client.get(reverse("whatif-list")).content.decode()
    assert reverse("whatif-detail", args=[run.pk]) in listing
    assert "quota vision:H100-SXM-80GB=2:2" in listing


@pytest.mark.django_db
def test_a_running_what_if_page_polls_its_progress(client, cluster_admin):
    run = WhatIfRun.objects.create(
        params={"since": "2026-11-01T00:00:00+00:00", "until": "2026-12-01T00:00:00+00:00"},
        state=WhatIfState.RUNNING,
        progress=0.42,
    )
    client.force_login(cluster_admin)
    html = client.get(reverse("whatif-detail", args=[run.pk])).content.decode()
    assert 'hx-trigger="every 2s"' in html
    assert 'value="42"' in html


@pytest.mark.django_db
def test_a_failed_what_if_page_says_why_and_stops_polling(client, cluster_admin):
    run = WhatIfRun.objects.create(
        params={"since": "2026-11-01T00:00:00+00:00", "until": "2026-12-01T00:00:00+00:00"},
        state=WhatIfState.FAILED,
        error="--since/--until: no finished job was submitted from 2026-11-01",
    )
    client.force_login(cluster_admin)
    html = client.get(reverse("whatif-detail", args=[run.pk]), HTTP_HX_REQUEST="true")
    assert "no finished job was submitted" in html.content.decode()
    assert "hx-trigger" not in html.content.decode()


@pytest.mark.django_db
def test_the_form_shows_a_bad_quota_on_its_field_and_starts_nothing(
    client, cluster_admin, vision, make_node
):
    make_node("n1", gpus=2)
    client.force_login(cluster_admin)
    response = client.post(reverse("whatif-list"), {**LAUNCH, "quotas": "vision:H100-SXM-80GB=8"})
    assert response.status_code == 400
    assert "is not TENANT:GPU_TYPE=GUARANTEED:LIMIT" in response.content.decode()
    assert response.context["form"].errors["quotas"]
    assert not WhatIfRun.objects.exists()


@pytest.mark.django_db
def test_the_form_refuses_a_period_that_ends_before_it_begins(client, cluster_admin, vision):
    client.force_login(cluster_admin)
    response = client.post(
        reverse("whatif-list"),
        {**LAUNCH, "since": UNTIL, "until": SINCE, "quotas": "", "weights": ""},
    )
    assert response.status_code == 400
    assert "is not before --until" in response.context["form"].errors["since"][0]


@pytest.mark.django_db
@pytest.mark.parametrize("name", ["whatif-list", "whatif-detail", "whatif-markdown"])
def test_members_get_403(client, alice, name):
    run = WhatIfRun.objects.create(params={})
    client.force_login(alice)
    args = [] if name == "whatif-list" else [run.pk]
    assert client.get(reverse(name, args=args)).status_code == 403
    assert client.post(reverse("whatif-list"), LAUNCH).status_code == 403
    assert WhatIfRun.objects.count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize("name", ["whatif-list", "whatif-detail", "whatif-markdown"])
def test_anonymous_visitors_are_sent_to_sign_in(client, name):
    run = WhatIfRun.objects.create(params={})
    url = reverse(name, args=[] if name == "whatif-list" else [run.pk])
    response = client.get(url)
    assert response.status_code == 302
    assert response["Location"] == f"{reverse('login')}?next={url}"


# A done run as the task stores it: the figures in the summary, NaN stored as null.
def _row(label: str, **figures) -> dict:
    row = {
        "policy": label,
        "jobs": 2,
        "unfinished": 0,
        "mean_jct_s": 900.0,
        "median_jct_s": 900.0,
        "p99_jct_s": 1194.0,
        "mean_queue_s": 300.0,
        "p99_queue_s": 594.0,
        "makespan_s": 1200.0,
        "waited_share": 0.5,
        "utilization": 0.5,
        "preemptions": 0,
        "preempted_gpu_hours_lost": 0.0,
        "max_rho": 1.0,
        "jain_rho": 1.0,
        "energy_j": 0.0,
        "peak_power_w": None,
        "power_budget_w": None,
        "over_budget_s": None,
        "wall_s": 0,
        "cpu_s": 0,
        "events": 0,
        "plan_calls": 0,
        "plan_wall_s": 0,
        "tenants": [
            {
                "tenant": "vision",
                "jobs": 2,
                "mean_jct_s": 900.0,
                "mean_queue_s": 300.0,
                "waited_share": 0.5,
                "rho": 1.0,
                "rho_job_mean": 1.0,
            }
        ],
    }
    return {**row, **figures}


SUMMARY = {
    "rows": [
        _row("what really happened"),
        _row(
            "simulated: what-if",
            jobs=1,
            unfinished=1,
            mean_jct_s=1234.56,
            mean_queue_s=12.34,
            waited_share=0.25,
            energy_j=7.2e6,
            peak_power_w=2900.0,
            over_budget_s=8684.0,
            tenants=[
                {
                    "tenant": "<b>vision</b>",
                    "jobs": 1,
                    "mean_jct_s": 1234.56,
                    "mean_queue_s": 12.34,
                    "waited_share": 0.0,
                    "rho": None,
                    "rho_job_mean": None,
                }
            ],
        ),
    ],
    "changes": ["vision: weight 1 -> 2"],
    "notes": ["2 finished jobs submitted from 2026-11-01 00:00 to 2026-12-01 00:00 UTC."],
}


@pytest.fixture
def done_run():
    params = {"since": "2026-11-01T00:00:00+00:00", "until": "2026-12-01T00:00:00+00:00"}
    return WhatIfRun.objects.create(
        params=params,
        state=WhatIfState.DONE,
        progress=1.0,
        summary=SUMMARY,
        report_markdown=report_of(WhatIfParams.from_json(params), SUMMARY).markdown(),
    )


def _cells(html: str, label: str) -> list[str]:
    """The cells of the table row that label names, as the page shows them."""
    start = html.index(f'<th scope="row">{label}</th>')
    row = html[start : html.index("</tr>", start)]
    return re.findall(r'<td class="num nowrap">([^<]*)</td>', row)


@pytest.mark.django_db
def test_the_report_page_shows_the_figures_of_the_stored_summary(client, cluster_admin, done_run):
    client.force_login(cluster_admin)
    html = client.get(reverse("whatif-detail", args=[done_run.pk])).content.decode()
    assert "<h2>What-if on 2026-11-01 00:00 to 2026-12-01 00:00 UTC</h2>" in html
    assert "<li>vision: weight 1 -&gt; 2</li>" in html
    assert (
        "<li>2 finished jobs submitted from 2026-11-01 00:00 to 2026-12-01 00:00 UTC.</li>" in html
    )
    # mean JCT, median, p99, mean queue, p99 queue, waited, makespan, util, max rho (not Jain's
    # index, which penalises gains), preempt, GPU-h lost, jobs, energy, peak, over budget:
    # unknown figures (null) show as "-".
    assert _cells(html, "what really happened") == [
        "900.0", "900.0", "1,194.0", "300.0", "594.0", "50.0 %", "0.01", "50.0 %", "1.000", "0",
        "0.0", "2", "0.0", "-", "-",
    ]  # fmt: skip
    whatif_cells = _cells(html, "simulated: what-if")
    assert whatif_cells[0] == "1,234.6" and whatif_cells[3] == "12.3"
    assert whatif_cells[5] == "25.0 %"
    assert whatif_cells[11] == "1 (+1 unfinished)"
    assert whatif_cells[12:] == ["2.0", "2.9", "8,684"]
    assert '<th scope="col" class="num nowrap">mean JCT (s)</th>' in html
    assert "<p>JCT = finish - submit; queue = JCT - time holding GPUs" in html


@pytest.mark.django_db
def test_the_per_tenant_table_shows_each_rows_figures_and_escapes_names(
    client, cluster_admin, done_run
):
    client.force_login(cluster_admin)
    html = client.get(reverse("whatif-detail", args=[done_run.pk])).content.decode()
    assert '<th scope="col" class="num nowrap">simulated: what-if queue / JCT / rho</th>' in html
    assert _cells(html, "vision") == ["2", "300.0 / 900 / 1.000", "-"]
    # A tenant the what-if row alone has; its rho was NaN (null in the summary).
    assert _cells(html, "&lt;b&gt;vision&lt;/b&gt;") == ["1", "-", "12.3 / 1,235 / -"]
    assert "<b>vision</b>" not in html


@pytest.mark.django_db
def test_the_page_and_the_download_show_the_same_figures(client, cluster_admin, done_run):
    client.force_login(cluster_admin)
    html = client.get(reverse("whatif-detail", args=[done_run.pk])).content.decode()
    text = client.get(reverse("whatif-markdown", args=[done_run.pk])).content.decode()
    line = next(line for line in text.splitlines() if line.startswith("| what really happened |"))
    assert line.strip("| ").split(" | ")[1:] == _cells(html, "what really happened")
    assert reverse("whatif-markdown", args=[done_run.pk]) in html


@pytest.mark.django_db
def test_a_run_without_a_report_has_no_download_and_no_report_section(client, cluster_admin):
    run = WhatIfRun.objects.create(
        params={"since": "2026-11-01T00:00:00+00:00", "until": "2026-12-01T00:00:00+00:00"},
        state=WhatIfState.RUNNING,
    )
    client.force_login(cluster_admin)
    assert client.get(reverse("whatif-markdown", args=[run.pk])).status_code == 404
    html = client.get(reverse("whatif-detail", args=[run.pk])).content.decode()
    assert 'aria-label="Report"' not in html


def _bars(html: str, figure_title: str) -> dict[str, float]:
    """The bars of the chart titled figure_title: their tooltip text -> drawn width."""
    start = html.index(f"<figcaption>{figure_title}")
    figure = html[start : html.index("</figure>", start)]
    return {
        title: float(width)
        for width, title in re.findall(
            r'<rect class="bar series-\d" [^>]*width="([\d.]+)"[^>]*><title>([^<]*)</title>', figure
        )
    }


@pytest.mark.django_db
def test_the_report_compares_the_runs_in_charts_drawn_to_scale(client, cluster_admin, done_run):
    client.force_login(cluster_admin)
    html = client.get(reverse("whatif-detail", args=[done_run.pk])).content.decode()
    # The longest time is 1,235 s: the chart counts in minutes.
    bars = _bars(html, "Job completion and queueing times (min)")
    real = bars["mean JCT, what really happened: 15.0 min"]
    whatif = bars["mean JCT, simulated: what-if: 20.6 min"]
    assert whatif / real == pytest.approx(1234.56 / 900.0, rel=0.01)
    assert (
        bars["mean queue, simulated: what-if: 0.2 min"]
        < bars["mean queue, what really happened: 5.0 min"]
    )
    assert len(bars) == 2 * 5  # two runs, five figures each
    tenants = _bars(html, "Mean queue per tenant (min)")
    # Each tenant's bar where its row has it; a tenant a run does not have has no bar, and the
    # name is escaped like everywhere else.
    assert set(tenants) == {
        "vision, what really happened: 5.0 min",
        "&lt;b&gt;vision&lt;/b&gt;, simulated: what-if: 0.2 min",
    }
    assert "<b>vision</b>" not in html
    # Screen readers get the comparison as text.
    assert (
        'aria-label="Job completion and queueing times: mean JCT: what really happened 15.0' in html
    )
