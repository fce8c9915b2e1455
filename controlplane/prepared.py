"""Querysets compiled once and run again with new arguments: for the hot paths' small reads.

Django builds a queryset and compiles it to SQL anew at every call; for the reads of a heartbeat
or a request (a handful of rows by id, under a lock) that costs more CPU than PostgreSQL spends
running them. A Prepared query is built once per process and shape of its arguments, with
stand-in values where the arguments go; each call puts the real values in their places and runs
the same text on the calling thread's connection, and Django's own converters (timestamps, JSON)
still turn the driver's rows into what the queryset would have returned. The converters only
read the settings of the connection that compiled it (time zone, backend operations), the same
for every thread, so the compiled form is shared by all of a web process's threads.

    ATTEMPTS = Prepared(lambda ids: JobAttempt.objects.filter(pk__in=ids).values("pk", "state"))
    ATTEMPTS.values([3, 4])   # [{"pk": 3, "state": "running"}, ...]

The builder must use its arguments only as filter values that Django passes through unchanged
(integers and lists of them, text): the stand-ins are found in the compiled parameters, and a
builder that transforms one is refused when it is first compiled. A list is one shape per
length (Django writes `IN (%s, %s, ...)`), and an empty one reads nothing, as `pk__in=[]` does.

Below every app: imports no app.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from django.db import connections

# Lists up to this long are compiled once per length; a longer one is compiled at its call, so
# that the forms kept stay few whatever lengths callers pass.
MAX_CACHED_LENGTH = 64

# Stand-ins: integers no id reaches, and text no caller passes (NUL is refused at every input).
_FIRST_INT = -(2**62)


def _stand_in(n: int, like: object) -> object:
    if isinstance(like, bool) or not isinstance(like, int | str):
        raise TypeError(f"a Prepared query takes integers, text and lists of them, not {like!r}")
    return _FIRST_INT - n if isinstance(like, int) else f"\x00prepared-{n}"


class _Compiled:
    __slots__ = ("compiler", "sql", "params", "places", "names")

    def __init__(self, compiler, sql: str, params: list, places: list, names: list[str]):
        self.compiler = compiler
        self.sql = sql
        self.params = params
        self.places = places  # (position in params, argument index, element index or None)
        self.names = names


class Prepared:
    """A values() or values_list() queryset built by `build(*args)`, compiled once per shape
    and database vendor."""

    def __init__(self, build: Callable[..., Any], using: str = "default"):
        self._build = build
        self._using = using
        self._cache: dict[tuple, _Compiled] = {}
        self._lock = threading.Lock()

    def _compiled(self, args: Sequence) -> _Compiled:
        shape = tuple(len(a) if isinstance(a, list | tuple) else None for a in args)
        if any(n is not None and n > MAX_CACHED_LENGTH for n in shape):
            return self._compile(args)  # rare, and not worth a form kept for ever
        key = (connections[self._using].vendor, shape)
        found = self._cache.get(key)
        if found is not None:
            return found
        with self._lock:
            found = self._cache.get(key)
            if found is None:
                found = self._cache[key] = self._compile(args)
        return found

    def _compile(self, args: Sequence) -> _Compiled:
        slots: dict[object, tuple[int, int | None]] = {}
        stand_ins: list[object] = []
        for i, arg in enumerate(args):
            if isinstance(arg, list | tuple):
                items = []
                for j, item in enumerate(arg):
                    s = _stand_in(len(slots), item)
                    slots[s] = (i, j)
                    items.append(s)
                stand_ins.append(items)
            else:
                s = _stand_in(len(slots), arg)
                slots[s] = (i, None)
                stand_ins.append(s)
        queryset = self._build(*stand_ins).using(self._using)
        query = queryset.query
        compiler = query.get_compiler(self._using)
        sql, params = compiler.as_sql()
        places = []
        for position, param in enumerate(params):
            slot = slots.get(param) if isinstance(param, int | str) else None
            if slot is not None:
                places.append((position, *slot))
        if len(places) != len(slots):
            raise ValueError(
                "a Prepared query's builder must pass each argument to the database unchanged"
            )
        names = [*query.extra_select, *query.values_select, *query.annotation_select]
        return _Compiled(compiler, sql, list(params), places, names)

    def rows(self, *args) -> list[tuple]:
        """The rows, converted as the queryset converts them (tuples in its column order)."""
        if any(isinstance(a, list | tuple) and not a for a in args):
            return []
        compiled = self._compiled(args)
        params = list(compiled.params)
        for position, i, j in compiled.places:
            params[position] = args[i] if j is None else args[i][j]
        with connections[self._using].cursor() as cursor:
            cursor.execute(compiled.sql, params)
            fetched = cursor.fetchall()
        return list(compiled.compiler.results_iter(results=[fetched], tuple_expected=True))

    def values(self, *args) -> list[dict[str, Any]]:
        """The rows as values() gives them: a dict per row, by field name."""
        if any(isinstance(a, list | tuple) and not a for a in args):
            return []
        names = self._compiled(args).names
        return [dict(zip(names, row, strict=True)) for row in self.rows(*args)]
