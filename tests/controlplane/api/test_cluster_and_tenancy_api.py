"""What the cluster and tenancy endpoints show, and what node actions do."""

import pytest

from controlplane.jobs import actions
from controlplane.tenancy.models import Quota
from tests.controlplane.api.helpers import results


def admit(world, job, gpus, borrowed, node=None):
    node = node or world.node
    free = [g for g in node.gpus.order_by("index") if not g.allocations.filter(active=True)]
    attempt = actions.admit_job(job, node=node, gpus=free[:gpus], borrowed=borrowed)
    actions.mark_attempt_running(attempt)
    return attempt


def test_cordon_drain_and_uncordon_set_the_nodes_admin_state(world):
    client = world.client("cluster_admin")
    url = f"/api/v1/nodes/{world.node.name}"
    for verb, state in (("cordon", "cordoned"), ("drain", "draining"), ("uncordon", "ready")):
        response = client.post(f"{url}/{verb}/")
        assert response.status_code == 200, response.content
        assert response.json()["state"] == state and response.json()["status"] == state
        world.node.refresh_from_db()
        assert world.node.state == state


def test_a_node_that_stopped_answering_shows_as_down_whatever_its_admin_state(world):
    world.node.ready = False
    world.node.save(update_fields=["ready"])
    body = world.client("member").get(f"/api/v1/nodes/{world.node.name}/").json()
    assert (body["status"], body["state"], body["ready"]) == ("down", "ready", False)


def test_a_node_summary_counts_its_free_and_allocated_gpus(world):
    admit(world, world.vision_job, gpus=1, borrowed=False)
    world.node.gpus.filter(index=1).update(power_draw_w=300.0)
    body = world.client("member").get(f"/api/v1/nodes/{world.node.name}/").json()
    assert (body["gpus_total"], body["gpus_allocated"], body["gpus_free"]) == (2, 1, 1)
    assert body["gpu_models"] == {"H100-SXM-80GB": 2}
    assert body["power_draw_w"] == 300.0
    assert "token_hash" not in body


def test_gpus_show_whether_they_are_held_but_not_by_whom(world):
    admit(world, world.vision_job, gpus=1, borrowed=False)
    gpus = results(world.client("other_tenant").get(f"/api/v1/gpus/?node={world.node.name}"))
    assert [(g["index"], g["allocated"]) for g in gpus] == [(0, True), (1, False)]
    assert not {"job", "tenant", "attempt"} & set(gpus[0])


def test_pools_show_their_budget_and_what_their_gpus_may_draw(world):
    world.pool.power_budget_w = 1000.0
    world.pool.save(update_fields=["power_budget_w"])
    body = world.client("viewer").get(f"/api/v1/pools/{world.pool.name}/").json()
    assert (body["power_budget_w"], body["nodes"], body["gpus"], body["power_max_w"]) == (
        1000.0,
        1,
        2,
        1400.0,
    )


def test_nodes_filter_by_gpu_model_and_state(world):
    world.fixture("make_node")("a100-node", gpus=1, model="A100-SXM4-80GB")
    client = world.client("member")
    names = [n["name"] for n in results(client.get("/api/v1/nodes/?gpu_model=A100-SXM4-80GB"))]
    assert names == ["a100-node"]
    client = world.client("cluster_admin")
    client.post("/api/v1/nodes/a100-node/cordon/")
    assert [n["name"] for n in results(client.get("/api/v1/nodes/?state=cordoned"))] == [
        "a100-node"
    ]


def test_quotas_show_gpus_held_within_the_guarantee_and_borrowed(world):
    make_job = world.fixture("make_job")
    world.ensure("node", "users")
    big = world.fixture("make_node")("gpu-b.example", gpus=4)
    admit(world, make_job(world.vision, world.alice, gpus=2), gpus=2, borrowed=False)
    admit(world, make_job(world.vision, world.alice, gpus=3), gpus=3, borrowed=True, node=big)
    make_job(world.vision, world.alice)  # pending: holds nothing
    admit(world, make_job(world.nlp, world.bob), gpus=1, borrowed=False, node=big)
    Quota.objects.create(tenant=world.vision, gpu_type="", guaranteed_gpus=0, limit_gpus=32)

    quotas = {
        q["gpu_type"]: q["usage"]
        for q in results(world.client("member").get("/api/v1/quotas/?tenant=vision"))
    }
    expected = {"gpus_in_use": 5, "gpus_guaranteed": 2, "gpus_borrowed": 3, "running_jobs": 2}
    assert quotas == {"H100-SXM-80GB": expected, "": expected}
    nlp = results(world.client("other_tenant").get("/api/v1/quotas/"))
    assert [q["usage"]["gpus_in_use"] for q in nlp] == [1]


def test_a_finished_job_no_longer_counts_against_its_quota(world):
    attempt = admit(world, world.vision_job, gpus=2, borrowed=False)
    actions.finish_attempt(attempt, exit_code=0)
    body = world.client("member").get(f"/api/v1/quotas/{world.vision_quota.pk}/").json()
    assert body["usage"] == {
        "gpus_in_use": 0,
        "gpus_guaranteed": 0,
        "gpus_borrowed": 0,
        "running_jobs": 0,
    }


def test_tenants_show_your_role_in_each(world):
    world.ensure("users")
    roles = {
        role: [
            (t["slug"], t["my_role"]) for t in results(world.client(role).get("/api/v1/tenants/"))
        ]
        for role in ("viewer", "tenant_admin", "cluster_admin")
    }
    assert roles["viewer"] == [("vision", "viewer")]
    assert roles["tenant_admin"] == [("vision", "admin")]
    assert roles["cluster_admin"] == [("nlp", None), ("vision", None)]


def test_a_tenant_admin_invites_a_member_who_accepts_and_then_sees_the_tenant(world):
    newcomer = world.fixture("make_user")("newcomer")
    invited = world.client("tenant_admin").post(
        "/api/v1/invitations/",
        {"tenant": "vision", "invitee": "newcomer", "role": "viewer"},
        format="json",
    )
    assert invited.status_code == 201, invited.content
    world.users["newcomer"] = newcomer
    accepted = world.client("newcomer").post(f"/api/v1/invitations/{invited.json()['id']}/accept/")
    assert accepted.status_code == 201, accepted.content
    slugs = [t["slug"] for t in results(world.client("newcomer").get("/api/v1/tenants/"))]
    assert slugs == ["vision"]


def test_a_budget_is_created_and_read_back_by_members(world):
    body = {
        "tenant": "vision",
        "kind": "gpu_hours",
        "period": "week",
        "amount": 250,
        "action": "no_borrowing",
        "warn_at_fraction": 0.9,
    }
    created = world.client("cluster_admin").post("/api/v1/budgets/", body, format="json")
    assert created.status_code == 201, created.content
    [seen] = results(world.client("viewer").get("/api/v1/budgets/"))
    assert {k: seen[k] for k in body} == {**body, "amount": 250.0}


def test_a_budget_shows_what_was_spent_this_period(world):
    from datetime import timedelta

    from django.utils import timezone

    from controlplane.tenancy.models import Budget

    world.ensure("users")
    gpu_hours = Budget.objects.create(
        tenant=world.vision, kind="gpu_hours", period="month", amount=10, action="hold"
    )
    world.ensure("vision_budget")  # 500 kWh a month
    job = world.vision_job
    attempt = actions.admit_job(
        job, node=world.node, gpus=list(world.node.gpus.all()), borrowed=False
    )
    actions.mark_attempt_running(attempt, started_at=timezone.now() - timedelta(hours=2))
    attempt.refresh_from_db()
    actions.finish_attempt(attempt, exit_code=0, energy_j=2 * 3.6e6)

    shown = {b["kind"]: b["usage"] for b in results(world.client("viewer").get("/api/v1/budgets/"))}
    assert shown["gpu_hours"]["used"] == pytest.approx(4.0, rel=1e-3)  # 2 GPUs for 2 hours
    assert shown["gpu_hours"]["fraction_used"] == pytest.approx(0.4, rel=1e-3)
    assert shown["energy_kwh"]["used"] == pytest.approx(2.0)
    assert not shown["energy_kwh"]["exhausted"]
    detail = world.client("member").get(f"/api/v1/budgets/{gpu_hours.pk}/").json()
    assert detail["usage"]["used"] == pytest.approx(4.0, rel=1e-3)
