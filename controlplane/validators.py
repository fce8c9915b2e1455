"""What every piece of text and every number must be before it may reach the database.

PostgreSQL stores no NUL character in text, and UTF-8 has no encoding for a lone surrogate
(U+D800..U+DFFF, which JSON's "\\ud800" escape can produce): either one in a query is a server
error, not an answer. Numbers past a signed 64-bit integer fit no column. These checks run once,
where input enters (the API's parsers and query parameters, the web UI's forms), and say which
field is at fault, so no view, serializer or query has to remember them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

from django.core.exceptions import ValidationError

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

# No NUL, no lone surrogate. Text that passes is what PostgreSQL and UTF-8 can hold.
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")

# Where errors about the request as a whole go (DRF's name).
NON_FIELD = "non_field_errors"
# Enough to show what is wrong without an error answer as long as the request.
MAX_PROBLEMS = 20


def text_problem(text: str) -> str | None:
    """Why this text cannot be stored, in words; None when it can."""
    match = _UNSTORABLE.search(text)
    if match is None:
        return None
    char = match.group()
    if char == "\x00":
        return "contains a NUL character (U+0000), which cannot be stored"
    return (
        f"contains a lone surrogate (U+{ord(char):04X}), which is not a character and cannot "
        "be stored"
    )


def shown(text: str, limit: int = 60) -> str:
    """The text as it may be echoed in an answer: escaped where it could not be encoded."""
    if text_problem(text) is None and text.isprintable():
        return text if len(text) <= limit else text[:limit] + "…"
    escaped = ascii(text)[1:-1]
    return escaped if len(escaped) <= limit else escaped[:limit] + "…"


def refuse_unstorable_text(value: str) -> None:
    """A Django validator: NUL or lone surrogate -> ValidationError."""
    problem = text_problem(value)
    if problem is not None:
        raise ValidationError(problem[0].upper() + problem[1:] + ".", code="unstorable")


class OutOfRange:
    """A JSON number no column can hold, kept as its literal so the error can say which field."""

    __slots__ = ("literal", "reason")

    def __init__(self, literal: str, reason: str):
        self.literal = literal
        self.reason = reason


def parse_json_int(literal: str):
    # Checked on the digits, before int(): Python refuses to convert more than 4,300 of them.
    if len(literal.lstrip("-")) > 19:
        return OutOfRange(literal, _int_range_reason(literal))
    value = int(literal)
    if not INT64_MIN <= value <= INT64_MAX:
        return OutOfRange(literal, _int_range_reason(literal))
    return value


def _int_range_reason(literal: str) -> str:
    return f"is out of range: whole numbers must lie between {INT64_MIN} and {INT64_MAX}"


def parse_json_float(literal: str):
    value = float(literal)
    if value in (float("inf"), float("-inf")):
        return OutOfRange(literal, "is beyond the largest number a double can hold (about 1.8e308)")
    return value


def parse_json_constant(literal: str):
    # NaN, Infinity and -Infinity: Python's json accepts them, JSON does not, and no column can
    # hold them.
    return OutOfRange(literal, f"is not a number JSON allows ({literal}); send a finite number")


def problems_in(data) -> dict[str, list[str]]:
    """Every unstorable string, key or number in parsed input, as DRF-style errors.

    The error key is the top-level field the problem is in (or non_field_errors); the message
    gives the path inside it, e.g. {"command": ["command[2] contains a NUL character ..."]}.
    """
    errors: dict[str, list[str]] = {}
    for field, message in _walk(data):
        errors.setdefault(field, []).append(message)
        if sum(len(v) for v in errors.values()) >= MAX_PROBLEMS:
            break
    return errors


def _walk(data) -> Iterator[tuple[str, str]]:
    # Iterative, depth-first: the parser has bounded the depth, but a stack costs nothing.
    stack: list[tuple[str | None, str, object]] = []
    if isinstance(data, Mapping):
        for key, value in reversed(list(data.items())):
            if isinstance(key, str) and text_problem(key) is not None:
                yield NON_FIELD, f"The field name {shown(key)!r} {text_problem(key)}."
                continue
            stack.append((str(key), str(key), value))
    else:
        stack.append((None, "", data))
    while stack:
        field, path, value = stack.pop()
        if isinstance(value, str):
            problem = text_problem(value)
            if problem is not None:
                yield _located(field, path, problem)
        elif isinstance(value, OutOfRange):
            yield _located(field, path, f"{shown(value.literal, 30)} {value.reason}")
        elif isinstance(value, Mapping):
            for key, item in reversed(list(value.items())):
                key = str(key)
                problem = text_problem(key)
                if problem is not None:
                    yield _located(field, path, f"has a key {shown(key)!r} that {problem}")
                    continue
                stack.append((field, f"{path}.{key}" if path else key, item))
        elif isinstance(value, list | tuple):
            for index in reversed(range(len(value))):
                stack.append((field, f"{path}[{index}]", value[index]))


def _located(field: str | None, path: str, problem: str) -> tuple[str, str]:
    if field is None:
        return NON_FIELD, (f"{path} {problem}." if path else f"The body {problem}.")
    if path == field:
        return field, problem[0].upper() + problem[1:] + "."
    return field, f"{path} {problem}."


def problems_in_query_dict(query) -> dict[str, list[str]]:
    """The same for a QueryDict (form bodies, query strings): keys and every value of each."""
    errors: dict[str, list[str]] = {}
    if hasattr(query, "lists"):
        pairs = query.lists()
    else:  # a plain dict, as tests and code hand to forms
        pairs = ((k, v if isinstance(v, list | tuple) else [v]) for k, v in query.items())
    for key, values in pairs:
        problem = text_problem(key)
        if problem is not None:
            errors.setdefault(NON_FIELD, []).append(f"The name {shown(key)!r} {problem}.")
            continue
        for value in values:
            if isinstance(value, str):
                problem = text_problem(value)
                if problem is not None:
                    errors[key] = [problem[0].upper() + problem[1:] + "."]
                    break
    return errors
