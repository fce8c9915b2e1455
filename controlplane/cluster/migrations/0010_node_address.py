"""Nodes advertise an address and a job port range; the answer carries each attempt's rendezvous.

The heartbeat answer now gives every member of an attempt its rank (jobs_attemptmember, joined
on the attempt and the node), the attempt's members' addresses in rank order and its master
port (both on jobs_jobattempt). controlplane.cluster.desired_state declares them; its test
changes each one.

- jobs_jobattempt: master_port and node_addrs join the columns 0009's function compares.
- jobs_attemptmember: an UPDATE of its rank, node or attempt bumps the member's old and new
  nodes (a row trigger on those columns only: the members' state, written by every report,
  is in no answer). Members are inserted with their attempt and its allocations, whose own
  triggers bump every node concerned in that same transaction.
"""

import importlib

from django.db import migrations, models

previous = importlib.import_module("controlplane.cluster.migrations.0009_job_contract_triggers")

ATTEMPT_CHANGED = previous.ATTEMPT_CHANGED.replace(
    "OR n.checkpoint_read_only IS DISTINCT FROM o.checkpoint_read_only",
    "OR n.checkpoint_read_only IS DISTINCT FROM o.checkpoint_read_only\n"
    "               OR n.master_port IS DISTINCT FROM o.master_port\n"
    "               OR n.node_addrs IS DISTINCT FROM o.node_addrs",
)
assert ATTEMPT_CHANGED != previous.ATTEMPT_CHANGED

MEMBER_CHANGED = """
CREATE OR REPLACE FUNCTION gpucp_member_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM gpucp_bump_nodes(ARRAY[OLD.node_id, NEW.node_id]::bigint[]);
    RETURN NULL;
END $$;
"""
MEMBER_COLUMNS = ("rank", "node_id", "attempt_id")
MEMBER_TRIGGER = "gpucp_jobs_attemptmember_update_bumps_node"


def create(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return  # the embedded mode (SQLite) answers every heartbeat by the full path
    schema_editor.execute(ATTEMPT_CHANGED)
    schema_editor.execute(MEMBER_CHANGED)
    changed = " OR ".join(f"OLD.{c} IS DISTINCT FROM NEW.{c}" for c in MEMBER_COLUMNS)
    schema_editor.execute(
        f"CREATE TRIGGER {MEMBER_TRIGGER} AFTER UPDATE OF {', '.join(MEMBER_COLUMNS)} "
        f"ON jobs_attemptmember FOR EACH ROW WHEN ({changed}) "
        "EXECUTE FUNCTION gpucp_member_changed()"
    )


def drop(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(f"DROP TRIGGER IF EXISTS {MEMBER_TRIGGER} ON jobs_attemptmember")
    schema_editor.execute("DROP FUNCTION IF EXISTS gpucp_member_changed()")
    schema_editor.execute(previous.ATTEMPT_CHANGED)


class Migration(migrations.Migration):

    dependencies = [
        ('cluster', '0009_job_contract_triggers'),
        ('jobs', '0007_attempt_members'),
    ]

    operations = [
        migrations.AddField(
            model_name='node',
            name='advertise_address',
            field=models.CharField(blank=True, default='', max_length=255),
        ),
        migrations.AddField(
            model_name='node',
            name='job_port_max',
            field=models.PositiveIntegerField(default=29999),
        ),
        migrations.AddField(
            model_name='node',
            name='job_port_min',
            field=models.PositiveIntegerField(default=29500),
        ),
        migrations.RunPython(create, drop),
    ]
