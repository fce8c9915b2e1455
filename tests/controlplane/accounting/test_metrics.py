"""/metrics as a Prometheus scraper reads it: parsed with prometheus_client's own parsers.

The event counters live in Redis (controlplane.event_metrics); every test counts under a key
prefix of its own, so that what it reads is what it did.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import time
import uuid

import pytest
from django.test import Client
from django.utils import timezone
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from controlplane import event_metrics
from controlplane.http_metrics import route_label
from controlplane.jobs import actions, arrays
from controlplane.jobs.models import Job, JobAttempt
from controlplane.redis_client import deployment_key
from controlplane.scheduling.cycle import run_scheduling_cycle

TOKEN = "scrape-secret"
OPENMETRICS = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
# Nothing listens on port 1: connecting is refused at once.
UNREACHABLE_REDIS = "redis://127.0.0.1:1/0"


@pytest.fixture(autouse=True)
def own_metric_keys(settings, monkeypatch):
    if not settings.REDIS_URL:
        pytest.fail("REDIS_URL must point at a real Redis for the metrics tests")
    prefix = f"test-metrics:{uuid.uuid4().hex}:"
    monkeypatch.setattr(event_metrics, "KEY_PREFIX", prefix)
    monkeypatch.setattr(event_metrics, "_resting_until", {})
    settings.METRICS_TOKEN = TOKEN
    url = settings.REDIS_URL  # a test may point it elsewhere
    yield
    conn = event_metrics._client(url)
    keys = list(conn.scan_iter(f"{deployment_key(prefix)}*"))
    if keys:
        conn.delete(*keys)


@pytest.fixture
def on_commit(django_capture_on_commit_callbacks):
    """Run what actions leave for after their commit, as production's commit does."""
    return lambda: django_capture_on_commit_callbacks(execute=True)


def scrape(accept: str | None = None):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {TOKEN}"}
    if accept:
        headers["HTTP_ACCEPT"] = accept
    response = Client().get("/metrics", **headers)
    assert response.status_code == 200, response.content
    return response


def samples(text: str | None = None) -> dict[str, list[tuple[dict, float]]]:
    """Every sample of a text-format scrape, by sample name: [(labels, value)]."""
    text = scrape().content.decode() if text is None else text
    found: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found.setdefault(s.name, []).append((s.labels, s.value))
    return found


def value(found, name: str, **labels) -> float:
    matching = [
        v for lab, v in found.get(name, []) if all(lab.get(k) == w for k, w in labels.items())
    ]
    assert len(matching) == 1, (name, labels, found.get(name))
    return matching[0]


def gpu_series(found, name: str, uuid_: str) -> dict:
    (labels,) = [lab for lab, _ in found[name] if lab["UUID"] == uuid_]
    return labels


def bucket(found, name: str, le: float, **labels) -> float:
    return value(found, f"{name}_bucket", le=_le(le), **labels)


def _le(bound: float) -> str:
    from prometheus_client.utils import floatToGoString

    return floatToGoString(bound)


def running_job(make_job, tenant, user, node, **fields) -> JobAttempt:
    job = make_job(tenant, user, **fields)
    attempt = actions.admit_job(job, node=node, gpus=[node.gpus.get(index=0)], borrowed=False)
    assert attempt is not None
    actions.mark_attempt_running(attempt)
    return attempt


def test_a_label_value_with_quotes_backslashes_and_newlines_reads_back_intact(
    make_node, make_job, vision, alice
):
    model = 'H100 "SXM" 80\\GB\nrev2'
    name = 'train "big" C:\\runs\nsecond line'
    node = make_node("n1", gpus=1, model=model)
    node.gpus.update(power_draw_w=300.0)
    running_job(make_job, vision, alice, node, name=name)

    plain = samples()
    om = {
        s.name: s.labels
        for family in openmetrics_families(scrape(OPENMETRICS).content.decode())
        for s in family.samples
    }

    labels = gpu_series(plain, "DCGM_FI_DEV_POWER_USAGE", "GPU-n1-0")
    assert (labels["modelName"], labels["job_name"]) == (model, name)
    assert (
        om["DCGM_FI_DEV_POWER_USAGE"]["modelName"],
        om["DCGM_FI_DEV_POWER_USAGE"]["job_name"],
    ) == (
        model,
        name,
    )


def test_a_scraper_that_asks_for_openmetrics_gets_it_and_others_the_text_format(make_node):
    make_node("n1", gpus=1)

    om = scrape(OPENMETRICS)
    plain = scrape()

    assert om["Content-Type"].startswith("application/openmetrics-text")
    assert om.content.decode().endswith("# EOF\n")
    names = {f.name for f in openmetrics_families(om.content.decode())}
    assert {"DCGM_FI_DEV_POWER_MGMT_LIMIT", "gpucp_node_ready", "gpucp_http_requests"} <= names
    assert plain["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "# EOF" not in plain.content.decode()


def test_dcgm_names_and_labels_are_kept(make_node):
    make_node("n1", gpus=1)
    from controlplane.cluster.models import GPU

    GPU.objects.update(energy_j=1000.0, ecc_errors=2)

    text = scrape().content.decode()

    # dcgm-exporter's counters keep their names, without the _total a counter type would add.
    found = samples(text)
    assert value(found, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", UUID="GPU-n1-0") == 1_000_000.0
    assert value(found, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", Hostname="n1", gpu="0") == 2.0
    assert "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL_total" not in text


def test_the_running_job_is_named_on_its_gpus_dcgm_series_until_it_ends(
    make_node, make_job, vision, alice, on_commit
):
    node = make_node("n1", gpus=2)
    node.gpus.update(power_draw_w=300.0)
    attempt = running_job(make_job, vision, alice, node, name="resnet")

    found = samples()
    busy = gpu_series(found, "DCGM_FI_DEV_POWER_USAGE", "GPU-n1-0")
    idle = gpu_series(found, "DCGM_FI_DEV_POWER_USAGE", "GPU-n1-1")
    assert (busy["job_id"], busy["job_name"], busy["tenant"]) == (
        str(attempt.job_id),
        "resnet",
        "vision",
    )
    assert (idle["job_id"], idle["job_name"], idle["tenant"]) == ("", "", "")

    with on_commit():
        actions.finish_attempt(JobAttempt.objects.get(pk=attempt.pk), exit_code=0)

    after = gpu_series(samples(), "DCGM_FI_DEV_POWER_USAGE", "GPU-n1-0")
    assert (after["job_id"], after["job_name"], after["tenant"]) == ("", "", "")


def test_a_jobs_queue_wait_lands_in_its_tenants_bucket_only(
    make_node, make_job, vision, nlp, alice, bob, on_commit
):
    node = make_node("n1", gpus=2)
    waited_45s = make_job(vision, alice)
    waited_200s = make_job(nlp, bob)
    now = timezone.now()
    Job.objects.filter(pk=waited_45s.pk).update(submitted_at=now - dt.timedelta(seconds=45))
    Job.objects.filter(pk=waited_200s.pk).update(submitted_at=now - dt.timedelta(seconds=200))
    # The scheduler's columns only, as its applier reads them (no submitted_at).
    rows = Job.objects.only("id", "state", "attempt_count", "tenant_id").in_bulk(
        [waited_45s.pk, waited_200s.pk]
    )

    with on_commit():
        # The cycle's batch for one, the one-by-one admission for the other.
        actions.admit_jobs(
            [actions.Admission(rows[waited_45s.pk], node, [node.gpus.get(index=0)], False)]
        )
        actions.admit_job(
            rows[waited_200s.pk], node=node, gpus=[node.gpus.get(index=1)], borrowed=False
        )

    found = samples()
    name = "gpucp_job_queue_wait_seconds"
    assert bucket(found, name, 30.0, tenant="vision") == 0
    assert bucket(found, name, 60.0, tenant="vision") == 1
    assert bucket(found, name, 300.0, tenant="vision") == 1
    assert value(found, f"{name}_count", tenant="vision") == 1
    assert value(found, f"{name}_sum", tenant="vision") == pytest.approx(45.0, abs=5.0)
    assert bucket(found, name, 120.0, tenant="nlp") == 0
    assert bucket(found, name, 300.0, tenant="nlp") == 1
    assert value(found, f"{name}_count", tenant="nlp") == 1


def test_a_requeued_jobs_second_admission_is_no_new_queue_wait(
    make_node, make_job, vision, alice, on_commit
):
    node = make_node("n1", gpus=1)
    gpu = node.gpus.get(index=0)
    job = make_job(vision, alice)
    with on_commit():
        attempt = actions.admit_job(job, node=node, gpus=[gpu], borrowed=False)
        actions.finish_attempt(attempt, exit_code=None, lost=True, never_started=True)
        job.refresh_from_db()
        actions.admit_job(job, node=node, gpus=[gpu], borrowed=False)

    found = samples()
    assert job.attempt_count == 2
    assert value(found, "gpucp_job_queue_wait_seconds_count", tenant="vision") == 1


def finished(found, tenant: str) -> dict[str, float]:
    return {
        outcome: value(found, "gpucp_jobs_finished_total", tenant=tenant, outcome=outcome)
        for outcome in ("succeeded", "failed", "cancelled")
    }


def test_each_finished_job_counts_once_by_outcome_even_when_its_report_comes_twice(
    make_node, make_job, vision, nlp, alice, on_commit
):
    node = make_node("n1", gpus=2)
    succeeded = running_job(make_job, vision, alice, node)
    failing = make_job(vision, alice)
    failed = actions.admit_job(failing, node=node, gpus=[node.gpus.get(index=1)], borrowed=False)
    pending = make_job(vision, alice)
    before = samples()
    assert finished(before, "vision") == {"succeeded": 0, "failed": 0, "cancelled": 0}

    report = actions.Report(succeeded.pk, exit_code=0, finished_at=timezone.now())
    for _ in range(2):  # the heartbeat's report, and the same report again (a retried request)
        with on_commit():
            actions.record_reports([report])
        with on_commit():
            actions.finish_attempt(
                JobAttempt.objects.get(pk=failed.pk), exit_code=None, message="no image"
            )
    with on_commit():
        actions.cancel_job(pending, actor=alice)

    after = samples()
    assert Job.objects.get(pk=succeeded.job_id).state == "SUCCEEDED"
    assert finished(after, "vision") == {"succeeded": 1, "failed": 1, "cancelled": 1}
    assert finished(after, "nlp") == {"succeeded": 0, "failed": 0, "cancelled": 0}


def test_a_late_report_that_turns_a_failed_job_into_a_success_is_no_second_end(
    make_node, make_job, vision, alice, on_commit
):
    node = make_node("n1", gpus=1)
    attempt = running_job(make_job, vision, alice, node, restartable=False)
    with on_commit():  # its node went silent: the job, not restartable, fails
        actions.finish_attempt(attempt, exit_code=None, lost=True, message="node lost")
    assert finished(samples(), "vision") == {"succeeded": 0, "failed": 1, "cancelled": 0}

    with on_commit():  # the node comes back: the process had exited 0
        actions.record_late_exit(
            JobAttempt.objects.get(pk=attempt.pk),
            exit_code=0,
            finished_at=timezone.now(),
            energy_j=None,
            energy_estimated=False,
            ended_by_itself=True,
        )

    assert Job.objects.get(pk=attempt.job_id).state == "SUCCEEDED"
    assert finished(samples(), "vision") == {"succeeded": 0, "failed": 1, "cancelled": 0}


def test_cancelling_an_array_counts_each_unfinished_task(vision, alice, on_commit):
    sweep = arrays.submit_array(
        tenant=vision,
        user=alice,
        fields={"name": "sweep", "image": "registry.local/t/s:1", "command": ["true"], "env": {}},
        spec="3",
        indexes=[0, 1, 2],
        max_parallel=None,
    ).array

    with on_commit():
        arrays.cancel_array(sweep, actor=alice)

    assert finished(samples(), "vision")["cancelled"] == 3


def test_each_scheduling_cycle_counts_in_the_cycle_histogram(make_node, make_job, vision, alice):
    make_node("n1", gpus=1)
    make_job(vision, alice)
    name = "gpucp_scheduling_cycle_duration_seconds"
    assert value(samples(), f"{name}_count") == 0

    run_scheduling_cycle(trigger="test")
    run_scheduling_cycle(trigger="test")

    found = samples()
    assert value(found, f"{name}_count") == 2
    assert value(found, f"{name}_bucket", le="+Inf") == 2
    assert value(found, f"{name}_sum") > 0
    # The latest cycle's own gauge, from its row.
    assert value(found, "gpucp_scheduling_last_cycle_duration_seconds") > 0


def test_an_api_request_counts_under_its_url_pattern_not_its_path(make_job, vision, alice):
    jobs = [make_job(vision, alice), make_job(vision, alice)]
    client = Client()
    client.force_login(alice)

    for job in jobs:
        assert client.get(f"/api/v1/jobs/{job.pk}/").status_code == 200
    assert client.get("/no/such/page/12345").status_code == 404

    found = samples()
    route = "/api/v1/jobs/<pk>/"
    assert value(found, "gpucp_http_requests_total", method="GET", route=route, status="200") == 2
    assert value(found, "gpucp_http_request_duration_seconds_count", method="GET", route=route) == 2
    assert (
        value(found, "gpucp_http_requests_total", method="GET", route="unmatched", status="404")
        == 1
    )
    routes = {labels["route"] for labels, _ in found["gpucp_http_requests_total"]}
    assert not any(str(job.pk) in r for r in routes for job in jobs), routes


@pytest.mark.parametrize(
    ("pattern", "label"),
    [
        ("api/v1/jobs/(?P<pk>[^/.]+)/$", "/api/v1/jobs/<pk>/"),
        ("api/v1/jobs\\.(?P<format>[a-z0-9]+)/?$", "/api/v1/jobs.<format>/"),
        ("jobs/<int:pk>/", "/jobs/<pk>/"),
        ("metrics", "/metrics"),
        ("", "/"),
    ],
)
def test_a_url_pattern_is_labelled_as_a_person_writes_it(pattern, label):
    assert route_label(pattern) == label


def test_a_scrape_while_redis_is_unreachable_answers_with_the_database_families(
    make_node, make_job, vision, alice, settings, on_commit
):
    make_node("n1", gpus=1).gpus.update(power_draw_w=250.0)
    job = make_job(vision, alice)
    settings.REDIS_URL = UNREACHABLE_REDIS

    with on_commit():  # recording the end fails, quietly: the cancel stands
        actions.cancel_job(job, actor=alice)
    found = samples()

    assert Job.objects.get(pk=job.pk).state == "CANCELLED"
    assert value(found, "gpucp_pending_jobs", tenant="vision") == 0
    assert value(found, "DCGM_FI_DEV_POWER_USAGE", UUID="GPU-n1-0") == 250.0
    assert "gpucp_jobs_finished_total" not in found
    assert "gpucp_http_requests_total" not in found


def test_without_redis_configured_the_event_families_are_absent(make_node, settings):
    make_node("n1", gpus=1)
    settings.REDIS_URL = ""  # the embedded mode may run without one

    found = samples()

    assert "gpucp_node_ready" in found
    assert not any(name.startswith("gpucp_scheduling_cycle_duration") for name in found)


def test_counters_and_histograms_never_decrease_across_scrapes(
    make_node, make_job, vision, alice, on_commit
):
    node = make_node("n1", gpus=1)
    monotonic = ("_total", "_bucket", "_count", "_sum")

    def growing(found):
        return {
            (name, tuple(sorted(labels.items()))): v
            for name, rows in found.items()
            if name.endswith(monotonic) and name.startswith("gpucp_")
            for labels, v in rows
        }

    first = growing(samples())
    attempt = running_job(make_job, vision, alice, node)
    with on_commit():
        actions.finish_attempt(JobAttempt.objects.get(pk=attempt.pk), exit_code=1)
    run_scheduling_cycle(trigger="test")
    second = growing(samples())

    assert first.keys() <= second.keys()
    assert all(second[key] >= v for key, v in first.items())
    assert any(second[key] > v for key, v in first.items())


def test_a_bucket_bound_dropped_from_the_code_counts_in_the_next_larger_one():
    family = event_metrics.CYCLE_DURATION
    event_metrics.Batch().observe(family, (), 0.04).observe(family, (), 0.2).send()
    fewer = dataclasses.replace(family, buckets=(0.1, 1.0))

    conn = event_metrics._redis()
    assert conn is not None
    decoded = event_metrics._decode(fewer, conn.hgetall(family.key))[()]

    assert decoded.buckets == [(0.1, 1), (1.0, 2), (math.inf, 2)]
    assert decoded.sum == pytest.approx(0.24)


def test_jobs_cancelled_because_their_dependency_failed_count_once_each(
    make_node, make_job, vision, alice, on_commit
):
    from controlplane.jobs.dependencies import DependencySpec

    node = make_node("n1", gpus=1)
    attempt = running_job(make_job, vision, alice, node)
    for _ in range(2):  # two jobs that need it to succeed
        make_job(vision, alice, depends_on=[DependencySpec("succeeded", job_id=attempt.job_id)])
    report = actions.Report(attempt.pk, exit_code=1, finished_at=timezone.now())
    for _ in range(2):  # the report, and the same report again
        with on_commit():
            actions.record_reports([report])
    # Its own failure, and the two it took with it: each once.
    assert finished(samples(), "vision") == {"succeeded": 0, "failed": 1, "cancelled": 2}
    # A job submitted after the failure, depending on it, is cancelled at its submit: once too.
    with on_commit():
        make_job(vision, alice, depends_on=[DependencySpec("succeeded", job_id=attempt.job_id)])
    assert finished(samples(), "vision")["cancelled"] == 3


def test_requests_reach_redis_within_the_flush_interval_for_other_processes_scrapes(
    make_job, vision, alice
):
    """A web process counts its requests in memory and writes them every HTTP_FLUSH_EVERY_S:
    a scrape answered by another process (which flushes only its own) still sees them soon."""
    job = make_job(vision, alice)
    client = Client()
    client.force_login(alice)
    for _ in range(3):
        assert client.get(f"/api/v1/jobs/{job.pk}/").status_code == 200

    conn = event_metrics._client(event_metrics.settings.REDIS_URL)
    field = event_metrics._field("GET", "/api/v1/jobs/<pk>/", "200")
    deadline = time.monotonic() + 10 * event_metrics.HTTP_FLUSH_EVERY_S
    stored = None
    # Read Redis itself, not event_metrics.read(), which would flush this process first.
    while time.monotonic() < deadline:
        stored = conn.hget(event_metrics.HTTP_REQUESTS.key, field)
        if stored is not None and int(stored) == 3:
            break
        time.sleep(0.05)
    assert stored is not None and int(stored) == 3
