"""The Django admin ops use: every page opens, and its actions go through the same code paths."""

from datetime import timedelta

import pytest
from django.contrib import admin
from django.contrib.messages import get_messages
from django.urls import reverse
from django.utils import timezone

from controlplane.cluster.models import JoinToken, NodeState
from controlplane.jobs.models import JobEvent, JobState
from controlplane.tenancy.models import hash_token

OUR_APPS = ("tenancy", "jobs", "cluster", "audit", "storage")
OUR_MODELS = [m for m in admin.site._registry if m._meta.app_label in OUR_APPS]


@pytest.fixture
def ops(client, world):
    world.ensure("vision_job", "join_token", "alice_token", "vision_budget", "vision_volume")
    client.force_login(world.users["cluster_admin"])
    return client


@pytest.mark.parametrize("model", OUR_MODELS, ids=lambda m: m._meta.label)
def test_every_admin_page_of_ours_opens(ops, model):
    opts = model._meta
    changelist = ops.get(reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist"))
    assert changelist.status_code == 200
    obj = model.objects.first()
    if obj is not None:
        change = ops.get(reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[obj.pk]))
        assert change.status_code == 200


def test_the_admin_covers_the_models_ops_need():
    labels = {m._meta.label for m in OUR_MODELS}
    assert {
        "tenancy.Tenant",
        "tenancy.Membership",
        "tenancy.Quota",
        "tenancy.Budget",
        "tenancy.ApiToken",
        "jobs.Job",
        "jobs.JobAttempt",
        "cluster.Pool",
        "cluster.Node",
        "cluster.GPU",
        "cluster.JoinToken",
        "storage.Volume",
    } <= labels


def test_a_join_token_added_in_the_admin_is_shown_once_and_stored_hashed(ops, world):
    expires = timezone.now() + timedelta(hours=2)
    response = ops.post(
        reverse("admin:cluster_jointoken_add"),
        {
            "pool": world.pool.pk,
            "expires_at_0": expires.strftime("%Y-%m-%d"),
            "expires_at_1": expires.strftime("%H:%M:%S"),
            "max_uses": 2,
        },
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    [message] = [str(m) for m in get_messages(response.wsgi_request) if "gcpj_" in str(m)]
    raw = message.rsplit(" ", 1)[-1]
    token = JoinToken.objects.get(token_hash=hash_token(raw))
    assert token.created_by == world.users["cluster_admin"] and token.max_uses == 2


def test_cancelling_from_the_admin_goes_through_the_job_actions(ops, world):
    job = world.vision_job
    response = ops.post(
        reverse("admin:jobs_job_changelist"),
        {"action": "cancel", "_selected_action": [job.pk]},
    )
    assert response.status_code == 302
    job.refresh_from_db()
    assert job.state == JobState.CANCELLED
    event = JobEvent.objects.filter(job=job).last()
    assert (event.kind, event.actor) == ("cancelled", world.users["cluster_admin"])


def test_draining_from_the_admin_sets_the_nodes_state(ops, world):
    response = ops.post(
        reverse("admin:cluster_node_changelist"),
        {"action": "set_draining", "_selected_action": [world.node.pk]},
    )
    assert response.status_code == 302
    world.node.refresh_from_db()
    assert world.node.state == NodeState.DRAINING


def test_a_nodes_admin_page_shows_no_secret_and_lets_no_one_edit_its_registration(ops, world):
    from controlplane.cluster.models import Node

    node = Node.objects.first()  # the world's node, which its job runs on
    Node.objects.filter(pk=node.pk).update(
        token_hash="a" * 64, registration_key_hash="b" * 64, registration_try=3
    )
    page = ops.get(reverse("admin:cluster_node_change", args=[node.pk])).content.decode()
    assert "a" * 64 not in page and "b" * 64 not in page
    for field in ("registration_try", "registration_join_token", "registered_at"):
        assert f'name="{field}"' not in page  # shown, not a form field
