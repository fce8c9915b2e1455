"""/api/v1/volumes/ as admins and researchers use it, and the tenant's checkpoint limit."""

from __future__ import annotations

import datetime as dt

import pytest
from rest_framework.test import APIClient

from controlplane.storage.models import Volume
from tests.controlplane.api.helpers import results

pytestmark = pytest.mark.django_db


def as_user(user) -> APIClient:
    client = APIClient()
    client.force_authenticate(user)
    return client


@pytest.fixture
def admin_api(cluster_admin):
    return as_user(cluster_admin)


def test_an_admin_defines_a_volume_for_some_tenants_and_pools(admin_api, vision, pool):
    response = admin_api.post(
        "/api/v1/volumes/",
        {
            "name": "datasets",
            "source": "/mnt/datasets",
            "tenants": ["vision"],
            "pools": ["default"],
            "read_only": True,
        },
        format="json",
    )
    assert response.status_code == 201, response.content
    volume = Volume.objects.get(name="datasets")
    assert [t.slug for t in volume.tenants.all()] == ["vision"]
    assert [p.name for p in volume.pools.all()] == ["default"]
    assert response.json()["source"] == "/mnt/datasets"


def test_a_researcher_sees_the_volumes_their_tenant_may_use_without_host_paths(
    make_volume, alice, bob, vision
):
    make_volume("vision-data", "/mnt/secret/vision", tenants=[vision])
    make_volume("shared", all_tenants=True)
    seen = results(as_user(alice).get("/api/v1/volumes/"))
    assert [v["name"] for v in seen] == ["shared", "vision-data"]
    assert all("source" not in v for v in seen)
    assert "/mnt/secret" not in as_user(alice).get("/api/v1/volumes/vision-data/").content.decode()
    # bob is in nlp: vision's volume does not exist for him.
    assert as_user(bob).get("/api/v1/volumes/vision-data/").status_code == 404
    assert [v["name"] for v in results(as_user(bob).get("/api/v1/volumes/"))] == ["shared"]


def test_a_researcher_cannot_write_volumes(make_volume, vision_admin, vision):
    make_volume("vision-data", tenants=[vision])
    client = as_user(vision_admin)
    body = {"name": "mine", "source": "/mnt/mine"}
    assert client.post("/api/v1/volumes/", body, format="json").status_code == 403
    url = "/api/v1/volumes/vision-data/"
    assert client.patch(url, {"source": "/mnt/other"}, format="json").status_code == 403
    assert client.delete(url).status_code == 403
    assert Volume.objects.get(name="vision-data").source == "/mnt/vision-data"


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"source": "/mnt/../etc"}, "source"),
        ({"source": "relative/path"}, "source"),
        ({"source": "/etc"}, "source"),
        ({"source": "/mnt/x\u0000y"}, "source"),
        ({"source": " /mnt/x"}, "source"),
        ({"name": "Bad Name"}, "name"),
        ({"kind": "nfs"}, "kind"),
        ({"checkpoint_retention_s": 10**10}, "checkpoint_retention_s"),
        ({"checkpoint_retention_s": -1}, "checkpoint_retention_s"),
        ({"tenants": ["nobody"]}, "tenants"),
        ({"pools": ["nowhere"]}, "pools"),
        ({"checkpoints": True, "read_only": True}, "checkpoints"),
        ({"description": "x" * 201}, "description"),
    ],
)
def test_a_bad_field_is_a_400_naming_it(admin_api, fields, field):
    body = {"name": "datasets", "source": "/mnt/datasets", **fields}
    response = admin_api.post("/api/v1/volumes/", body, format="json")
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert not Volume.objects.exists()


def test_a_second_checkpoint_volume_is_a_400_on_checkpoints(admin_api, ckpt_volume, make_volume):
    make_volume("scratch")
    response = admin_api.patch("/api/v1/volumes/scratch/", {"checkpoints": True}, format="json")
    assert response.status_code == 400
    assert "already the checkpoint volume" in response.json()["checkpoints"][0]


def test_a_lost_race_for_the_checkpoint_volume_is_a_400_on_checkpoints(
    admin_api, make_volume, monkeypatch
):
    """Two admins making two volumes the checkpoint volume at once: the constraint decides."""
    from controlplane.storage import rules

    make_volume("one", checkpoints=True)
    make_volume("two")
    # The rule's look-up ran before the other admin's commit: it saw no checkpoint volume.
    monkeypatch.setattr(rules.Volume.objects, "filter", _without_checkpoint_lookup())
    response = admin_api.patch("/api/v1/volumes/two/", {"checkpoints": True}, format="json")
    assert response.status_code == 400, response.content
    assert "at the same moment" in response.json()["checkpoints"][0]
    assert not Volume.objects.get(name="two").checkpoints


def _without_checkpoint_lookup():
    original = Volume.objects.filter

    def filter_(*args, **kwargs):
        if kwargs == {"checkpoints": True}:
            return Volume.objects.none()
        return original(*args, **kwargs)

    return filter_


def test_deleting_a_volume_jobs_still_use_is_a_409_saying_why(admin_api, ckpt_volume, finished_job):
    finished_job(ckpt_volume, ago=dt.timedelta(hours=1))
    response = admin_api.delete("/api/v1/volumes/ckpt/")
    assert response.status_code == 409
    assert "checkpoint directories of 1 job" in response.json()["detail"]
    assert Volume.objects.filter(name="ckpt").exists()


def test_the_admin_list_shows_which_nodes_have_each_volume(admin_api, make_volume, make_node):
    make_volume("datasets")
    make_node("gpu-1", gpus=1, volumes=["datasets"])
    make_node("gpu-2", gpus=1)
    [row] = results(admin_api.get("/api/v1/volumes/"))
    assert row["nodes"] == ["gpu-1"]


def test_the_tenant_checkpoint_limit_is_set_by_admins_and_usage_is_shown_to_members(
    admin_api, alice, vision, ckpt_volume, finished_job
):
    finished_job(ckpt_volume, ago=dt.timedelta(minutes=5), checkpoint_bytes=3 * 2**30)
    response = admin_api.patch(
        "/api/v1/tenants/vision/", {"checkpoint_limit_bytes": 5 * 2**30}, format="json"
    )
    assert response.status_code == 200, response.content
    seen = as_user(alice).get("/api/v1/tenants/vision/").json()
    assert seen["checkpoint_limit_bytes"] == 5 * 2**30
    assert seen["checkpoint_usage_bytes"] == 3 * 2**30
    refused = as_user(alice).patch(
        "/api/v1/tenants/vision/", {"checkpoint_limit_bytes": None}, format="json"
    )
    assert refused.status_code == 403
    bad = admin_api.patch("/api/v1/tenants/vision/", {"checkpoint_limit_bytes": -1}, format="json")
    assert bad.status_code == 400 and "checkpoint_limit_bytes" in bad.json()
