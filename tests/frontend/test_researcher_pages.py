"""What a researcher sees: dashboard, job list, job page, cancel, API tokens."""

import re

import pytest
from django.urls import reverse

pytestmark = pytest.mark.django_db


def text_of(response) -> str:
    """The page as a reader sees it: tags dropped, whitespace collapsed."""
    html = response.content.decode()
    html = re.sub(r"<(script|style)[^>]*>.*?</\1>", " ", html, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)).replace("&amp;", "&")


# --- home and dashboard ----------------------------------------------------------------------


def test_home_takes_a_member_to_their_tenants_dashboard(client, alice):
    client.force_login(alice)
    response = client.get(reverse("home"))
    assert response["Location"] == reverse("tenant-dashboard", args=["vision"])


def test_home_takes_a_cluster_admin_without_a_tenant_to_the_cluster(client, cluster_admin):
    client.force_login(cluster_admin)
    assert client.get(reverse("home"))["Location"] == reverse("cluster-overview")


def test_the_dashboard_shows_gpus_against_guarantee_and_limit(
    client, alice, running_job, pending_job
):
    client.force_login(alice)
    page = text_of(client.get(reverse("tenant-dashboard", args=["vision"])))
    assert "H100-SXM-80GB" in page
    assert "2 in use · guaranteed 8 · limit 16" in page
    assert "resnet" in page and "wait-for-me" in page
    assert "Not enough free H100-SXM-80GB GPUs: needs 2, 1 free." in page


def test_the_dashboard_counts_borrowed_gpus_apart(client, alice, vision, make_job, node):
    from controlplane.jobs import actions

    job = make_job(vision, alice, name="lend-me", gpus=1)
    actions.admit_job(job, node=node, gpus=[node.gpus.get(index=3)], borrowed=True)
    client.force_login(alice)
    page = text_of(client.get(reverse("tenant-dashboard", args=["vision"])))
    assert "1 in use (1 borrowed) · guaranteed 8 · limit 16" in page


def test_the_dashboard_shows_usage_against_budgets(client, alice, vision, running_job):
    from controlplane.tenancy.models import Budget

    Budget.objects.create(tenant=vision, kind="energy_kwh", period="month", amount=2.0)
    Budget.objects.create(tenant=vision, kind="gpu_hours", period="day", amount=1.0)
    client.force_login(alice)
    page = text_of(client.get(reverse("tenant-dashboard", args=["vision"])))
    # The fixture's attempt used 0.5 kWh and 1200 GPU-seconds (1/3 GPU-hour).
    assert "Energy : 0.50 of 2 kWh per month" in page
    assert "GPU-hours : 0.33 of 1 GPU-hours per day" in page
    assert "25% of monthly energy budget" in page


def test_a_dashboard_without_quota_or_jobs_says_so(client, make_user):
    from controlplane.tenancy.models import Membership, Tenant

    tenant = Tenant.objects.create(slug="empty", name="Empty lab")
    user = make_user("eve")
    Membership.objects.create(user=user, tenant=tenant, role="member")
    client.force_login(user)
    page = text_of(client.get(reverse("tenant-dashboard", args=["empty"])))
    assert "This tenant has no quota yet" in page
    assert "Nothing is running." in page
    assert "No energy or GPU-hour budget is set" in page


def test_the_dashboard_refreshes_as_a_fragment_for_htmx(client, alice, running_job):
    client.force_login(alice)
    response = client.get(reverse("tenant-dashboard", args=["vision"]), HTTP_HX_REQUEST="true")
    html = response.content.decode()
    assert "<html" not in html
    assert "2 in use" in text_of(response)


# --- job list --------------------------------------------------------------------------------


@pytest.fixture
def many_jobs(vision, alice, make_job, make_user, node):
    from controlplane.tenancy.models import Membership

    carol = make_user("carol")
    Membership.objects.create(user=carol, tenant=vision, role="member")
    jobs = [make_job(vision, alice, name=f"sweep-{i:02d}") for i in range(30)]
    jobs.append(make_job(vision, carol, name="carols-eval"))
    return jobs


def job_names(response) -> list[str]:
    return re.findall(
        r'<td class="nowrap"><a id="job-link-\d+" href="/jobs/\d+/">([^<]+)</a></td>',
        response.content.decode(),
    )


def test_the_job_list_pages_through_jobs_newest_first(client, alice, many_jobs):
    client.force_login(alice)
    first = client.get(reverse("job-list"))
    assert job_names(first)[:2] == ["carols-eval", "sweep-29"]
    assert len(job_names(first)) == 25
    assert "Page 1 of 2" in text_of(first)
    second = client.get(reverse("job-list") + "?page=2")
    assert job_names(second) == [f"sweep-{i:02d}" for i in range(5, -1, -1)]


def test_the_job_list_filters_by_user_name_and_state(client, alice, many_jobs, running_job):
    client.force_login(alice)
    assert job_names(client.get(reverse("job-list") + "?user=carol")) == ["carols-eval"]
    assert job_names(client.get(reverse("job-list") + "?name=SWEEP-0")) == [
        f"sweep-0{i}" for i in range(9, -1, -1)
    ]
    assert job_names(client.get(reverse("job-list") + "?state=RUNNING")) == ["resnet"]
    empty = client.get(reverse("job-list") + "?name=nothing-like-this")
    assert "No job matches these filters." in text_of(empty)


def test_the_job_list_sorts_by_name_both_ways(client, alice, many_jobs):
    client.force_login(alice)
    ascending = job_names(client.get(reverse("job-list") + "?sort=name"))
    assert ascending[:2] == ["carols-eval", "sweep-00"]
    descending = job_names(client.get(reverse("job-list") + "?sort=-name"))
    assert descending[0] == "sweep-29"
    html = client.get(reverse("job-list") + "?sort=name").content.decode()
    assert 'aria-sort="ascending"' in html


def test_sort_and_page_links_keep_the_filters(client, alice, many_jobs):
    client.force_login(alice)
    html = client.get(reverse("job-list") + "?name=sweep&sort=name").content.decode()
    assert 'href="?name=sweep&amp;page=2&amp;sort=name"' in html
    assert 'href="?name=sweep&amp;sort=-name"' in html


def test_the_live_job_list_answers_no_content_while_nothing_changed(client, alice, running_job):
    client.force_login(alice)
    first = client.get(reverse("job-list"), HTTP_HX_REQUEST="true")
    marker = re.search(r'name="v" value="([^"]+)"', first.content.decode()).group(1)
    unchanged = client.get(reverse("job-list"), {"v": marker}, HTTP_HX_REQUEST="true")
    assert unchanged.status_code == 204


def test_the_live_job_list_swaps_in_new_states_and_says_what_changed(client, alice, running_job):
    from controlplane.jobs import actions

    client.force_login(alice)
    first = client.get(reverse("job-list"), HTTP_HX_REQUEST="true")
    marker = re.search(r'name="v" value="([^"]+)"', first.content.decode()).group(1)
    actions.finish_attempt(running_job.attempts.get(), exit_code=0)
    changed = client.get(reverse("job-list"), {"v": marker}, HTTP_HX_REQUEST="true")
    assert changed.status_code == 200
    html = changed.content.decode()
    assert "<html" not in html
    assert "SUCCEEDED" in html
    assert re.search(
        r'id="announce"[^>]*hx-swap-oob="true"[^>]*>Job resnet \(#\d+\) is now SUCCEEDED', html
    )


# --- job page --------------------------------------------------------------------------------


def test_a_pending_job_page_says_why_it_waits_where_it_is_and_when_it_may_start(
    client, alice, pending_job
):
    client.force_login(alice)
    page = text_of(client.get(reverse("job-detail", args=[pending_job.pk])))
    assert "Why it waits: Not enough free H100-SXM-80GB GPUs: needs 2, 1 free." in page
    assert "Queue position 3 (2 jobs ahead)" in page
    assert "Estimated start" in page and "in about 1" in page  # 11–12 minutes from now
    assert "Not admitted yet" in page


def test_a_running_job_page_shows_node_gpus_caps_usage_log_and_charts(client, alice, running_job):
    client.force_login(alice)
    response = client.get(reverse("job-detail", args=[running_job.pk]))
    page = text_of(response)
    html = response.content.decode()
    assert "Node gpu-node-01" in page
    # (text_of leaves a space where the figure's <data> element closed.)
    for index in (0, 1):
        assert re.search(rf"GPU {index} \(H100-SXM-80GB, cap 600 W\s*\)", page)
    assert "0.500 kWh" in page
    assert "epoch 4 loss 0.200" in page
    # Two charts, each a line per GPU; the power chart also draws the cap (dashed).
    assert html.count("<svg") == 2
    assert html.count('class="line series-0"') == 2
    assert 'class="line series-cap dashed"' in html
    # Both GPUs reported the same all along: one line each chart says so (the chart's text
    # alternative names the last bucket's value).
    assert "2 GPUs, identical (GPU 0, 1) latest 90 %" in html
    assert 'hx-trigger="every 3s" data-pause-while-focused' in html
    assert "Used so far" in page


def test_a_finished_job_says_what_it_used_not_what_it_used_so_far(client, alice, running_job):
    from controlplane.jobs import actions

    actions.finish_attempt(running_job.attempts.get(), exit_code=0)
    client.force_login(alice)
    page = text_of(client.get(reverse("job-detail", args=[running_job.pk])))
    assert "SUCCEEDED" in page and re.search(r"\bUsed\s+[\d.]+\s+GPU-hours", page)
    assert "so far" not in page


def test_gpus_that_differ_are_drawn_apart(client, alice, running_job):
    from controlplane.cluster.models import GpuTelemetry

    gpu_1 = running_job.attempts.get().allocations.get(gpu__index=1).gpu
    GpuTelemetry.objects.filter(gpu=gpu_1).update(utilization_pct=40.0, power_draw_w=300.0)
    client.force_login(alice)
    html = client.get(reverse("job-detail", args=[running_job.pk])).content.decode()
    assert "identical" not in html
    assert "GPU 0 latest 90 %" in html and "GPU 1 latest 40 %" in html


def test_a_job_shorter_than_a_telemetry_bucket_is_drawn_where_it_ran(
    client, alice, vision, make_job, node
):
    """A 10 s job's one bucket (stamped with the bucket's start, before the job began) is
    drawn as a line over the 10 s the job ran, not as a dot before it started."""
    import datetime as dt

    from django.utils import timezone

    from controlplane.cluster.models import GpuTelemetry
    from controlplane.jobs import actions
    from controlplane.queries import attempt_telemetry

    job = make_job(vision, alice, name="short", gpus=1)
    gpu = node.gpus.get(index=0)
    attempt = actions.admit_job(job, node=node, gpus=[gpu], borrowed=False)
    bucket_at = timezone.now().replace(second=0, microsecond=0) - dt.timedelta(minutes=5)
    started = bucket_at + dt.timedelta(seconds=20)
    actions.mark_attempt_running(attempt, started_at=started)
    GpuTelemetry.objects.create(
        gpu=gpu, bucket_at=bucket_at, utilization_pct=70.0, power_draw_w=300.0, power_cap_w=600.0
    )
    actions.finish_attempt(attempt, exit_code=0, finished_at=started + dt.timedelta(seconds=10))
    attempt.refresh_from_db()

    (series,) = attempt_telemetry(attempt)
    assert [t for t, _ in series.utilization_pct] == [started, attempt.finished_at]
    assert [v for _, v in series.power_draw_w] == [300.0, 300.0]


def test_the_job_chart_covers_only_the_attempts_own_gpus_and_time(client, alice, running_job, node):
    import datetime as dt

    from controlplane.cluster.models import GpuTelemetry

    other_gpu = node.gpus.get(index=3)
    GpuTelemetry.objects.create(
        gpu=other_gpu, bucket_at=running_job.started_at, utilization_pct=5.0, power_draw_w=999.0
    )
    earlier = running_job.started_at - dt.timedelta(hours=2)
    GpuTelemetry.objects.create(
        gpu=node.gpus.get(index=0), bucket_at=earlier, utilization_pct=1.0, power_draw_w=998.0
    )
    client.force_login(alice)
    html = client.get(reverse("job-detail", args=[running_job.pk])).content.decode()
    assert "GPU 3" not in html
    # 999 W or 998 W would stretch the axis past 1000; the job's own readings stay under 500.
    assert ">1000<" not in html and ">600<" in html


def test_the_live_fragment_of_a_finished_job_stops_polling(client, alice, running_job):
    from controlplane.jobs import actions

    actions.finish_attempt(running_job.attempts.get(), exit_code=3)
    client.force_login(alice)
    response = client.get(
        reverse("job-live", args=[running_job.pk]) + "?state=RUNNING", HTTP_HX_REQUEST="true"
    )
    html = response.content.decode()
    assert "FAILED" in html and "exit code 3" in html
    assert "hx-trigger" not in html.split('id="job-actions"')[0]
    assert "Job resnet is now FAILED." in html
    # The header's cancel button goes away with the job.
    assert 'id="job-actions" hx-swap-oob="true"' in html and "Cancel job" not in html


def test_the_full_log_is_plain_text(client, alice, running_job):
    client.force_login(alice)
    response = client.get(reverse("job-log", args=[running_job.pk]))
    assert response["Content-Type"] == "text/plain; charset=utf-8"
    assert response.content.decode().startswith("epoch 0 loss 1.000\n")


def test_a_job_that_never_started_has_no_log_page(client, alice, pending_job):
    client.force_login(alice)
    assert client.get(reverse("job-log", args=[pending_job.pk])).status_code == 404
    assert client.get(reverse("job-output", args=[pending_job.pk])).status_code == 404


def test_the_output_page_has_the_sites_navigation_and_follows_a_running_job(
    client, alice, running_job
):
    from controlplane.jobs import actions

    client.force_login(alice)
    url = reverse("job-output", args=[running_job.pk])
    html = client.get(url).content.decode()
    assert 'aria-label="Main"' in html  # the site's navigation
    assert "epoch 0 loss 1.000" in html
    pre = re.search(r'<pre id="job-output"[^>]*>', html).group(0)
    size = len(running_job.attempts.get().log_chunks.get().data)
    assert f'data-next-offset="{size}"' in pre and "data-following" in pre
    assert f"/api/v1/jobs/{running_job.pk}/logs/?attempt=1&amp;rank=0" in pre
    assert (
        reverse("job-output", args=[running_job.pk])
        in client.get(reverse("job-detail", args=[running_job.pk])).content.decode()
    )

    attempt = running_job.attempts.get()
    actions.finish_attempt(attempt, exit_code=0)
    ended = client.get(url).content.decode()
    assert "data-following" not in re.search(r'<pre id="job-output"[^>]*>', ended).group(0)
    assert "this is all it wrote" in ended
    assert client.get(url, {"rank": 3}).status_code == 404


def test_another_tenants_output_page_is_not_found(client, bob, running_job):
    client.force_login(bob)
    assert client.get(reverse("job-output", args=[running_job.pk])).status_code == 404


# --- cancel ----------------------------------------------------------------------------------


def test_cancel_asks_first_and_changes_nothing_until_confirmed(client, alice, running_job):
    client.force_login(alice)
    response = client.get(reverse("job-cancel", args=[running_job.pk]))
    page = text_of(response)
    assert "Cancel job resnet" in page
    assert "It runs on gpu-node-01" in page
    assert "Yes, cancel the job" in page
    running_job.refresh_from_db()
    assert running_job.state == "RUNNING"


def test_confirming_cancels_the_job_and_tells_the_agent_to_stop_it(client, alice, running_job):
    client.force_login(alice)
    response = client.post(reverse("job-cancel", args=[running_job.pk]), follow=True)
    running_job.refresh_from_db()
    attempt = running_job.attempts.get()
    assert running_job.state == "CANCELLED"
    assert attempt.stop_requested_at is not None and attempt.stop_reason == "cancelled"
    assert "cancelled" in text_of(response)
    assert running_job.events.filter(kind="cancelled", actor=alice).exists()


def test_cancelling_a_finished_job_says_so_and_changes_nothing(client, alice, running_job):
    from controlplane.jobs import actions

    actions.finish_attempt(running_job.attempts.get(), exit_code=0)
    client.force_login(alice)
    response = client.post(reverse("job-cancel", args=[running_job.pk]), follow=True)
    running_job.refresh_from_db()
    assert running_job.state == "SUCCEEDED"
    assert "already finished (SUCCEEDED); nothing to cancel" in text_of(response)


# --- API tokens ------------------------------------------------------------------------------


def test_a_new_token_is_shown_once_and_only_its_hash_is_kept(client, alice):
    from controlplane.tenancy.models import ApiToken, hash_token

    client.force_login(alice)
    response = client.post(reverse("tokens"), {"name": "laptop"})
    assert response.status_code == 200
    assert response["Cache-Control"] == "no-store"
    raw = re.search(r'id="new-token">(gcp_[^<]+)<', response.content.decode()).group(1)
    token = ApiToken.objects.get(user=alice)
    assert token.token_hash == hash_token(raw) and raw not in token.token_hash

    again = client.get(reverse("tokens"))
    assert raw not in again.content.decode()
    assert token.prefix in again.content.decode()  # listed, by its first characters


def test_the_new_token_works_against_the_api(client, alice, running_job):
    client.force_login(alice)
    html = client.post(reverse("tokens"), {"name": "ci"}).content.decode()
    raw = re.search(r'id="new-token">(gcp_[^<]+)<', html).group(1)
    client.logout()
    answer = client.get("/api/v1/jobs/", HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert answer.status_code == 200
    assert answer.json()["count"] == 1


def test_a_token_needs_a_name_and_a_future_expiry(client, alice):
    from controlplane.tenancy.models import ApiToken

    client.force_login(alice)
    nameless = client.post(reverse("tokens"), {"name": ""})
    assert nameless.status_code == 400
    assert 'id="id_name_errors"' in nameless.content.decode()
    past = client.post(reverse("tokens"), {"name": "old", "expires_at": "2001-01-01T00:00"})
    assert past.status_code == 400
    assert "Must be in the future." in past.content.decode()
    assert ApiToken.objects.count() == 0


def test_a_revoked_token_stops_working_and_is_listed_as_revoked(client, alice):
    from controlplane.tenancy.models import ApiToken

    token, raw = ApiToken.issue(alice, "laptop")
    client.force_login(alice)
    response = client.post(reverse("token-revoke", args=[token.pk]), follow=True)
    assert "revoked; it no longer works" in text_of(response)
    token.refresh_from_db()
    assert token.revoked_at is not None
    client.logout()
    assert client.get("/api/v1/jobs/", HTTP_AUTHORIZATION=f"Bearer {raw}").status_code == 401


def test_nobody_sees_or_revokes_another_persons_tokens(client, alice, cluster_admin):
    from controlplane.tenancy.models import ApiToken

    token, _ = ApiToken.issue(alice, "alice-laptop")
    client.force_login(cluster_admin)
    assert "alice-laptop" not in client.get(reverse("tokens")).content.decode()
    assert client.post(reverse("token-revoke", args=[token.pk])).status_code == 404
    token.refresh_from_db()
    assert token.revoked_at is None


def test_many_alike_gpus_are_summed_up_in_one_line(client, alice, vision, make_job, node):
    from controlplane.jobs import actions

    node.gpus.update(power_cap_w=550.0)
    job = make_job(vision, alice, name="wide", gpus=4)
    actions.admit_job(job, node=node, gpus=list(node.gpus.all()), borrowed=False)
    client.force_login(alice)
    page = text_of(client.get(reverse("job-detail", args=[job.pk])))
    assert "4 × H100-SXM-80GB (GPU 0, 1, 2, 3), cap 550 W each" in page


# --- the job contract on the job page ------------------------------------------------------------


def test_the_job_page_shows_volumes_checkpoints_and_how_each_stop_went(
    client, alice, vision, make_job, node
):
    import datetime as dt

    from django.utils import timezone

    from controlplane.jobs import actions
    from controlplane.jobs.models import Job, JobAttempt
    from controlplane.storage.models import Volume

    ckpt = Volume.objects.create(name="ckpt", source="/srv/ckpt", checkpoints=True)
    job = make_job(
        vision,
        alice,
        mounts=[{"volume": "datasets", "path": "/data", "read_only": True}],
        checkpoint_volume=ckpt,
        stop_signal="SIGUSR1",
        preemption_grace_s=20,
    )
    Job.objects.filter(pk=job.pk).update(checkpoint_bytes=3 * 1024**3)
    attempt = actions.admit_job(job, node=node, gpus=list(node.gpus.all()[:1]), borrowed=False)
    actions.mark_attempt_running(attempt, started_at=timezone.now() - dt.timedelta(minutes=5))
    checkpoint_at = timezone.now().replace(microsecond=0) - dt.timedelta(minutes=1)
    JobAttempt.objects.filter(pk=attempt.pk).update(last_checkpoint_at=checkpoint_at)
    actions.request_stop(attempt, reason="preempted", message="Preempted")
    attempt.refresh_from_db()
    actions.finish_attempt(
        attempt,
        exit_code=143,
        finished_at=timezone.now(),
        notice=actions.StopNotice(signal_at=timezone.now() - dt.timedelta(seconds=2), killed=True),
    )

    client.force_login(alice)
    page = text_of(client.get(reverse("job-detail", args=[job.pk])))
    assert "datasets at /data (read-only)" in page
    assert "/gpucp/checkpoint ($GPUCP_CHECKPOINT_DIR), 3.0 GB" in page
    assert "SIGUSR1, then 20 s to leave before SIGKILL" in page
    assert f"{checkpoint_at:%b} {checkpoint_at.day} {checkpoint_at:%H:%M:%S} UTC" in page
    story = "Attempt 1 preempted: did not leave within its 20 s grace after SIGUSR1: killed"
    assert page.count(story) == 2  # on the timeline and in the attempt's row


def test_a_job_without_a_checkpoint_volume_says_so(client, alice, pending_job):
    client.force_login(alice)
    page = text_of(client.get(reverse("job-detail", args=[pending_job.pk])))
    assert "no checkpoint directory" in page
    assert "Volumes none" in page
