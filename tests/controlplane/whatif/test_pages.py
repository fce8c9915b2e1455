"""The what-if pages: cluster admins launch a run and read its report; nobody else gets in."""

import pytest
from django.urls import reverse

from controlplane.scheduling.models import WhatIfRun, WhatIfState
from controlplane.tenancy.models import Quota
from frontend.whatif_views import render_markdown
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
@pytest.mark.parametrize("name", ["whatif-list", "whatif-detail"])
def test_members_get_403(client, alice, name):
    run = WhatIfRun.objects.create(params={})
    client.force_login(alice)
    args = [run.pk] if name == "whatif-detail" else []
    assert client.get(reverse(name, args=args)).status_code == 403
    assert client.post(reverse("whatif-list"), LAUNCH).status_code == 403
    assert WhatIfRun.objects.count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize("name", ["whatif-list", "whatif-detail"])
def test_anonymous_visitors_are_sent_to_sign_in(client, name):
    run = WhatIfRun.objects.create(params={})
    url = reverse(name, args=[run.pk] if name == "whatif-detail" else [])
    response = client.get(url)
    assert response.status_code == 302
    assert response["Location"] == f"{reverse('login')}?next={url}"


def test_the_report_renderer_escapes_html_in_the_report():
    html = render_markdown(
        "# <script>alert(1)</script>\n\n- a <b>tenant</b>\n\n| run | x |\n|---|---:|\n| <i>r</i> | 1 |\n"
    )
    assert "<script>" not in html and "<b>" not in html and "<i>" not in html
    assert "<h2>&lt;script&gt;alert(1)&lt;/script&gt;</h2>" in html
    assert "<li>a &lt;b&gt;tenant&lt;/b&gt;</li>" in html
    assert '<th scope="row">&lt;i&gt;r&lt;/i&gt;</th><td class="num nowrap">1</td>' in html


def test_the_report_renderer_keeps_code_and_paragraphs():
    html = render_markdown("Some `code` here\nand there.\n\n```\nmanage.py whatif <x>\n```\n")
    assert "<p>Some <code>code</code> here and there.</p>" in html
    assert '<pre class="code">manage.py whatif &lt;x&gt;</pre>' in html
