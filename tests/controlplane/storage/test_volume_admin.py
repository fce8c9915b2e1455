"""The Django admin writes volumes through the actions: the rules refuse at the field, the change
is audited."""

from __future__ import annotations

import pytest
from django.urls import reverse

from controlplane.audit.models import AuditEvent
from controlplane.storage.models import Volume

pytestmark = pytest.mark.django_db


@pytest.fixture
def ops(client, cluster_admin):
    client.force_login(cluster_admin)
    return client


def form(**fields) -> dict:
    body = {
        "name": "datasets",
        "description": "",
        "kind": "host_path",
        "source": "/mnt/datasets",
        "checkpoint_retention_s": 604800,
    }
    return {**body, **fields}


def test_a_volume_added_in_the_admin_is_audited_with_its_tenants(ops, vision):
    response = ops.post(reverse("admin:storage_volume_add"), form(tenants=[vision.pk]))
    assert response.status_code == 302, response.content.decode()[:2000]
    volume = Volume.objects.get(name="datasets")
    assert [t.slug for t in volume.tenants.all()] == ["vision"]
    row = AuditEvent.objects.get(action="volume.create")
    assert row.after["tenants"] == ["vision"]


def test_the_admin_refuses_a_system_path_at_the_source_field(ops):
    response = ops.post(reverse("admin:storage_volume_add"), form(source="/proc/self"))
    assert response.status_code == 200
    assert "belongs to the host" in response.content.decode()
    assert not Volume.objects.exists()


def test_an_admin_change_is_audited_and_a_volume_in_use_is_not_deleted(
    ops, cluster_admin, make_job, vision, alice
):
    from controlplane.jobs.models import Job
    from controlplane.storage import actions

    volume = actions.create_volume(actor=cluster_admin, name="datasets", source="/mnt/datasets")
    url = reverse("admin:storage_volume_change", args=[volume.pk])
    response = ops.post(url, form(read_only="on"))
    assert response.status_code == 302
    assert AuditEvent.objects.get(action="volume.update").after == {"read_only": True}
    job = make_job(vision, alice)
    Job.objects.filter(pk=job.pk).update(mounts=[{"volume": "datasets", "path": "/d"}])
    ops.post(reverse("admin:storage_volume_delete", args=[volume.pk]), {"post": "yes"})
    assert Volume.objects.filter(pk=volume.pk).exists()
