"""EASY backfill: the first job of a GPU type that cannot start gets a reservation.

The reservation is the earliest time enough GPUs of its type free up for it, computed from the
predicted ends of the attempts that hold them (attempts told to stop free theirs now) and of the
jobs this cycle already started. A later job of that type may still start now if it fits and
either ends, on its predicted duration, before the reservation begins, or uses only GPUs the
reservation does not need: the `slack`, what will be free at the reservation's start beyond
what the reserved job takes. Each GPU type has its own reservation, since a job waiting for
H100s is not delayed by anything that runs on A100s.

A job that fits on one node reserves one node (the one where it can start earliest), so its
slack is counted on that node alone; a gang larger than any node reserves a number of GPUs of
its type anywhere, and its slack is counted over the whole type.

Without backfill (Config.backfill False) there are no reservations: every job that fits starts,
which is the greedy regime the baselines are measured in.
"""

from __future__ import annotations

from collections.abc import Callable

from scheduler.placement import TypeIndex

# (predicted end in seconds, node ordinal, GPUs of the type it frees there)
Release = tuple[float, int, int]


class Reservation:
    """GPUs of one type promised to the head of the queue for that type."""

    __slots__ = ("job_id", "gpu_type", "gpus", "start_s", "node", "slack")

    def __init__(
        self, job_id: int, gpu_type: str, gpus: int, start_s: float, node: int | None, slack: int
    ):
        self.job_id = job_id
        self.gpu_type = gpu_type
        self.gpus = gpus
        self.start_s = start_s
        self.node: int | None = node  # the reserved node, or None when counted over the type
        self.slack = slack  # GPUs a job running past start_s may still take from what is reserved

    def limits(self, job_id: int, end_s: float) -> tuple[bool, dict[int, int] | None]:
        """For a job ending at end_s: (restricted, per-node room) under this reservation."""
        if job_id == self.job_id or end_s <= self.start_s:
            return False, None
        if self.node is None:
            return True, None
        return True, {self.node: max(self.slack, 0)}

    def allows(self, n: int) -> bool:
        """Whether a gang counted over the type may take n of the GPUs."""
        return self.node is not None or n <= self.slack

    def consume(self, where: list[tuple[int, int]]) -> None:
        """Book what a job running past start_s took from the reserved GPUs."""
        if self.node is None:
            self.slack -= sum(count for _, count in where)
        else:
            for node, count in where:
                if node == self.node:
                    self.slack -= count


def reserve(
    job_id: int,
    n: int,
    ti: TypeIndex,
    now_s: float,
    releases: list[Release],
    node_ok: Callable[[int], bool] | None,
) -> Reservation | None:
    """The earliest reservation for n GPUs of this type, or None if they never free up."""
    if n <= ti.max_node_cap:
        by_node: dict[int, list[tuple[float, int]]] = {}
        for end_s, node, count in releases:
            by_node.setdefault(node, []).append((end_s, count))
        best: tuple[float, int] | None = None
        for node in sorted(ti.node_cap):
            if ti.node_cap[node] < n or (node_ok is not None and not node_ok(node)):
                continue
            free = ti.free_on(node)
            start_s = _when(n - free, by_node.get(node, []), now_s)
            if start_s is not None and (best is None or (start_s, node) < best):
                best = (start_s, node)
        if best is None:
            return None
        start_s, node = best
        freed = sum(c for end_s, c in by_node.get(node, []) if end_s <= start_s)
        return Reservation(job_id, ti.gpu_type, n, start_s, node, ti.free_on(node) + freed - n)
    start_s = _when(n - ti.total_free, [(end_s, c) for end_s, _, c in releases], now_s)
    if start_s is None:
        return None
    freed = sum(c for end_s, _, c in releases if end_s <= start_s)
    return Reservation(job_id, ti.gpu_type, n, start_s, None, ti.total_free + freed - n)


def _when(need: int, events: list[tuple[float, int]], now_s: float) -> float | None:
    if need <= 0:
        return now_s
    got = 0
    for end_s, count in sorted(events):
        got += count
        if got >= need:
            return max(end_s, now_s)
    return None
