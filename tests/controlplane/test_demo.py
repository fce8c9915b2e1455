"""The embedded mode's demo data goes through the actions like an admin's clicks."""

import pytest

from controlplane.audit.models import AuditEvent
from controlplane.cluster.models import Pool
from controlplane.demo import DEMO_TENANTS, seed_demo
from controlplane.tenancy.models import Membership, Quota, Tenant

pytestmark = pytest.mark.django_db


def test_the_demo_starts_the_audit_trail_and_seeds_once():
    created = seed_demo()
    assert set(created) == {"admin"} | {
        f"{slug}-{kind}" for slug, *_ in DEMO_TENANTS for kind in ("admin", "researcher")
    }
    assert Pool.objects.get(name="default").power_budget_w == 6000.0
    vision = Tenant.objects.get(slug="vision")
    h100 = Quota.objects.get(tenant=vision, gpu_type="H100-SXM-80GB")
    assert (h100.guaranteed_gpus, h100.limit_gpus) == (4, 12)

    rows = AuditEvent.objects.all()
    by_action = {a: rows.filter(action=a).count() for a in rows.values_list("action", flat=True)}
    assert by_action == {
        "pool.create": 1,
        "tenant.create": len(DEMO_TENANTS),
        "quota.create": 2 * len(DEMO_TENANTS),
        "membership.create": 2 * len(DEMO_TENANTS),
    }
    assert set(rows.values_list("actor__username", flat=True)) == {"admin"}
    # A tenant admin reading the trail sees their tenant's rows only.
    assert rows.filter(tenant=vision, action="quota.create").count() == 2

    again = seed_demo()
    assert again == {}
    assert AuditEvent.objects.count() == rows.count()
    assert Membership.objects.count() == 2 * len(DEMO_TENANTS)
