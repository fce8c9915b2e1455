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

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

LEASE_FILE = "lease.json"
FENCED_DIR = "fenced"


def boottime() -> float:
    """Seconds since boot, suspend included, the same in every process of this host."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def boot_id() -> str:
    """This boot's identity: a lease written before a reboot must not count after it."""
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
    grace_s: float  # SIGTERM to SIGKILL, for attempts not listed in graces
    graces: dict[str, float] = field(default_factory=dict)  # attempt id -> its own grace
    renewed_at_unix: float = 0.0  # for people reading the file

    @property
    def kill_at(self) -> float:
        """Every attempt of the node is gone by then (SIGKILL)."""
        return self.expires_at - self.margin_s

    def grace_of(self, attempt_id: int) -> float:
        return float(self.graces.get(str(attempt_id), self.grace_s))

    def term_at(self, attempt_id: int) -> float:
        """When the attempt gets its SIGTERM so that its grace ends by kill_at."""
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
    ) -> Lease:
        """The lease a heartbeat sent at `sent_at` (boottime) earned."""
        return cls(
            boot_id=boot_id(),
            expires_at=sent_at + lease_s,
            lease_s=lease_s,
            margin_s=margin_for(lease_s) if margin_s is None else margin_s,
            grace_s=grace_s,
            graces={str(k): float(v) for k, v in graces.items()},
            renewed_at_unix=time.time(),
        )


def write_lease(state_dir: Path, lease: Lease) -> None:
    """Replace the lease file in one rename (readers see the old lease or the new one).

    Not fsynced: only processes of this boot read it, from the page cache; after a crash of
    the host the lease is void anyway.
    """
    path = Path(state_dir) / LEASE_FILE
    tmp = path.with_name(f"{LEASE_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(lease)))
    os.replace(tmp, path)


def read_lease(state_dir: Path) -> Lease | None:
    """The last lease written, or None when there is none (never renewed, or unreadable)."""
    try:
        data = json.loads((Path(state_dir) / LEASE_FILE).read_text())
        known = {k: v for k, v in data.items() if k in Lease.__dataclass_fields__}
        return Lease(**known)
    except (OSError, ValueError, TypeError):
        return None


def mark_fenced(state_dir: Path, attempt_id: int, why: str) -> None:
    """Note that the fence stops this attempt, before it signals it: whoever sees the process
    end finds the note, and reports the end as the node's doing, not the job's."""
    folder = Path(state_dir) / FENCED_DIR
    folder.mkdir(exist_ok=True)
    path = folder / f"{attempt_id}.json"
    if not path.exists():
        tmp = folder / f"{attempt_id}.json.tmp"
        tmp.write_text(json.dumps({"at_unix": time.time(), "why": why}))
        os.replace(tmp, path)


def fenced(state_dir: Path, attempt_id: int) -> dict[str, Any] | None:
    """The fence's note on this attempt, or None when the fence never touched it."""
    try:
        note: dict[str, Any] = json.loads(
            (Path(state_dir) / FENCED_DIR / f"{attempt_id}.json").read_text()
        )
    except (OSError, ValueError):
        return None
    return note


def forget_fenced(state_dir: Path, attempt_id: int) -> None:
    try:
        (Path(state_dir) / FENCED_DIR / f"{attempt_id}.json").unlink()
    except FileNotFoundError:
        pass
