"""Reading rows fast: timestamps as Unix seconds computed by the database, and the driver's rows
without Django's converters.

The snapshot loader, the power-profile learner and the what-if history all read tables that
grow with the cluster; they share these helpers from here, below all of them, so that none of
them has to import another to get them.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, overload

import psycopg
from django.contrib.postgres.fields import ArrayField
from django.db import connections
from django.db.models import (
    BigIntegerField,
    BooleanField,
    Expression,
    F,
    FloatField,
    Func,
    TextField,
    Value,
)


class UnixSeconds(Func):
    """A timestamp column as Unix seconds, computed by the database.

    Turning tens of thousands of timestamps into datetimes in Python and back into numbers
    was the largest part of a load; the database hands over plain floats instead.
    """

    output_field = FloatField()

    def as_postgresql(self, compiler, connection, **extra_context):
        return self.as_sql(
            compiler, connection, template="EXTRACT(EPOCH FROM %(expressions)s)::float8"
        )

    def as_sqlite(self, compiler, connection, **extra_context):
        # Django stores aware datetimes in UTC; julianday reads that text format.
        return self.as_sql(
            compiler, connection, template="(julianday(%(expressions)s) - 2440587.5) * 86400.0"
        )


def unix_s(field_name: str) -> UnixSeconds:
    return UnixSeconds(F(field_name))


class AnyOf(Func):
    """`column = ANY(ids)` (PostgreSQL): one array parameter for any number of ids, so that the
    statement's text, and the plan psycopg prepares for it, is the same for every number."""

    output_field = BooleanField()
    arg_joiner = " = ANY("
    template = "%(expressions)s)"

    def __init__(self, column, ids: list[int]):
        super().__init__(column, Value(ids, output_field=ArrayField(BigIntegerField())))


class RowVersion(Expression):
    """Which version of a row this is: its xmin and ctid on PostgreSQL, NULL on other databases.

    PostgreSQL never changes a row in place: an UPDATE writes a new version, in a slot of its
    own (ctid) and stamped with the (sub)transaction that wrote it (xmin). So two versions of a
    row that one reader sees in turn differ in the pair: written by different transactions, the
    xmin differs; by the same one, the ctid does, since a slot is reused only once the version
    in it is dead to every transaction. A reader that kept what it built from a row can tell
    whether the row changed from these few bytes, whatever order the writers committed in.
    """

    output_field = TextField()

    def __init__(self, model):
        super().__init__()
        self.model = model

    def as_sql(self, compiler, connection):
        return "NULL", []

    def as_postgresql(self, compiler, connection):
        return row_version_sql(compiler.quote_name_unless_alias(self.model._meta.db_table)), []


def row_version_sql(table: str) -> str:
    """RowVersion's SQL for a quoted table name, for statements written out (a write guarded by
    the version read, RETURNING the one it makes): the one place that says what a version is."""
    return f"({table}.xmin::text || {table}.ctid::text)"


def raw_rows(queryset) -> list[tuple]:
    """Run a values_list queryset and return the driver's rows as they are.

    Skips Django's per-value converters, which cost as much as the query itself on the tables
    that grow with the cluster. Only for columns the driver already returns as plain numbers,
    text or booleans (SQLite returns booleans as 0/1: callers wrap them in bool()).
    """
    sql, params = queryset.query.sql_with_params()
    with connections[queryset.db].cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


def literal_sql(connection, sql: str, params) -> str:
    """`sql` with `params` written in as PostgreSQL literals, quoted by the driver itself.

    For constants only (states, the epoch's name): a statement whose text holds a value that
    changes would be a new statement, planned anew, at every call.
    """
    connection.ensure_connection()
    return psycopg.ClientCursor(connection.connection).mogrify(sql, params)


# The SQL of the fixed reads of every cycle, by the function that builds the queryset, the
# database alias and its vendor: building a queryset and compiling it cost more of a cycle's CPU
# than running it (about a quarter of a snapshot load with a few hundred waiting jobs).
_compiled: dict[tuple[Callable[[], Any], str, str], tuple[str, tuple | None]] = {}


def fixed_rows(build: Callable[[], Any], using: str = "default") -> list[tuple]:
    """raw_rows of the values_list queryset that build() returns, compiled once per process.

    Only for a query whose SQL and parameters are the same at every call: no times, no ids, no
    settings that may change while the process runs. build must be a module-level function
    (it is the cache's key).

    On PostgreSQL the parameters are written into the statement as literals. psycopg prepares
    a statement a connection runs often (settings.DB_PREPARED_STATEMENTS), and PostgreSQL then
    plans it once for any parameters: with `state = $2` that plan can use no partial index
    (`state = 'PENDING'` cannot be proven of an unknown value) and no statistics of the
    column, so the waiting jobs were read through the index of every state and sorted, and
    the jobs with earlier attempts past the whole index of states. With the constants in the
    text, the one plan is the one for these values.
    """
    with connections[using].cursor() as cursor:
        cursor.execute(*fixed_statement(build, using))
        return cursor.fetchall()


def fixed_statement(build: Callable[[], Any], using: str = "default") -> tuple[str, tuple | None]:
    """The SQL and parameters fixed_rows runs for build(), compiled at the first call.

    None for parameters where they are written into the SQL: the statement then runs as it
    is, a `%` in a literal included.
    """
    connection = connections[using]
    key = (build, using, connection.vendor)
    compiled = _compiled.get(key)
    if compiled is None:
        queryset = build().using(using)
        sql, params = queryset.query.sql_with_params()
        if connection.vendor == "postgresql" and params:
            compiled = (literal_sql(connection, sql, params), None)
        else:
            compiled = (sql, tuple(params))
        _compiled[key] = compiled
    return compiled


@overload
def from_unix_s(value: float) -> datetime: ...
@overload
def from_unix_s(value: None) -> None: ...
@overload
def from_unix_s(value: float | None) -> datetime | None: ...
def from_unix_s(value: float | None) -> datetime | None:
    return None if value is None else datetime.fromtimestamp(value, tz=UTC)
