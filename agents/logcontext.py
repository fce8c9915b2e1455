"""Log lines that say which job, attempt, node and tenant they are about, as text or as JSON.

Both ends use this, as they do agents.limits: the node agent and its fence set up their logging
with `configure`, and the control plane names `ContextFilter` and the formatters in
settings.LOGGING. So a line of either carries its ids under the same keys, and a log pipeline
can follow one job from the scheduling cycle that admitted it to the agent that ran it. No Django
here.

Code working on one job or attempt wraps that work in `bound(job_id=..., attempt_id=...)`:
every line logged inside the block, by any module, carries those ids, and the messages need not
repeat them. The ids live in a context variable, so a thread or a request sees only its own,
and a line logged after the block carries none of them.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any, TextIO

from pythonjsonlogger.json import JsonFormatter as _JsonFormatter

FORMATS = ("plain", "json")
# The ids a line may carry: their keys in JSON, and their short names at the end of a plain line.
FIELDS = {
    "job_id": "job",
    "attempt_id": "attempt",
    "node": "node",
    "tenant": "tenant",
    "cycle_id": "cycle",
}
PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_NONE: Mapping[str, object] = MappingProxyType({})
_bound: ContextVar[Mapping[str, object]] = ContextVar("gpucp_log_ids", default=_NONE)
# Set on an exception leaving a bound() block: the ids of the work that raised it, so that the
# line logging it further up, outside the block (a 500, a failed heartbeat cycle), names them.
_RAISED_WITH = "_gpucp_log_ids"


def check_format(value: str, name: str = "LOG_FORMAT") -> str:
    """The format named by an option, or ValueError naming the option and what it may be."""
    chosen = value.strip().lower()
    if chosen not in FORMATS:
        raise ValueError(f"{name} must be {' or '.join(FORMATS)}, not {value!r}")
    return chosen


def format_option(text: str) -> str:
    """check_format as an argparse type, for the agent's and the fence's --log-format. A type,
    not choices: argparse never checks a default (there GPUCP_LOG_FORMAT's value) against its
    choices, so a mistyped variable would pass unnoticed."""
    try:
        return check_format(text, "GPUCP_LOG_FORMAT / --log-format")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@contextmanager
def bound(**ids: object) -> Iterator[None]:
    """Lines logged inside carry these ids, besides those bound around it; None binds nothing.

    Keys are those of FIELDS: job_id, attempt_id, node, tenant, cycle_id.
    """
    unknown = ids.keys() - FIELDS.keys()
    if unknown:
        raise TypeError(f"not a log context field: {', '.join(sorted(unknown))}")
    token = _bound.set({**_bound.get(), **{k: v for k, v in ids.items() if v is not None}})
    try:
        yield
    except BaseException as exc:
        # The innermost block knows the most: an outer one leaves its ids as they are.
        if not hasattr(exc, _RAISED_WITH):
            try:
                setattr(exc, _RAISED_WITH, _bound.get())
            except (AttributeError, TypeError):
                pass  # an exception type that takes no attributes: its line goes without
        raise
    finally:
        _bound.reset(token)


def current() -> dict[str, object]:
    """The ids bound here and now."""
    return dict(_bound.get())


class ContextFilter(logging.Filter):
    """Puts the ids bound where a line is logged on its record, as attributes named as FIELDS,
    for the formatters. An id the call passed itself (`extra=`) is kept. Attached to handlers,
    so that it sees the lines of every logger."""

    def filter(self, record: logging.LogRecord) -> bool:
        ids = _bound.get()
        raised = record.exc_info[1] if record.exc_info else None
        if raised is not None:
            ids = {**getattr(raised, _RAISED_WITH, _NONE), **ids}
        for key in FIELDS:  # in one order, so that JSON lines list them alike
            if key in ids and key not in record.__dict__:
                setattr(record, key, ids[key])
        return True


class PlainFormatter(logging.Formatter):
    """The text line, followed by the ids it carries: `... attempt 3 started [job=12 attempt=3]`.
    A line that carries none reads exactly as without this formatter."""

    def __init__(self, fmt: str = PLAIN_FORMAT, datefmt: str | None = None) -> None:
        super().__init__(fmt, datefmt)

    def formatMessage(self, record: logging.LogRecord) -> str:
        text = super().formatMessage(record)
        ids = " ".join(
            f"{short}={record.__dict__[key]}"
            for key, short in FIELDS.items()
            if record.__dict__.get(key) is not None
        )
        # Before any traceback, which format() appends below this line.
        return f"{text} [{ids}]" if ids else text


class JsonFormatter(_JsonFormatter):
    """One JSON object per line: time (ISO 8601, UTC), level, logger, message, then exc_info
    (the traceback as text) when there is one, the ids the line carries, and what the call
    passed as `extra=`. `static_fields` go on every line (the agent's node name)."""

    def __init__(self, *, static_fields: Mapping[str, object] | None = None) -> None:
        super().__init__(
            "%(levelname)s %(name)s %(message)s",
            rename_fields={"levelname": "level", "name": "logger"},
            static_fields=dict(static_fields or {}),
        )

    def add_fields(
        self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]
    ) -> None:
        # First, so that a person reading the raw line sees when before what.
        log_data["time"] = iso_utc(record.created)
        super().add_fields(log_data, record, message_dict)


def iso_utc(unix_s: float) -> str:
    """2026-12-05T10:11:12.345Z: ISO 8601 in UTC, to the millisecond."""
    whole = int(unix_s)
    millis = min(999, int((unix_s - whole) * 1000))
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{millis:03d}Z"


def make_formatter(
    log_format: str,
    *,
    static_fields: Mapping[str, object] | None = None,
    plain_format: str = PLAIN_FORMAT,
) -> logging.Formatter:
    """The formatter of a format of FORMATS."""
    if log_format == "json":
        return JsonFormatter(static_fields=static_fields)
    return PlainFormatter(plain_format)


def configure(
    log_format: str,
    level: int,
    *,
    static_fields: Mapping[str, object] | None = None,
    plain_format: str = PLAIN_FORMAT,
    stream: TextIO | None = None,
) -> None:
    """A process's logging, as logging.basicConfig would set it (to stderr, and only where
    nothing set it up before), in this format and with the ids of the work on every line."""
    handler = logging.StreamHandler(stream)
    handler.addFilter(ContextFilter())
    handler.setFormatter(
        make_formatter(log_format, static_fields=static_fields, plain_format=plain_format)
    )
    logging.basicConfig(level=level, handlers=[handler])
