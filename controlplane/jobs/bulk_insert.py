"""INSERT many rows of a model in one statement, without a model instance per row.

Django's bulk_create builds an instance per row and prepares every field of every row in Python;
at a cold start's thousands of admissions (an attempt, its allocations and an event each) that
costs seconds. Here the values that differ per row travel as one JSON parameter and PostgreSQL
turns them into columns (INSERT ... SELECT FROM json_array_elements); the values every row shares,
the model's defaults included, are prepared once by their field, exactly as bulk_create would.
Other databases get bulk_create.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime

from django.db import connection, models


def insert_rows(
    model: type[models.Model],
    rows: Sequence[dict],
    *,
    common: dict | None = None,
    returning: str | None = None,
) -> list:
    """Insert rows (field attname -> value; the same keys in every row) sharing `common` values.

    Fields named in neither get their default. With `returning` (the attname of a field whose
    value is unique in the batch), returns the new primary keys in the order of `rows`, matched
    on that field, since PostgreSQL does not promise RETURNING in insertion order.
    """
    if not rows:
        return []
    common = common or {}
    if connection.vendor != "postgresql":
        objs = model.objects.bulk_create([model(**common, **row) for row in rows])
        return [obj.pk for obj in objs] if returning else []
    meta = model._meta
    varying = list(rows[0])
    fields = [f for f in meta.concrete_fields if not f.primary_key]
    qn = connection.ops.quote_name
    columns, select, params = [], [], []
    position = {attname: i for i, attname in enumerate(varying)}
    for f in fields:
        db_type = f.db_type(connection)
        columns.append(qn(f.column))
        if f.attname in position:
            i = position[f.attname]
            if isinstance(f, models.JSONField):
                select.append(f"(v->{i})::{db_type}")
            else:
                select.append(f"(v->>{i})::{db_type}")
        else:
            value = common[f.attname] if f.attname in common else f.get_default()
            select.append(f"%s::{db_type}")
            params.append(f.get_db_prep_save(value, connection))
    payload = json.dumps([[row[k] for k in varying] for row in rows], default=_json_value)
    sql = (
        f"INSERT INTO {qn(meta.db_table)} ({', '.join(columns)}) "
        f"SELECT {', '.join(select)} FROM json_array_elements(%s::json) AS v"
    )
    if returning:
        key = meta.get_field(returning)
        sql += f" RETURNING {qn(meta.pk.column)}, {qn(key.column)}"
    with connection.cursor() as cursor:
        cursor.execute(sql, [*params, payload])
        if not returning:
            return []
        by_key = {value: pk for pk, value in cursor.fetchall()}
    return [by_key[row[key.attname]] for row in rows]


def _json_value(value):
    if isinstance(value, datetime):
        # ISO 8601 with its offset: PostgreSQL reads it back to the same instant.
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
