"""The tenant's trail from before the audit app (tenancy.TenantEvent) is copied into the audit
trail, so a tenant's "Recent events" show what they showed before the upgrade."""

import datetime as dt

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

BEFORE = [("tenancy", "0002_token_scopes_and_invitations"), ("audit", "0001_initial")]
AFTER = [("tenancy", "0003_drop_tenantevent"), ("audit", "0002_copy_tenant_events")]


@pytest.fixture
def back_to_the_latest_schema():
    """Migrations after AFTER (in any app) are undone by going back to BEFORE: the tests that
    run next need every one of them again."""
    yield
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())


@pytest.mark.django_db(transaction=True)
def test_tenant_events_are_copied_into_the_audit_trail(back_to_the_latest_schema):
    executor = MigrationExecutor(connection)
    executor.migrate(BEFORE)
    old = executor.loader.project_state(BEFORE).apps
    tenant = old.get_model("tenancy", "Tenant").objects.create(slug="vision", name="Vision")
    other = old.get_model("tenancy", "Tenant").objects.create(slug="nlp", name="NLP")
    ops = old.get_model("auth", "User").objects.create(username="ops")
    events = old.get_model("tenancy", "TenantEvent").objects
    at = dt.datetime(2026, 11, 30, 12, tzinfo=dt.UTC)
    events.create(
        tenant=tenant,
        at=at,
        kind="member_added",
        message="ops added dave as viewer.",
        data={"actor": "ops", "user": "dave", "role": "viewer"},
    )
    events.create(
        tenant=other,
        at=at,
        kind="budget_warning",
        message="The monthly kWh budget (10 kWh) is 90% used; action: hold.",
        data={"budget": 3, "period_start": "2026-11-01T00:00:00+00:00"},
    )

    executor = MigrationExecutor(connection)
    executor.migrate(AFTER)
    new = executor.loader.project_state(AFTER).apps
    rows = {r.tenant_id: r for r in new.get_model("audit", "AuditEvent").objects.all()}

    added = rows[tenant.pk]
    assert (added.action, added.actor_id, added.actor_label, added.at) == (
        "membership.create",
        ops.pk,
        "ops",
        at,
    )
    assert added.message == "ops added dave as viewer."
    assert added.after == {"user": "dave", "role": "viewer"}
    warning = rows[other.pk]
    assert (warning.action, warning.actor_id, warning.actor_label) == (
        "budget.warning",
        None,
        "budget check",
    )
    # The budget check's once-per-period key survives, so no warning is written twice.
    assert warning.after["budget"] == 3 and warning.after["period_start"].startswith("2026-11-01")
