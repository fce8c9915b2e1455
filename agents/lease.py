"""The node's lease as this host sees it: when its attempts must be gone (docs/agent-protocol.md).

Every heartbeat the control plane answers renews the node's lease for `lease_s`, counted here
from the moment the heartbeat was SENT (the control plane recorded it later than that, so our
count runs out first). The lease is kept in `<state-dir>/lease.json` for the fence (agents.fence),
a process of its own that stops every attempt before the lease runs out, even when the agent
itself is dead or paused; the control plane gives their GPUs away only after it ran out.

Times are CLOCK_BOOTTIME seconds: one clock for every process of the host, never set by NTP or
by hand, and still counting while the host is suspended (CLOCK_MONOTONIC stops then, which would
let a resumed host believe its lease was still good). A lease from another boot is void.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agents.runtime.base import DEFAULT_STOP_SIGNAL, STOP_SIGNAL_NAMES, read_small, write_all

LEASE_FILE = "lease.json"
# The same lease for the process runtime's supervisor, a bash script that must compare it without
# starting a process: `<boot id> <kill_at> <grace>` on the first line, then `<attempt id>
# <grace>` for each attempt whose grace is not the lease's own, times in whole centiseconds
# (kill_at rounded down, graces up: the supervisor refuses too early, never too late).
LEASE_DEADLINE_FILE = "lease.deadline"
FENCED_DIR = "fenced"


def boottime() -> float:
    """Seconds since boot, suspend included, the same in every process of this host."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@functools.cache
def boot_id() -> str:
    """This boot's identity: a lease written before a reboot must not count after it.

    Read once per process: no process outlives its boot, and the agent asked for it at every
    start and lease check (a file read per job in a flood of short ones)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def margin_for(lease_s: float) -> float:
    """How long before its lease runs out every attempt must be gone, where the control plane
    does not say (it does: `fence_margin_s`, the same by default).

    It covers the fence's poll, a SIGKILL taking effect, and clock rates that differ between
    this host and the control plane's (a drift of 1e-4 costs 12 ms over 120 s).
    """
    return max(1.0, 0.05 * lease_s)


@dataclass
class Lease:
    """One renewal: what the fence acts on."""

    boot_id: str
    expires_at: float  # CLOCK_BOOTTIME: the lease runs out (as counted here)
    lease_s: float
    margin_s: float
    grace_s: float  # stop signal to SIGKILL, for attempts not listed in graces
    graces: dict[str, float] = field(default_factory=dict)  # attempt id -> its own grace
    renewed_at_unix: float = 0.0  # for people reading the file
    # attempt id -> its stop signal's name, where not SIGTERM. Absent from the files of an older
    # agent (read as SIGTERM for every attempt), and ignored by an older fence.
    signals: dict[str, str] = field(default_factory=dict)

    @property
    def kill_at(self) -> float:
        """Every attempt of the node is gone by then (SIGKILL)."""
        return self.expires_at - self.margin_s

    def grace_of(self, attempt_id: int) -> float:
        return float(self.graces.get(str(attempt_id), self.grace_s))

    def signal_of(self, attempt_id: int) -> str:
        """The name of the signal that tells the attempt to stop (SIGTERM unless it asked for
        another, or for one the agent does not allow)."""
        name = self.signals.get(str(attempt_id), DEFAULT_STOP_SIGNAL)
        return name if name in STOP_SIGNAL_NAMES else DEFAULT_STOP_SIGNAL

    def term_at(self, attempt_id: int) -> float:
        """When the attempt gets its stop signal so that its grace ends by kill_at."""
        return self.kill_at - self.grace_of(attempt_id)

    @property
    def of_this_boot(self) -> bool:
        return self.boot_id == boot_id()

    def remaining_s(self, now: float | None = None) -> float:
        """Seconds until kill_at (negative once past; -inf for a lease of another boot)."""
        if not self.of_this_boot:
            return float("-inf")
        return self.kill_at - (boottime() if now is None else now)

    @classmethod
    def renewed(
        cls,
        sent_at: float,
        lease_s: float,
        grace_s: float,
        graces: dict[int, float],
        *,
        margin_s: float | None = None,
        signals: dict[int, str] | None = None,
    ) -> Lease:
        """The lease a heartbeat sent at `sent_at` (boottime) earned: `grace_s` is the agent's
        own (--stop-grace), `graces` the attempts' own; the lease's is the longest of them."""
        return cls(
            boot_id=boot_id(),
            expires_at=sent_at + lease_s,
            lease_s=lease_s,
            margin_s=margin_for(lease_s) if margin_s is None else margin_s,
            # The longest grace of the node for every attempt, none listed: an attempt that
            # asked for less gets its notice earlier than it needs (this is the last resort of
            # a node cut off for a whole lease), and a lease that names no attempt is not a
            # new lease to write at every start and end.
            grace_s=max([grace_s, *(float(v) for v in graces.values())]),
            renewed_at_unix=time.time(),
            signals={str(k): v for k, v in (signals or {}).items() if v != DEFAULT_STOP_SIGNAL},
        )


def rewrite_lag_s(lease_s: float) -> float:
    """How much later than the lease on disk a renewal may be and still not be written.

    Every answered heartbeat renews the lease, many times a second on a node that starts and
    ends many short jobs, and each write is a new file renamed over the old one. Leaving the
    file up to this much behind the truth makes the fence and the supervisor act that much
    early, never late; 2 % of the lease (at most 1 s: 0.8 % of the default 120 s) is far inside
    the margins the lease already keeps."""
    return min(1.0, 0.02 * lease_s)


def renewal_worth_writing(
    written: Lease | None,
    renewed: Lease,
    graces: dict[int, float],
    default_grace_s: float,
) -> bool:
    """Whether `renewed` must replace the lease on disk (`written`), or says the same but for
    an end less than rewrite_lag_s later. One that ends earlier is always written.

    `graces` are the running attempts' own, `default_grace_s` the agent's (for attempts
    started later, which _lease_covers names in the file if they need more): a written lease
    that gives each of them at least its grace, and the same stop signals, is the same terms
    for this purpose. It gives some notice earlier than the renewal would, for at most
    rewrite_lag_s: a node whose long-grace job ended and whose next one starts a moment later
    (a flood of short jobs) rewrote the file three times per batch of starts."""
    if written is None:
        return True
    same_lease = (
        written.boot_id == renewed.boot_id
        and written.lease_s == renewed.lease_s
        and written.margin_s == renewed.margin_s
    )
    # An attempt's signal never changes, so an entry for one that ended names no other.
    same_terms = (
        written.grace_s >= default_grace_s
        and all(written.grace_of(a) >= grace_s for a, grace_s in graces.items())
        and all(written.signals.get(a) == name for a, name in renewed.signals.items())
    )
    later_s = renewed.expires_at - written.expires_at
    return not (same_lease and same_terms and 0.0 <= later_s < rewrite_lag_s(renewed.lease_s))


def _centiseconds(seconds: float, *, up: bool) -> int:
    return max(0, math.ceil(seconds * 100) if up else math.floor(seconds * 100))


def deadline_text(lease: Lease) -> str:
    """The lease as LEASE_DEADLINE_FILE holds it."""
    grace_cs = _centiseconds(lease.grace_s, up=True)
    lines = [f"{lease.boot_id} {_centiseconds(lease.kill_at, up=False)} {grace_cs}"]
    for attempt_id, grace_s in lease.graces.items():
        if _centiseconds(grace_s, up=True) != grace_cs:
            lines.append(f"{attempt_id} {_centiseconds(grace_s, up=True)}")
    return "\n".join(lines) + "\n"


def write_lease(state_dir: Path, lease: Lease) -> None:
    """Replace the lease files, each in one rename (readers see the old lease or the new one).

    Not fsynced: only processes of this boot read them, from the page cache; after a crash of
    the host the lease is void anyway. os.path and os.open, not pathlib: a node that starts
    and ends many short jobs rewrites them several times a second.
    """
    folder = os.fspath(state_dir)
    pid = os.getpid()
    for name, text in (
        (LEASE_DEADLINE_FILE, deadline_text(lease)),
        (LEASE_FILE, json.dumps(vars(lease))),
    ):
        path = os.path.join(folder, name)
        tmp = f"{path}.{pid}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            write_all(fd, text.encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)


def read_lease(state_dir: Path) -> Lease | None:
    """The last lease written, or None when there is none (never renewed, or unreadable)."""
    try:
        data = json.loads((Path(state_dir) / LEASE_FILE).read_text())
        known = {k: v for k, v in data.items() if k in Lease.__dataclass_fields__}
        return Lease(**known)
    except (OSError, ValueError, TypeError):
        return None


def mark_fenced(
    state_dir: Path, attempt_id: int, why: str, signal: str = "", *, killed: bool = False
) -> None:
    """Note that the fence stops this attempt, before it signals it: whoever sees the process
    end finds the note, and reports the end as the node's doing, not the job's.

    The note keeps when the first signal went out (`at_unix`, the attempt's stop_signal_at),
    which (`signal`), and once the fence had to kill, when (`killed_at_unix`)."""
    folder = Path(state_dir) / FENCED_DIR
    folder.mkdir(exist_ok=True)
    path = folder / f"{attempt_id}.json"
    note = fenced(state_dir, attempt_id)
    if note is not None and (not killed or "killed_at_unix" in note):
        return
    now = time.time()
    if note is None:
        note = {"at_unix": now, "why": why, "signal": signal}
    if killed:
        note["killed_at_unix"] = now
    tmp = folder / f"{attempt_id}.json.tmp"
    tmp.write_text(json.dumps(note))
    os.replace(tmp, path)


def fenced(state_dir: Path, attempt_id: int) -> dict[str, Any] | None:
    """The fence's note on this attempt, or None when the fence never touched it."""
    # read_small, not Path.read_text: the agent looks for a note of every attempt it runs at
    # every heartbeat, and there nearly never is one: one failed open, no file object.
    try:
        data = read_small(os.path.join(state_dir, FENCED_DIR, f"{attempt_id}.json"))
        if data is None:
            return None
        note: dict[str, Any] = json.loads(data)
    except (OSError, ValueError):
        return None
    return note


def forget_fenced(state_dir: Path, attempt_id: int) -> None:
    try:
        (Path(state_dir) / FENCED_DIR / f"{attempt_id}.json").unlink()
    except FileNotFoundError:
        pass
