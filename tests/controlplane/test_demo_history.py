"""The demo's generated past week: a history that could have happened here, which what-if, usage,
charts and duration predictions then read like any other."""

import datetime as dt
import io
from collections import defaultdict

import pytest
from django.core.management import call_command
from django.db.models import Sum

from controlplane import demo_history
from controlplane.audit.models import AuditEvent
from controlplane.cluster.models import GpuTelemetry, Pool
from controlplane.demo import seed_demo, seed_history
from controlplane.jobs import actions
from controlplane.jobs.models import Allocation, Job, JobAttempt, JobState
from controlplane.scheduling.cycle import run_scheduling_cycle
from controlplane.tenancy.models import Tenant
from scheduler import gpu_model

END = dt.datetime(2026, 12, 3, 12, 0, tzinfo=dt.UTC)
LIMITS = {demo_history.H100: (200.0, 700.0), demo_history.A100: (100.0, 400.0)}


def shapes(models=(demo_history.H100, demo_history.H100, demo_history.A100), gpus=8):
    return [
        demo_history.NodeShape(
            name=f"sim-node-{i}",
            gpu_type=model,
            gpus=tuple((j, *LIMITS[model]) for j in range(gpus)),
        )
        for i, model in enumerate(models, start=1)
    ]


def overlaps(intervals) -> bool:
    ordered = sorted(intervals)
    return any(later[0] < earlier[1] for earlier, later in zip(ordered, ordered[1:], strict=False))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_generated_week_never_gives_a_gpu_two_jobs_and_keeps_the_gpus_about_half_busy(seed):
    nodes = shapes()
    runs = demo_history.generate(nodes, ["vision", "nlp"], end=END, seed=seed)
    begin = END - dt.timedelta(days=demo_history.DEMO_HISTORY_DAYS)
    held = defaultdict(list)
    for run in runs:
        assert begin <= run.submitted_at <= run.started_at < run.finished_at < END
        node = next(n for n in nodes if n.name == run.node)
        assert node.gpu_type == run.kind.gpu_type and len(run.gpu_indexes) == run.kind.gpus
        for index in run.gpu_indexes:
            held[(run.node, index)].append((run.started_at, run.finished_at))
    assert not any(overlaps(spans) for spans in held.values())
    span_s = demo_history.DEMO_HISTORY_DAYS * 86400
    for model, gpus in ((demo_history.H100, 16), (demo_history.A100, 8)):
        busy_s = sum(
            (r.finished_at - r.started_at).total_seconds() * r.kind.gpus
            for r in runs
            if r.kind.gpu_type == model
        )
        assert 0.25 < busy_s / (gpus * span_s) < 0.65, model
    # Recurring kinds (what a duration predictor learns from), and each tenant submits.
    by_name = defaultdict(int)
    for run in runs:
        by_name[(run.tenant, run.kind.name)] += 1
    assert {t for t, _ in by_name} == {"vision", "nlp"}
    assert max(by_name.values()) >= 20
    outcomes = {r.outcome for r in runs}
    assert outcomes == {"succeeded", "failed", "cancelled"}
    # The same seed draws the same week.
    again = demo_history.generate(nodes, ["vision", "nlp"], end=END, seed=seed)
    assert [(r.submitted_at, r.node, r.gpu_indexes) for r in again] == [
        (r.submitted_at, r.node, r.gpu_indexes) for r in runs
    ]


def test_a_generated_week_runs_only_what_the_nodes_can_hold():
    # No A100 node: none of the A100 kinds; a 4-GPU node: no 8-GPU kind.
    runs = demo_history.generate(
        shapes(models=(demo_history.H100,), gpus=4), ["vision", "nlp"], end=END
    )
    assert runs
    assert {r.kind.gpu_type for r in runs} == {demo_history.H100}
    assert max(r.kind.gpus for r in runs) <= 4
    assert demo_history.generate(shapes(), ["nobody"], end=END) == []


def test_the_week_is_charged_power_that_keeps_the_pool_under_its_budget():
    nodes = shapes()
    runs = demo_history.generate(nodes, ["vision", "nlp"], end=END, days=2)
    budget_w = 6000.0
    points = demo_history.charge_power(
        runs, nodes, power_budget_w=budget_w, end=END, telemetry_s=86400
    )
    idle = {
        (n.name, g[0]): min(gpu_model.GPU_TYPES[n.gpu_type].idle_w, g[1])
        for n in nodes
        for g in n.gpus
    }
    by_minute = defaultdict(dict)
    for p in points:
        assert p.power_draw_w <= p.power_cap_w
        by_minute[p.at][(p.node, p.gpu_index)] = p.power_draw_w
    assert len(by_minute) > 600  # most minutes of the last day had something running
    for draws in by_minute.values():
        total_w = sum(draws.values()) + sum(w for k, w in idle.items() if k not in draws)
        assert total_w <= budget_w + 1e-6
    for run in runs:
        seconds = (run.finished_at - run.started_at).total_seconds()
        max_w = LIMITS[run.kind.gpu_type][1]
        idle_w = gpu_model.GPU_TYPES[run.kind.gpu_type].idle_w
        # Between idling and drawing the board's maximum, all the time, on every GPU.
        assert idle_w * seconds * run.kind.gpus < run.energy_j <= max_w * seconds * run.kind.gpus


@pytest.fixture
def demo_cluster(make_node):
    for i, model in enumerate((demo_history.H100, demo_history.H100, demo_history.A100), start=1):
        min_w, max_w = LIMITS[model]
        node = make_node(f"sim-node-{i}", gpus=8, model=model)
        node.gpus.update(power_min_w=min_w, power_max_w=max_w, power_default_w=max_w)
    seed_demo()
    Pool.objects.filter(name="default").update(power_budget_w=6000.0)


@pytest.mark.django_db
def test_a_fresh_demo_gets_its_past_once_and_it_reads_like_real_history(demo_cluster, client):
    now = dt.datetime.now(dt.UTC)
    jobs = seed_history(days=2, now=now)
    assert jobs > 100
    assert seed_history(days=2, now=now) == 0  # once
    assert Job.objects.count() == jobs
    assert AuditEvent.objects.filter(action="jobs.history_imported").count() == 1

    # Finished, nothing held, no GPU given to two attempts at once.
    assert not Job.objects.exclude(
        state__in=[JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED]
    ).exists()
    assert not Allocation.objects.filter(active=True).exists()
    spans = defaultdict(list)
    for gpu_id, start, end in Allocation.objects.values_list(
        "gpu_id", "attempt__started_at", "attempt__finished_at"
    ):
        spans[gpu_id].append((start, end))
    assert not any(overlaps(s) for s in spans.values())

    # The timeline of a job is the one the live path writes.
    job = Job.objects.filter(state=JobState.SUCCEEDED).first()
    kinds = list(job.events.values_list("kind", flat=True))
    assert kinds == ["submitted", "admitted", "running", "succeeded"]
    attempt = job.attempts.get()
    assert attempt.energy_j > 0 and attempt.gpu_seconds == pytest.approx(
        (attempt.finished_at - attempt.started_at).total_seconds() * job.gpus
    )

    # Usage: the tenants were charged GPU-hours and energy for it.
    vision = Tenant.objects.get(slug="vision")
    charged = JobAttempt.objects.filter(job__tenant=vision).aggregate(
        gpu_s=Sum("gpu_seconds"), energy_j=Sum("energy_j")
    )
    assert charged["gpu_s"] > 3600 and charged["energy_j"] > 1e6

    # Charts: the last day's jobs have telemetry on their GPUs while they ran.
    recent = (
        JobAttempt.objects.filter(finished_at__gte=now - dt.timedelta(hours=12))
        .order_by("-finished_at")
        .first()
    )
    rows = GpuTelemetry.objects.filter(
        gpu__in=recent.allocations.values("gpu"),
        bucket_at__gte=recent.started_at - dt.timedelta(minutes=1),
        bucket_at__lte=recent.finished_at,
    )
    assert rows.exists()
    assert all(r.power_draw_w <= r.power_cap_w for r in rows)


@pytest.mark.django_db
def test_a_job_like_the_past_ones_gets_a_duration_predicted_from_them(demo_cluster):
    seed_history(days=2, now=dt.datetime.now(dt.UTC))
    from django.contrib.auth import get_user_model

    user = get_user_model().objects.get(username="vision-researcher")
    vision = Tenant.objects.get(slug="vision")
    past = list(
        Job.objects.filter(
            tenant=vision, name="detr-lr-sweep", state=JobState.SUCCEEDED
        ).values_list("attempts__gpu_seconds", flat=True)
    )
    assert len(past) >= 5
    job = actions.submit_job(
        tenant=vision,
        user=user,
        name="detr-lr-sweep",
        image="registry.local/demo/train:1",
        command=["python", "sweep.py"],
        gpus=1,
        gpu_type=demo_history.A100,
    )
    run_scheduling_cycle()
    job.refresh_from_db()
    assert job.predicted_duration_s is not None
    past_sorted = sorted(past)
    assert past_sorted[0] <= job.predicted_duration_s <= past_sorted[-1]


@pytest.mark.django_db
@pytest.mark.slow
def test_the_readmes_whatif_example_works_on_a_fresh_demo(demo_cluster):
    seed_history(days=2)
    out = io.StringIO()
    # The README's command, word for word (on a shorter past, to keep the test quick).
    call_command("whatif", "--policy", "ours", "--quota", "vision:H100-SXM-80GB=8:16", stdout=out)
    report = out.getvalue()
    assert "| what really happened |" in report
    assert "| simulated: what-if |" in report
    assert "vision: quota H100-SXM-80GB (guaranteed/limit GPUs) 4/12 -> 8/16" in report
