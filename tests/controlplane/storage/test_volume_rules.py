"""What a volume may be: every bad field is refused by the rules the API, pages and admin share,
naming the field, and nothing is written."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError

from controlplane.audit.models import AuditEvent
from controlplane.storage import actions
from controlplane.storage.models import Volume

pytestmark = pytest.mark.django_db


def refused_field(cluster_admin, **values) -> set[str]:
    values.setdefault("name", "datasets")
    values.setdefault("source", "/mnt/datasets")
    before = Volume.objects.count()
    with pytest.raises(ValidationError) as exc:
        actions.create_volume(actor=cluster_admin, **values)
    assert Volume.objects.count() == before
    return set(exc.value.message_dict)


@pytest.mark.parametrize(
    "source",
    [
        "mnt/datasets",  # relative
        "./datasets",
        "/mnt/../etc",
        "/mnt/data/..",
        "/mnt//datasets",  # not in plain form
        "/mnt/datasets/",
        "/mnt/./datasets",
        "/",
        "/etc",
        "/etc/ssl",
        "/proc/1",
        "/var/run/docker.sock",
        "/var/lib/docker/volumes/x",
        "/usr/share/data",
        "/home",
        "/mnt/data\x00sets",
        "/mnt/data\ud800",
        "/mnt/data sets",
        "/mnt/a:b",
        "/mnt/" + "x" * 1100,
        "",
    ],
)
def test_a_host_path_source_that_is_not_a_safe_absolute_directory_is_refused(cluster_admin, source):
    assert refused_field(cluster_admin, source=source) == {"source"}


@pytest.mark.parametrize("source", ["/mnt/datasets", "/data/imagenet-2012", "/srv/nfs/team_a"])
def test_a_plain_absolute_host_path_is_accepted(cluster_admin, source):
    volume = actions.create_volume(actor=cluster_admin, name="datasets", source=source)
    assert volume.source == source


@pytest.mark.parametrize("source", ["a", "-vol", "vol/sub", "/mnt/x", "v\x00l", "v" * 256])
def test_an_engine_volume_needs_an_engine_volume_name(cluster_admin, source):
    assert refused_field(cluster_admin, kind="engine_volume", source=source) == {"source"}


@pytest.mark.parametrize(
    "name", ["Datasets", "data_sets", "-data", "data-", "da ta", "d\x00", "d\udfff", "x" * 64, ""]
)
def test_a_name_that_is_not_a_lower_case_slug_is_refused(cluster_admin, name):
    assert "name" in refused_field(cluster_admin, name=name)


def test_names_are_unique_and_fixed_once_made(cluster_admin, make_volume):
    volume = make_volume("datasets")
    assert refused_field(cluster_admin, name="datasets") == {"name"}
    with pytest.raises(ValidationError) as exc:
        actions.update_volume(volume, actor=cluster_admin, name="other")
    assert set(exc.value.message_dict) == {"name"}


@pytest.mark.parametrize("retention_s", [-1, 10 * 365 * 86400 + 1, 2**63, True])
def test_retention_beyond_ten_years_or_negative_is_refused(cluster_admin, retention_s):
    assert refused_field(cluster_admin, checkpoint_retention_s=retention_s) == {
        "checkpoint_retention_s"
    }


@pytest.mark.parametrize(
    "fields",
    [
        {"kind": "engine_volume", "source": "ckpt-vol"},
        {"read_only": True},
    ],
)
def test_the_checkpoint_volume_must_be_a_writable_host_path(cluster_admin, fields):
    assert refused_field(cluster_admin, checkpoints=True, **fields) == {"checkpoints"}


def test_there_is_only_one_checkpoint_volume(cluster_admin, ckpt_volume, make_volume):
    assert refused_field(cluster_admin, name="ckpt2", checkpoints=True) == {"checkpoints"}
    other = make_volume("scratch")
    with pytest.raises(ValidationError) as exc:
        actions.update_volume(other, actor=cluster_admin, checkpoints=True)
    assert set(exc.value.message_dict) == {"checkpoints"}


def test_a_per_tenant_engine_volume_is_refused(cluster_admin):
    assert refused_field(
        cluster_admin, kind="engine_volume", source="vol1", per_tenant_subdir=True
    ) == {"per_tenant_subdir"}


def test_create_update_and_delete_each_leave_one_audit_row_and_ask_for_a_cycle(
    cluster_admin, pool, vision, django_capture_on_commit_callbacks, monkeypatch
):
    from controlplane import wakeups

    asked: list[str] = []
    monkeypatch.setattr(wakeups, "request_cycle", asked.append)
    with django_capture_on_commit_callbacks(execute=True):
        volume = actions.create_volume(
            actor=cluster_admin, name="datasets", source="/mnt/datasets", tenants=[vision]
        )
    with django_capture_on_commit_callbacks(execute=True):
        actions.update_volume(volume, actor=cluster_admin, read_only=True, pools=[pool])
    with django_capture_on_commit_callbacks(execute=True):
        actions.update_volume(volume, actor=cluster_admin, description="ImageNet")
    assert len(asked) == 2  # a description changes nothing the scheduler reads
    with django_capture_on_commit_callbacks(execute=True):
        actions.delete_volume(volume, actor=cluster_admin)
    rows = list(AuditEvent.objects.filter(object_type="volume").order_by("pk"))
    assert [r.action for r in rows] == [
        "volume.create",
        "volume.update",
        "volume.update",
        "volume.delete",
    ]
    assert rows[0].after["tenants"] == ["vision"]
    assert rows[1].before == {"read_only": False, "pools": []}
    assert rows[1].after == {"read_only": True, "pools": ["default"]}
    assert len(asked) == 3


def test_an_update_that_changes_nothing_is_not_recorded(cluster_admin, make_volume):
    volume = make_volume("datasets", read_only=True)
    actions.update_volume(volume, actor=cluster_admin, read_only=True)
    assert not AuditEvent.objects.filter(action="volume.update").exists()


def test_a_volume_unfinished_jobs_mount_cannot_be_deleted(
    cluster_admin, make_volume, make_job, vision, alice
):
    from controlplane.jobs.models import Job

    volume = make_volume("datasets")
    job = make_job(vision, alice)
    Job.objects.filter(pk=job.pk).update(
        mounts=[{"volume": "datasets", "path": "/data", "read_only": True}]
    )
    with pytest.raises(actions.VolumeInUse, match="1 unfinished job"):
        actions.delete_volume(volume, actor=cluster_admin)
    Job.objects.filter(pk=job.pk).update(state="CANCELLED")
    actions.delete_volume(volume, actor=cluster_admin)
    assert not Volume.objects.exists()


def test_the_checkpoint_volume_stays_while_jobs_refer_to_it(
    cluster_admin, ckpt_volume, finished_job
):
    import datetime as dt

    finished_job(ckpt_volume, ago=dt.timedelta(days=30))
    with pytest.raises(actions.VolumeInUse, match="checkpoint directories of 1 job"):
        actions.delete_volume(ckpt_volume, actor=cluster_admin)
    assert Volume.objects.filter(pk=ckpt_volume.pk).exists()


def test_narrowing_a_volumes_pools_drops_it_from_the_nodes_outside_them(
    cluster_admin, make_volume, make_node, pool
):
    from controlplane.cluster.models import Node, Pool

    volume = make_volume("datasets")
    inside = make_node("in-1", volumes=["datasets"])
    outside = make_node("out-1", volumes=["datasets"])
    Node.objects.filter(pk=outside.pk).update(pool=Pool.objects.create(name="other"))
    actions.update_volume(volume, actor=cluster_admin, pools=[pool])
    assert Node.objects.get(pk=inside.pk).volumes == ["datasets"]
    assert Node.objects.get(pk=outside.pk).volumes == []
    actions.delete_volume(volume, actor=cluster_admin)
    assert Node.objects.get(pk=inside.pk).volumes == []


def test_the_tenant_checkpoint_limit_is_checked_and_audited(cluster_admin, vision):
    from controlplane.tenancy import actions as tenancy_actions

    tenancy_actions.set_checkpoint_limit(vision, 10 * 2**30, actor=cluster_admin)
    vision.refresh_from_db()
    assert vision.checkpoint_limit_bytes == 10 * 2**30
    row = AuditEvent.objects.get(action="tenant.update")
    assert row.after == {"checkpoint_limit_bytes": 10 * 2**30}
    for bad in (-1, 2**63, 10**18 + 1):
        with pytest.raises(ValidationError) as exc:
            tenancy_actions.set_checkpoint_limit(vision, bad, actor=cluster_admin)
        assert set(exc.value.message_dict) == {"checkpoint_limit_bytes"}
    tenancy_actions.set_checkpoint_limit(vision, None, actor=cluster_admin)
    vision.refresh_from_db()
    assert vision.checkpoint_limit_bytes is None


def test_a_name_taken_at_the_same_moment_is_refused_on_name(
    cluster_admin, make_volume, monkeypatch
):
    from controlplane.storage import rules

    make_volume("datasets")
    # The rule's look-up ran before the other admin's create committed.
    original = rules.Volume.objects.filter
    monkeypatch.setattr(
        rules.Volume.objects,
        "filter",
        lambda *a, **k: Volume.objects.none() if "name" in k else original(*a, **k),
    )
    with pytest.raises(ValidationError) as exc:
        actions.create_volume(actor=cluster_admin, name="datasets", source="/mnt/other")
    assert set(exc.value.message_dict) == {"name"}
