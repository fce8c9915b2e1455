"""Weighted dominant share: how much of the cluster a tenant holds, relative to its weight.

Each GPU type is a resource; a tenant's share of a type is the GPUs of it it holds over all the
healthy GPUs of that type on schedulable nodes, and its dominant share is the largest of those,
divided by its weight (DRF with weights). The tenant with the lowest one is served first among
jobs of equal standing, so capacity is lent in proportion to weight.
"""

from __future__ import annotations

from scheduler.quota import ANY, Book


def refresh(book: Book, capacity: dict[str, int]) -> None:
    """Recompute a tenant's share after its usage changed, and mark its queue entries stale."""
    share = 0.0
    for gpu_type, used in book.active.items():
        if gpu_type == ANY or used <= 0:
            continue
        cap = capacity.get(gpu_type)
        if cap:
            share = max(share, used / cap)
    share /= book.weight
    if share != book.share:
        book.share = share
        book.version += 1
