"""The agent API (docs/agent-protocol.md): register, heartbeat, watch, logs.

Plain Django views rather than DRF: agents are not users, so none of the user API's
authentication, permissions or content negotiation applies, and a heartbeat is the hottest
path of the system (10,000 nodes every 10 s). Bodies are validated strictly; a 400 names the
field at fault, like the user API does (`{"gpus[2].uuid": ["..."]}`).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from functools import wraps

from django.conf import settings
from django.db import (
    IntegrityError,
    InterfaceError,
    OperationalError,
    connection,
    transaction,
)
from django.db.models import F, Q
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from agents import limits, logcontext
from controlplane.cluster import actions as cluster_actions
from controlplane.cluster import gpu_claims, lease, watch_hub
from controlplane.cluster import heartbeat as hb_logic
from controlplane.cluster.agent_auth import (
    AgentAuthError,
    authenticate_node,
    bearer_token,
    node_token_digest,
)
from controlplane.cluster.heartbeat import AttemptReport, ConditionReport, Heartbeat
from controlplane.cluster.models import NODE_NAME_RE, Node
from controlplane.cluster.telemetry import GpuSample
from controlplane.jobs.models import AttemptMember, JobAttempt, LogChunk
from controlplane.storage import actions as storage_actions
from controlplane.storage import queries as storage_queries
from controlplane.unavailable import connection_lost
from controlplane.validators import text_problem as unstorable_text

log = logging.getLogger(__name__)

WATCH_MAX_TIMEOUT_S = 30.0
LOG_CHUNK_MAX_BYTES = 1024 * 1024


# --- validation ------------------------------------------------------------------------------
#
# Every value an agent sends is checked here, once, before anything is written: numbers within
# what the hardware and runtimes can report (agents.limits), text that PostgreSQL can store (no
# NUL, no lone surrogate). A registration or a log chunk with a bad field is refused whole (400
# naming it). A heartbeat is not: it renews the node's lease and carries its attempts' exits,
# and refusing it for one garbled sensor reading would end with the node's fence stopping every
# job. So a bad optional part of a heartbeat (a reading, a message, a condition) is left out and
# named under "warnings" in the answer; only a heartbeat whose frame (seq, sent_at, the lists)
# is unreadable is refused.


class Refused(Exception):
    """A well-formed request the credential does not allow (403) or the state forbids (409)."""

    def __init__(self, status: int, message: str):
        self.status = status
        self.message = message
        super().__init__(message)


class Invalid(Exception):
    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


MISSING = object()
MIN_INTEGER = -(2**63)
# A float beyond this is not a measurement, and float() of a larger integer overflows.
MAX_MAGNITUDE = 1e300
# What a GPU UUID may look like: printable ASCII without spaces (NVML's "GPU-8b1c...",
# "MIG-..."). It is an identity, compared byte for byte and shown in URLs.
GPU_UUID_RE = re.compile(r"[!-~]{1,96}")


def text_problem(value: str) -> str | None:
    """Why PostgreSQL cannot store this text, as a sentence (the project's one rule, in
    controlplane.validators); None when it can."""
    problem = unstorable_text(value)
    return None if problem is None else problem[0].upper() + problem[1:] + "."


def _get(body: dict, key: str, path: str, *, required: bool):
    if key not in body or body[key] is None:
        if required:
            raise Invalid(path + key, "This field is required.")
        return MISSING
    return body[key]


def _bounded(value, path: str, minimum, maximum):
    if minimum is not None and value < minimum:
        raise Invalid(path, f"Must be at least {minimum:g}.")
    if maximum is not None and value > maximum:
        raise Invalid(path, f"Must be at most {maximum:g}.")


def number(
    body: dict,
    key: str,
    path: str = "",
    *,
    required: bool = False,
    minimum=None,
    maximum=None,
):
    value = _get(body, key, path, required=required)
    if value is MISSING:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not -MAX_MAGNITUDE <= value <= MAX_MAGNITUDE  # NaN and the infinities fail this
    ):
        raise Invalid(path + key, "Must be a finite number.")
    _bounded(value, path + key, minimum, maximum)
    return float(value)


def integer(
    body: dict,
    key: str,
    path: str = "",
    *,
    required: bool = False,
    minimum=MIN_INTEGER,
    maximum=limits.MAX_COUNT,
):
    value = _get(body, key, path, required=required)
    if value is MISSING:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise Invalid(path + key, "Must be an integer.")
    # Every integer lands in a 64-bit column at most, or is compared with one.
    _bounded(value, path + key, max(MIN_INTEGER, minimum), min(limits.MAX_COUNT, maximum))
    return value


def string(
    body: dict,
    key: str,
    path: str = "",
    *,
    required: bool = False,
    max_length: int = 1000,
    text: bool = True,
):
    """A string field; with `text` (all but raw data), one PostgreSQL can store as text."""
    value = _get(body, key, path, required=required)
    if value is MISSING:
        return None
    if not isinstance(value, str):
        raise Invalid(path + key, "Must be a string.")
    if required and not value:
        raise Invalid(path + key, "May not be blank.")
    if len(value) > max_length:
        raise Invalid(path + key, f"At most {max_length} characters.")
    if text and (problem := text_problem(value)) is not None:
        raise Invalid(path + key, problem)
    return value


def gpu_uuid(body: dict, key: str, path: str = "", *, required: bool = False):
    value = string(body, key, path, required=required, max_length=96)
    if value is not None and not GPU_UUID_RE.fullmatch(value):
        raise Invalid(path + key, "Printable ASCII without spaces, at most 96 characters.")
    return value


def boolean(body: dict, key: str, path: str = "", *, default: bool):
    value = _get(body, key, path, required=False)
    if value is MISSING:
        return default
    if not isinstance(value, bool):
        raise Invalid(path + key, "Must be true or false.")
    return value


def objects(body: dict, key: str, path: str = "", *, required: bool) -> list[dict]:
    value = _get(body, key, path, required=required)
    if value is MISSING:
        return []
    if not isinstance(value, list):
        raise Invalid(path + key, "Must be a list.")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise Invalid(f"{path}{key}[{i}]", "Must be an object.")
    return value


def items(body: dict, key: str, *, required: bool) -> list:
    """A list whose entries are checked one by one (a heartbeat's), so a bad one is left out."""
    value = _get(body, key, "", required=required)
    if value is MISSING:
        return []
    if not isinstance(value, list):
        raise Invalid(key, "Must be a list.")
    return value


def parse_json(request: HttpRequest) -> dict:
    return parse_body(request.body)


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError):
        raise Invalid("non_field_errors", "The body is not valid JSON.") from None
    except RecursionError:
        raise Invalid("non_field_errors", "The body is nested too deeply.") from None
    if not isinstance(body, dict):
        raise Invalid("non_field_errors", "The body must be a JSON object.")
    return body


def parse_labels(body: dict) -> dict[str, str]:
    labels = _get(body, "labels", "", required=False)
    if labels is MISSING:
        return {}
    if not isinstance(labels, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
    ):
        raise Invalid("labels", "Must be an object of strings.")
    if len(labels) > limits.MAX_LABELS:
        raise Invalid("labels", f"At most {limits.MAX_LABELS} labels.")
    for key in labels:
        if not key or len(key) > limits.MAX_LABEL_KEY_CHARS:
            raise Invalid(
                "labels", f"Label names have 1 to {limits.MAX_LABEL_KEY_CHARS} characters."
            )
        if (problem := text_problem(key)) is not None:
            raise Invalid(
                "labels", f"Label name {key.encode('utf-8', 'backslashreplace')!r}: {problem}"
            )
        string(labels, key, "labels.", max_length=limits.MAX_LABEL_VALUE_CHARS)
    return labels


def parse_registration(body: dict) -> dict:
    name = string(body, "name", required=True, max_length=253)
    if not NODE_NAME_RE.match(name):
        raise Invalid("name", "Letters, digits, '.', '_' and '-' only, not at either end.")
    labels = parse_labels(body)
    gpus = []
    seen_uuids, seen_indexes = set(), set()
    for i, g in enumerate(objects(body, "gpus", required=True)):
        p = f"gpus[{i}]."
        power = {
            key: number(g, key, p, required=True, minimum=0, maximum=limits.MAX_GPU_POWER_W)
            for key in ("power_min_w", "power_max_w", "power_default_w")
        }
        gpu = {
            "index": integer(g, "index", p, required=True, minimum=0, maximum=limits.MAX_GPU_INDEX),
            "uuid": gpu_uuid(g, "uuid", p, required=True),
            "model": string(g, "model", p, required=True, max_length=64),
            "memory_mib": integer(
                g, "memory_mib", p, required=True, minimum=0, maximum=limits.MAX_GPU_MEMORY_MIB
            ),
            **power,
        }
        if gpu["power_min_w"] > gpu["power_max_w"]:
            raise Invalid(p + "power_min_w", "Must not exceed power_max_w.")
        if gpu["uuid"] in seen_uuids:
            raise Invalid(p + "uuid", "Listed twice.")
        if gpu["index"] in seen_indexes:
            raise Invalid(p + "index", "Listed twice.")
        seen_uuids.add(gpu["uuid"])
        seen_indexes.add(gpu["index"])
        gpus.append(gpu)
    return {
        "name": name,
        "cpus": integer(body, "cpus", required=True, minimum=0, maximum=limits.MAX_HOST_CPUS),
        "memory_mib": integer(
            body, "memory_mib", required=True, minimum=0, maximum=limits.MAX_HOST_MEMORY_MIB
        ),
        "labels": labels,
        "agent_version": string(body, "agent_version", max_length=64) or "",
        "runtime": string(body, "runtime", max_length=32) or "",
        "gpus": gpus,
        "address": node_address(body),
        "registration_key": registration_key(body),
        "registration_try": integer(body, "registration_try", minimum=1, maximum=2**31 - 1),
    }


_REGISTRATION_KEY_RE = re.compile(r"^[A-Za-z0-9_-]{32,128}$")


def registration_key(body: dict) -> str | None:
    """The agent's random key for this registration, which lets it send it again should the
    answer be lost (actions.register_node); optional, for agents of before it."""
    key = string(body, "registration_key", max_length=128)
    if key is not None and not _REGISTRATION_KEY_RE.match(key):
        raise Invalid("registration_key", "32 to 128 letters, digits, '_' or '-'.")
    return key


# A host name or an IPv4/IPv6 address: what a job's peers connect to.
_ADDRESS_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._:%-]{0,253}[A-Za-z0-9])?$")


def node_address(body: dict) -> dict:
    """The node's advertise_address and job_port_range, as Node fields (those given)."""
    fields: dict = {}
    address = string(body, "advertise_address", max_length=255)
    if address is not None:
        if not _ADDRESS_RE.match(address):
            raise Invalid("advertise_address", "Must be a host name or an IP address.")
        fields["advertise_address"] = address
    ports = _get(body, "job_port_range", "", required=False)
    if ports is not MISSING:
        if (
            not isinstance(ports, list)
            or len(ports) != 2
            or not all(isinstance(p, int) and not isinstance(p, bool) for p in ports)
            or not 1 <= ports[0] <= ports[1] <= 65535
        ):
            raise Invalid("job_port_range", "Must be [low, high], ports 1 to 65535, low <= high.")
        fields["job_port_min"], fields["job_port_max"] = ports
    return fields


# --- the heartbeat: what is valid is applied, what is not is named -----------------------------


def _left_out(warnings: dict, exc: Invalid, what: str) -> None:
    warnings.setdefault(exc.field, []).append(f"{exc.message} {what}")


LEFT_OUT = "Left out; the rest of the heartbeat was applied."


def _lenient(warnings: dict, fallback, parse, *args, **kwargs):
    """`parse(*args, **kwargs)`, or `fallback` with a warning when the value is invalid."""
    try:
        return parse(*args, **kwargs)
    except Invalid as exc:
        _left_out(warnings, exc, LEFT_OUT)
        return fallback


def _throttle_reasons(g: dict, p: str):
    reasons = _get(g, "throttle_reasons", p, required=False)
    if reasons is MISSING:
        return None
    if (
        not isinstance(reasons, list)
        or len(reasons) > limits.MAX_THROTTLE_REASONS
        or not all(
            isinstance(r, str) and len(r) <= limits.MAX_REASON_CHARS and text_problem(r) is None
            for r in reasons
        )
    ):
        raise Invalid(
            p + "throttle_reasons",
            f"Must be a list of at most {limits.MAX_THROTTLE_REASONS} names of at most "
            f"{limits.MAX_REASON_CHARS} characters.",
        )
    return tuple(reasons)


# A GPU reading's numbers in GpuSample's order, with their ranges.
GPU_NUMBERS = tuple(limits.GPU_READING_RANGES.items())


def gpu_sample(g, i: int, warnings: dict) -> GpuSample | None:
    """One GPU reading: a single pass for a valid one (a heartbeat carries one per GPU, a
    thousand times a second), the field-by-field validators for the rest, which name each
    field at fault in `warnings` and leave it out. Both give exactly the same result."""
    if type(g) is not dict:
        return checked_gpu_sample(g, i, warnings)
    values: list[float | None] = []
    for key, (lowest, highest) in GPU_NUMBERS:
        v = g.get(key)
        if v is None:
            values.append(None)
        elif (type(v) is float or type(v) is int) and lowest <= v <= highest:
            values.append(float(v))
        else:
            return checked_gpu_sample(g, i, warnings)
    uuid, healthy = g.get("uuid"), g.get("healthy", True)
    reasons, ecc = g.get("throttle_reasons"), g.get("ecc_errors")
    if (
        type(uuid) is not str
        or not GPU_UUID_RE.fullmatch(uuid)
        or (healthy is not None and type(healthy) is not bool)
        or (
            reasons is not None
            and (type(reasons) is not list or len(reasons) > limits.MAX_THROTTLE_REASONS)
        )
        or (ecc is not None and (type(ecc) is not int or not 0 <= ecc <= limits.MAX_COUNT))
    ):
        return checked_gpu_sample(g, i, warnings)
    if reasons:
        for r in reasons:
            # Printable ASCII cannot hold a NUL or a surrogate; anything else is checked slowly.
            if (
                type(r) is not str
                or len(r) > limits.MAX_REASON_CHARS
                or not r.isascii()
                or not r.isprintable()
            ):
                return checked_gpu_sample(g, i, warnings)
    return GpuSample(
        uuid,
        True if healthy is None else healthy,
        *values,
        throttle_reasons=None if reasons is None else tuple(reasons),
        ecc_errors=ecc,
    )


def checked_gpu_sample(g, i: int, warnings: dict) -> GpuSample | None:
    """A reading checked field by field: a bad number, flag or list is left out (not
    reported), with a warning; a reading without a usable UUID is left out whole."""
    p = f"gpus[{i}]."
    if not isinstance(g, dict):
        _left_out(warnings, Invalid(f"gpus[{i}]", "Must be an object."), LEFT_OUT)
        return None
    try:
        uuid = gpu_uuid(g, "uuid", p, required=True)
    except Invalid as exc:
        _left_out(warnings, exc, "This GPU's reading was left out; the rest was applied.")
        return None
    values = {
        key: _lenient(warnings, None, number, g, key, p, minimum=lowest, maximum=highest)
        for key, (lowest, highest) in GPU_NUMBERS
    }
    return GpuSample(
        uuid=uuid,
        healthy=_lenient(warnings, True, boolean, g, "healthy", p, default=True),
        **values,
        throttle_reasons=_lenient(warnings, None, _throttle_reasons, g, p),
        ecc_errors=_lenient(warnings, None, integer, g, "ecc_errors", p, minimum=0),
    )


def _attempt_report(a, i: int, warnings: dict) -> tuple[int | None, AttemptReport | None]:
    """(attempt id, report) of one `attempts[]` entry; (id, None) when the report cannot be
    applied (its state, exit code or stop cause is unreadable), (None, None) when not even its
    attempt is known. Unreadable optional fields are left out."""
    p = f"attempts[{i}]."
    if not isinstance(a, dict):
        _left_out(warnings, Invalid(f"attempts[{i}]", "Must be an object."), SKIPPED_REPORT)
        return None, None
    try:
        attempt_id = integer(a, "attempt_id", p, required=True, minimum=1)
    except Invalid as exc:
        _left_out(warnings, exc, SKIPPED_REPORT)
        return None, None
    try:
        state = string(a, "state", p, required=True, max_length=32)
        if state not in hb_logic.ATTEMPT_REPORT_STATES:
            raise Invalid(p + "state", f"One of {', '.join(hb_logic.ATTEMPT_REPORT_STATES)}.")
        stop_cause = string(a, "stop_cause", p, max_length=32)
        if stop_cause is not None and stop_cause not in hb_logic.STOP_CAUSES:
            raise Invalid(p + "stop_cause", f"One of {', '.join(hb_logic.STOP_CAUSES)}.")
    except Invalid as exc:
        _left_out(warnings, exc, UNAPPLIED_REPORT)
        return attempt_id, None
    # An exit lands even when its code is unreadable: the process is gone and its GPUs are
    # free; the job fails with an unknown code rather than keep its GPUs until a report that
    # may never come.
    exit_code = _lenient(
        warnings,
        None,
        integer,
        a,
        "exit_code",
        p,
        required=state == hb_logic.EXITED,
        minimum=limits.MIN_EXIT_CODE,
        maximum=limits.MAX_EXIT_CODE,
    )
    unix_time = {"minimum": 0, "maximum": limits.MAX_UNIX_TIME_S}
    return attempt_id, AttemptReport(
        attempt_id=attempt_id,
        state=state,
        started_at=_lenient(warnings, None, number, a, "started_at", p, **unix_time),
        exit_code=exit_code,
        finished_at=_lenient(warnings, None, number, a, "finished_at", p, **unix_time),
        energy_j=_lenient(
            warnings, None, number, a, "energy_j", p, minimum=0, maximum=limits.MAX_ENERGY_J
        ),
        energy_estimated=_lenient(
            warnings, False, boolean, a, "energy_estimated", p, default=False
        ),
        message=_lenient(warnings, "", string, a, "message", p, max_length=limits.MAX_MESSAGE_CHARS)
        or "",
        stop_cause=stop_cause,
        **hb_logic.contract_report_fields(a, p, warnings),
    )


SKIPPED_REPORT = (
    "This report was left out; until the agent sends it readably, no attempt of this node is "
    "judged by its absence."
)
UNAPPLIED_REPORT = (
    "This attempt's report was not applied; the attempt is left as it was until a readable "
    "report comes."
)
MAX_CONDITIONS = 256


def _condition(c, i: int, warnings: dict) -> ConditionReport | None:
    p = f"conditions[{i}]."
    if not isinstance(c, dict):
        _left_out(warnings, Invalid(f"conditions[{i}]", "Must be an object."), LEFT_OUT)
        return None
    try:
        kind = string(c, "type", p, required=True, max_length=64)
        uuid = gpu_uuid(c, "gpu_uuid", p)
    except Invalid as exc:
        _left_out(warnings, exc, "This condition was left out; the rest was applied.")
        return None
    message = _lenient(warnings, "", string, c, "message", p, max_length=limits.MAX_MESSAGE_CHARS)
    return ConditionReport(type=kind, message=message or "", gpu_uuid=uuid)


def parse_heartbeat(body: dict) -> Heartbeat:
    """A heartbeat, with what could not be read named in `Heartbeat.warnings` and left out.

    Invalid (a 400) only when the frame cannot be read: seq, sent_at, and gpus and attempts as
    lists. An attempt report that cannot be applied leaves its attempt as it was: it counts as
    reported (never as vanished from the node), and it is not acknowledged, so the agent sends
    it again.
    """
    seq = integer(body, "seq", required=True, minimum=0)
    sent_at = number(body, "sent_at", required=True, minimum=0, maximum=limits.MAX_UNIX_TIME_S)
    warnings: dict[str, list[str]] = {}
    gpus = []
    for i, g in enumerate(items(body, "gpus", required=True)):
        sample = gpu_sample(g, i, warnings)
        if sample is not None:
            gpus.append(sample)
    attempts, unreadable, complete = [], set(), True
    for i, a in enumerate(items(body, "attempts", required=True)):
        attempt_id, report = _attempt_report(a, i, warnings)
        if attempt_id is None:
            complete = False
        elif report is None:
            unreadable.add(attempt_id)
        else:
            attempts.append(report)
    conditions = []
    listed = _lenient(warnings, [], items, body, "conditions", required=False)
    if len(listed) > MAX_CONDITIONS:
        warnings.setdefault("conditions", []).append(
            f"At most {MAX_CONDITIONS} conditions; the rest were left out."
        )
    for i, c in enumerate(listed[:MAX_CONDITIONS]):
        condition = _condition(c, i, warnings)
        if condition is not None:
            conditions.append(condition)
    return Heartbeat(
        address=_lenient(warnings, {}, node_address, body) or None,
        seq=seq,
        sent_at=sent_at,
        gpus=tuple(gpus),
        attempts=tuple(a for a in attempts if a.attempt_id not in unreadable),
        conditions=tuple(conditions),
        warnings=warnings,
        unreadable_attempts=frozenset(unreadable),
        reports_complete=complete,
    )


# --- plumbing --------------------------------------------------------------------------------


def unauthorized(message: str) -> JsonResponse:
    response = JsonResponse({"detail": message}, status=401)
    response["WWW-Authenticate"] = 'Bearer realm="agent"'
    return response


def agent_view(*, node_auth: bool = True) -> Callable:
    """POST only, no CSRF (no cookies are honoured here), errors as JSON."""

    def decorate(view):
        @csrf_exempt
        @wraps(view)
        def wrapper(request: HttpRequest):
            if request.method != "POST":
                response = JsonResponse({"detail": "Method not allowed."}, status=405)
                response["Allow"] = "POST"
                return response
            try:
                if node_auth:
                    node = authenticate_node(request)
                    with logcontext.bound(node=node.name):
                        return view(request, node)
                return view(request)
            except AgentAuthError as exc:
                return unauthorized(str(exc))
            except Invalid as exc:
                return JsonResponse({exc.field: [exc.message]}, status=400)
            except Refused as exc:
                return JsonResponse({"detail": exc.message}, status=exc.status)

        return wrapper

    return decorate


# --- views -----------------------------------------------------------------------------------


@agent_view(node_auth=False)
def register(request: HttpRequest) -> JsonResponse:
    """Join with a join token: create or update the node and its GPUs, issue a node token
    (controlplane.cluster.actions.register_node)."""
    raw = bearer_token(request)
    data = parse_registration(parse_json(request))
    uuids = [g["uuid"] for g in data["gpus"]]
    for attempt in range(1, REGISTER_TRIES + 1):
        # Spent only for a well-formed request: a typo in the body must not burn a one-use
        # token. Anything refused after the use was counted rolls the count back with the rest.
        try:
            node, token = cluster_actions.register_node(raw, data)
            break
        except cluster_actions.RegistrationRefused as exc:
            raise Refused(409 if exc.conflict else 403, exc.message) from None
        except gpu_claims.GpuClaimRefused as refused:
            return _claim_refused(refused, data["name"])
        except IntegrityError as exc:
            # Only a GPU UUID that another registration took since we looked gets here.
            raced = gpu_claims.claims_raced(data["name"], uuids)
            if raced:
                return _claim_refused(gpu_claims.GpuClaimRefused(raced), data["name"])
            raise Invalid("gpus", f"Conflicts with another node's inventory: {exc}") from None
        except OperationalError as exc:
            # Two registrations, or one and a heartbeat, that locked the same nodes in opposite
            # orders (a swap of GPUs between two live nodes): nothing was written; again.
            if not hb_logic._is_deadlock(exc) or attempt == REGISTER_TRIES:
                raise
    log.info("node %s registered (%d GPUs)", node.name, len(data["gpus"]))
    return JsonResponse(
        {
            "node": node.name,
            "node_token": token,
            "heartbeat_interval_s": node.heartbeat_interval_s,
            **lease.grant(),
        },
        status=201,
    )


REGISTER_TRIES = 3


def _claim_refused(refused: gpu_claims.GpuClaimRefused, claimant: str) -> JsonResponse:
    """409 naming each GPU and its holder; recorded for an admin, apart from the registration
    (which was rolled back whole: no node, no GPU moved, no use of the join token spent)."""
    gpu_claims.record_refusal(refused, claimant)
    return JsonResponse(refused.answer(), status=409)


@agent_view(node_auth=False)
def heartbeat(request: HttpRequest) -> HttpResponse:
    status, body, headers = answer_heartbeat_request(
        request.headers.get("Authorization"), request.body
    )
    response = HttpResponse(body, status=status, content_type="application/json")
    for name, value in headers:
        response[name] = value
    return response


class PooledDatabaseDown:
    """Whether a process with a connection pool (DB_POOL_MAX_SIZE) should ask the database now.

    Without a pool, a database that is down refuses the connection at once and a heartbeat
    takes its degraded path (lease renewed in Redis) in a millisecond. A pool hides that: a
    request waits the pool's timeout for a connection that never comes, and agents heartbeat
    one request at a time, so heartbeats that each waited that long would renew their leases
    too late and our outage would stop their jobs. Hence, for the agent requests:

    - a thread that finds no idle connection in the pool asks it for one for QUICK_WAIT_S at
      most (a busy pool frees one in milliseconds; a fresh process, whose pool has none yet,
      learns in that time that the database is down);
    - once the database was found unreachable, they skip it (heartbeats are answered degraded,
      watches 503) until a direct connection (refused at once while the server is down) shows
      it is back: one such probe every RECHECK_S, by whichever request comes first;
    - when it is back, the pool is replaced: its own attempts to reconnect back off
      exponentially while the database is down (1, 2, 4... s), and a pool whose slots all wait
      their turn would refuse every request for tens of seconds after the outage.
    """

    RECHECK_S = 1.0
    QUICK_WAIT_S = 0.25

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._down = False
        self._probe_after = 0.0

    @staticmethod
    def pooled() -> bool:
        return getattr(connection, "pool", None) is not None

    def skip(self) -> bool:
        if not self.pooled():
            return False
        if not self._down:
            return not self._connects_quickly()
        now = time.monotonic()
        with self._lock:
            if not self._down or now < self._probe_after:
                return self._down
            self._probe_after = now + self.RECHECK_S
        if not self._reachable():
            return True
        self.found_up()
        return False

    def found_down(self) -> None:
        if self.pooled():
            with self._lock:
                if not self._down:
                    log.warning("database unreachable: agent requests skip it until it is back")
                self._down = True
                self._probe_after = time.monotonic() + self.RECHECK_S

    def found_up(self) -> None:
        if not self._down:
            return
        with self._lock:
            if not self._down:
                return
            self._down = False
        if connection.connection is not None:
            # Found up by a read this thread just made: the pool hands out connections again.
            log.warning("database reachable again")
            return
        log.warning("database reachable again: a new connection pool replaces the old one")
        # Waiting clients of the old pool fail at once; connections still out are closed when
        # given back. The next connection comes from a new pool, made on first use. (Only the
        # PostgreSQL wrapper has a pool, hence getattr for the type checker.)
        getattr(connection, "close_pool")()  # noqa: B009

    def _connects_quickly(self) -> bool:
        import psycopg
        import psycopg_pool

        if connection.connection is not None:
            return True  # this thread holds one (inside a test's transaction)
        pool = getattr(connection, "pool")  # noqa: B009 - PostgreSQL's wrapper alone has one
        try:
            pool.open()  # Django opens it on first use; a no-op once open
            if pool.get_stats().get("pool_available", 0):
                return True
            raw = pool.getconn(timeout=self.QUICK_WAIT_S)
        except psycopg_pool.PoolClosed:
            # Replaced by another thread a moment ago (found_up): the database was just found
            # up, and Django makes the new pool at this thread's first query.
            return True
        except psycopg_pool.PoolTimeout:
            if self.saturated(pool):
                # Every connection the pool may hold is open and in use: the database answers,
                # this process is busy. The request waits its turn like any; taken for an
                # outage, it would answer heartbeats degraded and then replace the pool under
                # the requests using it (250 agents registering at once did both).
                return True
            self.found_down()
            return False
        except psycopg.Error:
            self.found_down()
            return False
        pool.putconn(raw)
        return True

    @staticmethod
    def saturated(pool) -> bool:
        """Whether the pool holds as many connections as it may, all open: a pool that cannot
        hand one out then is busy, not cut off from its database."""
        return pool.get_stats().get("pool_size", 0) >= pool.max_size

    @staticmethod
    def replaced(exc: Exception) -> bool:
        """Whether a database error a request got is of a pool that another thread replaced
        (found_up) while this one was about to use it."""
        import psycopg_pool

        return isinstance(exc.__cause__, psycopg_pool.PoolClosed)

    def busy(self, exc: Exception) -> bool:
        """Whether a database error a request got says this process is busy (no connection
        free in time from a full pool, or the pool replaced under it), not that the database
        is out of reach."""
        import psycopg_pool

        if self.replaced(exc):
            return True
        return (
            isinstance(exc.__cause__, psycopg_pool.PoolTimeout)
            and self.pooled()
            and self.saturated(getattr(connection, "pool"))  # noqa: B009
        )

    @staticmethod
    def _reachable() -> bool:
        import psycopg

        try:
            psycopg.connect(**connection.get_connection_params()).close()
        except psycopg.Error:
            return False
        return True


pooled_database = PooledDatabaseDown()


class DatabaseSkipped(Exception):
    """The database was not asked: it was found unreachable a moment ago (PooledDatabaseDown)."""


def answer_heartbeat_request(
    authorization: str | None, body: bytes
) -> tuple[int, bytes, list[tuple[str, str]]]:
    """A heartbeat, from its Authorization header and body to (status, JSON, extra headers).

    Shared by the Django view and the WSGI shortcut (controlplane.cluster.agent_wsgi), which
    answers heartbeats without Django's middleware and request signals. The node comes with
    the generation of its desired state in one read (hb_logic.read_node), so the token is
    checked here rather than by agent_view's separate lookup.
    """
    try:
        digest = node_token_digest(authorization)
        report = parse_heartbeat(parse_body(body))
        if pooled_database.skip():
            return degraded_heartbeat(digest, DatabaseSkipped("found unreachable a moment ago"))
        for first_try in (True, False):
            try:
                read = hb_logic.read_node(digest)
                pooled_database.found_up()
                if read is None:
                    raise AgentAuthError("Invalid node token.")
                # Every line of the heartbeat names its node (agents.logcontext).
                with logcontext.bound(node=read.node.name):
                    answer = hb_logic.answer_heartbeat(read, report)
                    if report.warnings:
                        answer = with_warnings(answer, report.warnings, read.node.name)
                return 200, answer, []
            except (OperationalError, InterfaceError) as exc:
                if not database_unreachable(exc):
                    raise
                if pooled_database.replaced(exc) and first_try:
                    continue  # the pool was replaced under it: once more, from the new one
                if pooled_database.busy(exc):
                    # The lease is kept as in an outage (nothing else changes, the agent keeps
                    # its reports for the next answer), but the database is not marked down:
                    # that would answer every agent degraded and replace a pool in use.
                    return degraded_heartbeat(digest, exc, busy=True)
                # Most often a kept connection that PostgreSQL dropped when it restarted: once
                # more on a fresh one. Repeating a heartbeat is harmless (every write it makes
                # is guarded by the state it expects). A pool checks each connection it hands
                # out, so there a failure means no connection could be had: no second wait.
                if first_try and not connection.in_atomic_block and not pooled_database.pooled():
                    connection.close()
                    continue
                pooled_database.found_down()
                # PostgreSQL is out of reach (down, restarting, failing over): keep the node's
                # lease if that can be recorded elsewhere, so that our outage stops no job.
                return degraded_heartbeat(digest, exc)
        raise AssertionError("unreachable")
    except (AgentAuthError, Invalid) as exc:
        return refusal(exc)


def refusal(exc: AgentAuthError | Invalid) -> tuple[int, bytes, list[tuple[str, str]]]:
    """The answer of the agent requests answered past Django (heartbeat, watch) to a request
    refused for its token (401) or its body (400, naming the field)."""
    if isinstance(exc, AgentAuthError):
        return (
            401,
            json.dumps({"detail": str(exc)}).encode(),
            [("WWW-Authenticate", 'Bearer realm="agent"')],
        )
    return 400, json.dumps({exc.field: [exc.message]}).encode(), []


def with_warnings(answer: bytes, warnings: dict, node_name: str) -> bytes:
    """The answer, telling the agent what of its heartbeat was left out and why."""
    log.info("heartbeat of %s applied without %s", node_name, ", ".join(sorted(warnings)))
    return json.dumps({**json.loads(answer), "warnings": warnings}).encode()


def database_unreachable(exc: Exception) -> bool:
    """True when the error says the database cannot be talked to at all, not that a statement
    failed (a lock timeout, a deadlock: those are answered as errors, and retried by the agent);
    the rule the web's 503s follow (controlplane.unavailable.connection_lost)."""
    return isinstance(exc, OperationalError | InterfaceError) and connection_lost(exc)


def degraded_heartbeat(
    digest: str, cause: Exception, *, busy: bool = False
) -> tuple[int, bytes, list]:
    """Answer a heartbeat while PostgreSQL cannot be reached (busy: while this process has no
    connection free to ask it with): renew the lease, change nothing.

    The renewal counts only once it is recorded where the liveness sweep reads it: here, Redis
    (controlplane.cluster.lease). The token cannot be checked against the node rows, so only a
    token this process found there recently is taken. The answer carries no desired state:
    the agent keeps running what it runs, starts and stops nothing, and keeps every exit report
    (nothing was recorded) for the next answer that is not degraded.
    """
    retry = [("Retry-After", "1")]
    trusted = lease.trusted_node(digest)
    if trusted is None or not settings.REDIS_URL:
        log.warning("heartbeat refused while the database is unreachable: %s", cause)
        return 503, b'{"detail": "The database is unreachable; try again."}', retry
    now = timezone.now()
    try:
        lease.record_degraded_renewal(trusted.node_id, now)
    except Exception as exc:
        log.warning("database and Redis both unreachable (%s; %s): no lease renewed", cause, exc)
        return 503, b'{"detail": "The control plane cannot record heartbeats now."}', retry
    log.debug("lease of %s renewed through Redis: the database is unreachable", trusted.name)
    answer = {
        "degraded": True,
        "detail": (
            "The control plane is too busy to answer in full"
            if busy
            else "The database is unreachable"
        )
        + ": lease renewed, nothing else changed.",
        **lease.grant(),
        "heartbeat_interval_s": trusted.heartbeat_interval_s,
    }
    return 200, json.dumps(answer).encode(), []


class WatchSlots:
    """How many watches this process holds at once.

    A watch holds a server thread for up to 30 s. Were every thread holding one, heartbeats
    would queue behind them and nodes would be declared not ready for want of a thread; so a
    process keeps some threads for the rest and answers a watch over its limit with 429 (the
    agent backs off and keeps its periodic heartbeats). AGENT_WATCH_MAX_PER_PROCESS: the
    limit, 0 = none; set it a few below gunicorn's --threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.held = 0

    @staticmethod
    def limit() -> int:
        configured = getattr(settings, "AGENT_WATCH_MAX_PER_PROCESS", None)
        if configured is None:
            configured = os.environ.get("AGENT_WATCH_MAX_PER_PROCESS") or 0
        return int(configured)

    def try_acquire(self) -> bool:
        with self._lock:
            limit = self.limit()
            if limit and self.held >= limit:
                return False
            self.held += 1
            return True

    def release(self) -> None:
        with self._lock:
            self.held -= 1


watch_slots = WatchSlots()


@agent_view(node_auth=False)
def watch(request: HttpRequest) -> HttpResponse:
    """Long-poll until this node's desired state changes, or timeout_s (at most 30 s)."""
    status, body, headers = answer_watch_request(request.headers.get("Authorization"), request.body)
    response = HttpResponse(body, status=status, content_type="application/json")
    for name, value in headers:
        response[name] = value
    return response


WATCH_DATABASE_DOWN = json.dumps(
    {"detail": "The database is unreachable; heartbeat periodically."}
).encode()
WATCH_TURNED_AWAY = json.dumps(
    {"detail": "This server holds all the watches it may; heartbeat periodically."}
).encode()


def answer_watch_request(
    authorization: str | None, body: bytes
) -> tuple[int, bytes, list[tuple[str, str]]]:
    """A watch, from its Authorization header and body to (status, JSON, extra headers).

    Written like answer_heartbeat_request, without the request object, so that the WSGI
    shortcut (controlplane.cluster.agent_wsgi) can answer watches past Django's middleware
    as it does heartbeats: a watch is re-armed after every change, and Django's stack is most
    of what one costs once it needs no Redis connection of its own.
    """
    if pooled_database.skip():
        return 503, WATCH_DATABASE_DOWN, [("Retry-After", "1")]
    try:
        # The node with the generation of its desired state, by the heartbeat's prepared read.
        try:
            read = hb_logic.read_node(node_token_digest(authorization))
        except (OperationalError, InterfaceError) as exc:
            if not database_unreachable(exc):
                raise
            if not pooled_database.busy(exc):
                pooled_database.found_down()
            return 503, WATCH_DATABASE_DOWN, [("Retry-After", "1")]
        if read is None:
            raise AgentAuthError("Invalid node token.")
        timeout_s = number(parse_body(body), "timeout_s", minimum=0)
        timeout_s = min(WATCH_MAX_TIMEOUT_S, 20.0 if timeout_s is None else timeout_s)
    except (AgentAuthError, Invalid) as exc:
        return refusal(exc)
    if not watch_slots.try_acquire():
        return 429, WATCH_TURNED_AWAY, [("Retry-After", str(int(WATCH_MAX_TIMEOUT_S)))]
    try:
        changed = wait_for_change(read.node, timeout_s)
    finally:
        watch_slots.release()
    return 200, b'{"changed": true}' if changed else b'{"changed": false}', []


def wait_for_change(node: hb_logic.NodeInfo, timeout_s: float) -> bool:
    """True as soon as the node should be told something its last heartbeat did not say.

    The signal (Redis pub/sub through this process's one subscriber, or in-process without
    Redis) only says "look again"; whether anything changed is decided by comparing the desired
    state with the last answer. That comparison, made once the watch is listening, also catches
    a change that landed between the last heartbeat and this watch, which a signal alone would
    miss.
    """
    from controlplane import wakeups as notify

    def changed() -> bool:
        try:
            return _differs_from_last_answer(node)
        finally:
            _give_back_pooled_connection()

    if settings.REDIS_URL:
        return watch_hub.hub().wait(node.name, timeout_s, changed)
    seen = notify.node_version(node.name)
    if changed():
        return True
    return notify.wait_for_node_change(node.name, seen, timeout_s)


def _give_back_pooled_connection() -> None:
    """With a connection pool (DB_POOL_MAX_SIZE), hand this thread's connection back to it.

    A watch waits up to 30 s between two short reads; holding a PostgreSQL connection through
    that would make every connected agent cost one, which is what the pool is there to avoid.
    The next read takes one again (an empty query checks it first). Without a pool nothing is
    done: closing would cost a new connection per read. Never inside an atomic block (a test's
    transaction), whose connection must stay.
    """
    if pooled_database.pooled() and not connection.in_atomic_block:
        connection.close()


def _differs_from_last_answer(node: hb_logic.NodeInfo) -> bool:
    """Whether the desired state now differs from the last answer the node was given.

    In PostgreSQL: one indexed read of the node's generation, then the answer this process
    prepared for that generation (heartbeat.prepared_answer, shared with the heartbeats' steady
    path); only a generation this process has not seen yet costs the work and caps reads. The
    generation is read after the watch started listening, and the triggers count every change
    in the writer's own transaction, so a change committed before this read is in the prepared
    answer and one committed after it is signalled. Outside PostgreSQL (no generation), the
    desired state is computed afresh.
    """
    told = hb_logic.last_answer_digest(node.as_node())
    if told is None:
        return False
    read = hb_logic.read_node(node.token_hash)
    if read is None:
        return True  # its token was rotated or revoked: the heartbeat will say so
    if read.generation is None:
        return told != hb_logic.digest(hb_logic.current_desired_state(read.node.as_node()))
    return told != hb_logic.prepared_answer(read).digest


def log_chunk_bytes(body: dict) -> bytes:
    """A chunk's bytes: `data_b64` (base64, any bytes at all, as current agents send output
    that is not plain UTF-8 text) or `data` (text, encoded as UTF-8, as older agents send it;
    its NULs are kept, and the lone surrogates U+DC80..U+DCFF stand for the raw bytes 0x80..0xFF
    as Python's surrogateescape makes them)."""
    if "data_b64" in body and "data" in body:
        raise Invalid("data_b64", "Send data or data_b64, not both.")
    if "data_b64" in body:
        raw = string(body, "data_b64", max_length=4 * (LOG_CHUNK_MAX_BYTES // 3 + 1), text=False)
        try:
            data = base64.b64decode(raw or "", validate=True)
        except ValueError:
            raise Invalid("data_b64", "Must be base64 (RFC 4648, with padding).") from None
        field = "data_b64"
    else:
        text = string(body, "data", max_length=LOG_CHUNK_MAX_BYTES, text=False) or ""
        try:
            data = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            raise Invalid(
                "data",
                "Must not contain lone surrogates (U+D800..U+DC7F, U+DD00..U+DFFF): not text; "
                "send output that is not UTF-8 as data_b64.",
            ) from None
        field = "data"
    if len(data) > LOG_CHUNK_MAX_BYTES:
        raise Invalid(field, f"At most {LOG_CHUNK_MAX_BYTES} bytes per chunk.")
    return data


@agent_view()
def logs(request: HttpRequest, node: Node) -> JsonResponse:
    """Store a chunk of an attempt's output at its byte offset; a resent chunk is stored once."""
    body = parse_json(request)
    attempt_id = integer(body, "attempt_id", required=True, minimum=1)
    offset = integer(body, "offset", required=True, minimum=0)
    encoded = log_chunk_bytes(body)
    ours = Q(node_id=node.pk) | Q(allocations__gpu__node_id=node.pk)
    with transaction.atomic():
        # Each node ships its own member's output, a byte stream of its own (a gang's members
        # all write from offset 0). The member row's lock serialises its chunks, so its
        # log_bytes stays exact; the attempt's counts them all.
        member = (
            AttemptMember.objects.select_for_update()
            .filter(attempt_id=attempt_id, node_id=node.pk)
            .only("id", "attempt_id", "log_bytes")
            .first()
        )
        attempt = None
        if member is None:  # an attempt admitted before members existed
            attempt = (
                JobAttempt.objects.select_for_update()
                .filter(pk__in=JobAttempt.objects.filter(ours, pk=attempt_id).values("pk"))
                .only("id", "log_bytes")
                .first()
            )
            if attempt is None:
                return JsonResponse({"detail": "No such attempt on this node."}, status=404)
        if member is not None:
            stored_to = member.log_bytes
        else:
            assert attempt is not None
            stored_to = attempt.log_bytes
        end = offset + len(encoded)
        if offset > stored_to:
            # A gap: an earlier chunk was lost. Keep the stored output contiguous and say
            # where it ends, so the agent resends from there.
            return JsonResponse({"next_offset": stored_to})
        if end <= stored_to:
            return JsonResponse({"next_offset": stored_to})
        # Overlap: keep only the bytes past what is stored. Bytes, not text: a chunk may end
        # inside a character, and the next one carries the rest.
        tail = encoded[stored_to - offset :]
        LogChunk.objects.bulk_create(
            [LogChunk(attempt_id=attempt_id, member=member, offset=stored_to, data=tail)],
            ignore_conflicts=True,
        )
        if member is not None:
            AttemptMember.objects.filter(pk=member.pk).update(
                log_bytes=F("log_bytes") + (end - stored_to)
            )
        JobAttempt.objects.filter(pk=attempt_id).update(
            log_bytes=F("log_bytes") + (end - stored_to)
        )
    return JsonResponse({"next_offset": end})


# --- volumes ---------------------------------------------------------------------------------

# More names or ids than any node has volumes or any answer listed: a garbled body.
VOLUME_REPORT_MAX_ITEMS = 1000


def _name_list(body: dict, key: str) -> list[str] | None:
    value = _get(body, key, "", required=False)
    if value is MISSING:
        return None
    if not isinstance(value, list):
        raise Invalid(key, "Must be a list of volume names.")
    if len(value) > VOLUME_REPORT_MAX_ITEMS:
        raise Invalid(key, f"At most {VOLUME_REPORT_MAX_ITEMS} entries.")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item or len(item) > 63:
            raise Invalid(f"{key}[{i}]", "Must be a volume name (1 to 63 characters).")
        if (problem := text_problem(item)) is not None:
            raise Invalid(f"{key}[{i}]", problem)
    return value


def _id_list(body: dict, key: str) -> list[int]:
    value = _get(body, key, "", required=False)
    if value is MISSING:
        return []
    if not isinstance(value, list):
        raise Invalid(key, "Must be a list of job ids.")
    if len(value) > VOLUME_REPORT_MAX_ITEMS:
        raise Invalid(key, f"At most {VOLUME_REPORT_MAX_ITEMS} entries.")
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int) or not 1 <= item <= 2**63 - 1:
            raise Invalid(f"{key}[{i}]", "Must be a job id (a positive integer).")
    return value


def volumes_answer(node_id: int) -> dict:
    """What a node should have, and the checkpoint directories it should delete: only those on
    volumes of its pool that it reported having."""
    stored = Node.objects.only("id", "pool_id", "volumes").get(pk=node_id)
    volumes = list(storage_queries.volumes_for_pool(stored.pool_id))
    applicable = {v.name for v in volumes}
    has = sorted(applicable.intersection(stored.volumes or []))
    deletions = storage_queries.due_checkpoint_deletions(volume_names=has) if has else []
    return {
        "volumes": [
            {"name": v.name, "kind": v.kind, "source": v.source, "checkpoints": v.checkpoints}
            for v in volumes
        ],
        "checkpoint_deletions": [{"job_id": d.job_id, "host_path": d.host_path} for d in deletions],
    }


@csrf_exempt
def volumes(request: HttpRequest) -> JsonResponse:
    """GET: the volumes of the node's pool and its due checkpoint deletions. POST: the volumes
    it has ("present") and the checkpoint directories it deleted ("deleted_checkpoints")."""
    if request.method not in ("GET", "POST"):
        response = JsonResponse({"detail": "Method not allowed."}, status=405)
        response["Allow"] = "GET, POST"
        return response
    try:
        node = authenticate_node(request)
        if request.method == "GET":
            return JsonResponse(volumes_answer(node.pk))
        body = parse_json(request)
        present = _name_list(body, "present")
        deleted = _id_list(body, "deleted_checkpoints")
    except AgentAuthError as exc:
        return unauthorized(str(exc))
    except Invalid as exc:
        return JsonResponse({exc.field: [exc.message]}, status=400)
    if present is not None:
        storage_actions.record_node_volumes(node.pk, present)
    # After the report: a deletion counts only on a volume the node has now.
    storage_actions.mark_checkpoints_deleted(node.pk, deleted)
    return JsonResponse({"ok": True})
