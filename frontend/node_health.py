"""A node's health in words: what each code the agents report means to a person, and how bad it is.

The agents report health as machine codes: NVML's clock-event ("throttle") reasons by name
(`gpu_idle`, `hw_thermal_slowdown`, ... and `unknown_0x...` for bits NVML adds later, see
agents.gpu.nvml.THROTTLE_REASONS), uncorrected ECC errors, a GPU marked unhealthy (lost, a critical
XID, or no longer listed), and node conditions (`GpuTelemetryFailed`, `PowerCapFailed`). Liveness
is the control plane's own (a node that stopped answering is down).

Each note has a level: "bad" (a fault: the node or a GPU cannot be trusted with work), "warn"
(worth a look: slowed down, or idle while a job holds it) or "info" (what a healthy busy cluster
does, such as a GPU held to the cap the scheduler set). A node is "unhealthy" with any bad note,
"warning" with a warn note, else "healthy"; a deregistered node is "gone" and none of those.

`health_q` says the same in SQL, so the nodes page filters and paginates in the database: the two
must agree, and tests/frontend/test_nodes_page.py checks that they do.
"""

from __future__ import annotations

import datetime as dt
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from controlplane.cluster.models import GPU, Node
from controlplane.jobs.models import AttemptState
from controlplane.queries import GpuRow
from frontend.templatetags.gpucp import duration

BAD, WARN, INFO = "bad", "warn", "info"
HEALTHY, WARNING, UNHEALTHY, GONE = "healthy", "warning", "unhealthy", "gone"
HEALTH_LABELS = {
    HEALTHY: "healthy",
    WARNING: "warning",
    UNHEALTHY: "unhealthy",
    GONE: "deregistered",
}
# The badge class (app.css) of each level.
HEALTH_BADGES = {HEALTHY: "ok", WARNING: "warn", UNHEALTHY: "bad", GONE: "idle"}


@dataclass(frozen=True)
class Words:
    """What a code says of its GPUs: the predicate for one GPU and for several."""

    level: str
    one: str
    many: str


# Every NVML clock-event reason the agents name (agents.gpu.nvml.THROTTLE_REASONS). A GPU that
# is idle, capped or synced is doing what it should: "info", shown but not a problem.
THROTTLE_WORDS: dict[str, Words] = {
    # Idle on a free GPU is no news; on a GPU a running job holds it is (see IDLE_WHILE_HELD).
    "gpu_idle": Words(INFO, "is idle", "are idle"),
    "applications_clocks_setting": Words(
        INFO,
        "has its clocks held by an applications-clocks setting",
        "have their clocks held by an applications-clocks setting",
    ),
    "sw_power_cap": Words(INFO, "is held to its power cap", "are held to their power caps"),
    "hw_slowdown": Words(
        BAD,
        "is slowed by the hardware (too hot, or the power supply asked it to)",
        "are slowed by the hardware (too hot, or the power supply asked them to)",
    ),
    "sync_boost": Words(
        INFO,
        "runs its clocks in step with other GPUs (sync boost)",
        "run their clocks in step with other GPUs (sync boost)",
    ),
    "sw_thermal_slowdown": Words(
        WARN,
        "is slowed by the driver to keep it cool",
        "are slowed by the driver to keep them cool",
    ),
    "hw_thermal_slowdown": Words(
        BAD, "is slowed by the hardware: it is too hot", "are slowed by the hardware: too hot"
    ),
    "hw_power_brake_slowdown": Words(
        BAD,
        "is slowed by the power brake (the power supply signalled an overload)",
        "are slowed by the power brake (the power supply signalled an overload)",
    ),
    "display_clock_setting": Words(
        INFO,
        "has its clocks held by the display clock setting",
        "have their clocks held by the display clock setting",
    ),
    "board_limit": Words(
        WARN, "is slowed by a limit of its board", "are slowed by limits of their boards"
    ),
    "reliability": Words(
        WARN,
        "is slowed to protect its long-term reliability",
        "are slowed to protect their long-term reliability",
    ),
}
# gpu_idle on a GPU whose job is running: the job holds a GPU it does not use.
IDLE_WHILE_HELD = Words(
    WARN, "is idle while a running job holds it", "are idle while running jobs hold them"
)
# NVML bits newer than the agent: agents.gpu.nvml.decode_throttle_reasons names them so.
UNKNOWN_BITS_PREFIX = "unknown_0x"

# Node conditions the agents report (agents/daemon.py), with the GPU they name if any.
CONDITION_WORDS: dict[str, str] = {
    "GpuTelemetryFailed": "The agent cannot read its GPUs' readings",
    "PowerCapFailed": "A power cap could not be set on {gpu}",
}

OUT_OF_SERVICE = Words(
    BAD,
    "is out of service: the agent reports it lost or failed (a critical XID, say) "
    "or no longer lists it",
    "are out of service: the agent reports them lost or failed (a critical XID, say) "
    "or no longer lists them",
)


@dataclass(frozen=True)
class Note:
    level: str
    text: str
    code: str = ""  # the machine code behind it, for whoever greps a log for it


def throttle_words(code: str) -> Words:
    """The words for any reason name, one this version has words for or not."""
    known = THROTTLE_WORDS.get(code)
    if known is not None:
        return known
    if code.startswith(UNKNOWN_BITS_PREFIX):
        bits = code.removeprefix("unknown_")
        return Words(
            WARN,
            f"is slowed for a reason this version has no words for (NVML bits {bits})",
            f"are slowed for a reason this version has no words for (NVML bits {bits})",
        )
    # A name from a newer agent: shown as it came, but not judged (the database filter could not
    # judge it either, and the two must agree).
    return Words(INFO, f"reports “{code}”", f"report “{code}”")


def condition_text(kind: str, message: str, gpu: str = "") -> str:
    """A node condition as a sentence; a kind this version does not know reads as words too."""
    template = CONDITION_WORDS.get(kind)
    if template is None:
        # "GpuFellOffTheBus" -> "The agent reports: gpu fell off the bus".
        words = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", kind).replace("_", " ").strip().lower()
        template = f"The agent reports: {words}" + (" ({gpu})" if gpu else "")
    text = template.format(gpu=gpu or "a GPU")
    return f"{text}: {message}" if message else text


def _subject(indexes: Sequence[int]) -> str:
    if len(indexes) == 1:
        return f"GPU {indexes[0]}"
    return "GPUs " + ", ".join(str(i) for i in sorted(indexes))


def _gpu_note(words: Words, indexes: list[int], code: str, extra: str = "") -> Note:
    predicate = words.one if len(indexes) == 1 else words.many
    return Note(words.level, f"{_subject(indexes)} {predicate}{extra}.", code)


def node_notes(node: Node, gpus: Sequence[GpuRow], now: dt.datetime | None = None) -> list[Note]:
    """What a person should know about the node's health, worst first."""
    now = now or timezone.now()
    if node.deregistered_at is not None:
        return [
            Note(
                INFO,
                f"Deregistered {node.deregistered_at:%b %d %H:%M} UTC: gone for good; "
                "its GPUs may join another node.",
                "deregistered",
            )
        ]
    notes: list[Note] = []
    if not node.ready:
        if node.last_heartbeat_at is None:
            notes.append(Note(BAD, "Down: it has never sent a heartbeat.", "not_ready"))
        else:
            silent = duration(max(0.0, (now - node.last_heartbeat_at).total_seconds()))
            notes.append(Note(BAD, f"Down: no heartbeat for {silent}.", "not_ready"))
    by_uuid = {row.gpu.uuid: row.gpu for row in gpus}
    for c in node.conditions or []:
        gpu = by_uuid.get(c.get("gpu_uuid") or "")
        where = f"GPU {gpu.index}" if gpu is not None else (c.get("gpu_uuid") or "")
        text = condition_text(str(c.get("type") or "unknown"), str(c.get("message") or ""), where)
        since = c.get("since")
        if isinstance(since, int | float):
            text += f" (for {duration(max(0.0, now.timestamp() - since))})"
        notes.append(Note(BAD, text.rstrip(".") + ".", str(c.get("type") or "")))

    failed = [row.gpu.index for row in gpus if not row.gpu.healthy]
    if failed:
        notes.append(_gpu_note(OUT_OF_SERVICE, failed, "unhealthy"))
    ecc = [row.gpu for row in gpus if row.gpu.ecc_errors]
    if ecc:
        total = sum(g.ecc_errors or 0 for g in ecc)
        notes.append(
            Note(
                BAD,
                f"{_subject([g.index for g in ecc])} "
                f"{'has' if len(ecc) == 1 else 'have'} uncorrected memory (ECC) errors: "
                f"{total} since {'its driver' if len(ecc) == 1 else 'their drivers'} loaded.",
                "ecc_errors",
            )
        )
    by_code: dict[str, list[int]] = defaultdict(list)
    for row in gpus:
        for code in row.gpu.throttle_reasons or []:
            if code == "gpu_idle":
                if row.attempt is None or row.attempt.state != AttemptState.RUNNING:
                    continue  # idle and free (or its job still starting): nothing to say
                code = "gpu_idle_while_held"
            by_code[code].append(row.gpu.index)
    for code, indexes in by_code.items():
        words = IDLE_WHILE_HELD if code == "gpu_idle_while_held" else throttle_words(code)
        notes.append(_gpu_note(words, indexes, "gpu_idle" if words is IDLE_WHILE_HELD else code))
    order = {BAD: 0, WARN: 1, INFO: 2}
    return sorted(notes, key=lambda n: order[n.level])


def health_level(node: Node, notes: Sequence[Note]) -> str:
    if node.deregistered_at is not None:
        return GONE
    levels = {n.level for n in notes}
    return UNHEALTHY if BAD in levels else WARNING if WARN in levels else HEALTHY


# --- the same in SQL --------------------------------------------------------------------------


def _reasons_q(codes) -> Q:
    """A GPU reporting any of these reasons. The reasons are a JSON list of names; matching the
    quoted name in its text works on PostgreSQL and SQLite alike (jsonb's @> would not)."""
    q = Q(pk__in=[])
    for code in sorted(codes):
        q |= Q(throttle_reasons__icontains=f'"{code}"')
    return q


def _gpus_where(q: Q) -> Q:
    """Nodes with a GPU that matches: EXISTS, so a node is listed once however many match."""
    return Q(Exists(GPU.objects.filter(q, node=OuterRef("pk"))))


def _bad_q() -> Q:
    bad_reasons = [c for c, w in THROTTLE_WORDS.items() if w.level == BAD]
    return (
        Q(ready=False)
        | ~Q(conditions=[])
        | _gpus_where(Q(healthy=False) | Q(ecc_errors__gt=0) | _reasons_q(bad_reasons))
    )


def _warn_q() -> Q:
    warn_reasons = [c for c, w in THROTTLE_WORDS.items() if w.level == WARN]
    idle_while_held = Q(
        throttle_reasons__icontains='"gpu_idle"',
        allocations__active=True,
        allocations__attempt__state=AttemptState.RUNNING,
    )
    return _gpus_where(
        _reasons_q(warn_reasons)
        | Q(throttle_reasons__icontains=f'"{UNKNOWN_BITS_PREFIX}')
        | idle_while_held
    )


def health_q(level: str) -> Q:
    """Nodes whose `health_level` is `level`, as a filter for Node.objects."""
    present = Q(deregistered_at__isnull=True)
    if level == GONE:
        return ~present
    if level == UNHEALTHY:
        return present & _bad_q()
    if level == WARNING:
        return present & ~_bad_q() & _warn_q()
    if level == HEALTHY:
        return present & ~_bad_q() & ~_warn_q()
    raise ValueError(f"no health level {level!r}")
