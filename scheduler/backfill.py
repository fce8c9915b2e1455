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

import heapq
from bisect import bisect_left, insort
from collections.abc import Callable, Iterable, Iterator

from scheduler.model import Running
from scheduler.placement import Topology, TypeIndex, nodes_of

# (predicted end in seconds, node ordinal, GPUs of the type it frees there)
Release = tuple[float, int, int]


class ReleaseIndex:
    """When the running attempts that are not stopping free their GPUs, by type and node.

    Kept in the caller's memo (scheduler.memo) from one plan to the next and updated with the
    attempts that came and went (scheduler.quota.RunningTotals), so a reservation walks sorted
    lists instead of every running attempt. An attempt ends at its predicted end, or
    `default_s` after its start when it has none; ends already past count as now (reserve
    does that: the order of the lists is the same either way).
    """

    __slots__ = ("topo", "default_s", "epoch", "by_node", "by_type", "first")

    def __init__(self, topo: Topology, default_s: float):
        self.topo = topo
        self.default_s = default_s
        self.epoch = -1  # the RunningTotals update it is in step with (see PlanMemo.releases)
        # type -> node -> [(end, attempt id, GPUs there)], sorted
        self.by_node: dict[str, dict[int, list[tuple[float, int, int]]]] = {}
        # type -> [(end, attempt id, node, GPUs there)], sorted
        self.by_type: dict[str, list[tuple[float, int, int, int]]] = {}
        # type -> [(the node's earliest listed end, node)], sorted: a reservation meets the
        # nodes in the order they could start it (reserve), not every node of the type.
        self.first: dict[str, list[tuple[float, int]]] = {}

    def _entries(self, r: Running) -> Iterator[tuple[float, int, int]]:
        end_s = r.predicted_end_s
        if end_s is None:
            end_s = r.started_at_s + self.default_s
        for node, count in nodes_of(self.topo, r).items():
            yield end_s, node, count

    def add(self, r: Running, *, heads: bool = True) -> None:
        """Count an attempt's ends; `heads` False leaves `first` for add_all to make at once."""
        if r.stopping:
            return
        t, a = r.gpu_type, r.attempt_id
        per_node = self.by_node.setdefault(t, {})
        flat = self.by_type.setdefault(t, [])
        first = self.first.setdefault(t, [])
        for end_s, node, count in self._entries(r):
            on_node = per_node.setdefault(node, [])
            head = on_node[0][0] if on_node else None
            insort(on_node, (end_s, a, count))
            insort(flat, (end_s, a, node, count))
            if heads and (head is None or end_s < head):
                if head is not None:
                    del first[bisect_left(first, (head, node))]
                insort(first, (end_s, node))

    def remove(self, r: Running) -> None:
        if r.stopping:
            return
        t, a = r.gpu_type, r.attempt_id
        per_node = self.by_node[t]
        flat = self.by_type[t]
        first = self.first[t]
        for end_s, node, count in self._entries(r):
            on_node = per_node[node]
            head = on_node[0][0]
            del on_node[bisect_left(on_node, (end_s, a, count))]
            del flat[bisect_left(flat, (end_s, a, node, count))]
            after = on_node[0][0] if on_node else None
            if after != head:
                del first[bisect_left(first, (head, node))]
                if after is not None:
                    insort(first, (after, node))

    def add_all(self, running: Iterable[Running]) -> ReleaseIndex:
        for r in running:
            self.add(r, heads=False)
        # Each node's earliest end sorted once: kept in step one attempt at a time, the list of
        # a type's nodes would be cut and spliced for every attempt of a cycle's fresh index.
        for t, per_node in self.by_node.items():
            self.first[t] = sorted(
                (listed[0][0], node) for node, listed in per_node.items() if listed
            )
        return self


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
    releases: ReleaseIndex,
    extra: list[Release],
    skip: set[int],
    node_ok: Callable[[int], bool] | None,
) -> Reservation | None:
    """The earliest reservation for n GPUs of this type, or None if they never free up.

    `releases`: the running attempts' ends; `extra`: GPUs that free up besides (stopping
    attempts, this cycle's starts); `skip`: attempt ids whose GPUs are not to be counted as
    releases (preempted this cycle: they are in `extra` with the end of their notice).
    """
    t = ti.gpu_type
    if n <= ti.max_node_cap:
        more: dict[int, list[tuple[float, int]]] = {}
        for end_s, node, count in extra:
            more.setdefault(node, []).append((end_s, count))
        per_node = releases.by_node.get(t, {})
        node_cap = ti.node_cap

        def eligible(node: int) -> bool:
            return node_cap.get(node, 0) >= n and (node_ok is None or node_ok(node))

        def events_on(node: int) -> list[tuple[float, int]]:
            listed = per_node.get(node, ())
            if skip:
                events = [(end_s, c) for end_s, a, c in listed if a not in skip]
            else:
                events = [(end_s, c) for end_s, _, c in listed]
            beside = more.get(node)
            if beside:
                events.extend(beside)
                events.sort()
            return events

        # The earliest (start, node) over every node that may take the job, the lowest node
        # on a tie. A node with n GPUs free starts it now: the lowest such one.
        best: tuple[float, int] | None = None
        for k in range(n, len(ti.buckets)):
            for node in ti.buckets[k]:  # sorted
                if eligible(node):
                    if best is None or node < best[1]:
                        best = (now_s, node)
                    break
        # Any other node starts it no sooner than its earliest release (a listed end, or a
        # notice or a start of this cycle beside): met in that order, the walk stops at the
        # first node that cannot beat the best found, instead of walking every node.
        beside_first = sorted(
            (min(end_s for end_s, _ in ends), node) for node, ends in more.items()
        )
        met: set[int] = set()
        for first_s, node in heapq.merge(releases.first.get(t, ()), beside_first):
            earliest_s = first_s if first_s > now_s else now_s
            if best is not None and (earliest_s, node) >= best:
                if earliest_s > best[0]:
                    break  # every node after this one releases later still
                continue
            if node in met:
                continue  # met before, by an earlier release of its own
            met.add(node)
            free = ti.free_on(node)
            if free >= n or not eligible(node):
                continue
            start_s = _when(n - free, events_on(node), now_s)
            if start_s is not None and (best is None or (start_s, node) < best):
                best = (start_s, node)
        if best is None:
            return None
        start_s, node = best
        freed = sum(c for end_s, c in events_on(node) if end_s <= start_s)
        return Reservation(job_id, t, n, start_s, node, ti.free_on(node) + freed - n)
    flat = releases.by_type.get(t, [])
    ends: Iterable[tuple[float, int]] = (
        ((end_s, c) for end_s, a, _, c in flat if a not in skip)
        if skip
        else ((end_s, c) for end_s, _, _, c in flat)
    )
    beside_all: list[tuple[float, int]] = sorted((end_s, c) for end_s, _, c in extra)
    need = n - ti.total_free
    got = 0
    start: float | None = now_s if need <= 0 else None
    freed = 0
    for when, count in heapq.merge(ends, beside_all):
        if start is None:
            got += count
            if got >= need:
                start = max(when, now_s)
            freed += count
        elif when <= start:
            freed += count
        else:
            break
    if start is None:
        return None
    return Reservation(job_id, t, n, start, None, ti.total_free + freed - n)


def _when(need: int, events: list[tuple[float, int]], now_s: float) -> float | None:
    """When `need` GPUs have freed up, from `events` sorted by time."""
    if need <= 0:
        return now_s
    got = 0
    for end_s, count in events:
        got += count
        if got >= need:
            return max(end_s, now_s)
    return None
