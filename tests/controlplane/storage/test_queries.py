"""The read side: who may mount what, what a node should have, checkpoint usage, and which
checkpoint directories are due for deletion."""

from __future__ import annotations

import datetime as dt

import pytest

from controlplane.storage import queries
from controlplane.storage.models import Volume
from controlplane.storage.paths import checkpoint_host_path, mount_source

pytestmark = pytest.mark.django_db
HOUR = dt.timedelta(hours=1)


def test_a_tenant_may_use_volumes_for_every_tenant_and_those_listing_it(make_volume, vision, nlp):
    make_volume("shared", all_tenants=True)
    make_volume("vision-only", tenants=[vision])
    make_volume("nlp-only", tenants=[nlp])
    make_volume("nobodys")
    assert sorted(v.name for v in queries.volumes_for_tenant(vision)) == ["shared", "vision-only"]
    vision.active = False
    assert list(queries.volumes_for_tenant(vision)) == []


def test_a_pools_volumes_are_those_listing_it_or_no_pool(make_volume, pool):
    from controlplane.cluster.models import Pool

    other = Pool.objects.create(name="other")
    make_volume("everywhere")
    make_volume("here", pools=[pool])
    make_volume("there", pools=[other])
    make_volume("both", pools=[pool, other])
    assert [v.name for v in queries.volumes_for_pool(pool.pk)] == ["both", "everywhere", "here"]


def test_paths_on_the_host(make_volume, ckpt_volume):
    shared = make_volume("shared", "/mnt/shared")
    split = make_volume("split", "/mnt/split", per_tenant_subdir=True)
    assert mount_source(shared, "vision") == "/mnt/shared"
    assert mount_source(split, "vision") == "/mnt/split/tenants/vision"
    assert checkpoint_host_path(ckpt_volume, "vision", 42) == "/srv/ckpt/checkpoints/vision/42"


def test_checkpoint_usage_counts_only_directories_still_on_disk(
    ckpt_volume, finished_job, vision, nlp, make_job, bob
):
    from django.utils import timezone

    from controlplane.jobs.models import Job

    finished_job(ckpt_volume, ago=HOUR, checkpoint_bytes=1000)
    finished_job(ckpt_volume, ago=HOUR, checkpoint_bytes=200, state="FAILED")
    finished_job(ckpt_volume, ago=HOUR, checkpoint_bytes=5, checkpoint_deleted_at=timezone.now())
    other = make_job(nlp, bob)
    Job.objects.filter(pk=other.pk).update(checkpoint_volume=ckpt_volume, checkpoint_bytes=7)
    assert queries.checkpoint_usage_bytes(vision) == 1200
    assert queries.checkpoint_usage_by_tenant() == {vision.pk: 1200, nlp.pk: 7}


def test_due_deletions_are_finished_jobs_past_their_volumes_retention(
    ckpt_volume, finished_job, vision
):
    from django.utils import timezone

    due = finished_job(ckpt_volume, ago=2 * HOUR)  # retention is one hour
    finished_job(ckpt_volume, ago=dt.timedelta(minutes=30))  # still kept
    finished_job(ckpt_volume, ago=2 * HOUR, checkpoint_deleted_at=timezone.now())
    finished_job(ckpt_volume, ago=2 * HOUR, state="RUNNING")  # requeued after it ended once
    finished_job(ckpt_volume, ago=None, state="CANCELLED")  # no end time known
    listed = queries.due_checkpoint_deletions()
    assert [(d.job_id, d.host_path) for d in listed] == [
        (due.pk, f"/srv/ckpt/checkpoints/vision/{due.pk}")
    ]
    assert queries.due_checkpoint_deletion_count() == 1
    Volume.objects.filter(pk=ckpt_volume.pk).update(checkpoint_retention_s=3 * 3600)
    assert queries.due_checkpoint_deletions() == []
    assert queries.due_checkpoint_deletions(volume_names=["elsewhere"], now=timezone.now()) == []


def test_due_deletions_come_oldest_first_and_at_most_a_page(ckpt_volume, finished_job):
    jobs = [finished_job(ckpt_volume, ago=HOUR * (10 - i)) for i in range(5)]
    listed = queries.due_checkpoint_deletions(limit=3)
    assert [d.job_id for d in listed] == [j.pk for j in jobs[:3]]
