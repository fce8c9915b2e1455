"""The agent API (docs/agent-protocol.md): register, heartbeat, watch, logs.

Plain Django views rather than DRF: agents are not users, so none of the user API's
authentication, permissions or content negotiation applies, and a heartbeat is the hottest
path of the system (10,000 nodes every 10 s). Bodies are validated strictly; a 400 names the
field at fault, like the user API does (`{"gpus[2].uuid": ["..."]}`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from functools import wraps

from django.conf import settings
from django.db import (
    DatabaseError,
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
from redis.exceptions import RedisError

from controlplane.cluster import heartbeat as hb_logic
from controlplane.cluster import lease
from controlplane.cluster.agent_auth import (
    AgentAuthError,
    authenticate_node,
    bearer_token,
    consume_join_token,
    node_token_digest,
    rotate_node_token,
)
from controlplane.cluster.heartbeat import AttemptReport, ConditionReport, Heartbeat
from controlplane.cluster.models import GPU, NODE_NAME_RE, JoinToken, Node
from controlplane.cluster.telemetry import GpuSample
from controlplane.jobs.models import JobAttempt, LogChunk

log = logging.getLogger(__name__)

WATCH_MAX_TIMEOUT_S = 30.0
LOG_CHUNK_MAX_BYTES = 1024 * 1024
# Indexes real GPUs never have: where a GPU that left the node is kept, and where one that
# changes index waits during a registration.
RETIRED_INDEX = 1000
PARKED_INDEX = 1_000_000


# --- validation ------------------------------------------------------------------------------


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


def _get(body: dict, key: str, path: str, *, required: bool):
    if key not in body or body[key] is None:
        if required:
            raise Invalid(path + key, "This field is required.")
        return MISSING
    return body[key]


def number(body: dict, key: str, path: str = "", *, required: bool = False, minimum=None):
    value = _get(body, key, path, required=required)
    if value is MISSING:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise Invalid(path + key, "Must be a finite number.")
    if minimum is not None and value < minimum:
        raise Invalid(path + key, f"Must be at least {minimum}.")
    return float(value)


def integer(body: dict, key: str, path: str = "", *, required: bool = False, minimum=None):
    value = _get(body, key, path, required=required)
    if value is MISSING:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise Invalid(path + key, "Must be an integer.")
    if minimum is not None and value < minimum:
        raise Invalid(path + key, f"Must be at least {minimum}.")
    return value


def string(body: dict, key: str, path: str = "", *, required: bool = False, max_length: int = 1000):
    value = _get(body, key, path, required=required)
    if value is MISSING:
        return None
    if not isinstance(value, str):
        raise Invalid(path + key, "Must be a string.")
    if required and not value:
        raise Invalid(path + key, "May not be blank.")
    if len(value) > max_length:
        raise Invalid(path + key, f"At most {max_length} characters.")
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


def parse_json(request: HttpRequest) -> dict:
    return parse_body(request.body)


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError):
        raise Invalid("non_field_errors", "The body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise Invalid("non_field_errors", "The body must be a JSON object.")
    return body


def parse_registration(body: dict) -> dict:
    name = string(body, "name", required=True, max_length=253)
    if not NODE_NAME_RE.match(name):
        raise Invalid("name", "Letters, digits, '.', '_' and '-' only, not at either end.")
    labels = _get(body, "labels", "", required=False)
    if labels is MISSING:
        labels = {}
    if not isinstance(labels, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
    ):
        raise Invalid("labels", "Must be an object of strings.")
    gpus = []
    seen_uuids, seen_indexes = set(), set()
    for i, g in enumerate(objects(body, "gpus", required=True)):
        p = f"gpus[{i}]."
        gpu = {
            "index": integer(g, "index", p, required=True, minimum=0),
            "uuid": string(g, "uuid", p, required=True, max_length=96),
            "model": string(g, "model", p, required=True, max_length=64),
            "memory_mib": integer(g, "memory_mib", p, required=True, minimum=0),
            "power_min_w": number(g, "power_min_w", p, required=True, minimum=0),
            "power_max_w": number(g, "power_max_w", p, required=True, minimum=0),
            "power_default_w": number(g, "power_default_w", p, required=True, minimum=0),
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
        "cpus": integer(body, "cpus", required=True, minimum=0),
        "memory_mib": integer(body, "memory_mib", required=True, minimum=0),
        "labels": labels,
        "agent_version": string(body, "agent_version", max_length=64) or "",
        "runtime": string(body, "runtime", max_length=32) or "",
        "gpus": gpus,
    }


# A GPU reading's numbers in GpuSample's order, with their minimum (None: none).
GPU_NUMBERS = (
    ("utilization_pct", 0),
    ("memory_used_mib", 0),
    ("power_draw_w", 0),
    ("power_cap_w", 0),
    ("energy_j", 0),
    ("temperature_c", None),
    ("sm_clock_mhz", 0),
)


def gpu_sample(g: dict, i: int) -> GpuSample:
    """One GPU reading: a single pass for a valid one (a heartbeat carries one per GPU, a
    thousand times a second), the field-by-field validators for the rest, which name the
    field at fault. Both accept and refuse exactly the same readings."""
    values = []
    for key, minimum in GPU_NUMBERS:
        v = g.get(key)
        if v is None:
            values.append(None)
        elif (
            (type(v) is float or type(v) is int)
            and math.isfinite(v)
            and (minimum is None or v >= minimum)
        ):
            values.append(float(v))
        else:
            return checked_gpu_sample(g, i)
    uuid, healthy = g.get("uuid"), g.get("healthy", True)
    reasons, ecc = g.get("throttle_reasons"), g.get("ecc_errors")
    if (
        type(uuid) is not str
        or not uuid
        or len(uuid) > 96
        or (healthy is not None and type(healthy) is not bool)
        or (reasons is not None and type(reasons) is not list)
        or (ecc is not None and (type(ecc) is not int or ecc < 0))
    ):
        return checked_gpu_sample(g, i)
    if reasons:
        for r in reasons:
            if type(r) is not str:
                return checked_gpu_sample(g, i)
    return GpuSample(
        uuid,
        True if healthy is None else healthy,
        *values,
        throttle_reasons=None if reasons is None else tuple(reasons),
        ecc_errors=ecc,
    )


def checked_gpu_sample(g: dict, i: int) -> GpuSample:
    p = f"gpus[{i}]."
    reasons = _get(g, "throttle_reasons", p, required=False)
    if reasons is not MISSING and (
        not isinstance(reasons, list) or not all(isinstance(r, str) for r in reasons)
    ):
        raise Invalid(p + "throttle_reasons", "Must be a list of strings.")
    return GpuSample(
        uuid=string(g, "uuid", p, required=True, max_length=96),
        healthy=boolean(g, "healthy", p, default=True),
        utilization_pct=number(g, "utilization_pct", p, minimum=0),
        memory_used_mib=number(g, "memory_used_mib", p, minimum=0),
        power_draw_w=number(g, "power_draw_w", p, minimum=0),
        power_cap_w=number(g, "power_cap_w", p, minimum=0),
        energy_j=number(g, "energy_j", p, minimum=0),
        temperature_c=number(g, "temperature_c", p),
        sm_clock_mhz=number(g, "sm_clock_mhz", p, minimum=0),
        throttle_reasons=None if reasons is MISSING else tuple(reasons),
        ecc_errors=integer(g, "ecc_errors", p, minimum=0),
    )


def parse_heartbeat(body: dict) -> Heartbeat:
    gpus = [gpu_sample(g, i) for i, g in enumerate(objects(body, "gpus", required=True))]
    attempts = []
    for i, a in enumerate(objects(body, "attempts", required=True)):
        p = f"attempts[{i}]."
        state = string(a, "state", p, required=True, max_length=32)
        if state not in hb_logic.ATTEMPT_REPORT_STATES:
            raise Invalid(p + "state", f"One of {', '.join(hb_logic.ATTEMPT_REPORT_STATES)}.")
        exit_code = integer(a, "exit_code", p)
        if state == hb_logic.EXITED and exit_code is None:
            raise Invalid(p + "exit_code", "Required when state is exited.")
        stop_cause = string(a, "stop_cause", p, max_length=32)
        if stop_cause is not None and stop_cause not in hb_logic.STOP_CAUSES:
            raise Invalid(p + "stop_cause", f"One of {', '.join(hb_logic.STOP_CAUSES)}.")
        attempts.append(
            AttemptReport(
                attempt_id=integer(a, "attempt_id", p, required=True, minimum=1),
                state=state,
                started_at=number(a, "started_at", p, minimum=0),
                exit_code=exit_code,
                finished_at=number(a, "finished_at", p, minimum=0),
                energy_j=number(a, "energy_j", p, minimum=0),
                energy_estimated=boolean(a, "energy_estimated", p, default=False),
                message=string(a, "message", p, max_length=2000) or "",
                stop_cause=stop_cause,
            )
        )
    conditions = []
    for i, c in enumerate(objects(body, "conditions", required=False)):
        p = f"conditions[{i}]."
        conditions.append(
            ConditionReport(
                type=string(c, "type", p, required=True, max_length=64),
                message=string(c, "message", p, max_length=2000) or "",
                gpu_uuid=string(c, "gpu_uuid", p, max_length=96),
            )
        )
    return Heartbeat(
        seq=integer(body, "seq", required=True, minimum=0),
        sent_at=number(body, "sent_at", required=True, minimum=0),
        gpus=tuple(gpus),
        attempts=tuple(attempts),
        conditions=tuple(conditions),
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
                    return view(request, authenticate_node(request))
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
    """Join with a join token: create or update the node and its GPUs, issue a node token."""
    raw = bearer_token(request)
    data = parse_registration(parse_json(request))
    # Spent only for a well-formed request: a typo in the body must not burn a one-use token.
    try:
        with transaction.atomic():
            join = consume_join_token(raw)
            # Refused after the use was counted: the transaction rolls the count back too.
            node, token = _register_node(join, data)
    except IntegrityError as exc:
        raise Invalid("gpus", f"Conflicts with another node's inventory: {exc}") from None
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


def _register_node(join: JoinToken, data: dict) -> tuple[Node, str]:
    """Create the node, or update it when the join token was issued for its name.

    A join token that names no node makes new nodes only: registering an existing name would
    hand its holder that node's identity (a fresh node token, the node's work to come, the
    right to report its attempts' exits).
    """
    name = data["name"]
    if join.node_name and join.node_name != name:
        # 403, not 409: the name may well be free; this credential is simply not for it.
        raise Refused(
            403, f"This join token was issued for node {join.node_name!r} only, not {name!r}."
        )
    now = timezone.now()
    fields = {
        "pool": join.pool,
        "cpus": data["cpus"],
        "memory_mib": data["memory_mib"],
        "labels": data["labels"],
        "agent_version": data["agent_version"],
        "runtime": data["runtime"],
        "heartbeat_interval_s": settings.AGENT_HEARTBEAT_INTERVAL_S,
        "last_heartbeat_at": now,
        "ready": True,
    }
    if join.node_name:
        node, _ = Node.objects.select_for_update().update_or_create(name=name, defaults=fields)
    else:
        try:
            # Create, not get-or-create: a name taken between a look-up and the insert (another
            # registration racing this one) is refused by the unique constraint all the same.
            with transaction.atomic():
                node = Node.objects.create(name=name, **fields)
        except IntegrityError:
            raise Refused(
                409,
                f"A node named {name!r} is already registered. To join it again (its agent lost "
                "its node token), use a join token issued for this node name (node_name).",
            ) from None
    reported = {g["uuid"]: g for g in data["gpus"]}
    existing = {g.uuid: g for g in GPU.objects.select_for_update().filter(node=node)}
    # A GPU that left this node (pulled, swapped, dead) is kept for its history but marked
    # unhealthy, and moved off the index a replacement may now have.
    taken = {g["index"] for g in data["gpus"]}
    for uuid, gpu in existing.items():
        if uuid not in reported:
            updates = {"healthy": False}
            if gpu.index in taken:
                updates["index"] = _spare_index(node)
            GPU.objects.filter(pk=gpu.pk).update(**updates)
    # Park the GPUs that change index out of the way first, so a reordering (two GPUs swapping
    # indexes) never collides with the one-index-per-node constraint half way through.
    moving = [u for u, g in existing.items() if u in reported and g.index != reported[u]["index"]]
    if moving:
        GPU.objects.filter(node=node, uuid__in=moving).update(index=F("index") + PARKED_INDEX)
    for g in data["gpus"]:
        inventory = {k: g[k] for k in g if k != "uuid"}
        gpu = existing.get(g["uuid"])
        if gpu is None:
            # New here; possibly moved from another node, whose row it takes over.
            GPU.objects.update_or_create(
                uuid=g["uuid"], defaults={**inventory, "node": node, "healthy": True}
            )
        else:
            GPU.objects.filter(pk=gpu.pk).update(**inventory, healthy=True)
    return node, rotate_node_token(node)


def _spare_index(node: Node) -> int:
    top = GPU.objects.filter(node=node).order_by("-index").values_list("index", flat=True).first()
    return max(RETIRED_INDEX, (top or 0) + 1)


@agent_view(node_auth=False)
def heartbeat(request: HttpRequest) -> HttpResponse:
    status, body, headers = answer_heartbeat_request(
        request.headers.get("Authorization"), request.body
    )
    response = HttpResponse(body, status=status, content_type="application/json")
    for name, value in headers:
        response[name] = value
    return response


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
        for first_try in (True, False):
            try:
                read = hb_logic.read_node(digest)
                if read is None:
                    raise AgentAuthError("Invalid node token.")
                return 200, hb_logic.answer_heartbeat(read, report), []
            except (OperationalError, InterfaceError) as exc:
                if not database_unreachable(exc):
                    raise
                if first_try and not connection.in_atomic_block:
                    # Most often a kept connection that PostgreSQL dropped when it restarted:
                    # once more on a fresh one. Repeating a heartbeat is harmless (every write
                    # it makes is guarded by the state it expects).
                    connection.close()
                    continue
                # PostgreSQL is out of reach (down, restarting, failing over): keep the node's
                # lease if that can be recorded elsewhere, so that our outage stops no job.
                return degraded_heartbeat(digest, exc)
        raise AssertionError("unreachable")
    except AgentAuthError as exc:
        return (
            401,
            json.dumps({"detail": str(exc)}).encode(),
            [("WWW-Authenticate", 'Bearer realm="agent"')],
        )
    except Invalid as exc:
        return 400, json.dumps({exc.field: [exc.message]}).encode(), []


def database_unreachable(exc: Exception) -> bool:
    """True when the error says the database cannot be talked to at all, not that a statement
    failed (a lock timeout, a deadlock: those are answered as errors, and retried by the agent).

    No SQLSTATE (the connection was refused or broke), class 08 (connection exception) or
    57P (the server is shutting down, or not accepting connections yet).
    """
    if isinstance(exc, InterfaceError):
        return True
    sqlstate = getattr(exc.__cause__, "sqlstate", None)
    return sqlstate is None or sqlstate.startswith(("08", "57P"))


def degraded_heartbeat(digest: str, cause: Exception) -> tuple[int, bytes, list]:
    """Answer a heartbeat while PostgreSQL cannot be reached: renew the lease, change nothing.

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
        "detail": "The database is unreachable: lease renewed, nothing else changed.",
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


@agent_view()
def watch(request: HttpRequest, node: Node) -> JsonResponse:
    """Long-poll until this node's desired state changes, or timeout_s (at most 30 s)."""
    body = parse_json(request)
    timeout_s = number(body, "timeout_s", minimum=0)
    timeout_s = min(WATCH_MAX_TIMEOUT_S, 20.0 if timeout_s is None else timeout_s)
    if not watch_slots.try_acquire():
        response = JsonResponse(
            {"detail": "This server holds all the watches it may; heartbeat periodically."},
            status=429,
        )
        response["Retry-After"] = str(int(WATCH_MAX_TIMEOUT_S))
        return response
    try:
        return JsonResponse({"changed": wait_for_change(node, timeout_s)})
    finally:
        watch_slots.release()


def wait_for_change(node: Node, timeout_s: float) -> bool:
    """True as soon as the node should be told something its last heartbeat did not say.

    The signal (Redis pub/sub, or in-process without Redis) only says "look again"; whether
    anything changed is decided by comparing the desired state with the last answer. That
    comparison, made after subscribing, also catches a change that landed between the last
    heartbeat and this watch, which a signal alone would miss.
    """
    from controlplane.scheduling import notify

    deadline = time.monotonic() + timeout_s
    if settings.REDIS_URL:
        from controlplane.redis_client import get_redis

        pubsub = get_redis().pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(notify.node_channel(node.name))
            if _differs_from_last_answer(node):
                return True
            while (remaining := deadline - time.monotonic()) > 0:
                if pubsub.get_message(timeout=min(remaining, 1.0)) is not None:
                    return True
            return False
        except (RedisError, OSError, ValueError) as exc:
            # Redis went away (or its connection broke under us): look again once a second
            # for what is left of the timeout instead of failing a request that only waits.
            log.warning("watch of %s falls back to polling: %s", node.name, exc)
            return _poll_for_change(node, deadline)
        finally:
            try:
                pubsub.close()
            except (RedisError, OSError, ValueError):
                pass
    seen = notify.node_version(node.name)
    if _differs_from_last_answer(node):
        return True
    return notify.wait_for_node_change(node.name, seen, timeout_s)


def _poll_for_change(node: Node, deadline: float) -> bool:
    while (remaining := deadline - time.monotonic()) > 0:
        time.sleep(min(remaining, 1.0))
        try:
            if _differs_from_last_answer(node):
                return True
        except (DatabaseError, RedisError, OSError):
            return False  # the agent's periodic heartbeat carries on regardless
    return False


def _differs_from_last_answer(node: Node) -> bool:
    told = hb_logic.last_answer_digest(node)
    return told is not None and told != hb_logic.digest(hb_logic.current_desired_state(node))


@agent_view()
def logs(request: HttpRequest, node: Node) -> JsonResponse:
    """Store a chunk of an attempt's output at its byte offset; a resent chunk is stored once."""
    body = parse_json(request)
    attempt_id = integer(body, "attempt_id", required=True, minimum=1)
    offset = integer(body, "offset", required=True, minimum=0)
    data = string(body, "data", max_length=LOG_CHUNK_MAX_BYTES) or ""
    encoded = data.encode()
    if len(encoded) > LOG_CHUNK_MAX_BYTES:
        raise Invalid("data", f"At most {LOG_CHUNK_MAX_BYTES} bytes per chunk.")
    ours = Q(node_id=node.pk) | Q(allocations__gpu__node_id=node.pk)
    with transaction.atomic():
        # The attempt row's lock serialises chunks of one attempt, so log_bytes stays exact.
        attempt = (
            JobAttempt.objects.select_for_update()
            .filter(pk__in=JobAttempt.objects.filter(ours, pk=attempt_id).values("pk"))
            .only("id", "log_bytes")
            .first()
        )
        if attempt is None:
            return JsonResponse({"detail": "No such attempt on this node."}, status=404)
        stored_to = attempt.log_bytes
        end = offset + len(encoded)
        if offset > stored_to:
            # A gap: an earlier chunk was lost. Keep the stored output contiguous and say
            # where it ends, so the agent resends from there.
            return JsonResponse({"next_offset": stored_to})
        if end <= stored_to:
            return JsonResponse({"next_offset": stored_to})
        # Overlap: keep only the bytes past what is stored. The agent cuts chunks at character
        # boundaries, and so does the stored end, so the tail decodes cleanly.
        tail = encoded[stored_to - offset :].decode(errors="replace")
        LogChunk.objects.bulk_create(
            [LogChunk(attempt_id=attempt.pk, offset=stored_to, data=tail)],
            ignore_conflicts=True,
        )
        JobAttempt.objects.filter(pk=attempt.pk).update(
            log_bytes=F("log_bytes") + (end - stored_to)
        )
    return JsonResponse({"next_offset": end})
