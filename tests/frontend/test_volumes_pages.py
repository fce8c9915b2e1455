"""The volume pages: admins define volumes and see where they are; researchers see what they may
mount (never host paths); dashboards show checkpoint storage against the tenant's limit."""

from __future__ import annotations

import datetime as dt

import pytest
from django.urls import reverse
from django.utils import timezone

from controlplane.storage.models import Volume
from tests.frontend.test_admin_pages import error_at
from tests.frontend.test_researcher_pages import text_of

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin(client, cluster_admin):
    client.force_login(cluster_admin)
    return client


@pytest.fixture
def volume(cluster_admin, vision):
    from controlplane.storage import actions

    return actions.create_volume(
        actor=cluster_admin,
        name="vision-data",
        source="/mnt/secret-vision",
        description="ImageNet and friends",
        tenants=[vision],
        read_only=True,
    )


@pytest.fixture
def ckpt(cluster_admin):
    from controlplane.storage import actions

    return actions.create_volume(
        actor=cluster_admin,
        name="ckpt",
        source="/srv/ckpt",
        checkpoints=True,
        checkpoint_retention_s=3600,
    )


def checkpoint_job(job, volume, *, checkpoint_bytes, finished_ago=None):
    from controlplane.jobs.models import Job

    fields = {"checkpoint_volume": volume, "checkpoint_bytes": checkpoint_bytes}
    if finished_ago is not None:
        fields |= {"state": "SUCCEEDED", "finished_at": timezone.now() - finished_ago}
    Job.objects.filter(pk=job.pk).update(**fields)


def test_the_admin_list_shows_sources_tenants_nodes_and_due_deletions(
    admin, volume, ckpt, make_node, make_job, vision, alice
):
    make_node("gpu-7", gpus=1, volumes=["vision-data"])
    checkpoint_job(
        make_job(vision, alice), ckpt, checkpoint_bytes=10, finished_ago=dt.timedelta(hours=2)
    )
    response = admin.get(reverse("manage-volumes"))
    text = text_of(response)
    assert "/mnt/secret-vision" in text
    assert "gpu-7" in text
    assert "1 checkpoint directory past retention" in text
    # ckpt is on no node yet: said so, next to it.
    assert "none" in text.split("ckpt", 2)[-1]


def test_an_admin_creates_a_volume_through_the_form(admin, vision, pool):
    response = admin.post(
        reverse("manage-volume-create"),
        {
            "name": "datasets",
            "kind": "host_path",
            "source": "/mnt/datasets",
            "tenants": ["vision"],
            "pools": ["default"],
            "read_only": "on",
            "checkpoint_retention_days": "7",
        },
    )
    assert response.status_code == 302, error_at(response, "source")
    volume = Volume.objects.get(name="datasets")
    assert volume.read_only and volume.checkpoint_retention_s == 7 * 86400
    assert [t.slug for t in volume.tenants.all()] == ["vision"]


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("source", "/etc", "belongs to the host"),
        ("source", "/mnt/../etc", "give the directory itself"),
        ("source", "relative", "absolute"),
        ("name", "Not A Slug", "Lower-case"),
        ("checkpoint_retention_days", "100000", "10 years"),
        ("checkpoint_retention_days", "1e300", "10 years"),
    ],
)
def test_a_bad_field_in_the_form_is_shown_at_it_and_nothing_is_saved(admin, field, value, says):
    body = {
        "name": "datasets",
        "kind": "host_path",
        "source": "/mnt/datasets",
        "checkpoint_retention_days": "7",
        field: value,
    }
    response = admin.post(reverse("manage-volume-create"), body)
    assert response.status_code == 400
    assert says in error_at(response, field)
    assert not Volume.objects.exists()


def test_deleting_asks_first_and_refuses_while_jobs_use_it(admin, ckpt, make_job, vision, alice):
    confirm = admin.get(reverse("manage-volume-delete", args=["ckpt"]))
    assert "Volume ckpt will be deleted" in text_of(confirm)
    assert Volume.objects.filter(name="ckpt").exists()
    checkpoint_job(make_job(vision, alice), ckpt, checkpoint_bytes=0)
    response = admin.post(reverse("manage-volume-delete", args=["ckpt"]), follow=True)
    assert "was not deleted" in text_of(response)
    assert Volume.objects.filter(name="ckpt").exists()


def test_a_researcher_sees_the_volumes_of_their_tenants_without_host_paths(
    client, alice, bob, volume, nlp, cluster_admin
):
    from controlplane.storage import actions

    actions.create_volume(actor=cluster_admin, name="nlp-corpus", source="/mnt/nlp", tenants=[nlp])
    client.force_login(alice)
    text = text_of(client.get(reverse("my-volumes")))
    assert "vision-data" in text and "ImageNet and friends" in text and "read-only" in text
    assert "/mnt/secret-vision" not in text
    assert "nlp-corpus" not in text
    client.force_login(bob)
    assert "vision-data" not in text_of(client.get(reverse("my-volumes")))


def test_the_dashboard_shows_checkpoint_storage_against_the_limit(
    client, alice, vision, ckpt, make_job
):
    vision.checkpoint_limit_bytes = 4 * 2**30
    vision.save()
    checkpoint_job(make_job(vision, alice), ckpt, checkpoint_bytes=5 * 2**30)
    client.force_login(alice)
    text = text_of(client.get(reverse("tenant-dashboard", args=["vision"])))
    assert "Checkpoint storage 5.0 GB of 4.0 GB over the limit" in text


def test_an_admin_sets_the_checkpoint_limit_in_gib_and_sees_usage_per_tenant(
    admin, vision, ckpt, make_job, alice
):
    checkpoint_job(make_job(vision, alice), ckpt, checkpoint_bytes=2**30)
    response = admin.post(
        reverse("manage-tenant", args=["vision"]),
        {
            "slug": "vision",
            "name": "Vision lab",
            "weight": "1",
            "active": "on",
            "checkpoint_limit_gib": "10",
        },
    )
    assert response.status_code == 302
    vision.refresh_from_db()
    assert vision.checkpoint_limit_bytes == 10 * 2**30
    assert "1.0 GB of 10.0 GB" in text_of(admin.get(reverse("manage-tenants")))
    refused = admin.post(
        reverse("manage-tenant", args=["vision"]),
        {
            "slug": "vision",
            "name": "Vision lab",
            "weight": "1",
            "active": "on",
            "checkpoint_limit_gib": "-1",
        },
    )
    assert refused.status_code == 400
    assert "GiB" in error_at(refused, "checkpoint_limit_gib")
    vision.refresh_from_db()
    assert vision.checkpoint_limit_bytes == 10 * 2**30
