"""The membership rules the API and the web UI share (controlplane.tenancy.actions)."""

import threading

import pytest
from django.db import connection, connections, transaction

from controlplane.tenancy import actions
from controlplane.tenancy.models import Membership, Role


def test_a_tenant_admin_can_neither_demote_nor_remove_the_last_tenant_admin(vision_admin):
    mine = Membership.objects.get(user=vision_admin)
    with pytest.raises(actions.LastTenantAdmin, match="last tenant admin of vision"):
        actions.change_membership_role(mine, Role.MEMBER, actor=vision_admin)
    with pytest.raises(actions.LastTenantAdmin):
        actions.remove_membership(mine, actor=vision_admin)
    mine.refresh_from_db()
    assert mine.role == Role.ADMIN


def test_an_admin_may_step_down_once_someone_else_is_admin(vision_admin, alice):
    mine = Membership.objects.get(user=vision_admin)
    actions.change_membership_role(
        Membership.objects.get(user=alice), Role.ADMIN, actor=vision_admin
    )
    actions.change_membership_role(mine, Role.VIEWER, actor=vision_admin)
    assert Membership.objects.get(user=vision_admin).role == Role.VIEWER
    actions.remove_membership(Membership.objects.get(user=vision_admin), actor=alice)
    assert list(
        Membership.objects.filter(tenant__slug="vision").values_list("role", flat=True)
    ) == [Role.ADMIN]


def test_a_cluster_admin_may_remove_a_tenants_last_admin(vision_admin, cluster_admin):
    actions.remove_membership(Membership.objects.get(user=vision_admin), actor=cluster_admin)
    assert not Membership.objects.filter(tenant__slug="vision").exists()


def _backend_pid_waits_on_a_lock(pid: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid])
        row = cursor.fetchone()
    return row is not None and row[0] == "Lock"


@pytest.mark.django_db(transaction=True)
def test_two_admins_demoting_each_other_at_once_leave_the_tenant_one_admin(
    vision_admin, make_user, vision
):
    other = make_user("olga")
    Membership.objects.create(user=other, tenant=vision, role=Role.ADMIN)
    first_demoted = threading.Event()
    release_first = threading.Event()
    second_pid: list[int] = []
    outcome: dict[str, object] = {}

    def demote_vera():
        try:
            with transaction.atomic():
                mine = Membership.objects.get(user=vision_admin)
                actions.change_membership_role(mine, Role.MEMBER, actor=vision_admin)
                first_demoted.set()
                release_first.wait(30)
        finally:
            connections.close_all()

    def demote_olga():
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                second_pid.append(cursor.fetchone()[0])
            theirs = Membership.objects.get(user=other)
            try:
                actions.change_membership_role(theirs, Role.MEMBER, actor=other)
                outcome["second"] = "demoted"
            except actions.LastTenantAdmin:
                outcome["second"] = "refused"
        finally:
            connections.close_all()

    first = threading.Thread(target=demote_vera)
    first.start()
    assert first_demoted.wait(30)
    second = threading.Thread(target=demote_olga)
    second.start()
    # Let the first commit only once the second has either finished on its own (no lock: it
    # saw the uncommitted state) or is queued behind the first's lock.
    while second.is_alive() and not (second_pid and _backend_pid_waits_on_a_lock(second_pid[0])):
        second.join(0.01)
    release_first.set()
    first.join(30)
    second.join(30)
    assert outcome == {"second": "refused"}
    assert Membership.objects.filter(tenant=vision, role=Role.ADMIN).count() == 1
