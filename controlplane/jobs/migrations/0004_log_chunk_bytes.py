"""Log chunks become bytes (bytea): a text column refuses a NUL, so a job that printed one lost
its whole log. Existing rows are converted as their UTF-8 encoding, byte for byte.

Django's own AlterField would cast text to bytea with `::bytea`, which reads backslashes as
escapes (a log line "C:\\new" would change or fail), so PostgreSQL gets convert_to() instead.
Going back decodes as UTF-8, with NUL and invalid bytes as U+FFFD: text cannot hold them.
"""

from django.db import migrations

import controlplane.jobs.models

TABLE = "jobs_logchunk"


def to_bytes(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            f'ALTER TABLE {TABLE} ALTER COLUMN "data" TYPE bytea USING convert_to("data", \'UTF8\')'
        )
        return
    # SQLite keeps whatever type a value had; a text value becomes the blob of its UTF-8 bytes.
    schema_editor.execute(
        f'UPDATE {TABLE} SET "data" = CAST("data" AS BLOB) WHERE typeof("data") = \'text\''
    )


def to_text(apps, schema_editor):
    LogChunk = apps.get_model("jobs", "LogChunk")
    rows = list(LogChunk.objects.values_list("pk", "data"))
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f'ALTER TABLE {TABLE} ALTER COLUMN "data" TYPE text USING \'\'')
    for pk, data in rows:
        raw = data.encode() if isinstance(data, str) else bytes(data)
        text = raw.decode("utf-8", "replace").replace("\x00", "\ufffd")
        with schema_editor.connection.cursor() as cursor:
            cursor.execute(f'UPDATE {TABLE} SET "data" = %s WHERE id = %s', [text, pk])


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0003_submit_key"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="logchunk",
                    name="data",
                    field=controlplane.jobs.models.OutputBytesField(),
                ),
            ],
            database_operations=[migrations.RunPython(to_bytes, to_text)],
        ),
    ]
