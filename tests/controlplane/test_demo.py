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


def test_the_embedded_demo_has_datasets_and_a_checkpoint_volume_on_its_storage_root(tmp_path):
    from controlplane.storage.models import Volume

    seed_demo(storage_root=tmp_path / "storage")
    datasets = Volume.objects.get(name="datasets")
    assert datasets.read_only and datasets.all_tenants
    assert (tmp_path / "storage" / "datasets" / "README.txt").exists()
    checkpoints = Volume.objects.get(checkpoints=True)
    assert checkpoints.source == str((tmp_path / "storage" / "checkpoints").resolve())
    assert AuditEvent.objects.filter(action="volume.create").count() == 2

    seed_demo(storage_root=tmp_path / "storage")  # a second `make run` adds nothing
    assert Volume.objects.count() == 2


def test_lost_demo_passwords_are_replaced_and_printed_again(django_user_model):
    from io import StringIO

    from django.core.management import call_command

    first = seed_demo()
    someone = django_user_model.objects.create_user("carol", password="carols-own-pass-1")
    out = StringIO()
    call_command("reset_demo_passwords", stdout=out)
    printed = dict(line.split() for line in out.getvalue().splitlines()[1:])

    # Every demo account, and only those, has a new password that signs in; the old ones fail.
    assert set(printed) == set(first)
    for username, password in printed.items():
        user = django_user_model.objects.get(username=username)
        assert password != first[username]
        assert user.check_password(password) and not user.check_password(first[username])
    someone.refresh_from_db()
    assert someone.check_password("carols-own-pass-1")
    resets = AuditEvent.objects.filter(action="user.password_reset")
    assert sorted(resets.values_list("object_repr", flat=True)) == sorted(first)
    assert all(password not in str(resets.values()) for password in printed.values())


def test_resetting_demo_passwords_without_a_demo_says_so():
    from django.core.management import call_command
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="no demo accounts"):
        call_command("reset_demo_passwords")


@pytest.mark.parametrize(
    "message,status,shown",
    [
        ('"POST /api/agent/v1/heartbeat HTTP/1.1" 200 812', 200, False),
        ('"GET /api/agent/v1/watch?generation=4 HTTP/1.1" 304 0', 304, False),
        ('"POST /api/agent/v1/heartbeat HTTP/1.1" 500 145', 500, True),
        ('"POST /api/agent/v1/heartbeat HTTP/1.1" 401 58', 401, True),
        ('"GET /jobs/ HTTP/1.1" 200 5120', 200, True),
    ],
)
def test_the_embedded_access_log_leaves_out_only_the_agents_routine_requests(
    message, status, shown
):
    import logging

    from controlplane.scheduling.management.commands.embedded import QuietAgentRequests

    record = logging.LogRecord("django.server", logging.INFO, __file__, 1, message, None, None)
    record.status_code = status
    assert QuietAgentRequests().filter(record) is shown
