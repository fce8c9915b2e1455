"""Per-node desired-state generations, counted by triggers (PostgreSQL only).

Statement-level triggers with transition tables: one upsert per statement, whatever the number
of rows it wrote, so the scheduler's bulk writes and the telemetry batches pay little. A change
counts when it alters what a heartbeat answers: an attempt's state, stop request or node; an
allocation's GPU, attempt or activity; a GPU's desired cap, index, UUID or node. Job specs
(image, command, ...) do not change once submitted, so jobs carry no trigger.

Also sets a fillfactor on the tables heartbeats rewrite, for heap-only updates.
"""

import django.db.models.deletion
from django.db import migrations, models

BUMP = """
CREATE OR REPLACE FUNCTION gpucp_bump_nodes(node_ids bigint[]) RETURNS void
LANGUAGE sql AS $$
    -- In node order, so that two writers bumping the same nodes lock them in the same order.
    INSERT INTO cluster_nodegeneration (node_id, generation)
    SELECT DISTINCT id, 1 FROM unnest(node_ids) AS t(id) WHERE id IS NOT NULL ORDER BY id
    ON CONFLICT (node_id) DO UPDATE SET generation = cluster_nodegeneration.generation + 1
$$;

CREATE OR REPLACE FUNCTION gpucp_attempt_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    ids bigint[];
BEGIN
    IF TG_OP = 'INSERT' THEN
        SELECT array_agg(node_id) INTO ids FROM new_rows;
    ELSIF TG_OP = 'DELETE' THEN
        SELECT array_agg(node_id) INTO ids FROM old_rows;
    ELSE
        WITH changed AS (
            SELECT n.id, n.node_id, o.node_id AS old_node_id
            FROM new_rows n JOIN old_rows o ON o.id = n.id
            WHERE n.state IS DISTINCT FROM o.state
               OR n.stop_requested_at IS DISTINCT FROM o.stop_requested_at
               OR n.node_id IS DISTINCT FROM o.node_id
        )
        SELECT array_agg(x) INTO ids FROM (
            SELECT node_id AS x FROM changed
            UNION SELECT old_node_id FROM changed
            -- A gang's attempt is in the answer of every node holding one of its GPUs.
            UNION SELECT g.node_id FROM changed c
                  JOIN jobs_allocation al ON al.attempt_id = c.id
                  JOIN cluster_gpu g ON g.id = al.gpu_id
        ) nodes;
    END IF;
    IF ids IS NOT NULL THEN
        PERFORM gpucp_bump_nodes(ids);
    END IF;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION gpucp_allocation_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    ids bigint[];
BEGIN
    IF TG_OP = 'INSERT' THEN
        SELECT array_agg(g.node_id) INTO ids
        FROM new_rows n JOIN cluster_gpu g ON g.id = n.gpu_id;
    ELSIF TG_OP = 'DELETE' THEN
        SELECT array_agg(g.node_id) INTO ids
        FROM old_rows o JOIN cluster_gpu g ON g.id = o.gpu_id;
    ELSE
        WITH changed AS (
            SELECT n.gpu_id, o.gpu_id AS old_gpu_id
            FROM new_rows n JOIN old_rows o ON o.id = n.id
            WHERE n.active IS DISTINCT FROM o.active
               OR n.gpu_id IS DISTINCT FROM o.gpu_id
               OR n.attempt_id IS DISTINCT FROM o.attempt_id
        )
        SELECT array_agg(g.node_id) INTO ids
        FROM changed c JOIN cluster_gpu g ON g.id IN (c.gpu_id, c.old_gpu_id);
    END IF;
    IF ids IS NOT NULL THEN
        PERFORM gpucp_bump_nodes(ids);
    END IF;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION gpucp_gpu_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    ids bigint[];
BEGIN
    SELECT array_agg(x) INTO ids FROM (
        SELECT n.node_id AS x FROM new_rows n JOIN old_rows o ON o.id = n.id
        WHERE n.desired_power_cap_w IS DISTINCT FROM o.desired_power_cap_w
           OR n."index" IS DISTINCT FROM o."index"
           OR n.uuid IS DISTINCT FROM o.uuid
           OR n.node_id IS DISTINCT FROM o.node_id
        UNION
        SELECT o.node_id FROM new_rows n JOIN old_rows o ON o.id = n.id
        WHERE n.node_id IS DISTINCT FROM o.node_id
    ) nodes;
    IF ids IS NOT NULL THEN
        PERFORM gpucp_bump_nodes(ids);
    END IF;
    RETURN NULL;
END $$;
"""

TRIGGERS = [
    ("jobs_jobattempt", "gpucp_attempt_changed", "INSERT", "NEW TABLE AS new_rows"),
    (
        "jobs_jobattempt",
        "gpucp_attempt_changed",
        "UPDATE",
        "OLD TABLE AS old_rows NEW TABLE AS new_rows",
    ),
    ("jobs_jobattempt", "gpucp_attempt_changed", "DELETE", "OLD TABLE AS old_rows"),
    ("jobs_allocation", "gpucp_allocation_changed", "INSERT", "NEW TABLE AS new_rows"),
    (
        "jobs_allocation",
        "gpucp_allocation_changed",
        "UPDATE",
        "OLD TABLE AS old_rows NEW TABLE AS new_rows",
    ),
    ("jobs_allocation", "gpucp_allocation_changed", "DELETE", "OLD TABLE AS old_rows"),
    ("cluster_gpu", "gpucp_gpu_changed", "UPDATE", "OLD TABLE AS old_rows NEW TABLE AS new_rows"),
]


def _trigger_name(table: str, event: str) -> str:
    return f"gpucp_{table}_{event.lower()}_bumps_node"


def create_triggers(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return  # the embedded mode (SQLite) answers every heartbeat by the full path
    schema_editor.execute(BUMP)
    # Room on each page for the heartbeats' rewrites of these rows (liveness, latest readings,
    # the current history bucket) to stay heap-only: no index entry per rewrite.
    for table, percent in (("cluster_node", 70), ("cluster_gpu", 60), ("cluster_gputelemetry", 80)):
        schema_editor.execute(f"ALTER TABLE {table} SET (fillfactor = {percent})")
    for table, function, event, transition in TRIGGERS:
        schema_editor.execute(
            f"CREATE TRIGGER {_trigger_name(table, event)} AFTER {event} ON {table} "
            f"REFERENCING {transition} FOR EACH STATEMENT EXECUTE FUNCTION {function}()"
        )


def drop_triggers(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    for table, _, event, _ in TRIGGERS:
        schema_editor.execute(f"DROP TRIGGER IF EXISTS {_trigger_name(table, event)} ON {table}")
    for function in ("gpucp_attempt_changed", "gpucp_allocation_changed", "gpucp_gpu_changed"):
        schema_editor.execute(f"DROP FUNCTION IF EXISTS {function}()")
    schema_editor.execute("DROP FUNCTION IF EXISTS gpucp_bump_nodes(bigint[])")
    for table in ("cluster_node", "cluster_gpu", "cluster_gputelemetry"):
        schema_editor.execute(f"ALTER TABLE {table} RESET (fillfactor)")


class Migration(migrations.Migration):
    dependencies = [
        ("cluster", "0001_initial"),
        ("jobs", "0001_initial"),
    ]

    operations = [
        migrations.CreateModel(
            name="NodeGeneration",
            fields=[
                (
                    "node",
                    models.OneToOneField(
                        db_constraint=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        primary_key=True,
                        related_name="+",
                        serialize=False,
                        to="cluster.node",
                    ),
                ),
                ("generation", models.BigIntegerField(default=0)),
            ],
        ),
        migrations.RunPython(create_triggers, drop_triggers),
    ]
