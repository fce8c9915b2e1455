"""Reading an attempt's stored output (the LogChunk rows agents ship): the API and the web UI both
call this, so a log reads the same in both.

Output is stored as the bytes the program wrote. It is shown as text, decoded as UTF-8, with
what text cannot show faithfully made visible instead of lost or hidden: a byte that is not
part of valid UTF-8 appears as `\\xNN` (its value, as Python writes it), and a NUL as `\\x00`.
Everything else, control characters included, is shown as it is. The exact bytes stay
downloadable (`read_log_bytes`, the web UI's "full log" link).
"""

from __future__ import annotations

from controlplane.jobs.models import JobAttempt, LogChunk

# A full log larger than this is answered from its end, with `truncated` set.
MAX_LOG_ANSWER_BYTES = 4 * 1024 * 1024


def read_log(attempt: JobAttempt, tail_lines: int | None) -> tuple[str, int, bool]:
    """(text as shown, size in bytes, whether the start was cut off) of an attempt's output."""
    raw, size_bytes, truncated = read_log_bytes(attempt, tail_lines)
    return display_text(raw), size_bytes, truncated


def display_text(raw: bytes) -> str:
    """Output bytes as text a page or a JSON answer shows faithfully (see the module's note)."""
    return raw.decode("utf-8", "backslashreplace").replace("\x00", "\\x00")


def read_log_bytes(attempt: JobAttempt, tail_lines: int | None) -> tuple[bytes, int, bool]:
    """(bytes, size in bytes, whether the start was cut off) of an attempt's stored output.

    Reads chunks from the end and stops as soon as it has the lines (or bytes) it needs, so the
    tail of a long log costs a few rows. Chunks that overlap (a resend from another boundary)
    contribute each byte once.
    """
    chunks = (
        LogChunk.objects.filter(attempt=attempt).order_by("-offset").values_list("offset", "data")
    )
    pieces: list[bytes] = []
    covered_from = None  # lowest offset collected so far
    size_bytes = 0
    collected = 0
    newlines = 0
    truncated = False
    for offset, raw in chunks.iterator(chunk_size=64):
        end = offset + len(raw)
        size_bytes = max(size_bytes, end)
        if covered_from is not None and end > covered_from:
            raw = raw[: max(0, covered_from - offset)]
        covered_from = offset if covered_from is None else min(covered_from, offset)
        pieces.append(raw)
        collected += len(raw)
        newlines += raw.count(b"\n")
        if tail_lines is not None and newlines > tail_lines:
            break
        if collected >= MAX_LOG_ANSWER_BYTES:
            truncated = covered_from > 0
            break
    blob = b"".join(reversed(pieces))
    if len(blob) > MAX_LOG_ANSWER_BYTES:
        blob = blob[-MAX_LOG_ANSWER_BYTES:]
        truncated = True
    if tail_lines is not None:
        lines = blob.splitlines(keepends=True)
        blob = b"".join(lines[-tail_lines:]) if tail_lines else b""
    return blob, size_bytes, truncated
