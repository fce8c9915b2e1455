"""What admins see and change: cluster overview, nodes, tenants, quotas, budgets, pools, members."""

import datetime as dt
import re

import pytest
from django.urls import reverse
from django.utils import timezone

from tests.frontend.test_researcher_pages import text_of

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin(client, cluster_admin):
    client.force_login(cluster_admin)
    return client


def error_at(response, field: str) -> str:
    match = re.search(
        rf'<ul class="errorlist" id="id_{field}_errors">(.*?)</ul>', response.content.decode(), re.S
    )
    return re.sub(r"<[^>]+>", " ", match.group(1)) if match else ""


# --- cluster overview and nodes ---------------------------------------------------------------


def test_the_overview_splits_each_tenants_gpus_into_guaranteed_and_borrowed(
    admin, running_job, pending_job, vision, alice, make_job, node
):
    from controlplane.jobs import actions

    lent = make_job(vision, alice, name="on-loan", gpus=1)
    actions.admit_job(lent, node=node, gpus=[node.gpus.get(index=3)], borrowed=True)
    response = admin.get(reverse("cluster-overview"))
    row = re.search(
        r'<th scope="row"><a href="/t/vision/">vision</a></th>(.*?)</tr>',
        response.content.decode(),
        re.S,
    )
    cells = re.findall(r'<td class="num">(?:<a [^>]+>)?(\d+)', row.group(1))
    # within guarantee, borrowed, guaranteed quota, pending jobs, pending GPUs
    assert cells == ["2", "1", "8", "1", "2"]
    # The caption gives the tenant's limit (its quota: 16), not the bars' shared scale.
    caption = re.search(r'<div class="bar-caption">(.*?)</div>', row.group(1), re.S).group(1)
    assert "3 in use (1 borrowed) · guaranteed 8 · limit 16" in caption
    assert "a job larger than that is borrowed as a whole" in response.content.decode()


def test_the_overview_draws_pool_power_against_its_budget(admin, running_job, pool):
    pool.power_budget_w = 1500.0
    pool.save()
    response = admin.get(reverse("cluster-overview"))
    html = response.content.decode()
    assert "Pool default: power draw" in html
    assert 'class="threshold"' in html and "pool budget: 1500 W" in html
    # Two GPUs of 450..495 W each: the summed line, not each GPU.
    assert "draw (sum of GPUs) latest 990 W" in html
    assert "sum of caps" not in html


def test_the_pools_worst_case_counts_busy_gpus_at_their_caps_and_idle_ones_at_their_draw(
    admin, running_job, pool
):
    from controlplane.cluster.models import GPU

    # running_job holds two GPUs of its node; the other GPUs of the pool are idle.
    node_gpus = GPU.objects.filter(node__pool=pool)
    node_gpus.update(power_cap_w=200.0, power_draw_w=70.0)
    held = GPU.objects.filter(allocations__active=True)
    held.update(power_cap_w=600.0, power_draw_w=480.0)
    idle = node_gpus.count() - held.count()
    expected_w = 600.0 * held.count() + 70.0 * idle
    page = text_of(admin.get(reverse("cluster-overview")))
    assert f"If every job drew its cap {expected_w:,.0f} W" in page
    assert "Caps sum" not in page


def test_the_overview_says_what_the_last_scheduling_cycle_did(admin):
    from controlplane.scheduling.models import SchedulingCycle

    earlier = timezone.now() - dt.timedelta(minutes=1)
    SchedulingCycle.objects.create(started_at=earlier, duration_ms=3.0, starts=9, pending=0)
    SchedulingCycle.objects.create(duration_ms=12.5, starts=3, preemptions=1, pending=7)
    page = text_of(admin.get(reverse("cluster-overview")))
    assert "took 12.5 ms, on the regular tick: 3 starts, 1 preemption, 7 left pending." in page
    # One line for the last cycle, not a row per cycle.
    assert "took 3.0 ms" not in page


def test_an_empty_cluster_overview_says_what_is_missing(admin):
    page = text_of(admin.get(reverse("cluster-overview")))
    assert "No scheduling cycle has run yet." in page
    assert "No tenants yet." in page


def test_a_nodes_page_shows_each_gpu_with_its_job_power_and_temperature(admin, running_job):
    # The list has a row per node; the node's own page has a row per GPU.
    page = text_of(admin.get(reverse("node-detail", args=["gpu-node-01"])))
    assert "gpu-node-01 ready" in page
    assert "64 480 / 600 resnet #" in page.replace(" 93 ", " ")
    assert "free" in page


@pytest.mark.parametrize(
    "verb,state", [("cordon", "cordoned"), ("drain", "draining"), ("uncordon", "ready")]
)
def test_cordon_drain_and_uncordon_change_what_the_scheduler_may_do(admin, node, verb, state):
    from controlplane.cluster.models import Node

    if verb == "uncordon":
        Node.objects.filter(pk=node.pk).update(state="cordoned")
    response = admin.post(reverse("node-action", args=[node.name, verb]), follow=True)
    assert Node.objects.get(pk=node.pk).state == state
    assert f"Node {node.name} is" in text_of(response)


def test_a_drain_asks_first_and_names_the_jobs_it_will_preempt(
    admin, node, vision, alice, make_job
):
    from controlplane.cluster.models import Node
    from controlplane.jobs import actions

    lent = make_job(vision, alice, name="on-loan", gpus=1)
    actions.admit_job(lent, node=node, gpus=[node.gpus.get(index=0)], borrowed=True)
    owned = make_job(vision, alice, name="guaranteed", gpus=1)
    actions.admit_job(owned, node=node, gpus=[node.gpus.get(index=1)], borrowed=False)
    url = reverse("node-action", args=[node.name, "drain"])

    # One click on "Drain…" only asks, naming what the drain would preempt and what it keeps.
    question = admin.get(url, {"next": "/cluster/nodes/"})
    assert question.status_code == 200
    assert Node.objects.get(pk=node.pk).state == "ready"
    html = question.content.decode()
    preempted = re.search(r'<ul id="drain-preempted">(.*?)</ul>', html, re.S).group(1)
    kept = re.search(r'<ul id="drain-kept">(.*?)</ul>', html, re.S).group(1)
    assert "on-loan" in preempted and "guaranteed" not in preempted
    assert "guaranteed" in kept
    assert 'name="next" value="/cluster/nodes/"' in html

    # The answer "yes" drains it and goes back where the admin came from.
    done = admin.post(url, {"next": "/cluster/nodes/"})
    assert done["Location"] == "/cluster/nodes/"
    assert Node.objects.get(pk=node.pk).state == "draining"


@pytest.mark.parametrize("verb", ["cordon", "uncordon"])
def test_only_a_drain_has_a_question_page(admin, node, verb):
    from controlplane.cluster.models import Node

    assert admin.get(reverse("node-action", args=[node.name, verb])).status_code == 405
    assert Node.objects.get(pk=node.pk).state == "ready"


@pytest.mark.parametrize(
    "state,offered",
    [
        ("ready", ["Cordon", "Drain…"]),
        ("cordoned", ["Drain…", "Uncordon"]),
        ("draining", ["Uncordon"]),
    ],
)
def test_a_node_offers_only_the_changes_its_state_allows(admin, node, state, offered):
    from controlplane.cluster.models import Node

    Node.objects.filter(pk=node.pk).update(state=state)
    for url in (reverse("node-detail", args=[node.name]), reverse("node-list")):
        html = admin.get(url).content.decode()
        actions = re.search(r'<div class="actions">(.*?)</div>', html, re.S).group(1)
        buttons = re.findall(r">(Cordon|Drain…|Uncordon)</(?:button|a)>", actions)
        assert buttons == offered, url


def test_a_node_action_never_redirects_off_site(admin, node):
    response = admin.post(
        reverse("node-action", args=[node.name, "cordon"]), {"next": "https://evil.example/"}
    )
    assert response["Location"] == reverse("node-detail", args=[node.name])


def test_an_unknown_node_action_is_not_found(admin, node):
    assert admin.post(reverse("node-action", args=[node.name, "reboot"])).status_code == 404


def test_a_down_node_is_shown_down_whatever_its_admin_state(admin, node):
    from controlplane.cluster.models import Node

    Node.objects.filter(pk=node.pk).update(ready=False, state="cordoned")
    page = text_of(admin.get(reverse("node-detail", args=[node.name])))
    assert "gpu-node-01 down" in page
    assert "the node is not answering" in page


# --- tenants, quotas, budgets ---------------------------------------------------------------


def test_a_quota_with_a_limit_below_its_guarantee_is_refused_at_the_limit_field(admin, vision):
    from controlplane.tenancy.models import Quota

    quota = Quota.objects.get(tenant=vision)
    response = admin.post(
        reverse("manage-quota", args=[quota.pk]),
        {"guaranteed_gpus": "20", "limit_gpus": "10", "max_running_jobs": ""},
    )
    assert response.status_code == 400
    assert "Must be at least guaranteed_gpus (20)" in error_at(response, "limit_gpus")
    quota.refresh_from_db()
    assert (quota.guaranteed_gpus, quota.limit_gpus) == (8, 16)


def test_a_changed_quota_shows_on_the_tenants_dashboard(admin, vision, alice, client):
    from controlplane.tenancy.models import Quota

    quota = Quota.objects.get(tenant=vision)
    response = admin.post(
        reverse("manage-quota", args=[quota.pk]),
        {"guaranteed_gpus": "4", "limit_gpus": "6", "max_running_jobs": "3"},
    )
    assert response["Location"] == reverse("manage-tenant", args=["vision"])
    client.force_login(alice)
    page = text_of(client.get(reverse("tenant-dashboard", args=["vision"])))
    assert "0 in use · guaranteed 4 · limit 6" in page
    assert "max 3 running jobs" in page


def test_a_second_quota_for_the_same_type_is_refused(admin, vision):
    from controlplane.tenancy.models import Quota

    response = admin.post(
        reverse("manage-quota-create", args=["vision"]),
        {"gpu_type": "H100-SXM-80GB", "guaranteed_gpus": "1", "limit_gpus": "2"},
    )
    assert response.status_code == 400
    assert "already has a quota for H100-SXM-80GB" in error_at(response, "gpu_type")
    assert Quota.objects.filter(tenant=vision).count() == 1


def test_a_new_any_type_quota_is_added(admin, vision):
    from controlplane.tenancy.models import Quota

    admin.post(
        reverse("manage-quota-create", args=["vision"]),
        {"gpu_type": "", "guaranteed_gpus": "0", "limit_gpus": "20", "max_running_jobs": ""},
    )
    quota = Quota.objects.get(tenant=vision, gpu_type="")
    assert (quota.limit_gpus, quota.max_running_jobs) == (20, None)


def test_a_quotas_type_is_fixed_once_created(admin, vision):
    from controlplane.tenancy.models import Quota

    quota = Quota.objects.get(tenant=vision)
    admin.post(
        reverse("manage-quota", args=[quota.pk]),
        {"gpu_type": "A100-SXM4-80GB", "guaranteed_gpus": "8", "limit_gpus": "16"},
    )
    quota.refresh_from_db()
    assert quota.gpu_type == "H100-SXM-80GB"


def test_deleting_a_quota_asks_first(admin, vision):
    from controlplane.tenancy.models import Quota

    quota = Quota.objects.get(tenant=vision)
    assert "This cannot be undone" in text_of(
        admin.get(reverse("manage-quota-delete", args=[quota.pk]))
    )
    assert Quota.objects.filter(pk=quota.pk).exists()
    admin.post(reverse("manage-quota-delete", args=[quota.pk]))
    assert not Quota.objects.filter(pk=quota.pk).exists()


def test_budgets_are_validated_like_the_api_does(admin, vision):
    from controlplane.tenancy.models import Budget

    bad = admin.post(
        reverse("manage-budget-create", args=["vision"]),
        {
            "kind": "energy_kwh",
            "period": "month",
            "amount": "-3",
            "action": "throttle",
            "warn_at_fraction": "1.5",
        },
    )
    assert bad.status_code == 400
    assert "Must be a number more than 0." in error_at(bad, "amount")
    assert "at most 1" in error_at(bad, "warn_at_fraction")
    assert Budget.objects.count() == 0

    good = admin.post(
        reverse("manage-budget-create", args=["vision"]),
        {
            "kind": "energy_kwh",
            "period": "week",
            "amount": "250",
            "action": "hold",
            "warn_at_fraction": "0.9",
        },
    )
    assert good.status_code == 302
    budget = Budget.objects.get()
    assert (budget.kind, budget.period, budget.amount, budget.action) == (
        "energy_kwh",
        "week",
        250.0,
        "hold",
    )

    again = admin.post(
        reverse("manage-budget-create", args=["vision"]),
        {
            "kind": "energy_kwh",
            "period": "day",
            "amount": "5",
            "action": "hold",
            "warn_at_fraction": "0.9",
        },
    )
    assert "already has a energy_kwh budget" in error_at(again, "kind")


def test_a_budget_is_edited_and_the_tenant_page_shows_its_use(admin, vision, running_job):
    from controlplane.tenancy.models import Budget

    budget = Budget.objects.create(tenant=vision, kind="gpu_hours", period="month", amount=10)
    admin.post(
        reverse("manage-budget", args=[budget.pk]),
        {"period": "month", "amount": "2", "action": "no_borrowing", "warn_at_fraction": "0.5"},
    )
    budget.refresh_from_db()
    assert (budget.amount, budget.action) == (2.0, "no_borrowing")
    page = text_of(admin.get(reverse("manage-tenant", args=["vision"])))
    assert "0.33 (17%)" in page


def test_a_tenant_is_created_and_then_edited(admin):
    from controlplane.tenancy.models import Tenant

    response = admin.post(
        reverse("manage-tenant-create"),
        {"slug": "robotics", "name": "Robotics lab", "weight": "2", "active": "on"},
    )
    assert response["Location"] == reverse("manage-tenant", args=["robotics"])
    admin.post(
        reverse("manage-tenant", args=["robotics"]),
        {"slug": "robotics", "name": "Robotics", "weight": "3"},
    )
    tenant = Tenant.objects.get(slug="robotics")
    assert (tenant.name, tenant.weight, tenant.active) == ("Robotics", 3.0, False)


def test_a_tenant_weight_must_be_positive(admin, vision):
    response = admin.post(
        reverse("manage-tenant", args=["vision"]),
        {"slug": "vision", "name": "Vision lab", "weight": "0", "active": "on"},
    )
    assert response.status_code == 400
    assert "more than 0" in error_at(response, "weight")


def test_the_tenants_page_lists_quotas_budgets_and_members(admin, vision, alice, nlp):
    page = text_of(admin.get(reverse("manage-tenants")))
    assert "vision Vision lab" in page and "nlp NLP lab" in page
    assert "H100-SXM-80GB: 8 / 16" in page


def test_a_pool_power_budget_is_set_validated_and_cleared(admin, pool, node):
    from controlplane.cluster.models import Pool

    field = f"pool{pool.pk}-power_budget_w"
    bad = admin.post(reverse("manage-pools"), {"pool": pool.pk, field: "-5"})
    assert bad.status_code == 400
    assert "Must be more than 0 W" in bad.content.decode()
    assert Pool.objects.get().power_budget_w is None

    admin.post(reverse("manage-pools"), {"pool": pool.pk, field: "12000"})
    assert Pool.objects.get().power_budget_w == 12000.0
    admin.post(reverse("manage-pools"), {"pool": pool.pk, field: ""})
    assert Pool.objects.get().power_budget_w is None


# --- members ---------------------------------------------------------------------------------


def test_a_tenant_admin_invites_a_member_who_accepts_and_then_changes_their_role(
    client, vision_admin, alice, make_user
):
    from controlplane.tenancy.models import Invitation, Membership

    dave = make_user("dave")
    client.force_login(vision_admin)
    response = client.post(
        reverse("tenant-members", args=["vision"]), {"invitee": "dave", "role": "viewer"}
    )
    assert response.status_code == 302
    assert not Membership.objects.filter(user=dave).exists()  # not until dave accepts
    invitation = Invitation.objects.get(invitee="dave")
    assert "dave" in text_of(client.get(reverse("tenant-members", args=["vision"])))

    client.force_login(dave)
    assert "vision" in text_of(client.get(reverse("my-invitations")))
    accepted = client.post(reverse("invitation-answer", args=[invitation.pk, "accept"]))
    assert accepted["Location"] == reverse("tenant-dashboard", args=["vision"])
    membership = Membership.objects.get(user=dave)
    assert (membership.tenant.slug, membership.role) == ("vision", "viewer")

    client.force_login(vision_admin)
    client.post(reverse("membership-change", args=[membership.pk]), {"role": "member"})
    membership.refresh_from_db()
    assert membership.role == "member"


def test_inviting_tells_a_tenant_admin_nothing_about_who_has_an_account(
    client, vision_admin, bob, make_user
):
    from controlplane.tenancy.models import Membership

    make_user("loner")
    client.force_login(vision_admin)
    answers = []
    for invitee in ("bob", "loner", "nobody-at-all"):
        posted = client.post(
            reverse("tenant-members", args=["vision"]), {"invitee": invitee, "role": "member"}
        )
        shown = client.get(posted["Location"]).content.decode()
        said = re.search(r'<ul class="messages".*?</ul>', shown, re.S).group(0)
        answers.append((posted.status_code, posted["Location"], said.replace(invitee, "X")))
    assert answers[0] == answers[1] == answers[2]
    assert "X is invited as member of vision; they join when they accept." in answers[0][2]
    assert Membership.objects.filter(tenant__slug="vision").count() == 1


def test_a_cluster_admin_adds_directly_and_twice_or_a_stranger_is_refused_at_the_username(
    admin, vision_admin, alice
):
    from controlplane.tenancy.models import Membership

    twice = admin.post(
        reverse("tenant-members", args=["vision"]), {"user": "alice", "role": "member"}
    )
    assert "alice is already a member of vision." in error_at(twice, "user")
    stranger = admin.post(
        reverse("tenant-members", args=["vision"]), {"user": "nobody", "role": "member"}
    )
    assert stranger.status_code == 400
    assert error_at(stranger, "user")
    assert Membership.objects.filter(tenant__slug="vision").count() == 2


def test_a_tenant_admin_cannot_remove_the_last_admin(client, vision_admin):
    from controlplane.tenancy.models import Membership

    client.force_login(vision_admin)
    mine = Membership.objects.get(user=vision_admin)
    response = client.post(
        reverse("membership-change", args=[mine.pk]), {"remove": "1"}, follow=True
    )
    assert "last tenant admin of vision" in text_of(response)
    demote = client.post(
        reverse("membership-change", args=[mine.pk]), {"role": "member"}, follow=True
    )
    assert "last tenant admin of vision" in text_of(demote)
    mine.refresh_from_db()
    assert mine.role == "admin"


def test_a_tenant_admin_removes_a_member(client, vision_admin, alice):
    from controlplane.tenancy.models import Membership

    client.force_login(vision_admin)
    membership = Membership.objects.get(user=alice)
    client.post(reverse("membership-change", args=[membership.pk]), {"remove": "1"})
    assert not Membership.objects.filter(pk=membership.pk).exists()


def test_a_tenant_admin_cannot_touch_another_tenants_members(client, vision_admin, bob):
    from controlplane.tenancy.models import Membership

    client.force_login(vision_admin)
    theirs = Membership.objects.get(user=bob)
    assert client.get(reverse("tenant-members", args=["nlp"])).status_code == 404
    assert (
        client.post(reverse("membership-change", args=[theirs.pk]), {"remove": "1"}).status_code
        == 404
    )
    assert Membership.objects.filter(pk=theirs.pk).exists()


def test_the_job_page_links_an_admin_to_the_node(admin, running_job):
    html = admin.get(reverse("job-detail", args=[running_job.pk])).content.decode()
    assert f'href="{reverse("node-detail", args=["gpu-node-01"])}"' in html


def test_pool_power_history_sums_gpus_per_bucket(running_job, pool):
    from controlplane import queries

    [power] = queries.pool_power(window=dt.timedelta(hours=1), now=timezone.now())
    assert power.gpus == 4
    assert power.draw_now_w == 960.0  # two GPUs report 480 W; two report nothing
    assert [round(v) for _, v in power.draw_w][:3] == [900, 910, 920]


def test_the_overview_counts_each_allocated_gpu_once_however_many_jobs_it_held(
    admin, vision, alice, make_job, node
):
    from controlplane.jobs import actions

    gpu = node.gpus.get(index=0)
    for name in ("first", "second"):
        job = make_job(vision, alice, name=name, gpus=1)
        attempt = actions.admit_job(job, node=node, gpus=[gpu], borrowed=False)
        if name == "first":
            actions.finish_attempt(attempt, exit_code=0)
    page = text_of(admin.get(reverse("cluster-overview")))
    assert "1 / 4 GPUs allocated" in page
