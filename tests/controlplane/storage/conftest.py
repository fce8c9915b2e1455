"""Volumes, nodes with tokens, and finished jobs with checkpoint directories."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone


@pytest.fixture
def make_volume(db, cluster_admin):
    from controlplane.storage import actions

    def make(name: str, source: str | None = None, **fields):
        fields.setdefault("kind", "host_path")
        return actions.create_volume(
            actor=cluster_admin, name=name, source=source or f"/mnt/{name}", **fields
        )

    return make


@pytest.fixture
def ckpt_volume(make_volume):
    return make_volume("ckpt", "/srv/ckpt", checkpoints=True, checkpoint_retention_s=3600)


@pytest.fixture
def node_token():
    from controlplane.cluster.agent_auth import rotate_node_token

    return rotate_node_token


@pytest.fixture
def finished_job(make_job, alice, vision):
    """A job of vision's with its checkpoint directory on `volume`, finished `ago` back."""
    from controlplane.jobs.models import Job

    def make(volume, *, ago: dt.timedelta, checkpoint_bytes: int = 0, state="SUCCEEDED", **f):
        job = make_job(vision, alice)
        Job.objects.filter(pk=job.pk).update(
            checkpoint_volume=volume,
            checkpoint_bytes=checkpoint_bytes,
            state=state,
            finished_at=timezone.now() - ago if ago is not None else None,
            **f,
        )
        job.refresh_from_db()
        return job

    return make
