"""Write many rows in one statement: the control plane's one bulk-write helper.

Django's bulk_create and bulk_update build a model instance per row and prepare every field of
every row in Python, and bulk_update writes a CASE per field and row; at a cycle's thousands of
admissions, queue positions or telemetry readings that costs seconds. Here the rows travel as
one array per column, which PostgreSQL unnests into rows:

    UPDATE t SET x = v.x, y = v.y FROM unnest($1::bigint[], $2::text[], $3::jsonb[]) AS v(k, x, y)
    WHERE t.id = v.k

sent through psycopg's server-binding cursor in binary: the statement's text is the same
whatever the number of rows, so it is prepared once per connection, and psycopg packs a list of
numbers many times faster than Django's client-side binding quotes it as text. The one type map
is Django's own: a column's array type is its field's db_type, and a value is made what that
type takes by _pg_column. SQLite (the embedded mode) gets the same statements over a VALUES list
of the fields' own prepared values.

insert_rows and update_rows cover the control plane's bulk writes; a statement that needs more
(an upsert keeping running means, a liveness that never moves back) builds on rows_from and
execute, and says why beside it (controlplane.cluster.telemetry).

Below every app: imports no app.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Sequence

from django.conf import settings
from django.db import connection, models

# A column of a rows CTE: its name there, and the model field whose type and values it has.
Column = tuple[str, models.Field]


def _pg_column(field: models.Field, values: list) -> list:
    """A column's values as the binary array of its field's type takes them.

    Per column, not per value: a telemetry batch carries tens of thousands of values, and most
    columns (integers, text, booleans, timestamps) go to psycopg as they are.
    """
    if isinstance(field, models.JSONField):
        return [None if v is None else json.dumps(v) for v in values]
    if isinstance(field, models.FloatField):
        # A binary array holds one element type: integers among the floats are made floats.
        return [None if v is None else float(v) for v in values]
    return values


def _sqlite_value(field: models.Field, value):
    return None if value is None else field.get_db_prep_save(value, connection)


def _db_type(field: models.Field) -> str:
    kind = field.db_type(connection)
    if kind is None:
        raise TypeError(f"{field!r} has no column type")
    return kind


def _column(field: models.Field) -> str:
    """The field's column, quoted."""
    if field.column is None:
        raise TypeError(f"{field!r} has no column")
    return connection.ops.quote_name(field.column)


def column(model: type[models.Model], name: str) -> str:
    """The quoted column of the model's field of this name, for a statement written out."""
    return _column(field(model, name))


def field(model: type[models.Model], name: str) -> models.Field:
    """The model's concrete field of this name or attname (a reverse relation is refused)."""
    found = model._meta.get_field(name)
    if not isinstance(found, models.Field):
        raise TypeError(f"{model.__name__}.{name} is not a column")
    return found


def rows_from(name: str, columns: Sequence[Column], rows: Sequence[tuple]) -> tuple[str, list]:
    """A FROM item `name(columns)` holding `rows` (tuples in the order of columns): (sql, params).

    On PostgreSQL one binary array parameter per column, unnested, for execute(); on SQLite a
    VALUES list named by a subquery (an empty list is not SQL, so a row of NULLs, which matches
    nothing, stands in for it). A FROM item and not a CTE: a statement that begins with WITH
    reports no row count through Python's sqlite3.
    """
    names = ", ".join(c for c, _ in columns)
    if connection.vendor == "postgresql":
        arrays = ", ".join(f"%b::{_db_type(f)}[]" for _, f in columns)
        params = [_pg_column(f, [row[i] for row in rows]) for i, (_, f) in enumerate(columns)]
        return f"unnest({arrays}) AS {name}({names})", params
    values = [
        tuple(_sqlite_value(f, row[i]) for i, (_, f) in enumerate(columns)) for row in rows
    ] or [(None,) * len(columns)]
    placeholders = "(" + ", ".join(["%s"] * len(columns)) + ")"
    named = ", ".join(f"column{i + 1} AS {c}" for i, (c, _) in enumerate(columns))
    params = [p for row in values for p in row]
    return (
        f"(SELECT {named} FROM (VALUES {', '.join([placeholders] * len(values))})) AS {name}",
        params,
    )


def sqlite_chunk(columns: int) -> int:
    """Rows per statement on SQLite, whose statements take a bounded number of parameters."""
    return max(1, (connection.features.max_query_params or 999) // max(1, columns))


@contextlib.contextmanager
def server_cursor():
    """A psycopg cursor binding parameters on the server, on this thread's Django connection.

    Its statements run with prepare=True are prepared once per connection. settings.py
    normally has psycopg prepare any statement a connection ran 5 times (prepare_threshold 5,
    with server-side binding). With DB_PREPARED_STATEMENTS=0 (a pooler that cannot follow
    prepared statements) nothing is prepared, prepare=True statements included. Where the
    threshold is None otherwise (Django's default), it is set here out of reach of counting,
    so that only prepare=True statements are prepared.
    """
    import psycopg

    # As Django's own cursor() does: a kept connection the server has since closed (a restart)
    # is replaced before its first statement of the request, not used to fail it.
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    raw = connection.connection
    if raw.prepare_threshold is None and getattr(settings, "DB_PREPARED_STATEMENTS", True):
        # Only statements executed with prepare=True: never reached by counting.
        raw.prepare_threshold = 1 << 30
    # Errors as Django's (IntegrityError, OperationalError...), and a broken connection marked
    # as such, so that Django closes it instead of handing it to the next request.
    with connection.wrap_database_errors, psycopg.Cursor(raw) as cursor:
        yield cursor


@contextlib.contextmanager
def cursor() -> Iterator:
    """The cursor for rows_from's parameters: server-binding on PostgreSQL, Django's elsewhere."""
    if connection.vendor != "postgresql":
        with connection.cursor() as django_cursor:
            yield django_cursor
        return
    with server_cursor() as raw:
        yield raw


def execute(cur, sql: str, params: Sequence) -> None:
    """Run one statement on a cursor(); prepared once per connection on PostgreSQL.

    Recorded in connection.queries when Django records queries (DEBUG, or a test capturing
    them), as its own cursors' statements are, so that statement counts stay true.
    """
    began = time.monotonic()
    if connection.vendor == "postgresql":
        cur.execute(sql, params, prepare=True)
    else:
        cur.execute(sql, params)
    if connection.vendor == "postgresql" and connection.queries_logged:
        connection.queries_log.append(
            {"sql": sql, "time": f"{time.monotonic() - began:.3f}", "alias": connection.alias}
        )


def _fields(model: type[models.Model], names: Sequence[str]) -> list[models.Field]:
    return [field(model, name) for name in names]


def insert_rows(
    model: type[models.Model],
    rows: Sequence[dict],
    *,
    common: dict | None = None,
    returning: str | None = None,
) -> list:
    """INSERT rows (field attname -> value; the same keys in every row) sharing `common` values.

    Fields named in neither get their default. With `returning` (the attname of a field whose
    value is unique in the batch), returns the new primary keys in the order of `rows`, matched
    on that field, since PostgreSQL does not promise RETURNING in insertion order.
    """
    if not rows:
        return []
    common = common or {}
    meta = model._meta
    qn = connection.ops.quote_name
    varying = list(rows[0])
    position = {attname: i for i, attname in enumerate(varying)}
    columns: list[Column] = [(f"c{i}", f) for i, f in enumerate(_fields(model, varying))]
    names, select, shared = [], [], []
    for f in meta.concrete_fields:
        if f.primary_key:
            continue
        names.append(_column(f))
        if f.attname in position:
            select.append(f"v.c{position[f.attname]}")
        else:
            value = common[f.attname] if f.attname in common else f.get_default()
            if connection.vendor == "postgresql":
                select.append(f"CAST(%s AS {_db_type(f)})")
                shared.append(f.get_db_prep_save(value, connection))
            else:
                select.append("%s")
                shared.append(_sqlite_value(f, value))
    table = qn(meta.db_table)
    key = field(model, returning) if returning else None
    ids: dict = {}
    chunk = len(rows) if connection.vendor == "postgresql" else sqlite_chunk(len(varying))
    with cursor() as cur:
        for start in range(0, len(rows), chunk):
            part = rows[start : start + chunk]
            source, params = rows_from("v", columns, [tuple(r[k] for k in varying) for r in part])
            sql = (
                f"INSERT INTO {table} ({', '.join(names)}) SELECT {', '.join(select)} FROM {source}"
            )
            if key is not None:
                sql += f" RETURNING {_column(meta.pk)}, {_column(key)}"
            # The shared values come first in the statement's text, the rows' after them.
            execute(cur, sql, [*shared, *params])
            if key is not None:
                ids.update({value: pk for pk, value in cur.fetchall()})
    return [ids[row[key.attname]] for row in rows] if key is not None else []


def update_rows(
    model: type[models.Model],
    fields: Sequence[str],
    rows: Sequence[tuple],
    *,
    only_if: dict | None = None,
) -> int:
    """UPDATE rows, each (pk, *values in the order of fields), in one statement; returns the
    count written. only_if maps a field to the value it must still have: a row whose value
    differs (another writer got there first) is left alone, and not counted.
    """
    if not rows:
        return 0
    meta = model._meta
    qn = connection.ops.quote_name
    table = qn(meta.db_table)
    targets = _fields(model, fields)
    columns: list[Column] = [("k", meta.pk), *((f"c{i}", f) for i, f in enumerate(targets))]
    assignments = ", ".join(f"{_column(f)} = v.c{i}" for i, f in enumerate(targets))
    guards, guard_params = [], []
    for name, wanted in (only_if or {}).items():
        f = field(model, name)
        guards.append(f" AND {table}.{_column(f)} = %s")
        guard_params.append(f.get_db_prep_save(wanted, connection))
    # In key order: the rows are visited the way the table and its index lie, and two writers
    # of the same rows lock them in the same order.
    rows = sorted(rows, key=lambda row: row[0])
    chunk = len(rows) if connection.vendor == "postgresql" else sqlite_chunk(len(columns))
    written = 0
    with cursor() as cur:
        for start in range(0, len(rows), chunk):
            source, params = rows_from("v", columns, rows[start : start + chunk])
            sql = (
                f"UPDATE {table} SET {assignments} FROM {source} "
                f"WHERE {table}.{_column(meta.pk)} = v.k{''.join(guards)}"
            )
            execute(cur, sql, [*params, *guard_params])
            written += cur.rowcount
    return written


def _for_ids(sql: str, ids: Sequence[int]) -> Iterator:
    """Run `sql` for `ids` (see execute_for_ids), yielding the cursor after each statement."""
    if not ids:
        return
    with cursor() as cur:
        if connection.vendor == "postgresql":
            execute(cur, sql.format(among="= ANY(%b::bigint[])"), [list(ids)])
            yield cur
            return
        chunk = sqlite_chunk(1)
        for start in range(0, len(ids), chunk):
            part = list(ids[start : start + chunk])
            execute(cur, sql.format(among=f"IN ({', '.join(['%s'] * len(part))})"), part)
            yield cur


def execute_for_ids(sql: str, ids: Sequence[int]) -> int:
    """Run `sql`, in which `{among}` follows an integer column, for those of its rows whose
    column is one of `ids`; returns the count of rows it touched.

    A fixed text instead of a queryset: Django compiles a query (an update with subqueries
    above all) anew at every call, which cost a heartbeat more CPU than the statement itself.
    On PostgreSQL the ids travel as one binary array (`= ANY`), so the text is the same for
    any number of them and prepared once; on SQLite as placeholders, in chunks it accepts.
    """
    return sum(cur.rowcount for cur in _for_ids(sql, ids))


def rows_for_ids(sql: str, ids: Sequence[int]) -> list[tuple]:
    """The rows a SELECT `sql` returns for `ids` (as execute_for_ids), as the driver gives them."""
    rows: list[tuple] = []
    for cur in _for_ids(sql, ids):
        rows += cur.fetchall()
    return rows
