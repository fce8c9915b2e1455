"""Volumes, a node to run on, and a signed-in client for the job contract's tests."""

import pytest
from rest_framework.test import APIClient

from controlplane.storage.models import Volume


@pytest.fixture
def volumes(db, vision, nlp):
    """datasets (every tenant), models (read-only, every tenant), vision-only (vision's),
    nlp-private (nlp's), ckpt (the checkpoint volume)."""
    datasets = Volume.objects.create(name="datasets", source="/mnt/datasets", all_tenants=True)
    models = Volume.objects.create(
        name="models", source="/mnt/models", all_tenants=True, read_only=True
    )
    vision_only = Volume.objects.create(name="vision-only", source="/mnt/vision")
    vision_only.tenants.add(vision)
    nlp_private = Volume.objects.create(name="nlp-private", source="/mnt/nlp")
    nlp_private.tenants.add(nlp)
    ckpt = Volume.objects.create(
        name="ckpt", source="/srv/ckpt", checkpoints=True, all_tenants=True
    )
    return {v.name: v for v in (datasets, models, vision_only, nlp_private, ckpt)}


@pytest.fixture
def member(alice, make_node):
    make_node("gpu-a", gpus=2)
    client = APIClient()
    client.force_authenticate(alice)
    return client
