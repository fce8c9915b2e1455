"""The order in which pending jobs are considered.

FAIR, ours, compares jobs on, in turn:

1. guaranteed work first: a job that fits in what is left of its tenant's guarantee (jobs of a
   tenant fill its guarantee in the order below) goes before any job that would borrow;
2. priority, raised by waiting: every `aging_period_s` a job has waited counts like one unit of
   priority, so a job never waits forever behind a stream of newer ones of its class, and a low
   job overtakes fresh normal ones after (100 - 50) periods;
3. the tenant's weighted dominant share, lowest first, kept current as the cycle starts jobs
   (the queue is a merge of per-tenant queues, so one tenant's burst cannot fill a cycle);
4. the predicted duration, shortest first (short jobs are not stuck behind long ones);
5. submit time, then job id, so equal keys still give one order.

The other orderings are the simulator's baselines and ignore tenants and priorities:
FIFO (submit time), SJF and SRTF (predicted duration; SRTF also preempts, see
scheduler.preemption), LAS (Tiresias' discretised two-dimensional least attained service: GPU-
seconds received so far, in queues, FIFO inside a queue) and QSSF (Helios: predicted GPU time).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator

from scheduler.model import ANY_GPU_TYPE, Config, Ordering, Pending
from scheduler.quota import ANY, Book

# Tiresias' queue boundaries in attained GPU-seconds: under 1 GPU-hour, under 10, the rest.
LAS_QUEUE_THRESHOLDS_GPU_S = (3600.0, 36000.0)


def las_queue(attained_gpu_s: float) -> int:
    """The 2D-LAS queue of a job: 0 for the least attained service."""
    for i, threshold in enumerate(LAS_QUEUE_THRESHOLDS_GPU_S):
        if attained_gpu_s < threshold:
            return i
    return len(LAS_QUEUE_THRESHOLDS_GPU_S)


def aged_priority(p: Pending, now_s: float, config: Config) -> int:
    """Priority plus one for every full aging period the job has waited."""
    if config.aging_period_s <= 0:
        return p.priority
    waited_s = now_s - p.submitted_at_s
    if waited_s <= 0:
        return p.priority
    return p.priority + math.floor(waited_s / config.aging_period_s)


def order(
    pending: tuple[Pending, ...],
    config: Config,
    now_s: float,
    books: dict[str, Book],
    predicted_s: dict[int, float],
) -> Iterator[Pending]:
    """The pending jobs in the order the cycle considers them.

    For FAIR this is lazy: the next job is chosen after the previous one was dealt with, so a
    tenant's share reflects what this cycle already gave it.
    """
    ordering = config.ordering
    if ordering is Ordering.FAIR:
        return _fair(pending, config, now_s, books, predicted_s)
    if ordering is Ordering.FIFO:
        key = lambda p: (p.submitted_at_s, p.job_id)  # noqa: E731
    elif ordering in (Ordering.SJF, Ordering.SRTF):
        key = lambda p: (predicted_s[p.job_id], p.submitted_at_s, p.job_id)  # noqa: E731
    elif ordering is Ordering.LAS:
        key = lambda p: (las_queue(p.attained_service_s), p.submitted_at_s, p.job_id)  # noqa: E731
    elif ordering is Ordering.QSSF:
        key = lambda p: (  # noqa: E731
            predicted_s[p.job_id] * max(p.gpus, 1),
            p.submitted_at_s,
            p.job_id,
        )
    else:
        raise ValueError(f"unknown ordering {ordering!r}")
    return iter(sorted(pending, key=key))


def guaranteed_jobs(jobs: list[Pending], book: Book) -> set[int]:
    """Which of a tenant's jobs, taken in order, fit in what is left of its guarantee."""
    g = book.guaranteed
    if not g:
        return set()
    room = {key: g[key] - book.active.get(key, 0) for key in g}
    typed = sorted(k for k in g if k != ANY)
    out: set[int] = set()
    for p in jobs:
        n = p.gpus
        if p.gpu_type == ANY_GPU_TYPE:
            keys = [ANY] if ANY in room else []
            if not keys:
                keys = [next((k for k in typed if room[k] >= n), typed[0])]
        else:
            keys = [k for k in (p.gpu_type, ANY) if k in room]
            if not keys:
                continue
        if all(room[k] >= n for k in keys):
            for k in keys:
                room[k] -= n
            out.add(p.job_id)
    return out


def _fair(
    pending: tuple[Pending, ...],
    config: Config,
    now_s: float,
    books: dict[str, Book],
    predicted_s: dict[int, float],
) -> Iterator[Pending]:
    per_tenant: dict[str, list[tuple]] = {}
    for p in pending:
        per_tenant.setdefault(p.tenant, []).append(
            (-aged_priority(p, now_s, config), predicted_s[p.job_id], p.submitted_at_s, p.job_id, p)
        )
    queues: dict[str, list[tuple]] = {}
    for tenant, rows in per_tenant.items():
        rows.sort(key=lambda row: row[:4])
        guaranteed = guaranteed_jobs([row[4] for row in rows], books[tenant])
        keyed = [(0 if row[3] in guaranteed else 1, *row) for row in rows]
        keyed.sort(key=lambda row: row[:5])
        queues[tenant] = keyed
    heap: list[tuple] = []
    position = dict.fromkeys(queues, 0)
    for tenant, rows in queues.items():
        heap.append(_entry(rows[0], books[tenant], tenant))
    heapq.heapify(heap)
    while heap:
        entry = heapq.heappop(heap)
        tenant = entry[7]
        book = books[tenant]
        rows = queues[tenant]
        i = position[tenant]
        if entry[6] != book.version:
            heapq.heappush(heap, _entry(rows[i], book, tenant))
            continue
        yield rows[i][5]
        i += 1
        position[tenant] = i
        if i < len(rows):
            heapq.heappush(heap, _entry(rows[i], book, tenant))


def _entry(row: tuple, book: Book, tenant: str) -> tuple:
    guaranteed, neg_priority, predicted, submitted, job_id, _ = row
    return (
        guaranteed,
        neg_priority,
        book.share,
        predicted,
        submitted,
        job_id,
        book.version,
        tenant,
    )
