import datetime as dt

import pytest
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families
from rest_framework.test import APIClient

from controlplane.accounting.budgets import (
    J_PER_KWH,
    budget_states,
    period_bounds,
    record_budget_warnings,
    scheduler_view,
)
from controlplane.audit.models import AuditEvent
from controlplane.jobs import actions
from controlplane.tenancy.models import Budget

pytestmark = pytest.mark.django_db


def _finished_attempt(
    make_job, make_node, tenant, user, *, gpus=1, seconds=3600.0, energy_j=0.0, node="n1"
):
    node = make_node(node, gpus=gpus)
    job = make_job(tenant, user, gpus=gpus)
    attempt = actions.admit_job(job, node=node, gpus=list(node.gpus.all()), borrowed=False)
    start = timezone.now() - dt.timedelta(seconds=seconds)
    actions.mark_attempt_running(attempt, started_at=start)
    attempt.refresh_from_db()
    actions.finish_attempt(attempt, exit_code=0, energy_j=energy_j)
    return attempt


@pytest.mark.parametrize(
    ("period", "start", "end"),
    [
        ("day", "2026-12-02T00:00", "2026-12-03T00:00"),
        ("week", "2026-11-30T00:00", "2026-12-07T00:00"),
        ("month", "2026-12-01T00:00", "2027-01-01T00:00"),
    ],
)
def test_periods_are_utc_days_iso_weeks_and_calendar_months(period, start, end):
    now = dt.datetime(2026, 12, 2, 15, 30, tzinfo=dt.UTC)
    got = period_bounds(period, now)
    assert [t.strftime("%Y-%m-%dT%H:%M") for t in got] == [start, end]


def test_a_finished_attempt_books_its_gpu_hours_and_energy_to_its_tenant(
    make_job, make_node, vision, alice
):
    _finished_attempt(
        make_job, make_node, vision, alice, gpus=2, seconds=1800, energy_j=0.5 * J_PER_KWH
    )
    Budget.objects.create(tenant=vision, kind="gpu_hours", period="day", amount=10, action="hold")
    Budget.objects.create(
        tenant=vision, kind="energy_kwh", period="day", amount=4, action="throttle"
    )
    states = {s.kind: s for s in budget_states()}
    assert states["gpu_hours"].used == pytest.approx(1.0, rel=0.01)  # 2 GPUs x 30 min
    assert states["energy_kwh"].used == pytest.approx(0.5)
    assert not states["energy_kwh"].exhausted


def test_energy_beyond_what_the_gpus_can_draw_is_booked_at_their_maximum_and_marked_estimated(
    make_job, make_node, vision, alice
):
    # 2 GPUs of at most 700 W for 30 min can draw 0.7 kWh; a report of 2 kWh (a counter read
    # long after the exit, a counter that jumped) cannot be what they drew.
    attempt = _finished_attempt(
        make_job, make_node, vision, alice, gpus=2, seconds=1800, energy_j=2 * J_PER_KWH
    )
    attempt.refresh_from_db()
    seconds = (attempt.finished_at - attempt.started_at).total_seconds()
    assert attempt.energy_j == pytest.approx(2 * 700.0 * seconds)
    # Multiplied, not divided: energy / seconds can round one ulp above the bound it equals.
    assert attempt.energy_j <= 2 * 700.0 * seconds
    assert attempt.energy_estimated is True


def test_energy_within_what_the_gpus_can_draw_is_booked_as_reported(
    make_job, make_node, vision, alice
):
    attempt = _finished_attempt(
        make_job, make_node, vision, alice, gpus=2, seconds=1800, energy_j=0.5 * J_PER_KWH
    )
    attempt.refresh_from_db()
    assert (attempt.energy_j, attempt.energy_estimated) == (0.5 * J_PER_KWH, False)


def test_a_spent_budget_gives_its_action_to_its_tenant_only(
    make_job, make_node, vision, nlp, alice, bob
):
    _finished_attempt(make_job, make_node, vision, alice, seconds=7200)
    _finished_attempt(make_job, make_node, nlp, bob, seconds=60, node="n2")
    Budget.objects.create(tenant=vision, kind="gpu_hours", period="week", amount=1, action="hold")
    Budget.objects.create(tenant=nlp, kind="gpu_hours", period="week", amount=1, action="hold")
    view = scheduler_view(budget_states(), timezone.now())
    assert view[vision.pk].budget_action == "hold"
    assert nlp.pk not in view or view[nlp.pk].budget_action is None


def test_the_strictest_action_wins_when_two_budgets_are_spent(make_job, make_node, vision, alice):
    _finished_attempt(make_job, make_node, vision, alice, seconds=7200, energy_j=1.2 * J_PER_KWH)
    Budget.objects.create(
        tenant=vision, kind="gpu_hours", period="day", amount=1, action="no_borrowing"
    )
    Budget.objects.create(
        tenant=vision, kind="energy_kwh", period="day", amount=1, action="throttle"
    )
    assert (
        scheduler_view(budget_states(), timezone.now())[vision.pk].budget_action == "no_borrowing"
    )


def test_an_energy_budget_becomes_a_power_pace_for_the_rest_of_the_period(vision):
    Budget.objects.create(
        tenant=vision, kind="energy_kwh", period="day", amount=24, action="throttle"
    )
    noon = dt.datetime(2026, 12, 2, 12, 0, tzinfo=dt.UTC)
    (state,) = budget_states(noon)
    # 24 kWh left over 12 hours: 2 kW on average.
    assert state.power_pace_w(noon) == pytest.approx(2000.0)


def test_a_budget_warning_is_written_once_per_period(make_job, make_node, vision, alice):
    _finished_attempt(make_job, make_node, vision, alice, seconds=3600 * 0.9)
    Budget.objects.create(
        tenant=vision,
        kind="gpu_hours",
        period="month",
        amount=1,
        action="hold",
        warn_at_fraction=0.8,
    )
    assert record_budget_warnings(budget_states()) == 1
    assert record_budget_warnings(budget_states()) == 0
    event = AuditEvent.objects.get(tenant=vision)
    assert event.action == "budget.warning" and "90%" in event.message


def test_usage_csv_lists_only_the_tenants_a_member_belongs_to(
    make_job, make_node, vision, nlp, alice, bob
):
    _finished_attempt(make_job, make_node, vision, alice, seconds=3600)
    client = APIClient()
    client.force_authenticate(bob)
    body = client.get("/api/v1/accounting/usage.csv?period=month").content.decode()
    lines = body.strip().splitlines()
    assert lines[0].startswith("tenant,period,period_start")
    assert [line.split(",")[0] for line in lines[1:]] == ["nlp"]
    client.force_authenticate(alice)
    rows = client.get("/api/v1/accounting/usage/?period=month").json()
    assert [(r["tenant"], round(r["gpu_hours"], 2)) for r in rows] == [("vision", 1.0)]


def test_usage_rejects_a_period_that_is_not_allowed(alice):
    client = APIClient()
    client.force_authenticate(alice)
    response = client.get("/api/v1/accounting/usage/?period=year")
    assert response.status_code == 400
    assert "period" in response.json()


def test_usage_needs_a_signed_in_user():
    assert APIClient().get("/api/v1/accounting/usage/").status_code == 401


def test_metrics_speak_dcgm_names_and_our_own(make_node, vision, alice, cluster_admin, settings):
    from controlplane.cluster.models import GPU

    make_node("n1", gpus=1)
    GPU.objects.update(power_draw_w=312.5, energy_j=1000.0, utilization_pct=None)
    settings.METRICS_TOKEN = "scrape-secret"
    client = APIClient()
    assert client.get("/metrics").status_code == 401
    text = client.get("/metrics", HTTP_AUTHORIZATION="Bearer scrape-secret").content.decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    gpu = {"gpu": "0", "UUID": "GPU-n1-0", "modelName": "H100-SXM-80GB", "Hostname": "n1"}
    idle = {"job_id": "", "job_name": "", "tenant": ""}
    assert [(s.labels, s.value) for s in families["DCGM_FI_DEV_POWER_USAGE"].samples] == [
        ({**gpu, **idle}, 312.5)
    ]
    assert [
        (s.labels, s.value) for s in families["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"].samples
    ] == [({**gpu, **idle}, 1e6)]
    # A value the GPU does not report is absent, not zero.
    assert families["DCGM_FI_DEV_GPU_UTIL"].samples == []
    assert [(s.labels, s.value) for s in families["gpucp_pending_jobs"].samples] == [
        ({"tenant": "vision"}, 0.0)
    ]
    assert families["gpucp_tenant_energy_joules"].type == "counter"
    client.force_login(alice)
    assert client.get("/metrics").status_code == 401
    client.force_login(cluster_admin)
    assert client.get("/metrics").status_code == 200


@pytest.mark.parametrize("path", ["one attempt", "a heartbeat's batch"])
@pytest.mark.parametrize(
    ("energy_j", "booked_j", "estimated"),
    [
        # A job of 10 ms whose agent read the counters from its set-up 2 s before: what one
        # 700 W GPU can draw in the 2.01 s the attempt held it, booked as measured.
        (700.0, 700.0, False),
        # More than the GPU can draw while the attempt held it: bounded, and marked estimated.
        (700.0 * 3, 700.0 * 2.01, True),
    ],
)
def test_a_short_jobs_energy_is_bounded_over_the_time_its_gpus_were_its_own(
    make_job, make_node, vision, alice, path, energy_j, booked_j, estimated
):
    from controlplane.jobs.models import JobAttempt

    node = make_node("n1", gpus=1)
    job = make_job(vision, alice, gpus=1)
    attempt = actions.admit_job(job, node=node, gpus=list(node.gpus.all()), borrowed=False)
    finished_at = timezone.now()
    admitted_at = finished_at - dt.timedelta(seconds=2.01)
    started_at = finished_at - dt.timedelta(seconds=0.01)
    JobAttempt.objects.filter(pk=attempt.pk).update(created_at=admitted_at)
    if path == "one attempt":
        actions.mark_attempt_running(attempt, started_at=started_at)
        attempt.refresh_from_db()
        actions.finish_attempt(attempt, exit_code=0, finished_at=finished_at, energy_j=energy_j)
    else:
        actions.record_reports(
            [
                actions.Report(
                    attempt.pk,
                    started_at=started_at,
                    exit_code=0,
                    finished_at=finished_at,
                    energy_j=energy_j,
                )
            ]
        )
    attempt.refresh_from_db()
    assert attempt.state == "SUCCEEDED"
    assert attempt.energy_j == pytest.approx(booked_j)
    assert attempt.energy_estimated is estimated
    assert attempt.gpu_seconds == pytest.approx(0.01)  # the run alone is what it used
