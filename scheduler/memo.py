"""What plan() may reuse from one call to the next: indexes derived from inputs that seldom change.

A scheduling loop hands plan() the same node tuple and the same history tuple cycle after cycle
until something changes (the control plane's loader and the simulator both keep them), and
building their indexes is a large part of a cycle at simulator scale. The index is reused while
the caller passes the very same tuple (identity: the inputs are immutable, so the same tuple
means the same contents).

A memo belongs to one caller and one thread at a time: a scheduling loop, a simulator run. Two
threads planning at once (the embedded loop and a what-if replay) each own theirs, so neither
can be handed the other's index. plan() without one builds every index afresh.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scheduler.backfill import ReleaseIndex
    from scheduler.model import Config, HistoryRecord, Node, Running, Tenant
    from scheduler.placement import FreeGPUs, Topology
    from scheduler.predict import HistoryIndex
    from scheduler.preemption import Candidate, VictimPool
    from scheduler.quota import PreemptionBound, RunningTotals
    from scheduler.reasons import Fleet


class PlanMemo:
    __slots__ = (
        "_topology",
        "_history_index",
        "_fleet",
        "_running",
        "_releases",
        "_free",
        "_candidates",
        "_victim_pool",
        "_bound",
        "sentences",
    )

    def __init__(self, sentences: bool = True) -> None:
        # False: PendingDecision.reason is left empty (a caller that reads only the codes, such
        # as the trace simulator, spares a sentence per waiting job per cycle); no decision
        # depends on it.
        self.sentences = sentences
        # (the tuple it was built from, the index): kept together, replaced together.
        self._topology: tuple[tuple[Node, ...], Topology] | None = None
        self._history_index: tuple[tuple[HistoryRecord, ...], HistoryIndex] | None = None
        self._fleet: tuple[Sequence[Node], Fleet] | None = None
        self._running: RunningTotals | None = None
        self._releases: ReleaseIndex | None = None
        self._free: FreeGPUs | None = None
        # ((instant, config, topology), victim candidates by id of their attempt object)
        self._candidates: tuple[tuple[float, Config, Topology], dict[int, Any]] | None = None
        self._victim_pool: VictimPool | None = None
        # (the bound's Config.max_preemptions, the tenants it was made from, the bound)
        self._bound: tuple[int | None, tuple[Tenant, ...], PreemptionBound] | None = None

    def preemption_bound(
        self, max_preemptions: int | None, tenants: tuple[Tenant, ...]
    ) -> PreemptionBound:
        """Config.max_preemptions as it applies to these tenants' jobs (scheduler.quota.
        PreemptionBound): the same object while the tenants' guarantees are the same, so what
        was summed under it (running_totals) is kept."""
        from scheduler.quota import PreemptionBound

        cached = self._bound
        if cached is not None and cached[0] == max_preemptions and cached[1] is tenants:
            return cached[2]
        bound = PreemptionBound(max_preemptions, tenants)
        if cached is not None and cached[2].key == bound.key:
            bound = cached[2]
        self._bound = (max_preemptions, tenants, bound)
        return bound

    def running_totals(
        self, running: tuple[Running, ...], bound: PreemptionBound | None = None
    ) -> RunningTotals:
        """The running attempts summed (scheduler.quota.RunningTotals), kept from call to call
        while the preemption bound they are summed under is the same."""
        from scheduler.quota import PreemptionBound, RunningTotals

        if bound is None:
            bound = PreemptionBound()
        if self._running is None or (
            self._running.bound is not bound and self._running.bound.key != bound.key
        ):
            self._running = RunningTotals(bound)
        return self._running.update(running)

    def releases(
        self, topology: Topology, default_s: float, running: tuple[Running, ...]
    ) -> ReleaseIndex:
        """The running attempts' ends (scheduler.backfill.ReleaseIndex), kept from call to call.

        Call after running_totals(running) in the same plan: it applies what that update
        changed, or builds the index afresh when it missed an update or the topology changed.
        """
        from scheduler.backfill import ReleaseIndex

        totals = self._running
        assert totals is not None, "running_totals() first"
        index = self._releases
        if (
            index is None
            or index.topo is not topology
            or index.default_s != default_s
            or index.epoch != totals.epoch - 1
        ):
            index = self._releases = ReleaseIndex(topology, default_s).add_all(running)
        else:
            for r in totals.removed:
                index.remove(r)
            for r in totals.added:
                index.add(r)
        index.epoch = totals.epoch
        return index

    def free_gpus(self, topology: Topology, running: tuple[Running, ...]) -> FreeGPUs:
        """The free GPUs per type and node (scheduler.placement.FreeGPUs), kept from call to
        call; like releases(), call after running_totals(running) in the same plan."""
        from scheduler.placement import FreeGPUs

        totals = self._running
        assert totals is not None, "running_totals() first"
        free = self._free
        if free is None or free.topo is not topology or free.epoch != totals.epoch - 1:
            free = self._free = FreeGPUs(topology, totals.held, running)
        else:
            free.update(totals.held, totals.added, totals.removed)
        free.epoch = totals.epoch
        return free

    def candidates(
        self, now_s: float, config: Config, topology: Topology
    ) -> dict[int, tuple[Running, Candidate]]:
        """Preemption candidates (scheduler.preemption.Candidate) made by plans at this instant
        under this config and topology: a cycle often plans again at the same instant (after a
        preemption), and a candidate depends only on its attempt object and these. Forgotten at
        the next instant."""
        key = (now_s, config, topology)
        kept = self._candidates
        if (
            kept is None
            or kept[0][0] != now_s
            or kept[0][1] is not config
            or kept[0][2] is not topology
        ):
            kept = self._candidates = (key, {})
        return kept[1]

    def victim_pool(self, config: Config, topology: Topology) -> VictimPool:
        """Preemption candidates kept across instants (scheduler.preemption.VictimPool), for
        this config and topology; call after running_totals() in the same plan: the pool takes
        in the attempts that update added and removed (or is built afresh, when a plan first
        needs a victim, if it missed one)."""
        from scheduler.preemption import VictimPool

        pool = self._victim_pool
        totals = self._running
        assert totals is not None, "running_totals() first"
        if (
            pool is None
            or (pool.config is not config and pool.config != config)
            or pool.topo is not topology
            or pool.bound is not totals.bound
        ):
            pool = self._victim_pool = VictimPool(config, topology, totals.bound)
        pool.follow(totals)
        return pool

    def topology(self, nodes: tuple[Node, ...]) -> Topology:
        from scheduler.placement import Topology

        cached = self._topology
        if cached is None or cached[0] is not nodes:
            cached = self._topology = (nodes, Topology(nodes))
        return cached[1]

    def history_index(self, history: tuple[HistoryRecord, ...]) -> HistoryIndex:
        from scheduler.predict import HistoryIndex

        cached = self._history_index
        if cached is None or cached[0] is not history:
            cached = self._history_index = (history, HistoryIndex(history))
        return cached[1]

    def fleet(self, nodes: Sequence[Node]) -> Fleet:
        from scheduler.reasons import build_fleet

        cached = self._fleet
        if cached is None or cached[0] is not nodes:
            cached = self._fleet = (nodes, build_fleet(nodes))
        return cached[1]
