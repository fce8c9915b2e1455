"""The node's storage chores, kept off the heartbeat's path (docs/agent-protocol.md, "Volumes").

A stat or a walk of a folder on a hung NFS server can block for minutes; a heartbeat must not
wait on it. So one thread (`StorageWorker.run`) does all of it, and the agent's loop only hands
it what to look at and reads what it found:

- the checkpoints of running attempts: the mtime of `<checkpoint dir>/.checkpoint` at every
  pass, and the size of the dir at most once a minute per attempt, and once more after the
  attempt ended;
- the volumes: every 30 s it asks the control plane which volumes apply to the node, reports
  the ones present (when the set changed, after deletions, or every 10 minutes), and deletes the
  checkpoint dirs the control plane says are due, only inside a checkpoint volume.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agents.client import ControlPlaneClient, ControlPlaneError, Rejected
from agents.runtime.base import CHECKPOINT_LINE, CHECKPOINT_MARKER, Runtime

log = logging.getLogger(__name__)

PASS_EVERY_S = 1.0
SIZE_EVERY_S = 60.0
VOLUMES_EVERY_S = 30.0
REPORT_AT_LEAST_EVERY_S = 600.0
# An old control plane without the volumes endpoint (404) is asked again this rarely, in case
# it was upgraded meanwhile.
ABSENT_RETRY_S = 600.0
CHECKPOINTS_SUBDIR = "checkpoints"
FILE_TIME_SLACK_S = 0.05


def scan_checkpoint_lines(head: str | None, data: bytes) -> tuple[bool, str | None]:
    """Whether ``data`` holds a line that starts with ``gpucp:checkpoint``, and the scan state
    to pass with the next bytes of the same output.

    The state is "" at the start of a line, the first bytes of the current line while they may
    still become the marker (latin-1, shorter than it), or None in the middle of a line that
    cannot: so a marker cut between two chunks is still found, and never found twice.
    """
    found = False
    pos = 0
    size = len(data)
    while True:
        if head is None:
            newline = data.find(b"\n", pos)
            if newline < 0:
                return found, None
            head, pos = "", newline + 1
            continue
        piece = data[pos : pos + len(CHECKPOINT_LINE) - len(head)]
        newline = piece.find(b"\n")
        if newline >= 0:  # the line ended before it could be the marker
            head, pos = "", pos + newline + 1
            continue
        candidate = head.encode("latin-1") + piece
        pos += len(piece)
        if not CHECKPOINT_LINE.startswith(candidate):
            head = None
        elif len(candidate) == len(CHECKPOINT_LINE):
            found, head = True, None
        elif pos >= size:
            return found, candidate.decode("latin-1")


def dir_bytes(path: str) -> int | None:
    """Bytes of the regular files under ``path`` (symlinks not followed); None when absent."""
    total = 0
    stack = [path]
    seen_root = False
    while stack:
        folder = stack.pop()
        try:
            with os.scandir(folder) as entries:
                seen_root = True
                for entry in entries:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                        elif entry.is_file(follow_symlinks=False):
                            total += entry.stat(follow_symlinks=False).st_size
                    except OSError:
                        continue  # removed while we looked
        except OSError:
            if folder == path:
                return None
    return total if seen_root else None


def marker_mtime(checkpoint_dir: str) -> float | None:
    """The mtime of the dir's `.checkpoint` (the job's last completed checkpoint), or None."""
    try:
        st = os.stat(os.path.join(checkpoint_dir, CHECKPOINT_MARKER))
    except OSError:
        return None
    return st.st_mtime


def checkpoint_dir_inside(host_path: str, volume_source: str, job_id: int) -> str | None:
    """The real path of the checkpoint dir to delete, or None when it must not be deleted.

    Only `<source>/checkpoints/<tenant>/<job id>` itself: lexically inside the volume's
    `checkpoints/` (no ".."), named after its job, and with no symlink on the way (its real
    path is the one it spells), so nothing outside the volume is ever reached.
    """
    if not (host_path.startswith("/") and volume_source.startswith("/")):
        return None
    if ".." in host_path.split("/"):
        return None
    root = os.path.join(os.path.normpath(volume_source), CHECKPOINTS_SUBDIR)
    path = os.path.normpath(host_path)
    relative = os.path.relpath(path, root)
    parts = relative.split(os.sep)
    if relative.startswith("..") or len(parts) < 2 or "." in parts:
        return None
    if parts[-1] != str(job_id):
        return None
    real_root = os.path.realpath(root)
    if os.path.realpath(path) != os.path.join(real_root, relative):
        return None
    return os.path.join(real_root, relative)


def delete_checkpoint_dir(host_path: str, volume_source: str, job_id: int) -> bool:
    """Delete one job's checkpoint dir if it is safely inside the volume; True when it is gone
    (or never was), False when it was refused or could not be removed."""
    path = checkpoint_dir_inside(host_path, volume_source, job_id)
    if path is None:
        log.warning(
            "refusing to delete %s for job %s: not a job's dir in %s/%s/",
            host_path,
            job_id,
            volume_source,
            CHECKPOINTS_SUBDIR,
        )
        return False
    if not os.path.lexists(path):
        return True
    if os.path.islink(path) or not os.path.isdir(path):
        log.warning("refusing to delete %s: not a directory", path)
        return False
    errors: list[str] = []

    def on_error(function: Any, failed: str, exc_info: Any) -> None:
        if not isinstance(exc_info[1], FileNotFoundError):
            errors.append(f"{failed}: {exc_info[1]}")

    shutil.rmtree(path, onerror=on_error)
    if os.path.lexists(path):
        log.warning("checkpoint dir of job %s not fully deleted: %s", job_id, errors[:3])
        return False
    log.info("deleted the checkpoint dir of job %s (%s)", job_id, path)
    return True


def volume_present(volume: dict[str, Any], runtime: Runtime) -> bool:
    """Whether the node has this volume as the contract defines it."""
    kind, source = volume.get("kind"), volume.get("source")
    if not isinstance(source, str) or not source:
        return False
    if kind == "host_path":
        if not source.startswith("/") or not os.path.isdir(source):
            return False
        if volume.get("checkpoints"):
            return os.access(source, os.W_OK | os.X_OK)
        return True
    if kind == "engine_volume":
        return runtime.has_volume(source)
    return False


@dataclass
class CheckpointSeen:
    """What the worker found of one attempt's checkpoint dir."""

    checkpoint_at: float | None = None  # the marker's newest mtime in this attempt
    checkpoint_bytes: int | None = None
    final: bool = False  # measured after the attempt ended


@dataclass
class _Tracked:
    path: str
    started_at: float | None
    ended: bool = False
    sized_at: float | None = None  # monotonic


class StorageWorker:
    """Checkpoint and volume chores in a thread of their own (`run`), or one pass (`step`)."""

    def __init__(
        self,
        client: ControlPlaneClient,
        runtime: Runtime,
        *,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.runtime = runtime
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._tracked: dict[int, _Tracked] = {}
        self._seen: dict[int, CheckpointSeen] = {}
        self._next_volumes_at = 0.0
        self._last_present: list[str] | None = None
        self._last_report_at: float | None = None
        self.feature_absent = False
        self.reports = 0  # volume reports the control plane took

    # -- what the agent's loop calls (never blocks on storage) -----------------------------------

    def track(self, attempt_id: int, path: str, started_at: float | None, ended: bool) -> None:
        """Watch this attempt's checkpoint dir (again: its start time or end may be new)."""
        with self._lock:
            tracked = self._tracked.get(attempt_id)
            if tracked is None:
                self._tracked[attempt_id] = _Tracked(path, started_at, ended)
            else:
                tracked.started_at = started_at or tracked.started_at
                tracked.ended = tracked.ended or ended

    def forget(self, attempt_id: int) -> None:
        with self._lock:
            self._tracked.pop(attempt_id, None)
            self._seen.pop(attempt_id, None)

    def seen(self, attempt_id: int) -> CheckpointSeen | None:
        with self._lock:
            seen = self._seen.get(attempt_id)
            return None if seen is None else CheckpointSeen(**vars(seen))

    # -- the thread ------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Pass after pass until ``stop``; an error in one pass never ends the thread."""
        while not stop.is_set():
            try:
                self.step()
            except Exception:
                log.exception("storage pass failed; trying again")
            stop.wait(PASS_EVERY_S)

    def step(self) -> None:
        """One pass: the checkpoints of tracked attempts, then the volumes when due."""
        self.step_checkpoints()
        if self._monotonic() >= self._next_volumes_at:
            self.step_volumes()

    def step_checkpoints(self) -> None:
        with self._lock:
            tracked = dict(self._tracked)
        for attempt_id, item in tracked.items():
            with self._lock:
                seen = self._seen.get(attempt_id) or CheckpointSeen()
            if seen.final:
                continue
            mtime = marker_mtime(item.path)
            # A marker older than the attempt is an earlier attempt's checkpoint. File times
            # come from the kernel's coarse clock, a tick behind the one started_at was read
            # from: a marker touched at once may seem a little older than its attempt.
            if mtime is not None and (
                item.started_at is None or mtime >= item.started_at - FILE_TIME_SLACK_S
            ):
                if seen.checkpoint_at is None or mtime > seen.checkpoint_at:
                    seen.checkpoint_at = mtime
            now = self._monotonic()
            if item.ended or item.sized_at is None or now - item.sized_at >= SIZE_EVERY_S:
                size = dir_bytes(item.path)
                if size is not None:
                    seen.checkpoint_bytes = size
                item.sized_at = now
                seen.final = item.ended
            with self._lock:
                if attempt_id in self._tracked:
                    self._seen[attempt_id] = seen

    def step_volumes(self) -> None:
        """Ask which volumes apply, delete what is due, report what is here."""
        now = self._monotonic()
        self._next_volumes_at = now + VOLUMES_EVERY_S
        try:
            answer = self.client.volumes()
        except Rejected as exc:
            if exc.status == 404:
                if not self.feature_absent:
                    log.info("the control plane has no volumes endpoint: volumes not reported")
                self.feature_absent = True
                self._next_volumes_at = now + ABSENT_RETRY_S
            else:
                log.warning("volumes not read: %s", exc)
            return
        except ControlPlaneError as exc:
            log.debug("volumes not read: %s", exc)
            return
        self.feature_absent = False
        volumes = [v for v in answer.get("volumes") or () if isinstance(v, dict)]
        present = sorted(
            str(v["name"])
            for v in volumes
            if isinstance(v.get("name"), str) and volume_present(v, self.runtime)
        )
        checkpoint_sources = [
            str(v["source"])
            for v in volumes
            if v.get("checkpoints") and v.get("kind") == "host_path" and str(v["name"]) in present
        ]
        deleted = self._delete_due(answer.get("checkpoint_deletions") or (), checkpoint_sources)
        due = (
            present != self._last_present
            or deleted
            or self._last_report_at is None
            or now - self._last_report_at >= REPORT_AT_LEAST_EVERY_S
        )
        if not due:
            return
        try:
            self.client.report_volumes(present, deleted)
        except ControlPlaneError as exc:
            log.warning("volumes not reported: %s", exc)
            return
        if present != self._last_present:
            log.info("volumes here: %s", ", ".join(present) or "none")
        self._last_present = present
        self._last_report_at = now
        self.reports += 1

    @staticmethod
    def _delete_due(deletions: Any, sources: list[str]) -> list[int]:
        deleted = []
        for item in deletions:
            if not isinstance(item, dict):
                continue
            job_id, host_path = item.get("job_id"), item.get("host_path")
            if isinstance(job_id, bool) or not isinstance(job_id, int):
                continue
            if not isinstance(host_path, str):
                continue
            for source in sources:
                if checkpoint_dir_inside(host_path, source, job_id) is not None:
                    if delete_checkpoint_dir(host_path, source, job_id):
                        deleted.append(job_id)
                    break
            else:
                log.warning(
                    "not deleting %s (job %s): not inside a checkpoint volume here",
                    host_path,
                    job_id,
                )
        return deleted
