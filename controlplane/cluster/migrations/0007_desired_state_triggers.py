"""The generation triggers count every column the heartbeat answer reads (PostgreSQL only).

controlplane.cluster.desired_state declares the columns the answer reads, and its test changes
each one on a node with work. Two were not counted by migration 0002: an attempt's job (the
answer names it, and reads the job's spec through it) and the job's spec itself (its GPU
count, image, command, environment, CPUs, memory and run-time limit), which 0002 took to be
fixed once submitted. Nothing in the control plane rewrites them today; an operator's edit
through the admin or a shell would have left agents running from a stale cached answer.

The job trigger is a row trigger on those columns only: PostgreSQL fires it only for an UPDATE
that names one of them, so the scheduler's every-cycle writes of pending reasons, positions
and estimates (thousands of rows) never reach it, and its WHEN clause skips a rewrite that
changes nothing.
"""

import importlib

from django.db import migrations

ATTEMPT_CHANGED = """
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
               OR n.job_id IS DISTINCT FROM o.job_id
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
"""

JOB_SPEC_CHANGED = """
CREATE OR REPLACE FUNCTION gpucp_job_spec_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- The nodes whose answer lists one of the job's active attempts: where it was placed, and
    -- every node holding one of its GPUs (a gang).
    PERFORM gpucp_bump_nodes(ARRAY(
        SELECT a.node_id FROM jobs_jobattempt a
        WHERE a.job_id = NEW.id AND a.state IN ('ADMITTED', 'RUNNING')
        UNION
        SELECT g.node_id FROM jobs_jobattempt a
        JOIN jobs_allocation al ON al.attempt_id = a.id AND al.active
        JOIN cluster_gpu g ON g.id = al.gpu_id
        WHERE a.job_id = NEW.id
    ));
    RETURN NULL;
END $$;
"""

JOB_SPEC_COLUMNS = ("gpus", "image", "command", "env", "cpus", "memory_mib", "max_runtime_s")
JOB_TRIGGER = "gpucp_jobs_job_update_bumps_node"


def create(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return  # the embedded mode (SQLite) answers every heartbeat by the full path
    schema_editor.execute(ATTEMPT_CHANGED)
    schema_editor.execute(JOB_SPEC_CHANGED)
    changed = " OR ".join(f"OLD.{c} IS DISTINCT FROM NEW.{c}" for c in JOB_SPEC_COLUMNS)
    schema_editor.execute(
        f"CREATE TRIGGER {JOB_TRIGGER} AFTER UPDATE OF {', '.join(JOB_SPEC_COLUMNS)} "
        f"ON jobs_job FOR EACH ROW WHEN ({changed}) EXECUTE FUNCTION gpucp_job_spec_changed()"
    )


def drop(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(f"DROP TRIGGER IF EXISTS {JOB_TRIGGER} ON jobs_job")
    schema_editor.execute("DROP FUNCTION IF EXISTS gpucp_job_spec_changed()")
    # 0002's functions as they were, the attempt's among them.
    previous = importlib.import_module("controlplane.cluster.migrations.0002_nodegeneration")
    schema_editor.execute(previous.BUMP)


class Migration(migrations.Migration):
    dependencies = [
        ("cluster", "0006_gpu_claim_conflicts"),
        ("jobs", "0004_log_chunk_bytes"),
    ]

    operations = [migrations.RunPython(create, drop)]
