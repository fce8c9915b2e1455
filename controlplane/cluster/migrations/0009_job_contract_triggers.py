"""The generation triggers count the columns the job contract added to the heartbeat answer.

The answer now carries each attempt's stop signal and grace, its mounts resolved against the
volumes (their kind, source, read-only flag, per-tenant subdirectory), and its checkpoint
directory (the checkpoint volume's source and the tenant's slug) with the attempt's read-only
flag. controlplane.cluster.desired_state declares them; its test changes each one.

- jobs_jobattempt: checkpoint_read_only joins the columns 0007's function compares.
- jobs_job: the row trigger of 0007 covers the new spec columns too (same function).
- tenancy_tenant: a slug is part of every per-tenant source and checkpoint path.
- storage_volume: any write of a volume (an admin's, rare) bumps every node with active work:
  a mount names its volume by name inside the job's JSON, so finding exactly the jobs that use
  one costs more than the few extra answers this sends.
"""

import importlib

from django.db import migrations

previous = importlib.import_module("controlplane.cluster.migrations.0007_desired_state_triggers")

ATTEMPT_CHANGED = previous.ATTEMPT_CHANGED.replace(
    "OR n.job_id IS DISTINCT FROM o.job_id",
    "OR n.job_id IS DISTINCT FROM o.job_id\n"
    "               OR n.checkpoint_read_only IS DISTINCT FROM o.checkpoint_read_only",
)
assert ATTEMPT_CHANGED != previous.ATTEMPT_CHANGED

JOB_SPEC_COLUMNS = (
    *previous.JOB_SPEC_COLUMNS,
    "tenant_id",
    "mounts",
    "stop_signal",
    "preemption_grace_s",
    "checkpoint_volume_id",
)

# The nodes whose answer lists an active attempt of a job matching `jobs` (a condition on j).
_ACTIVE_NODES = """
    SELECT a.node_id FROM jobs_jobattempt a JOIN jobs_job j ON j.id = a.job_id
    WHERE a.state IN ('ADMITTED', 'RUNNING') AND ({jobs})
    UNION
    SELECT g.node_id FROM jobs_jobattempt a JOIN jobs_job j ON j.id = a.job_id
    JOIN jobs_allocation al ON al.attempt_id = a.id AND al.active
    JOIN cluster_gpu g ON g.id = al.gpu_id
    WHERE {jobs}
"""

TENANT_CHANGED = f"""
CREATE OR REPLACE FUNCTION gpucp_tenant_slug_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM gpucp_bump_nodes(ARRAY({_ACTIVE_NODES.format(jobs="j.tenant_id = NEW.id")}));
    RETURN NULL;
END $$;
"""

VOLUME_CHANGED = f"""
CREATE OR REPLACE FUNCTION gpucp_volume_changed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM gpucp_bump_nodes(ARRAY({_ACTIVE_NODES.format(jobs="TRUE")}));
    RETURN NULL;
END $$;
"""

JOB_TRIGGER = previous.JOB_TRIGGER
TENANT_TRIGGER = "gpucp_tenancy_tenant_slug_bumps_node"
VOLUME_TRIGGER = "gpucp_storage_volume_bumps_node"


def _job_trigger(schema_editor, columns) -> None:
    schema_editor.execute(f"DROP TRIGGER IF EXISTS {JOB_TRIGGER} ON jobs_job")
    changed = " OR ".join(f"OLD.{c} IS DISTINCT FROM NEW.{c}" for c in columns)
    schema_editor.execute(
        f"CREATE TRIGGER {JOB_TRIGGER} AFTER UPDATE OF {', '.join(columns)} "
        f"ON jobs_job FOR EACH ROW WHEN ({changed}) EXECUTE FUNCTION gpucp_job_spec_changed()"
    )


def create(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return  # the embedded mode (SQLite) answers every heartbeat by the full path
    schema_editor.execute(ATTEMPT_CHANGED)
    _job_trigger(schema_editor, JOB_SPEC_COLUMNS)
    schema_editor.execute(TENANT_CHANGED)
    schema_editor.execute(
        f"CREATE TRIGGER {TENANT_TRIGGER} AFTER UPDATE OF slug ON tenancy_tenant FOR EACH ROW "
        "WHEN (OLD.slug IS DISTINCT FROM NEW.slug) EXECUTE FUNCTION gpucp_tenant_slug_changed()"
    )
    schema_editor.execute(VOLUME_CHANGED)
    schema_editor.execute(
        f"CREATE TRIGGER {VOLUME_TRIGGER} AFTER INSERT OR UPDATE OR DELETE ON storage_volume "
        "FOR EACH STATEMENT EXECUTE FUNCTION gpucp_volume_changed()"
    )


def drop(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    schema_editor.execute(f"DROP TRIGGER IF EXISTS {VOLUME_TRIGGER} ON storage_volume")
    schema_editor.execute("DROP FUNCTION IF EXISTS gpucp_volume_changed()")
    schema_editor.execute(f"DROP TRIGGER IF EXISTS {TENANT_TRIGGER} ON tenancy_tenant")
    schema_editor.execute("DROP FUNCTION IF EXISTS gpucp_tenant_slug_changed()")
    _job_trigger(schema_editor, previous.JOB_SPEC_COLUMNS)
    schema_editor.execute(previous.ATTEMPT_CHANGED)


class Migration(migrations.Migration):
    dependencies = [
        ("cluster", "0008_node_volumes"),
        ("jobs", "0005_job_contract"),
        ("storage", "0001_initial"),
        ("tenancy", "0004_checkpoint_limit"),
    ]

    operations = [migrations.RunPython(create, drop)]
