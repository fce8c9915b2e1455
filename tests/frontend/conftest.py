"""Fixtures for the web UI tests: a small cluster with one running and one pending job of vision."""

import datetime as dt

import pytest
from django.utils import timezone


@pytest.fixture
def node(make_node):
    return make_node("gpu-node-01", gpus=4)


@pytest.fixture
def pending_job(vision, alice, make_job, node):
    from controlplane.jobs.models import Job

    job = make_job(vision, alice, name="wait-for-me", gpus=2)
    # What a scheduling cycle writes for a job it left waiting.
    Job.objects.filter(pk=job.pk).update(
        pending_reason_code="no_capacity",
        pending_reason="Not enough free H100-SXM-80GB GPUs: needs 2, 1 free.",
        queue_position=3,
        estimated_start_at=timezone.now() + dt.timedelta(minutes=12),
    )
    job.refresh_from_db()
    return job


@pytest.fixture
def running_job(vision, alice, make_job, node):
    """A 2-GPU job running on gpu-node-01 for ten minutes, with telemetry and some output."""
    from controlplane.cluster.models import GpuTelemetry
    from controlplane.jobs import actions
    from controlplane.jobs.models import JobAttempt, LogChunk

    job = make_job(vision, alice, name="resnet", gpus=2, gpu_type="H100-SXM-80GB")
    gpus = list(node.gpus.order_by("index")[:2])
    attempt = actions.admit_job(job, node=node, gpus=gpus, borrowed=False)
    started = timezone.now() - dt.timedelta(minutes=10)
    actions.mark_attempt_running(attempt, started_at=started)
    JobAttempt.objects.filter(pk=attempt.pk).update(energy_j=3.6e6 * 0.5, gpu_seconds=1200.0)
    for gpu in gpus:
        gpu.power_cap_w = 600.0
        gpu.power_draw_w = 480.0
        gpu.utilization_pct = 93.0
        gpu.temperature_c = 64.0
        gpu.save()
        for minute in range(10):
            GpuTelemetry.objects.create(
                gpu=gpu,
                bucket_at=started + dt.timedelta(minutes=minute),
                utilization_pct=90.0 + minute % 3,
                power_draw_w=450.0 + minute * 5,
                power_cap_w=600.0,
                temperature_c=60.0,
            )
    text = "".join(f"epoch {i} loss {1 / (i + 1):.3f}\n" for i in range(5))
    LogChunk.objects.create(attempt=attempt, offset=0, data=text)
    job.refresh_from_db()
    return job


@pytest.fixture
def as_user(client):
    def login(user):
        client.force_login(user)
        return client

    return login


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    # Every test signs in a few people; the production hasher's deliberate slowness is not what
    # these tests are about.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
