"""The user API's request bodies, checked once before any view sees them.

Whatever the endpoint, a body that parses is one the database can hold: no NUL or lone
surrogate in any string or key, no number past a signed 64-bit integer or a double, no NaN or
Infinity, and JSON no deeper than MAX_JSON_DEPTH. Anything else is a 400 naming the field
(`{"command": ["command[2] contains a NUL character ..."]}`), never a 500 from the database,
from Python's recursion limit or from a JSON error that names nothing. Fields' own rules
(ranges, formats) stay with the serializers.
"""

from __future__ import annotations

import json
import re

from django.conf import settings
from rest_framework import exceptions, parsers

from controlplane.validators import (
    NON_FIELD,
    parse_json_constant,
    parse_json_float,
    parse_json_int,
    problems_in,
    problems_in_query_dict,
)

# No request of this API nests more than three levels (env in a job); 64 leaves room for any
# that will, and is far below what recursion in Python's json module (about 1,000) survives.
MAX_JSON_DEPTH = 64

# A JSON string (escapes included) or a bracket: enough to measure nesting without parsing.
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def too_deep(text: str, max_depth: int = MAX_JSON_DEPTH) -> tuple[bool, str | None]:
    """Whether the JSON text nests deeper than max_depth, and under which top-level field."""
    if text.count("[") + text.count("{") <= max_depth:
        return False, None
    depth = 0
    root_is_object = False
    last_key: str | None = None
    field: str | None = None
    for match in _TOKEN.finditer(text):
        token = match.group()
        if token[0] == '"':
            if depth == 1 and root_is_object:
                last_key = token
            continue
        if token in "[{":
            depth += 1
            if depth == 1:
                root_is_object = token == "{"
            elif depth == 2 and root_is_object:
                field = last_key
            if depth > max_depth:
                return True, _decoded_key(field)
        else:
            depth -= 1
    return False, None


def _decoded_key(token: str | None) -> str | None:
    if token is None:
        return None
    try:
        return json.loads(token)
    except ValueError:
        return None


class JSONParser(parsers.JSONParser):
    def parse(self, stream, media_type=None, parser_context=None):
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        try:
            text = stream.read().decode(encoding)
        except UnicodeDecodeError as exc:
            raise exceptions.ParseError(
                f"The body is not valid {encoding}: {exc.reason}."
            ) from None
        deep, field = too_deep(text)
        if deep:
            raise _depth_error(field)
        try:
            data = json.loads(
                text,
                parse_int=parse_json_int,
                parse_float=parse_json_float,
                parse_constant=parse_json_constant,
            )
        except RecursionError:
            # Not reachable past too_deep(), which counts what json would recurse into; kept so
            # that a miscount is a 400, never a crashed worker.
            raise _depth_error(None) from None
        except ValueError as exc:
            raise exceptions.ParseError(f"JSON parse error - {exc}") from None
        problems = problems_in(data)
        if problems:
            raise exceptions.ValidationError(problems)
        return data


def _depth_error(field: str | None) -> exceptions.ValidationError:
    message = f"Nested more than {MAX_JSON_DEPTH} levels deep; no field of this API needs that."
    if field is not None and problems_in({field: None}) == {}:
        return exceptions.ValidationError({field: [message]})
    return exceptions.ValidationError({NON_FIELD: [message]})


class FormParser(parsers.FormParser):
    def parse(self, stream, media_type=None, parser_context=None):
        data = super().parse(stream, media_type, parser_context)
        problems = problems_in_query_dict(data)
        if problems:
            raise exceptions.ValidationError(problems)
        return data


class MultiPartParser(parsers.MultiPartParser):
    def parse(self, stream, media_type=None, parser_context=None):
        result = super().parse(stream, media_type, parser_context)
        problems = problems_in_query_dict(result.data)
        if problems:
            raise exceptions.ValidationError(problems)
        return result
