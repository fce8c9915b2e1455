"""Model instances from fixed SQL statements: for the few reads and writes every submit makes.

Compiling an ORM query costs about a millisecond of Python on every run (a token with its user:
0.9 to 1.4 ms, against 0.08 ms for the same statement sent as it is), and a submit made three
such reads before it wrote anything. The reads that every request repeats are written once as
SQL, with their columns from the models' own metadata, and each row is turned into model
instances with the converters the ORM would apply (SQLite's datetimes, JSON as text), so what
comes back is what the queryset would have returned. The same for the two rows every submit
inserts (the job and its first event): Model.save compiles its INSERT anew each time (about
half of a submit's ORM time), insert() sends one written once per model.

Below every app: imports no app.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from django.db import DEFAULT_DB_ALIAS, connections
from django.db.models import Model, signals

M = TypeVar("M", bound=Model)


class Columns(Generic[M]):
    """One model's concrete columns under a table alias: the SELECT list, and how a row's
    slice of values becomes an instance."""

    def __init__(self, model: type[M], alias: str):
        self.model = model
        self.alias = alias
        self.fields = tuple(model._meta.concrete_fields)
        self.attnames = [f.attname for f in self.fields]
        self.pk_index = self.fields.index(model._meta.pk)
        self._converters: dict[str, list[tuple[int, list[Callable], Any]]] = {}

    def __len__(self) -> int:
        return len(self.fields)

    def select(self, using: str = DEFAULT_DB_ALIAS) -> str:
        quote = connections[using].ops.quote_name
        # A concrete field always has a column (only a non-concrete one has none).
        return ", ".join(f"{self.alias}.{quote(str(f.column))}" for f in self.fields)

    def table(self, using: str = DEFAULT_DB_ALIAS) -> str:
        quote = connections[using].ops.quote_name
        return f"{quote(self.model._meta.db_table)} {self.alias}"

    def _converters_for(self, using: str) -> list[tuple[int, list[Callable], Any]]:
        # The same pairs SQLCompiler.get_converters makes: the backend's, then the field's.
        found = self._converters.get(using)
        if found is None:
            connection = connections[using]
            found = []
            for i, field in enumerate(self.fields):
                column = field.get_col(self.alias)
                converters = connection.ops.get_db_converters(column)
                converters += column.get_db_converters(connection)
                if converters:
                    found.append((i, converters, column))
            self._converters[using] = found
        return found

    def build(self, values: Sequence[Any], using: str = DEFAULT_DB_ALIAS) -> M:
        connection = connections[using]
        row = list(values)
        for i, converters, column in self._converters_for(using):
            value = row[i]
            for convert in converters:
                value = convert(value, column, connection)
            row[i] = value
        return self.model.from_db(using, self.attnames, row)


def fetch(sql: str, params: Sequence[Any], using: str = DEFAULT_DB_ALIAS) -> list[tuple]:
    with connections[using].cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


_insert_sql: dict[tuple[type[Model], str], tuple[str, tuple]] = {}


def _insert_statement(model: type[Model], using: str) -> tuple[str, tuple]:
    """The INSERT of one row with every concrete column but the auto primary key, returning it."""
    found = _insert_sql.get((model, using))
    if found is None:
        meta = model._meta
        quote = connections[using].ops.quote_name
        fields = tuple(f for f in meta.local_concrete_fields if f is not meta.auto_field)
        columns = ", ".join(quote(str(f.column)) for f in fields)
        marks = ", ".join(["%s"] * len(fields))
        assert meta.pk is not None  # every model has one
        pk = quote(str(meta.pk.column))
        sql = f"INSERT INTO {quote(meta.db_table)} ({columns}) VALUES ({marks}) RETURNING {pk}"
        found = _insert_sql[(model, using)] = (sql, fields)
    return found


def _plain_insert(instance: Model, using: str) -> tuple[str, tuple, list] | None:
    """(statement, fields, parameters) of insert()'s fixed statement for this new instance, or
    None where the ORM's own save must do it (see insert())."""
    model = type(instance)
    meta = model._meta
    connection = connections[using]
    plain = (
        meta.auto_field is not None
        and instance.pk is None
        and not meta.parents
        and list(meta.db_returning_fields) == [meta.auto_field]
        and connection.features.can_return_columns_from_insert
        and not signals.pre_save.has_listeners(model)
        and not signals.post_save.has_listeners(model)
    )
    if not plain:
        return None
    # What save() checks first: a related object assigned before it was saved.
    instance._prepare_related_fields_for_save(operation_name="save")  # type: ignore[attr-defined]
    sql, fields = _insert_statement(model, using)
    values = [f.pre_save(instance, True) for f in fields]
    if any(hasattr(v, "resolve_expression") for v in values):
        return None
    params = [
        f.get_db_prep_save(v, connection=connection) for f, v in zip(fields, values, strict=True)
    ]
    return sql, fields, params


def _inserted(instance: Model, pk: Any, using: str) -> None:
    """The instance after its row went in with primary key `pk`, as save() leaves it."""
    setattr(instance, instance._meta.auto_field.attname, pk)  # type: ignore[union-attr]
    instance._state.adding = False
    instance._state.db = using


def insert(instance: Model, using: str = DEFAULT_DB_ALIAS) -> None:
    """Insert a new instance as Model.save(force_insert=True) would, with a fixed statement.

    The ORM's own save where this could differ from it: a model with save signal receivers,
    an explicit primary key, a column filled by the database besides the key (db_default), a
    parent model, a value that is an expression (a subquery), or a backend that cannot return
    the new key."""
    plain = _plain_insert(instance, using)
    if plain is None:
        instance.save(force_insert=True, using=using)
        return
    sql, _, params = plain
    with connections[using].cursor() as cursor:
        cursor.execute(sql, params)
        (pk,) = cursor.fetchone()
    _inserted(instance, pk, using)


_pair_sql: dict[tuple[type[Model], type[Model], str, str], str] = {}


def one_statement_pair(
    parent: Model, child: Model, link: str, using: str = DEFAULT_DB_ALIAS
) -> Callable[[], None] | None:
    """insert(parent), then insert(child) pointing at it through its foreign key `link` (the
    attname, "job_id"), as one statement, ready to run: the child's row takes the parent's new
    key from a data-modifying WITH, so the pair costs one round trip instead of two, and is
    atomic on its own. None where that cannot be: a backend other than PostgreSQL (SQLite has
    no INSERT inside WITH), or either instance needs the ORM's save (see insert())."""
    connection = connections[using]
    if connection.vendor != "postgresql":
        return None
    first = _plain_insert(parent, using)
    # The child's link is filled by the statement: left out of its values here.
    second = _plain_insert(child, using) if first is not None else None
    if first is None or second is None:
        return None
    (parent_sql, _, parent_params), (_, child_fields, child_params) = first, second
    key = (type(parent), type(child), link, using)
    sql = _pair_sql.get(key)
    if sql is None:
        quote = connection.ops.quote_name
        marks = ", ".join(
            f"(SELECT {quote(str(parent._meta.pk.column))} FROM parent)"  # type: ignore[union-attr]
            if f.attname == link
            else "%s"
            for f in child_fields
        )
        child_meta = child._meta
        columns = ", ".join(quote(str(f.column)) for f in child_fields)
        (link_column,) = (f.column for f in child_fields if f.attname == link)
        sql = _pair_sql[key] = (
            f"WITH parent AS ({parent_sql}) "
            f"INSERT INTO {quote(child_meta.db_table)} ({columns}) VALUES ({marks}) "
            f"RETURNING {quote(str(link_column))}, "
            f"{quote(str(child_meta.pk.column))}"  # type: ignore[union-attr]
        )
    params = parent_params + [
        p for f, p in zip(child_fields, child_params, strict=True) if f.attname != link
    ]

    def run() -> None:
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            parent_pk, child_pk = cursor.fetchone()
        _inserted(parent, parent_pk, using)
        setattr(child, link, parent_pk)
        _inserted(child, child_pk, using)

    return run


def insert_pair(parent: Model, child: Model, link: str, using: str = DEFAULT_DB_ALIAS) -> None:
    """The pair of one_statement_pair, in one statement where it can be, else two inserts
    (inside the caller's transaction, which makes them one)."""
    run = one_statement_pair(parent, child, link, using)
    if run is not None:
        run()
        return
    insert(parent, using)
    setattr(child, link, parent.pk)
    insert(child, using)
