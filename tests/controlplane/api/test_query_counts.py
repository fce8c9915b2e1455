"""List endpoints run a fixed number of queries, however many rows they show.

Each baseline is the count measured when it was set; a change that adds a query per row (a
missing select_related / prefetch) fails here, and so does one that adds a query per page.
"""

from datetime import timedelta
from itertools import count

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from controlplane.cluster.models import JoinToken
from controlplane.jobs import actions
from controlplane.jobs.dependencies import DependencySpec
from controlplane.tenancy.models import ApiToken, Budget, Membership, Quota, Tenant

serial = count()


def more_tenants(world, n):
    for _ in range(n):
        i = next(serial)
        tenant = Tenant.objects.create(slug=f"lab-{i}", name=f"Lab {i}")
        Membership.objects.create(user=world.alice, tenant=tenant, role="member")
        Quota.objects.create(tenant=tenant, gpu_type="", guaranteed_gpus=1, limit_gpus=2)
        Budget.objects.create(tenant=tenant, kind="energy_kwh", period="day", amount=10)
        Budget.objects.create(tenant=tenant, kind="gpu_hours", period="week", amount=10)


def more_members(world, n):
    for _ in range(n):
        user = world.fixture("make_user")(f"person-{next(serial)}")
        Membership.objects.create(user=user, tenant=world.vision, role="viewer")


def more_nodes(world, n):
    for _ in range(n):
        world.fixture("make_node")(f"node-{next(serial)}.example", gpus=2)


def more_pools(world, n):
    from controlplane.cluster.models import Pool

    for _ in range(n):
        Pool.objects.create(name=f"pool-{next(serial)}", power_budget_w=1000.0)


def more_jobs(world, n):
    make_job = world.fixture("make_job")
    for _ in range(n):
        node = world.fixture("make_node")(f"node-{next(serial)}.example", gpus=1)
        job = make_job(world.vision, world.alice)
        attempt = actions.admit_job(job, node=node, gpus=list(node.gpus.all()), borrowed=False)
        actions.mark_attempt_running(attempt)
        # and one left pending, waiting for it
        make_job(
            world.vision,
            world.users["tenant_admin"],
            depends_on=[DependencySpec("succeeded", job_id=job.pk)],
        )


def more_join_tokens(world, n):
    for _ in range(n):
        i = next(serial)
        JoinToken.objects.create(
            token_hash=f"{i:064d}",
            prefix=f"gcpj_{i}",
            pool=world.pool,
            created_by=world.users["cluster_admin"],
            expires_at=timezone.now() + timedelta(hours=1),
        )


def more_api_tokens(world, n):
    for _ in range(n):
        ApiToken.issue(world.alice, f"token-{next(serial)}")


# (url, how to add rows, role, queries at most) — the counts include the session's own
# lookups: none here, the tests authenticate without a session.
LISTS = [
    ("/api/v1/tenants/", more_tenants, "member", 2),
    ("/api/v1/tenants/", more_tenants, "cluster_admin", 2),
    ("/api/v1/memberships/", more_members, "viewer", 2),
    ("/api/v1/quotas/", more_tenants, "member", 4),
    ("/api/v1/quotas/", more_tenants, "cluster_admin", 4),
    ("/api/v1/budgets/", more_tenants, "member", 4),  # and one per distinct period
    ("/api/v1/pools/", more_pools, "member", 2),
    ("/api/v1/nodes/", more_nodes, "member", 3),
    ("/api/v1/gpus/", more_nodes, "member", 2),
    ("/api/v1/jobs/", more_jobs, "member", 3),  # and the page's depends_on, in one prefetch
    ("/api/v1/jobs/", more_jobs, "cluster_admin", 3),
    ("/api/v1/join-tokens/", more_join_tokens, "cluster_admin", 2),
    ("/api/v1/api-tokens/", more_api_tokens, "member", 2),
]


def queries_for(client, url) -> int:
    with CaptureQueriesContext(connection) as captured:
        response = client.get(url)
    assert response.status_code == 200, response.content
    return len(captured.captured_queries)


@pytest.mark.parametrize(
    ("url", "grow", "role", "baseline"), LISTS, ids=[f"{u}-{r}" for u, _, r, _ in LISTS]
)
def test_a_list_costs_the_same_queries_for_few_rows_and_many(
    world, django_assert_max_num_queries, url, grow, role, baseline
):
    world.ensure("users", "node")
    client = world.client(role)
    grow(world, 2)
    few = queries_for(client, url)
    grow(world, 8)
    with django_assert_max_num_queries(baseline):
        response = client.get(url)
    many = queries_for(client, url)
    assert response.json()["count"] >= 10
    assert many == few


def test_a_job_detail_costs_the_same_queries_for_one_attempt_or_several(world):
    node = world.node
    job = world.vision_job
    client = world.client("member")
    url = f"/api/v1/jobs/{job.pk}/"

    def run_once():
        job.refresh_from_db()
        attempt = actions.admit_job(job, node=node, gpus=list(node.gpus.all()), borrowed=True)
        actions.mark_attempt_running(attempt)
        actions.request_stop(attempt, reason="preempted", message="for the test")
        attempt.refresh_from_db()
        actions.finish_attempt(attempt, exit_code=137)

    run_once()
    one = queries_for(client, url)
    for _ in range(3):
        run_once()
    assert len(client.get(url).json()["attempts"]) == 4
    # The job, its dependencies, attempts, their GPUs, their members, the timeline, the roles.
    assert queries_for(client, url) == one <= 7
