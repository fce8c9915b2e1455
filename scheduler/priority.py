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
from collections.abc import Callable, Iterator

from scheduler.model import ANY_GPU_TYPE, Config, Ordering, Pending, Running
from scheduler.quota import ANY, Book

# Tiresias' queue boundaries in attained GPU-seconds: under 1 GPU-hour, under 10, the rest.
LAS_QUEUE_THRESHOLDS_GPU_S = (3600.0, 36000.0)


def las_queue(attained_gpu_s: float) -> int:
    """The 2D-LAS queue of a job: 0 for the least attained service."""
    for i, threshold in enumerate(LAS_QUEUE_THRESHOLDS_GPU_S):
        if attained_gpu_s < threshold:
            return i
    return len(LAS_QUEUE_THRESHOLDS_GPU_S)


def attained_now(r: Running, now_s: float) -> float:
    """A running attempt's attained service (GPU-seconds) at now_s (see Running)."""
    if r.attained_as_of_s is None:
        return r.attained_service_s
    return r.attained_service_s + len(r.gpus) * max(now_s - r.attained_as_of_s, 0.0)


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
    key: Callable[[Pending], tuple[float, ...]]
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
    active = book.active
    room = {key: g[key] - active.get(key, 0) for key in g}
    out: set[int] = set()
    if len(room) == 1 and ANY in room:
        # The common case, one quota for all types: a running sum is enough.
        left = room[ANY]
        for p in jobs:
            if p.gpus <= left:
                left -= p.gpus
                out.add(p.job_id)
        return out
    typed = sorted(k for k in g if k != ANY)
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
    period_s = config.aging_period_s
    # (-priority, predicted s, submitted s, job id, job), sorted per tenant
    per_tenant: dict[str, list[tuple[int, float, float, int, Pending]]] = {}
    for p in pending:
        priority = p.priority
        if period_s > 0:
            waited_s = now_s - p.submitted_at_s
            if waited_s > 0:
                priority += math.floor(waited_s / period_s)
        # Job ids are unique, so tuples never compare the Pending at their end.
        row = (-priority, predicted_s[p.job_id], p.submitted_at_s, p.job_id, p)
        rows = per_tenant.get(p.tenant)
        if rows is None:
            per_tenant[p.tenant] = [row]
        else:
            rows.append(row)
    # the same, led by 0 for the jobs within the tenant's guarantee and 1 for the others
    queues: dict[str, list[tuple[int, int, float, float, int, Pending]]] = {}
    # (within, -priority, tenant's share, predicted s, submitted s, job id, the share's version,
    # tenant, position in its queue)
    heap: list[tuple[int, int, float, float, float, int, int, str, int]] = []
    for tenant, rows in per_tenant.items():
        rows.sort()
        guaranteed = guaranteed_jobs([row[4] for row in rows], books[tenant])
        if guaranteed:
            queue = [(0, *r) for r in rows if r[3] in guaranteed] + [
                (1, *r) for r in rows if r[3] not in guaranteed
            ]
        else:
            queue = [(1, *r) for r in rows]
        queues[tenant] = queue
        book = books[tenant]
        first = queue[0]
        heap.append((*first[:2], book.share, *first[2:5], book.version, tenant, 0))
    heapq.heapify(heap)
    # The head is replaced in place (one sift, not a pop and a push): entries differ in their
    # tenant, so the order they come out in does not depend on how the heap is laid out.
    pop, replace_head = heapq.heappop, heapq.heapreplace
    while heap:
        entry = heap[0]
        tenant = entry[7]
        book = books[tenant]
        i = entry[8]
        queue = queues[tenant]
        if entry[6] != book.version:
            queued = queue[i]
            replace_head(heap, (*queued[:2], book.share, *queued[2:5], book.version, tenant, i))
            continue
        yield queue[i][5]
        i += 1
        if i < len(queue):
            queued = queue[i]
            replace_head(heap, (*queued[:2], book.share, *queued[2:5], book.version, tenant, i))
        else:
            pop(heap)
