"""The job contract as the scheduler sees it: the volumes a node has and a job needs, every
attempt's notice, when a stopping attempt's GPUs are free at the latest, the work a preemption
would lose; and a tenant past its checkpoint storage limit gets read-only checkpoint dirs."""

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from controlplane.cluster.models import Node
from controlplane.jobs import actions
from controlplane.jobs.models import Job, JobAttempt, JobEvent
from controlplane.scheduling.applier import apply_plan
from controlplane.scheduling.cycle import scheduler_config
from controlplane.scheduling.loader import load_snapshot
from controlplane.storage.models import Volume
from scheduler import model as m

pytestmark = pytest.mark.django_db


@pytest.fixture
def ckpt(db):
    return Volume.objects.create(name="ckpt", source="/srv/ckpt", checkpoints=True)


def _job(make_job, tenant, user, ckpt=None, **fields):
    return make_job(
        tenant,
        user,
        mounts=[
            {"volume": "datasets", "path": "/data", "read_only": True},
            {"volume": "models", "path": "/models", "read_only": True},
        ],
        checkpoint_volume=ckpt,
        **fields,
    )


def test_nodes_and_pending_jobs_carry_their_volumes_and_notice(
    make_node, make_job, vision, alice, ckpt
):
    node = make_node("n1", gpus=2)
    Node.objects.filter(pk=node.pk).update(volumes=["ckpt", "datasets"])
    job = _job(make_job, vision, alice, ckpt, preemption_grace_s=45)
    snapshot = load_snapshot().snapshot
    (loaded_node,) = snapshot.nodes
    assert loaded_node.volumes == frozenset({"ckpt", "datasets"})
    (pending,) = snapshot.pending
    assert pending.job_id == job.pk
    assert pending.volumes == ("ckpt", "datasets", "models")
    assert pending.grace_s == 45.0


def test_a_running_attempt_carries_its_notice_and_its_last_checkpoint_over_all_attempts(
    make_node, make_job, vision, alice, ckpt
):
    node = make_node("n1", gpus=2)
    job = _job(make_job, vision, alice, ckpt, preemption_grace_s=20, checkpoint_interval_s=900)
    first = actions.admit_job(job, node=node, gpus=list(node.gpus.all()[:1]), borrowed=False)
    earlier = timezone.now() - timedelta(minutes=10)
    # An earlier attempt's checkpoint: the job keeps one directory, so it still counts.
    JobAttempt.objects.filter(pk=first.pk).update(last_checkpoint_at=earlier)
    (running,) = load_snapshot().snapshot.running
    assert running.grace_s == 20.0
    assert running.checkpoint_interval_s == 900.0
    assert running.last_checkpoint_s == pytest.approx(earlier.timestamp(), abs=1e-3)
    assert running.stop_by_s is None

    actions.request_stop(first, reason="preempted", message="Preempted")
    asked = JobAttempt.objects.get(pk=first.pk).stop_requested_at
    (running,) = load_snapshot().snapshot.running
    assert running.stopping
    assert running.stop_by_s == pytest.approx(asked.timestamp() + 20.0, abs=1e-3)


def test_the_restart_cost_is_the_operators_setting(settings):
    settings.PREEMPTION_RESTART_COST_S = 240.0
    settings.SCHEDULER_POLICY = {}
    assert scheduler_config().restart_cost_s == 240.0


def test_the_loader_reads_mounts_and_checkpoints_without_a_query_per_job(
    make_node, make_job, vision, alice, ckpt
):
    def grow(n):
        node = make_node(f"n{n}", gpus=n)
        for gpu in node.gpus.all():
            attempt = actions.admit_job(
                _job(make_job, vision, alice, ckpt, checkpoint_interval_s=60),
                node=node,
                gpus=[gpu],
                borrowed=False,
            )
            JobAttempt.objects.filter(pk=attempt.pk).update(last_checkpoint_at=timezone.now())
            _job(make_job, vision, alice, ckpt)

    counts = []
    for n in (1, 6):
        grow(n)
        load_snapshot()  # the power-profile step's first look at new attempts
        with CaptureQueriesContext(connection) as queries:
            load_snapshot()
        counts.append(len(queries))
    assert counts[0] == counts[1]


# --- the applier: checkpoint storage limit ----------------------------------------------------


def _start(job, node="n1", uuids=("GPU-n1-0",)):
    return m.Start(job_id=job.pk, placements=((node, tuple(uuids)),), borrowed=False)


def test_a_tenant_past_its_checkpoint_limit_gets_read_only_checkpoint_dirs(
    make_node, make_job, vision, alice, ckpt
):
    make_node("n1", gpus=2)
    vision.checkpoint_limit_bytes = 1000
    vision.save()
    old = _job(make_job, vision, alice, ckpt)
    Job.objects.filter(pk=old.pk).update(checkpoint_bytes=1500)
    job = _job(make_job, vision, alice, ckpt)
    apply_plan(m.Plan(starts=(_start(job),)), load_snapshot())
    attempt = JobAttempt.objects.get(job=job)
    assert attempt.checkpoint_read_only is True
    event = JobEvent.objects.get(job=job, kind=actions.CHECKPOINT_READ_ONLY_EVENT)
    assert event.message == (
        "Tenant over its checkpoint storage limit: 1.5 KiB of 1000 B used; this attempt's "
        "checkpoint directory is read-only"
    )


@pytest.mark.parametrize(
    ("limit", "used", "deleted", "read_only"),
    [
        (None, 10**12, False, False),  # no limit
        (1000, 999, False, False),  # under it
        (1000, 1000, False, True),  # at it
        (1000, 5000, True, False),  # what was there is deleted
    ],
)
def test_the_limit_counts_what_checkpoint_dirs_hold_now(
    make_node, make_job, vision, alice, ckpt, limit, used, deleted, read_only
):
    make_node("n1", gpus=2)
    vision.checkpoint_limit_bytes = limit
    vision.save()
    old = _job(make_job, vision, alice, ckpt)
    Job.objects.filter(pk=old.pk).update(
        checkpoint_bytes=used, checkpoint_deleted_at=timezone.now() if deleted else None
    )
    job = _job(make_job, vision, alice, ckpt)
    apply_plan(m.Plan(starts=(_start(job),)), load_snapshot())
    assert JobAttempt.objects.get(job=job).checkpoint_read_only is read_only


def test_a_job_without_a_checkpoint_dir_is_not_limited(make_node, make_job, vision, alice, ckpt):
    make_node("n1", gpus=2)
    vision.checkpoint_limit_bytes = 0
    vision.save()
    job = _job(make_job, vision, alice, None)
    apply_plan(m.Plan(starts=(_start(job),)), load_snapshot())
    assert JobAttempt.objects.get(job=job).checkpoint_read_only is False
    assert not JobEvent.objects.filter(kind=actions.CHECKPOINT_READ_ONLY_EVENT).exists()
