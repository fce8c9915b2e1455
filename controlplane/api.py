"""Shared API plumbing: the error format, and the boundary every query string passes.

`QueryParamsBoundary` is mixed into every /api/v1/ view (ScopedViewSet, the usage views). After
authentication it refuses, with a 400 naming the parameter:
- a parameter the operation's OpenAPI schema does not declare (a typo such as `?stat=RUNNING`
  would otherwise return every job as if it had matched);
- a parameter the schema declares once, given several times;
- a value with text PostgreSQL cannot store (NUL, a lone surrogate).
The declared parameters are read from the schema itself (filterset, ordering, pagination and
each view's own declarations, as drf-spectacular publishes them at /api/schema/), so what the
schema says and what the API accepts cannot drift apart.
"""

from __future__ import annotations

import logging
import threading

from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import exceptions
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.views import exception_handler as drf_exception_handler

from controlplane.validators import NON_FIELD, shown, text_problem

log = logging.getLogger(__name__)


class CsvRenderer(BaseRenderer):
    """Lets a client that asks for text/csv (Accept) reach a view that answers CSV itself (an
    HttpResponse), instead of a 406; an error answered on the way is JSON text."""

    media_type = "text/csv"
    format = "csv"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None):
        if isinstance(data, str):
            return data.encode()
        return JSONRenderer().render(data)


# For views and actions that answer CSV: JSON first (errors, a client that asks for nothing).
CSV_RENDERERS = [JSONRenderer, CsvRenderer]


def exception_handler(exc, context):
    # Model-level validation that slipped past a serializer still answers 400 naming the field.
    if isinstance(exc, DjangoValidationError):
        exc = exceptions.ValidationError(
            exc.message_dict if hasattr(exc, "error_dict") else {"non_field_errors": exc.messages}
        )
    return drf_exception_handler(exc, context)


class QueryParamsBoundary:
    """Refuses query parameters the schema does not declare, and unstorable text in them."""

    def initial(self, request, *args, **kwargs):
        super().initial(request, *args, **kwargs)
        # A key in the URL that no object could have (/api/v1/tenants/a%00b/) names nothing.
        if any(isinstance(v, str) and text_problem(v) for v in kwargs.values()):
            raise exceptions.NotFound()
        action = getattr(self, "action", None) or request.method.lower()
        if action == "head":
            action = "get"
        declared = documented_query_parameters(type(self), action)
        errors = query_parameter_errors(request.query_params, declared or {})
        if errors:
            raise exceptions.ValidationError(errors)


def query_parameter_errors(query, declared: dict[str, dict]) -> dict[str, list[str]]:
    errors: dict[str, list[str]] = {}
    for name, values in query.lists():
        problem = text_problem(name)
        if problem is not None:
            errors.setdefault(NON_FIELD, []).append(f"The parameter {shown(name)!r} {problem}.")
            continue
        parameter = declared.get(name)
        if parameter is None:
            takes = ", ".join(sorted(declared)) or "no query parameters"
            errors[name] = [f"Unknown query parameter; this operation takes {takes}."]
            continue
        if len(values) > 1 and not _repeatable(parameter):
            errors[name] = ["Give this parameter once."]
            continue
        for value in values:
            problem = text_problem(value)
            if problem is not None:
                errors[name] = [problem[0].upper() + problem[1:] + "."]
                break
    return errors


def _repeatable(parameter: dict) -> bool:
    # OpenAPI: an array in a form-style query parameter repeats the name unless explode is false.
    return parameter.get("schema", {}).get("type") == "array" and parameter.get("explode", True)


_table_lock = threading.Lock()
_table: dict[tuple[type, str], dict[str, dict]] | None = None


def documented_query_parameters(view_class: type, action: str) -> dict[str, dict] | None:
    """Name -> OpenAPI parameter for each query parameter of the operation; None if undocumented.

    Built from the generated schema on first use (about half a second, once per process; a web
    process builds it at start, warm_query_parameters).
    """
    global _table
    if _table is None:
        with _table_lock:
            if _table is None:
                _table = _query_parameters_by_operation()
    return _table.get((view_class, action))


def warm_query_parameters() -> None:
    """Build the table now (a web process at start), so the first request does not wait for it.

    A failure is logged and left to the first request that needs the table, as before: the
    documentation's generator failing must not keep the web process from starting.
    """
    try:
        documented_query_parameters(QueryParamsBoundary, "get")
    except Exception:  # noqa: BLE001 - see the docstring
        log.exception("could not build the table of documented query parameters at start")


def _query_parameters_by_operation() -> dict[tuple[type, str], dict[str, dict]]:
    from drf_spectacular.settings import spectacular_settings

    generator = spectacular_settings.DEFAULT_GENERATOR_CLASS()
    schema = generator.get_schema(request=None, public=True)
    table = {}
    for path, _, method, callback in generator.endpoints:
        view = generator.create_view(callback, method)
        operations = schema["paths"].get(generator.coerce_path(path, method, view), {})
        operation = operations.get(method.lower())
        if operation is None:
            continue
        action = getattr(view, "action", None) or method.lower()
        table[(callback.cls, action)] = {
            p["name"]: p for p in operation.get("parameters", ()) if p.get("in") == "query"
        }
    return table
