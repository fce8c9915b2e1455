"""The agent's records of its attempts, in one append-only file: `<state-dir>/attempts.log`.

Each line is one JSON object: a record (`{"attempt_id": 7, ...}`, the whole record as it now
is) or a drop (`{"dropped": 7}`, the attempt was forgotten). Loading takes the last record of
each attempt not dropped since. Once the file holds many more lines than attempts it is
rewritten as one record per attempt kept (a fresh file, synced, renamed over the old one).

Why a log and not a file per attempt (`attempts/<id>.json`, which earlier agents wrote and
this one still reads, once): each rewrite of a small file by write-and-rename makes a new
inode and frees the old one. In a flood of short jobs that was two files made and freed per
job for its records alone, and on ext4 without a journal every new inode is found by skipping
past the inodes freed in the last seconds one at a time: a third of the agent's CPU went there.
An append makes nothing new, and the starts of one reconcile share one fsync.

A crash can cut only the last line (a record is one write); loading skips a line that does not
parse. A record written without `durable` survives a crash of the agent (the kernel has it),
not always one of the host, as with the former rename without fsync.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# The log is rewritten once it holds this many lines, or four times the attempts it keeps if
# that is more: a rewrite costs one line per attempt kept, so appends stay O(1) on average.
COMPACT_AT_LINES = 1000
COMPACT_FACTOR = 4


class AttemptJournal:
    """Records by attempt id; `put` and `drop` append, `load` reads them back."""

    def __init__(self, path: Path, *, compact_at_lines: int = COMPACT_AT_LINES) -> None:
        self.path = path
        self._compact_at_lines = compact_at_lines
        self._fd: int | None = None
        self._lines = 0  # lines in the file now, compaction's measure
        self._cut = False  # the last append was cut short: the next starts a line of its own

    def load(self) -> dict[int, dict[str, Any]]:
        """The last record of every attempt not dropped since; a line cut by a crash is skipped."""
        records: dict[int, dict[str, Any]] = {}
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            data = b""
        self._lines = 0
        for number, line in enumerate(data.split(b"\n"), 1):
            if not line:
                continue
            self._lines += 1
            try:
                entry = json.loads(line)
                if "dropped" in entry:
                    records.pop(int(entry["dropped"]), None)
                else:
                    records[int(entry["attempt_id"])] = entry
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                log.warning("%s: skipping line %d (%s)", self.path, number, exc)
        # Cut by a crash: the next append must start on a line of its own.
        self._cut = bool(data) and not data.endswith(b"\n")
        return records

    def put(self, records: Iterable[dict[str, Any]], *, durable: bool) -> None:
        """Append these records (each with its attempt_id) in one write; fsync if durable."""
        lines = [json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in records]
        if lines:
            self._append(b"".join(lines), durable=durable)
            self._lines += len(lines)

    def drop(self, attempt_ids: Iterable[int]) -> None:
        """Forget these attempts. Not synced: the caller's tombstones already are, and loading
        leaves out tombstoned attempts."""
        lines = [b'{"dropped":%d}\n' % attempt_id for attempt_id in attempt_ids]
        if lines:
            self._append(b"".join(lines), durable=False)
            self._lines += len(lines)

    def compact_if_due(self, kept: Callable[[], list[dict[str, Any]]]) -> None:
        """Rewrite the log as `kept()` once it holds many more lines than attempts."""
        if self._lines >= self._compact_at_lines:
            records = kept()
            if self._lines >= COMPACT_FACTOR * len(records):
                self.rewrite(records)

    def rewrite(self, records: list[dict[str, Any]]) -> None:
        """Replace the log with these records, durably: a crash leaves the old log or the new."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            for record in records:
                f.write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self.close()
        self._lines = len(records)
        self._cut = False

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _append(self, data: bytes, *, durable: bool) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        if self._cut:
            data = b"\n" + data
        self._cut = True  # until the whole of it is written
        written = os.write(self._fd, data)
        if written != len(data):
            # A full disk part-way: the line is cut (loading skips it), and the next append
            # must not run on from it.
            raise OSError(f"{self.path}: wrote {written} of {len(data)} bytes")
        self._cut = False
        if durable:
            os.fdatasync(self._fd)
