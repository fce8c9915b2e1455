"""Reading an attempt's stored output (the LogChunk rows agents ship): the API and the web UI both
call this, so a log reads the same in both.

Output is stored as the bytes the program wrote. It is shown as text, decoded as UTF-8, with
what text cannot show faithfully made visible instead of lost or hidden: a byte that is not
part of valid UTF-8 appears as `\\xNN` (its value, as Python writes it), and a NUL as `\\x00`.
Everything else, control characters included, is shown as it is. The exact bytes stay
downloadable (`read_log_bytes`, the web UI's "full log" link).
"""

from __future__ import annotations

from django.db.models import Q
from django.db.models.functions import Length

from controlplane.jobs.models import JobAttempt, LogChunk

# A full log larger than this is answered from its end, with `truncated` set.
MAX_LOG_ANSWER_BYTES = 4 * 1024 * 1024


def read_log(attempt: JobAttempt, tail_lines: int | None, rank: int = 0) -> tuple[str, int, bool]:
    """(text as shown, size in bytes, whether the start was cut off) of an attempt's output."""
    raw, size_bytes, truncated = read_log_bytes(attempt, tail_lines, rank)
    return display_text(raw), size_bytes, truncated


def display_text(raw: bytes) -> str:
    """Output bytes as text a page or a JSON answer shows faithfully (see the module's note)."""
    return raw.decode("utf-8", "backslashreplace").replace("\x00", "\\x00")


# Chunks read per query when reading from an offset (read_log_from).
LOG_READ_PAGE_ROWS = 64


def _of_rank(rank: int) -> Q:
    """The chunks of the member of `rank` (rank 0 also owns output stored before members)."""
    return Q(member__rank=rank) | Q(member__isnull=True) if rank == 0 else Q(member__rank=rank)


def read_log_bytes(
    attempt: JobAttempt, tail_lines: int | None, rank: int = 0
) -> tuple[bytes, int, bool]:
    """(bytes, size in bytes, whether the start was cut off) of an attempt's stored output: that
    of its member of `rank` (each node's member writes its own; a one-node attempt has rank 0
    alone, as does output stored before members existed).

    Reads chunks from the end and stops as soon as it has the lines (or bytes) it needs, so the
    tail of a long log costs a few rows. Chunks that overlap (a resend from another boundary)
    contribute each byte once.
    """
    chunks = (
        LogChunk.objects.filter(attempt=attempt)
        .filter(_of_rank(rank))
        .order_by("-offset")
        .values_list("offset", "data")
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


def read_log_from(
    attempt: JobAttempt, start: int, max_bytes: int, rank: int = 0
) -> tuple[bytes, int, int]:
    """(bytes from byte `start` on, the offset just after them, size in bytes) of an output.

    What a follower asks for: it passes back the offset it was given and gets only what came
    since. At most `max_bytes` are answered (the rest on the next call). Each member of a
    multi-node attempt (`rank`) has its own output, with its own offsets. A gap between stored
    chunks (bytes an agent gave up on) is skipped, so a follower is never stuck before it.
    """
    start = max(0, start)
    chunks = LogChunk.objects.filter(attempt=attempt).filter(_of_rank(rank))
    # Most calls come from a follower that has read everything: the chunk holding `start` then
    # ends there, and its bytes are not wanted. Its length alone says so, without its data.
    holding = (
        chunks.filter(offset__lte=start)
        .order_by("-offset")
        .values_list("offset", Length("data"))
        .first()
    )
    pieces: list[bytes] = []
    position = start
    size_bytes = 0
    collected = 0
    rows: list[tuple[int, bytes]] = []
    if holding is not None:
        size_bytes = holding[0] + holding[1]
        if size_bytes > start:
            rows = list(chunks.filter(offset=holding[0]).values_list("offset", "data")[:1])
    later = chunks.order_by("offset").values_list("offset", "data")
    after = start
    while True:
        for offset, raw in rows:
            end = offset + len(raw)
            size_bytes = max(size_bytes, end)
            if end <= position:
                continue  # wholly before what is wanted, or resent bytes already taken
            if collected >= max_bytes:
                # The rest is for the next call; only the size is still wanted, from the last
                # row.
                last = chunks.order_by("-offset").values_list("offset", Length("data")).first()
                if last is not None:
                    size_bytes = max(size_bytes, last[0] + last[1])
                return b"".join(pieces), position, max(size_bytes, start)
            piece = raw[max(0, position - offset) :][: max_bytes - collected]
            pieces.append(piece)
            collected += len(piece)
            position = max(position, offset) + len(piece)
        # Pages of plain queries, not a server-side cursor (three round trips even when
        # nothing came): a follower's call usually finds one page or none.
        rows = list(later.filter(offset__gt=after)[:LOG_READ_PAGE_ROWS])
        if not rows:
            break
        after = rows[-1][0]
    return b"".join(pieces), position, max(size_bytes, start)


def complete_utf8_prefix(raw: bytes) -> bytes:
    """raw less a UTF-8 character cut off at its end, which the next read completes.

    A follower reads output as it is shipped, and a chunk may end inside a character: shown
    at once, its bytes would read as `\\xNN`, and the rest of it the same on the next read.
    """
    for back in range(1, min(3, len(raw)) + 1):
        byte = raw[-back]
        if byte & 0xC0 == 0x80:
            continue  # a continuation byte: look further back for the lead byte
        if byte >= 0xC0:
            needed = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            if needed > back:
                return raw[:-back]
        return raw
    return raw
