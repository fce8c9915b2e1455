"""Who may open which page: the same isolation rules as the API, for every page of the UI."""

import re

import pytest
from django.urls import reverse

pytestmark = pytest.mark.django_db


@pytest.fixture
def objects(vision, running_job, node, pool, cluster_admin):
    """One of everything a page can be about, so every URL below can be built."""
    from controlplane.tenancy.models import ApiToken, Budget, Membership, Quota

    quota = Quota.objects.get(tenant=vision)
    budget = Budget.objects.create(tenant=vision, kind="gpu_hours", period="month", amount=100)
    token, _ = ApiToken.issue(running_job.submitted_by, "laptop")
    membership = Membership.objects.get(tenant=vision, user=running_job.submitted_by)
    from controlplane.storage import actions as storage_actions

    storage_actions.create_volume(
        actor=cluster_admin, name="datasets", source="/mnt/datasets", tenants=[vision]
    )
    from controlplane.jobs import arrays

    sweep = arrays.submit_array(
        tenant=vision,
        user=running_job.submitted_by,
        fields={"name": "sweep", "image": "registry.local/t/s:1", "command": ["true"], "env": {}},
        spec="2",
        indexes=[0, 1],
        max_parallel=None,
    ).array
    return {
        "array": sweep.pk,
        "volume": "datasets",
        "job": running_job.pk,
        "tenant": vision.slug,
        "node": node.name,
        "quota": quota.pk,
        "budget": budget.pk,
        "token": token.pk,
        "membership": membership.pk,
    }


# (url name, kwargs from `objects`, HTTP method)
EVERY_PAGE = [
    ("home", {}, "get"),
    ("tenant-dashboard", {"slug": "tenant"}, "get"),
    ("tenant-members", {"slug": "tenant"}, "get"),
    ("membership-change", {"pk": "membership"}, "post"),
    ("job-list", {}, "get"),
    ("job-submit", {}, "get"),
    ("job-submit-preview", {}, "post"),
    ("job-detail", {"pk": "job"}, "get"),
    ("job-live", {"pk": "job"}, "get"),
    ("job-log", {"pk": "job"}, "get"),
    ("job-output", {"pk": "job"}, "get"),
    ("job-cancel", {"pk": "job"}, "get"),
    ("job-cancel", {"pk": "job"}, "post"),
    ("array-list", {}, "get"),
    ("array-detail", {"pk": "array"}, "get"),
    ("array-cancel", {"pk": "array"}, "get"),
    ("array-cancel", {"pk": "array"}, "post"),
    ("tokens", {}, "get"),
    ("token-revoke", {"pk": "token"}, "post"),
    ("cluster-overview", {}, "get"),
    ("node-list", {}, "get"),
    ("node-detail", {"name": "node"}, "get"),
    ("node-action", {"name": "node", "verb": "cordon"}, "post"),
    ("manage-tenants", {}, "get"),
    ("manage-tenant-create", {}, "get"),
    ("manage-tenant", {"slug": "tenant"}, "get"),
    ("manage-quota-create", {"slug": "tenant"}, "get"),
    ("manage-quota", {"pk": "quota"}, "get"),
    ("manage-quota-delete", {"pk": "quota"}, "get"),
    ("manage-budget-create", {"slug": "tenant"}, "get"),
    ("manage-budget", {"pk": "budget"}, "get"),
    ("manage-budget-delete", {"pk": "budget"}, "get"),
    ("manage-pools", {}, "get"),
    ("manage-volumes", {}, "get"),
    ("manage-volume-create", {}, "get"),
    ("manage-volume", {"name": "volume"}, "get"),
    ("manage-volume-delete", {"name": "volume"}, "get"),
    ("my-volumes", {}, "get"),
]

CLUSTER_ADMIN_ONLY = [
    ("cluster-overview", {}, "get"),
    ("node-list", {}, "get"),
    ("node-detail", {"name": "node"}, "get"),
    ("node-action", {"name": "node", "verb": "drain"}, "post"),
    ("manage-tenants", {}, "get"),
    ("manage-tenant-create", {}, "get"),
    ("manage-tenant-create", {}, "post"),
    ("manage-tenant", {"slug": "tenant"}, "get"),
    ("manage-tenant", {"slug": "tenant"}, "post"),
    ("manage-quota-create", {"slug": "tenant"}, "get"),
    ("manage-quota", {"pk": "quota"}, "get"),
    ("manage-quota", {"pk": "quota"}, "post"),
    ("manage-quota-delete", {"pk": "quota"}, "post"),
    ("manage-budget-create", {"slug": "tenant"}, "get"),
    ("manage-budget", {"pk": "budget"}, "get"),
    ("manage-budget-delete", {"pk": "budget"}, "post"),
    ("manage-pools", {}, "get"),
    ("manage-pools", {}, "post"),
    ("manage-volumes", {}, "get"),
    ("manage-volume-create", {}, "get"),
    ("manage-volume-create", {}, "post"),
    ("manage-volume", {"name": "volume"}, "get"),
    ("manage-volume", {"name": "volume"}, "post"),
    ("manage-volume-delete", {"name": "volume"}, "get"),
    ("manage-volume-delete", {"name": "volume"}, "post"),
]


def url_for(name, kwargs, objects):
    return reverse(name, kwargs={k: objects.get(v, v) for k, v in kwargs.items()})


@pytest.mark.parametrize("name,kwargs,method", EVERY_PAGE)
def test_anonymous_visitors_are_sent_to_sign_in(client, objects, name, kwargs, method):
    url = url_for(name, kwargs, objects)
    response = getattr(client, method)(url)
    assert response.status_code == 302
    assert response["Location"].startswith("/login/?next=")


@pytest.mark.parametrize("name,kwargs,method", CLUSTER_ADMIN_ONLY)
def test_cluster_admin_pages_refuse_members_and_tenant_admins(
    client, objects, alice, vision_admin, name, kwargs, method
):
    from controlplane.cluster.models import Node
    from controlplane.tenancy.models import Quota

    url = url_for(name, kwargs, objects)
    before = (list(Quota.objects.values()), list(Node.objects.values("state")))
    for user in (alice, vision_admin):
        client.force_login(user)
        response = getattr(client, method)(url)
        assert response.status_code == 403, (user.username, url)
    assert (list(Quota.objects.values()), list(Node.objects.values("state"))) == before


@pytest.mark.parametrize("name,kwargs,method", [p for p in CLUSTER_ADMIN_ONLY if p[2] == "get"])
def test_cluster_admin_pages_open_for_cluster_admins(
    client, objects, cluster_admin, name, kwargs, method
):
    client.force_login(cluster_admin)
    assert client.get(url_for(name, kwargs, objects)).status_code == 200


TENANT_OBJECT_PAGES = [
    ("tenant-dashboard", {"slug": "tenant"}, "get"),
    ("tenant-members", {"slug": "tenant"}, "get"),
    ("membership-change", {"pk": "membership"}, "post"),
    ("job-detail", {"pk": "job"}, "get"),
    ("job-live", {"pk": "job"}, "get"),
    ("job-log", {"pk": "job"}, "get"),
    ("job-output", {"pk": "job"}, "get"),
    ("job-cancel", {"pk": "job"}, "get"),
    ("job-cancel", {"pk": "job"}, "post"),
    ("array-detail", {"pk": "array"}, "get"),
    ("array-cancel", {"pk": "array"}, "get"),
    ("array-cancel", {"pk": "array"}, "post"),
    ("token-revoke", {"pk": "token"}, "post"),
]


@pytest.mark.parametrize("name,kwargs,method", TENANT_OBJECT_PAGES)
def test_another_tenants_objects_are_not_found(client, objects, bob, name, kwargs, method):
    from controlplane.jobs.models import Job
    from controlplane.tenancy.models import ApiToken, Membership

    client.force_login(bob)
    response = getattr(client, method)(url_for(name, kwargs, objects), {"remove": "1"})
    assert response.status_code == 404
    assert Job.objects.get(pk=objects["job"]).state == "RUNNING"
    assert not Job.objects.filter(array_id=objects["array"], state="CANCELLED").exists()
    assert ApiToken.objects.get(pk=objects["token"]).revoked_at is None
    assert Membership.objects.filter(pk=objects["membership"]).exists()


def test_a_job_id_of_another_tenant_reads_like_one_that_does_not_exist(client, objects, bob):
    client.force_login(bob)
    theirs = client.get(reverse("job-detail", args=[objects["job"]]))
    made_up = client.get(reverse("job-detail", args=[objects["job"] + 1000]))
    assert theirs.status_code == made_up.status_code == 404

    def without_csrf(response):
        # Each answer carries a fresh CSRF token (masked anew every time); nothing else differs.
        return re.sub(
            rb'("X-CSRFToken": "|name="csrfmiddlewaretoken" value=")[^"]+', b"", response.content
        )

    assert without_csrf(theirs) == without_csrf(made_up)


def test_a_tenants_membership_page_is_for_its_admins_only(
    client, objects, alice, vision_admin, vision_viewer
):
    url = reverse("tenant-members", args=["vision"])
    for user, status in ((vision_admin, 200), (alice, 403), (vision_viewer, 403)):
        client.force_login(user)
        assert client.get(url).status_code == status, user.username


def test_a_viewer_may_read_jobs_but_not_submit_or_cancel_them(client, running_job, vision_viewer):
    client.force_login(vision_viewer)
    assert client.get(reverse("job-detail", args=[running_job.pk])).status_code == 200
    assert client.get(reverse("job-submit")).status_code == 403
    assert client.post(reverse("job-cancel", args=[running_job.pk])).status_code == 403
    running_job.refresh_from_db()
    assert running_job.state == "RUNNING"


def test_a_member_cannot_cancel_a_colleagues_job_but_a_tenant_admin_can(
    client, running_job, make_user, vision, vision_admin
):
    from controlplane.tenancy.models import Membership

    colleague = make_user("carol")
    Membership.objects.create(user=colleague, tenant=vision, role="member")
    client.force_login(colleague)
    assert client.post(reverse("job-cancel", args=[running_job.pk])).status_code == 403
    running_job.refresh_from_db()
    assert running_job.state == "RUNNING"

    client.force_login(vision_admin)
    response = client.post(reverse("job-cancel", args=[running_job.pk]))
    assert response.status_code == 302
    running_job.refresh_from_db()
    assert running_job.state == "CANCELLED"


def test_the_job_list_shows_only_the_users_tenants(client, running_job, bob, nlp, make_job):
    theirs = make_job(nlp, bob, name="bobs-job")
    client.force_login(bob)
    body = client.get(reverse("job-list")).content.decode()
    assert "bobs-job" in body and f"/jobs/{theirs.pk}/" in body
    assert "resnet" not in body


def test_someone_in_no_tenant_is_told_what_to_do(client, make_user):
    client.force_login(make_user("newcomer"))
    response = client.get(reverse("home"))
    assert response.status_code == 200
    assert "not in a tenant yet" in response.content.decode()


def test_every_page_has_one_polite_live_region_for_updates(client, alice):
    client.force_login(alice)
    html = client.get(reverse("job-list")).content.decode()
    assert html.count('id="announce"') == 1
    assert 'id="announce" class="visually-hidden" role="status" aria-live="polite"' in html
    assert '<a class="skip-link" href="#main">' in html
