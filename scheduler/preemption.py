"""Preemption: which running attempts to stop so that a waiting job can start.

Who may be stopped, always only a preemptible attempt that has run at least
`Config.min_runtime_s` (restarting work that just began wastes more than it frees), is not
already stopping, and whose job was preempted fewer than `Config.max_preemptions` times:

- for a job within its tenant's guarantee: borrowed attempts of other tenants that are still
  over their own guarantee, those that lose the least work per GPU first (Config.victim_order
  LOST_WORK, see `lost_work_s`), or the youngest first (YOUNGEST, the rule from before jobs
  reported checkpoints);
- for such a job that needs several GPUs on one node, where the borrowed attempts free no node
  even once they have all run their minimum (they start wherever GPUs were free, so in a full
  cluster they are scattered): any attempts of tenants over their guarantee, each tenant giving
  up no more than it uses beyond its guarantees (`reclaim_node`; not under the SRTF and LAS
  baselines);
- in FAIR, for any job: attempts of its own tenant with a lower priority, lowest first, then in
  the same victim order;
- under SRTF: attempts with a longer remaining time than the job's predicted duration; under
  LAS: attempts in a later attained-service queue than the job's. Other tenants' attempts only
  while they are borrowed, so a guarantee is never taken away by a baseline either.

The victims are chosen on one node the job fits on (a gang larger than any node: over the whole
type), in the preference order above (other tenants' borrowed work first, unless the job must
first win back some of its own tenant's quota, which only its own attempts can give), until
enough GPUs and quota would be free; then every chosen victim that is not needed after all is
given back, last chosen first, so no more is evicted than needed. Under LOST_WORK, a job on one
node that only other tenants' borrowed work can make room for gets instead the set, over every
node it fits on, that loses the least work in all (`_least_lost`): an order alone cannot weigh
one large victim that loses little per GPU against a small one that loses more. When a
candidate that alone makes room will save its next checkpoint soon, and waiting until it can
do so within its notice costs the job fewer GPU-seconds than preempting now throws away, the
job waits for it instead (Search.defer_until_s): the victim's GPUs keep doing useful work
meanwhile. A tenant brought back to its guarantee stays out of the searches for the rest of
the cycle.
GPUs of attempts already stopping count as free soon and are used before anything new is
evicted, so a job never causes a second preemption for GPUs it is already owed.
"""

from __future__ import annotations

import abc
import bisect
import heapq
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from typing import Any, NamedTuple, overload

from scheduler.model import Config, Ordering, Running, VictimOrder
from scheduler.placement import ClusterIndex, Fits, Topology, TypeIndex, nodes_of
from scheduler.priority import attained_now, las_queue
from scheduler.quota import Book, PreemptionBound, RunningTotals


class Candidate:
    """A running attempt that may be preempted, with where its GPUs are."""

    __slots__ = (
        "run",
        "tenant",
        "size",
        "nodes",
        "remaining_s",
        "attained_s",
        "queue",
        "lost_s",
        "at_s",
    )

    def __init__(
        self,
        run: Running,
        nodes: dict[int, int],
        remaining_s: float,
        lost_s: float,
        attained_s: float | None = None,
    ):
        self.run = run
        self.tenant = run.tenant
        self.size = len(run.gpus)
        self.nodes = nodes
        self.remaining_s = remaining_s
        # its attained service now (priority.attained_now)
        self.attained_s = run.attained_service_s if attained_s is None else attained_s
        self.queue = las_queue(self.attained_s)
        # Seconds of run time per GPU a preemption now would cost it (see lost_work_s).
        self.lost_s = lost_s
        # The instant the fields above are of, for a candidate kept across instants (VictimPool).
        self.at_s = math.nan

    def refresh(self, now_s: float, config: Config) -> None:
        """Its time-dependent fields as of now_s, as Victims makes them for a new candidate."""
        r = self.run
        if r.remaining_s is not None:
            self.remaining_s = r.remaining_s
        elif r.predicted_end_s is not None:
            self.remaining_s = max(r.predicted_end_s - now_s, 0.0)
        else:
            self.remaining_s = max(r.started_at_s + config.default_duration_s - now_s, 0.0)
        self.lost_s = lost_work_s(r, now_s, config.restart_cost_s)
        self.attained_s = attained_now(r, now_s)
        self.queue = las_queue(self.attained_s)
        self.at_s = now_s


def lost_work_s(r: Running, now_s: float, restart_cost_s: float) -> float:
    """Seconds of run time, per GPU, that preempting the attempt now throws away.

    The work since its last checkpoint (of this attempt: one from an earlier attempt is where
    this one started from) plus the restart. A job that said how often it checkpoints and whose
    next checkpoint, counted from the last one in whole intervals, falls within its notice
    (grace_s) will save it before it stops: it loses only the restart. Times the attempt's GPU
    count this is the GPU-seconds lost.
    """
    since_s = r.started_at_s
    if r.last_checkpoint_s is not None and r.last_checkpoint_s > since_s:
        since_s = r.last_checkpoint_s
    elapsed_s = max(now_s - since_s, 0.0)
    interval_s = r.checkpoint_interval_s
    if interval_s is not None and interval_s > 0 and elapsed_s > 0:
        next_s = since_s + math.ceil(elapsed_s / interval_s) * interval_s
        if next_s <= now_s + r.grace_s:
            elapsed_s = 0.0
    return elapsed_s + restart_cost_s


class Victims:
    """The preemptible attempts of a cycle, in the orders the rules above walk them.

    Built lazily, per GPU type and tenant as jobs ask: most cycles preempt nothing, and the
    trace simulator runs hundreds of thousands of them.
    """

    def __init__(
        self,
        running: tuple[Running, ...],
        index: ClusterIndex,
        borrowed: Callable[[], set[int]],
        config: Config,
        now_s: float,
        kept: dict[int, tuple[Running, Candidate]] | None = None,
        pool: VictimPool | None = None,
        totals: RunningTotals | None = None,
        bound: PreemptionBound | None = None,
    ):
        # `bound`: Config.max_preemptions as it applies to each attempt (PreemptionBound).
        self._bound = (
            bound
            if bound is not None
            else totals.bound
            if totals is not None
            else PreemptionBound(config.max_preemptions)
        )
        # `kept`: candidates made by earlier plans at this same instant, under this config and
        # topology (PlanMemo.candidates), by id of their attempt object: reused for the same
        # object, since a candidate depends on nothing else.
        self._kept = kept
        # `pool`: candidates kept across instants (PlanMemo.victim_pool), for this config and
        # topology, with `totals` (the running attempts summed, PlanMemo.running_totals);
        # not used where its orders do not hold.
        if pool is not None:
            assert totals is not None, "a pool holds the attempts summed in totals"
            pool.sync(running, totals)
            if pool.irregular:
                pool = None
        self._pool = pool
        self._running = running
        self._index = index
        self._borrowed = borrowed
        self._config = config
        self._now_s = now_s
        self.by_lost_work = config.victim_order is not VictimOrder.YOUNGEST
        self.now_s = now_s
        self.restart_cost_s = config.restart_cost_s
        self._by_type: dict[str, list[Running]] | None = None
        self._by_owner: dict[tuple[str, str], list[Running]] = {}
        self._candidates: dict[int, Candidate] = {}
        self._cross: dict[str, list[Candidate]] = {}
        self._own: dict[tuple[str, str], list[Candidate]] = {}
        self._baseline: dict[tuple[str, str | None], Sequence[Candidate]] = {}
        self._cross_ids: set[int] = set()
        self._cross_by_node: dict[str, dict[int, list[Candidate]]] = {}
        self._takeable_by_node: dict[str, dict[int, list[Candidate]]] = {}
        self._cross_checkpointing: dict[str, list[Candidate]] = {}
        # (rule, type) -> index of the first candidate of that list still worth looking at
        self.start: dict[tuple[str, str], int] = {}
        # type -> max-heap of (-potential, node), stale entries dropped when met; see most()
        self._potential: dict[str, list[tuple[int, int]]] = {}
        self.cross_gpus: dict[str, dict[int, int]] = {}  # type -> node -> borrowed GPUs there
        self._labelled = False  # whether the pool was told this cycle's borrowed attempts
        self._cross_some: dict[str, bool] = {}  # type -> whether it has borrowed candidates

    def _group(self) -> dict[str, list[Running]]:
        if self._by_type is None:
            by_type: dict[str, list[Running]] = {}
            min_runtime_s = self._config.min_runtime_s
            now_s = self._now_s
            by_owner = self._by_owner
            takeable = self._bound.takeable
            for r in self._running:
                if r.stopping or now_s - r.started_at_s < min_runtime_s or not takeable(r):
                    continue
                by_type.setdefault(r.gpu_type, []).append(r)
                by_owner.setdefault((r.tenant, r.gpu_type), []).append(r)
            self._by_type = by_type
        return self._by_type

    def _candidate(self, r: Running) -> Candidate:
        c = self._candidates.get(r.attempt_id)
        if c is None and self._kept is not None:
            entry = self._kept.get(id(r))
            if entry is not None and entry[0] is r:
                c = self._candidates[r.attempt_id] = entry[1]
        if c is None:
            if r.remaining_s is not None:
                remaining_s = r.remaining_s
            elif r.predicted_end_s is not None:
                remaining_s = max(r.predicted_end_s - self._now_s, 0.0)
            else:
                remaining_s = max(
                    r.started_at_s + self._config.default_duration_s - self._now_s, 0.0
                )
            c = self._candidates[r.attempt_id] = Candidate(
                r,
                self._index.nodes_of(r),
                remaining_s,
                lost_work_s(r, self._now_s, self._config.restart_cost_s),
                attained_now(r, self._now_s),
            )
            if self._kept is not None:
                self._kept[id(r)] = (r, c)
        return c

    def _order(self, c: Candidate) -> tuple[float, ...]:
        """The victim order among equals (same rule, same priority): Config.victim_order."""
        if self._config.victim_order is VictimOrder.YOUNGEST:
            return _youngest(c)
        # Least lost per GPU first: freeing GPUs then costs the least work for every GPU freed.
        # Among equals, the smaller loses less in all; then the youngest (the former rule).
        return (c.lost_s, c.size, -c.run.started_at_s, -c.run.attempt_id)

    def cross(self, gpu_type: str) -> list[Candidate]:
        """Borrowed attempts of a type, in the victim order (see _order)."""
        found = self._cross.get(gpu_type)
        if found is None:
            borrowed = self._borrowed()
            pool = self._pool
            if pool is not None:
                self.cross_counts(gpu_type)
                now_s, min_runtime_s = self._now_s, self._config.min_runtime_s
                refresh = self._refresh
                found = []
                # The pool's borrowed candidates only, in the same order as all of the type's.
                for entry in self._lent_pool(pool).lent_victim.get(gpu_type, ()):
                    c = entry[-1]
                    if not now_s - c.run.started_at_s < min_runtime_s:
                        refresh(c)
                        found.append(c)
                if not pool.youngest:
                    found = _settle(found, _lost, self._order)
            else:
                found = [
                    self._candidate(r)
                    for r in self._group().get(gpu_type, ())
                    if r.attempt_id in borrowed
                ]
                found.sort(key=self._order)
                self._count_cross(gpu_type, found)
            self._cross[gpu_type] = found
        return found

    def _lent_pool(self, pool: VictimPool) -> VictimPool:
        """The pool, told this cycle's borrowed attempts (once: they do not change in it)."""
        if not self._labelled:
            pool.label(self._borrowed())
            self._labelled = True
        return pool

    def _count_cross(self, gpu_type: str, found: Iterable[Candidate]) -> None:
        per_node: dict[int, int] = {}
        some = False
        for c in found:
            some = True
            self._cross_ids.add(c.run.attempt_id)
            for node, count in c.nodes.items():
                per_node[node] = per_node.get(node, 0) + count
        self.cross_gpus[gpu_type] = per_node
        self._cross_some[gpu_type] = some

    def cross_counts(self, gpu_type: str) -> dict[int, int]:
        """Node -> GPUs of the type's borrowed attempts there (cross_gpus), and which they are.

        Counted when the type's borrowed attempts are first asked for, as a list or counted,
        and then only lowered by evictions (evicted). With a pool this needs neither the
        candidates refreshed nor their order: a search under SRTF or LAS reads the counts at
        every plan, the list only for a job within its guarantee.
        """
        per_node = self.cross_gpus.get(gpu_type)
        if per_node is None:
            pool = self._pool
            if pool is None:
                self.cross(gpu_type)
            else:
                # The pool keeps the GPUs of the borrowed candidates that have run
                # min_runtime_s counted (VictimPool.label, VictimPool.age).
                self._lent_pool(pool).age(self._now_s)
                self.cross_gpus[gpu_type] = dict(pool.aged_gpus.get(gpu_type, {}))
                self._cross_some[gpu_type] = pool.aged_count.get(gpu_type, 0) > 0
            per_node = self.cross_gpus[gpu_type]
        return per_node

    def has_cross(self, gpu_type: str) -> bool:
        """Whether the type has any borrowed attempt that may be preempted now."""
        self.cross_counts(gpu_type)
        return self._cross_some[gpu_type]

    def cross_by_node(self, gpu_type: str) -> dict[int, list[Candidate]]:
        """The borrowed attempts of a type by node they hold GPUs on, each list in the victim
        order. Built once per cycle; victims taken stay listed (searches skip them)."""
        found = self._cross_by_node.get(gpu_type)
        if found is None:
            found = {}
            for c in self.cross(gpu_type):
                for node in c.nodes:
                    found.setdefault(node, []).append(c)
            self._cross_by_node[gpu_type] = found
        return found

    def takeable_by_node(self, gpu_type: str) -> dict[int, list[Candidate]]:
        """Every attempt of a type that may be preempted now, borrowed or not, by node it holds
        GPUs on, each list in the victim order (see reclaim_node). Built once per cycle, when a
        job first asks; victims taken stay listed (searches skip them)."""
        found = self._takeable_by_node.get(gpu_type)
        if found is None:
            found = {}
            pool = self._pool
            made = self._candidates
            for r in self._group().get(gpu_type, ()):
                # The pool's candidate where it has one (the one its lists and evicted() know).
                c = made.get(r.attempt_id)
                if c is None and pool is not None:
                    c = pool.by_attempt.get(r.attempt_id)
                    if c is not None and c.run is r:
                        made[r.attempt_id] = self._refresh(c)
                    else:
                        c = None
                if c is None:
                    c = self._candidate(r)
                for node in c.nodes:
                    found.setdefault(node, []).append(c)
            for listed in found.values():
                listed.sort(key=self._order)
            self._takeable_by_node[gpu_type] = found
        return found

    def room_once_aged(
        self, ti: TypeIndex, n: int, done: set[int], usable: Callable[[int], bool]
    ) -> bool:
        """Whether some usable node will have n GPUs free or freeable from borrowed work once
        its borrowed attempts have all run their minimum (young ones included)."""
        borrowed = self._borrowed()
        counts: dict[int, int] = {}
        for r in self._running:
            if (
                r.attempt_id in borrowed
                and r.gpu_type == ti.gpu_type
                and not r.stopping
                and r.attempt_id not in done
                and self._bound.takeable(r)
            ):
                for node, count in self._index.nodes_of(r).items():
                    counts[node] = counts.get(node, 0) + count
        return any(
            ti.free_on(node) + ti.soon.get(node, 0) + count >= n and usable(node)
            for node, count in counts.items()
        )

    def cross_checkpointing(self, gpu_type: str) -> list[Candidate]:
        """The borrowed attempts of a type that said how often they checkpoint: the only ones
        a job may wait for instead of preempting (see _least_lost)."""
        found = self._cross_checkpointing.get(gpu_type)
        if found is None:
            found = [c for c in self.cross(gpu_type) if c.run.checkpoint_interval_s]
            self._cross_checkpointing[gpu_type] = found
        return found

    def own(self, tenant: str, gpu_type: str) -> list[Candidate]:
        """A tenant's attempts of a type, lowest priority first, then in the victim order."""
        key = (tenant, gpu_type)
        found = self._own.get(key)
        if found is None:
            order = self._order
            pool = self._pool
            if pool is not None and pool.fair:
                found = [self._refresh(c) for c in self._pooled(pool.own.get(key, ()))]
                if not pool.youngest:
                    found = _settle(found, _priority_lost, lambda c: (c.run.priority, *order(c)))
            else:
                self._group()
                found = [self._candidate(r) for r in self._by_owner.get(key, ())]
                found.sort(key=lambda c: (c.run.priority, *order(c)))
            self._own[key] = found
        return found

    def _refresh(self, c: Candidate) -> Candidate:
        """A pool's candidate with its time-dependent fields as of this instant."""
        if c.at_s != self._now_s:
            c.refresh(self._now_s, self._config)
        return c

    def _pooled(self, entries: Sequence[PoolEntry]) -> Iterator[Candidate]:
        """The candidates of a pool's list that may be preempted now (run long enough)."""
        now_s, min_runtime_s = self._now_s, self._config.min_runtime_s
        for entry in entries:
            c = entry[-1]
            if not now_s - c.run.started_at_s < min_runtime_s:
                yield c

    def _may_go(self, c: Candidate) -> bool:
        return not self._now_s - c.run.started_at_s < self._config.min_runtime_s

    def baseline(self, gpu_type: str, tenant: str | None = None) -> Sequence[Candidate]:
        """The SRTF / LAS candidates: borrowed ones of any tenant (tenant None) or a tenant's own.

        SRTF sorts the longest remaining time first; LAS the latest attained-service queue.
        """
        key = (gpu_type, tenant)
        found = self._baseline.get(key)
        if found is None and self._pool is not None:
            found = self._baseline[key] = self._pooled_baseline(self._pool, gpu_type, tenant)
        if found is None:
            if tenant is None:
                found = list(self.cross(gpu_type))
            else:
                # The keys below tell every two attempts apart (the attempt id last), so the
                # tenant's attempts need not be put in own()'s order first.
                self._group()
                found = [self._candidate(r) for r in self._by_owner.get((tenant, gpu_type), ())]
            if self._config.ordering is Ordering.SRTF:
                found.sort(key=lambda c: (-c.remaining_s, *_youngest(c)))
            else:
                found.sort(key=lambda c: (-c.queue, -c.attained_s, *_youngest(c)))
            self._baseline[key] = found
        return found

    def _pooled_baseline(
        self, pool: VictimPool, gpu_type: str, tenant: str | None
    ) -> Sequence[Candidate]:
        # The lazy lists test and refresh their candidates inline (as _may_go and _refresh):
        # they walk every candidate of the type, most of them not borrowed, at every plan.
        gate = _Gate(None, self._now_s, self._config.min_runtime_s, self._config)
        if pool.srtf:
            if tenant is None:
                gate = gate._replace(borrowed=self._borrowed())
                return _Lazy(self._lent_pool(pool).lent_srtf.get(gpu_type, []), gate)
            return _Lazy(pool.srtf_own.get((tenant, gpu_type), []), gate)
        if pool.las and self._now_s >= pool.las_latest_as_of_s:
            # Before an attempt's as_of its service is not base + slope x now (_las_base).
            if tenant is None:
                gate = gate._replace(borrowed=self._borrowed())
                # The rounding allowed is that of every candidate of the type, as before the
                # merge read the borrowed ones only.
                slopes = _max_slope(pool.las_type.get(gpu_type, {}))
                groups = self._lent_pool(pool).lent_las.get(gpu_type, {})
                return _LasLazy(groups, gate, pool.las_scale, slopes)
            groups = pool.las_own.get((tenant, gpu_type), {})
            return _LasLazy(groups, gate, pool.las_scale)
        if tenant is None:
            found = list(self.cross(gpu_type))
        else:
            owned = pool.owned.get((tenant, gpu_type), {})
            found = [self._refresh(c) for c in owned.values() if self._may_go(c)]
        found.sort(key=_las_key)
        return found

    def most(self, ti: TypeIndex) -> int:
        """An upper bound of the GPUs any one node could give by preempting borrowed work.

        A node's potential is its free and soon-free GPUs plus its borrowed candidates'. It only
        falls during a cycle, so a heap with stale entries dropped lazily answers in O(1)
        amortised, and a job that asks for more fails its search without walking candidates.
        """
        t = ti.gpu_type
        cross_gpus = self.cross_gpus.get(t, {})
        heap = self._potential.get(t)

        def potential(node: int) -> int:
            return ti.free_on(node) + ti.soon.get(node, 0) + cross_gpus.get(node, 0)

        if heap is None:
            cross_gpus = self.cross_counts(t)
            heap = self._potential[t] = [(-potential(node), node) for node in cross_gpus]
            heapq.heapify(heap)
            ti.changed.clear()
        for node in ti.changed:
            if node in cross_gpus:
                heapq.heappush(heap, (-potential(node), node))
        ti.changed.clear()
        while heap:
            negative, node = heap[0]
            if -negative == potential(node):
                return -negative
            heapq.heappop(heap)
        return 0

    def evicted(self, c: Candidate) -> None:
        """Forget a victim's GPUs in the per-node potential once it is preempted."""
        pool = self._pool
        if c.run.attempt_id in self._cross_ids or (
            pool is not None
            and c.run.gpu_type in self.cross_gpus
            and pool.lent(c)
            and self._may_go(c)
        ):
            per_node = self.cross_gpus[c.run.gpu_type]
            for node, count in c.nodes.items():
                per_node[node] -= count
            index_changed = self._index.types[c.run.gpu_type].changed
            index_changed.extend(c.nodes)


def _youngest(c: Candidate) -> tuple[float, int]:
    return (-c.run.started_at_s, -c.run.attempt_id)


# The key of a candidate in a VictimPool list: fields that do not move with time, the attempt id
# last (unique, so the candidate after it is never compared), then the candidate.
PoolEntry = tuple[Any, ...]


class VictimPool:
    """Preemption candidates kept from one plan to the next, in orders that hold across instants.

    A scheduling loop's plans see mostly the same running attempts (the trace simulator: one
    start or one completion between two plans, among thousands), and building every candidate
    and sorting every list again at each instant was most of a preempting policy's cycle. The
    pool keeps a Candidate per attempt object (told apart by identity, as RunningTotals; an
    attempt remade is a new one), refreshed when first read at a new instant, and its lists
    sorted by keys that do not move with time and order the candidates as the rules' keys do:

    - the victim order (LOST_WORK): the work lost now is `now - since + restart` (since: the
      start or a later checkpoint), which can only fall as `since` grows, so (-since, size,
      -start, -attempt id) orders as (lost, size, -start, -attempt id) except where rounding
      makes two losses equal; such candidates are next to each other, and Victims sorts each
      run of equal losses by the rule's key (`_settle`);
    - SRTF (longest remaining first): remaining is `max(end - now, 0)` (end: the predicted
      end), so -end orders as -remaining, runs of equal remaining sorted likewise;
    - the own-tenant rule: priority first, then the victim order.

    A candidate whose loss does not follow that (an attempt that said how often it checkpoints:
    its next checkpoint may fall within its notice) or whose remaining time is stated instead
    (`Running.remaining_s`) makes the pool `irregular`: Victims then builds its lists as without
    a pool. LAS's attained service grows at each attempt's own GPU count (its slope), so no
    one order holds across instants; but among attempts of one slope, `attained - slope x now`
    is fixed (see `_las_base`): the pool keeps a list per slope in that order, and a plan
    merges them lazily, as far as a search walks (`_LasLazy`).

    A pool serves one config and one topology (PlanMemo.victim_pool). It holds the candidates
    of the running attempts summed in a RunningTotals (PlanMemo.running_totals) and follows
    what each of its updates adds and removes; the objects held keep their ids from being
    reused while they are held.
    """

    def __init__(self, config: Config, topo: Topology, bound: PreemptionBound | None = None):
        self.config = config
        self.topo = topo
        # The preemption bound of the totals it follows (PlanMemo.victim_pool makes a new pool
        # when that changes): attempts at it are no candidates.
        self.bound = bound if bound is not None else PreemptionBound(config.max_preemptions)
        self._clear()

    def _clear(self) -> None:
        # RunningTotals.epoch of the running attempts it holds (-1: none yet)
        self.epoch = -1
        self._cands: dict[int, Candidate] = {}  # id(run) -> candidate
        self.by_attempt: dict[int, Candidate] = {}  # attempt id -> candidate
        self._entries: dict[int, list[tuple[list[PoolEntry], PoolEntry]]] = {}
        self.irregular = 0
        config = self.config
        self.srtf = config.ordering is Ordering.SRTF
        self.fair = config.ordering is Ordering.FAIR
        self.youngest = config.victim_order is VictimOrder.YOUNGEST
        # type -> in the victim order
        self.victim: dict[str, list[PoolEntry]] = {}
        # (tenant, type) -> the own-tenant rule's order (FAIR)
        self.own: dict[tuple[str, str], list[PoolEntry]] = {}
        # type / (tenant, type) -> longest remaining first (SRTF)
        self.srtf_type: dict[str, list[PoolEntry]] = {}
        self.srtf_own: dict[tuple[str, str], list[PoolEntry]] = {}
        # (tenant, type) -> the tenant's candidates of the type (LAS), by id of the attempt
        self.owned: dict[tuple[str, str], dict[int, Candidate]] = {}
        # type / (tenant, type) -> slope -> most attained service first (LAS, see _las_base)
        self.las = config.ordering is Ordering.LAS
        self.las_type: dict[str, dict[float, list[PoolEntry]]] = {}
        self.las_own: dict[tuple[str, str], dict[float, list[PoolEntry]]] = {}
        # The largest attained service, slope x time and `attained_as_of_s` of any candidate
        # taken in since the pool was last cleared: what bounds the rounding of a merge, and
        # the instant before which the merge does not hold (see _LasLazy).
        self.las_scale = 0.0
        self.las_latest_as_of_s = -math.inf
        # id(run) -> its entries in the type's lists above (victim order, SRTF or None, LAS
        # (slope, entry) or None): what _lend() puts in the borrowed-only lists below.
        self._typed: dict[int, tuple[PoolEntry, PoolEntry | None, tuple[float, PoolEntry] | None]]
        self._typed = {}
        # The borrowed candidates, kept as labels flip (label()) and attempts come and go,
        # instead of being picked out of every candidate of a type at each plan: a search reads
        # the borrowed ones only (counts at every plan, lists for many), and at saturation they
        # are a third of the candidates (the dev file at L = 6: about 450 of 1,330). Same
        # entries as the lists above, so the same orders.
        self._labelled: set[int] = set()  # attempt ids borrowed as of the last label()
        self._lent: dict[int, list[tuple[list[PoolEntry], PoolEntry]]] = {}  # id(run) -> placed
        self.lent_victim: dict[str, list[PoolEntry]] = {}  # type -> in the victim order
        self.lent_srtf: dict[str, list[PoolEntry]] = {}  # type -> longest remaining first
        self.lent_las: dict[str, dict[float, list[PoolEntry]]] = {}  # type -> slope -> LAS
        # Of the borrowed candidates, those that have not run min_runtime_s by `aged_at_s`
        # (the latest instant age() was told), youngest first, (-start, -attempt id, candidate):
        # at saturation most borrowed attempts are that young (the dev file at L = 6: about 285
        # of 450), and time only ages them, so they leave from the tail, each once; the rest
        # are counted.
        self.aged_at_s = -math.inf
        self.young: dict[str, list[PoolEntry]] = {}
        self.aged_gpus: dict[str, dict[int, int]] = {}  # type -> node -> GPUs (none at 0)
        self.aged_count: dict[str, int] = {}  # type -> borrowed candidates counted

    def follow(self, totals: RunningTotals) -> None:
        """Take in what the last update of the running totals changed, if the pool holds the
        attempts of the update before (a plan calls this after every update); otherwise the
        pool is stale and sync() builds it afresh when a plan next needs a victim."""
        if self.epoch != totals.epoch - 1:
            return
        self.epoch = totals.epoch
        if not (totals.added or totals.removed or totals.replaced):
            return
        for r in totals.removed:
            self._drop(r)
        for old, _ in totals.replaced:
            self._drop(old)
        many = len(totals.added) + len(totals.replaced) > 64
        bulk: dict[int, list[PoolEntry]] | None = {} if many else None
        for r in totals.added:
            self._take(r, bulk)
        for _, new in totals.replaced:
            self._take(new, bulk)
        if bulk:
            for into in bulk.values():
                into.sort()

    def sync(self, running: tuple[Running, ...], totals: RunningTotals) -> None:
        """Hold these running attempts (summed in `totals`): built afresh unless it holds them
        already."""
        if self.epoch == totals.epoch:
            return
        self._clear()
        self.epoch = totals.epoch
        bulk: dict[int, list[PoolEntry]] = {}
        for r in running:
            self._take(r, bulk)
        for into in bulk.values():
            into.sort()

    def _drop(self, r: Running) -> None:
        key = id(r)
        c = self._cands.pop(key, None)
        if c is not None:
            if self.by_attempt.get(r.attempt_id) is c:
                del self.by_attempt[r.attempt_id]
            self._remove(key, c)

    def _take(self, r: Running, bulk: dict[int, list[PoolEntry]] | None) -> None:
        if r.stopping or not self.bound.takeable(r):
            return
        self._add(id(r), Candidate(r, nodes_of(self.topo, r), 0.0, 0.0), bulk)

    def _add(self, key: int, c: Candidate, bulk: dict[int, list[PoolEntry]] | None) -> None:
        r = c.run
        self._cands[key] = c
        self.by_attempt[r.attempt_id] = c
        if r.remaining_s is not None or (
            r.checkpoint_interval_s is not None and r.checkpoint_interval_s > 0
        ):
            self.irregular += 1
        kind = (r.tenant, r.gpu_type)
        tail: tuple[Any, ...] = (-r.started_at_s, -r.attempt_id, c)
        if self.youngest:
            order = tail
        else:
            since_s = r.started_at_s
            if r.last_checkpoint_s is not None and r.last_checkpoint_s > since_s:
                since_s = r.last_checkpoint_s
            order = (-since_s, c.size, *tail)
        placed: list[tuple[list[PoolEntry], PoolEntry]] = [
            (self.victim.setdefault(r.gpu_type, []), order)
        ]
        srtf_entry: PoolEntry | None = None
        las_entry: tuple[float, PoolEntry] | None = None
        if self.fair:
            placed.append((self.own.setdefault(kind, []), (r.priority, *order)))
        if self.srtf:
            if r.predicted_end_s is not None:
                end_s = r.predicted_end_s
            else:
                end_s = r.started_at_s + self.config.default_duration_s
            entry = srtf_entry = (-end_s, *tail)
            placed.append((self.srtf_type.setdefault(r.gpu_type, []), entry))
            placed.append((self.srtf_own.setdefault(kind, []), entry))
        if self.las:
            slope, base, scale = _las_base(r)
            self.las_scale = max(self.las_scale, scale)
            if r.attained_as_of_s is not None:
                self.las_latest_as_of_s = max(self.las_latest_as_of_s, r.attained_as_of_s)
            entry = (-base, -r.attempt_id, c)
            las_entry = (slope, entry)
            placed.append((self.las_type.setdefault(r.gpu_type, {}).setdefault(slope, []), entry))
            placed.append((self.las_own.setdefault(kind, {}).setdefault(slope, []), entry))
        _insert_all(placed, bulk)
        self._entries[key] = placed
        self.owned.setdefault(kind, {})[key] = c
        self._typed[key] = (order, srtf_entry, las_entry)
        if r.attempt_id in self._labelled:
            self._lend(key, c, bulk)

    def _remove(self, key: int, c: Candidate) -> None:
        r = c.run
        if r.remaining_s is not None or (
            r.checkpoint_interval_s is not None and r.checkpoint_interval_s > 0
        ):
            self.irregular -= 1
        for into, entry in self._entries.pop(key):
            del into[bisect.bisect_left(into, entry)]
        del self.owned[(r.tenant, r.gpu_type)][key]
        if key in self._lent:
            self._unlend(key, c)
        del self._typed[key]

    def label(self, borrowed: set[int]) -> None:
        """Hold as borrowed the candidates whose attempt ids are in `borrowed` (a plan's
        quota.label_borrowed) and no others. Between two plans a few labels flip (a tenant's
        attempts come and go, so the tail past its guarantee moves), and only those are moved:
        the sets are compared in C, the candidates walked are the flipped ones."""
        labelled = self._labelled
        flips = borrowed ^ labelled
        if not flips:
            return
        labelled ^= flips
        held, lent = self.by_attempt, self._lent
        coming: list[Candidate] = []
        for aid in flips:
            c = held.get(aid)
            if c is None:
                continue
            key = id(c.run)
            if aid in labelled:
                if key not in lent:
                    coming.append(c)
            elif key in lent:
                self._unlend(key, c)
        bulk: dict[int, list[PoolEntry]] | None = {} if len(coming) > 64 else None
        for c in coming:
            self._lend(id(c.run), c, bulk)
        if bulk:
            for into in bulk.values():
                into.sort()

    def _lend(self, key: int, c: Candidate, bulk: dict[int, list[PoolEntry]] | None) -> None:
        r = c.run
        t = r.gpu_type
        order, srtf_entry, las_entry = self._typed[key]
        placed: list[tuple[list[PoolEntry], PoolEntry]] = [
            (self.lent_victim.setdefault(t, []), order)
        ]
        if srtf_entry is not None:
            placed.append((self.lent_srtf.setdefault(t, []), srtf_entry))
        if las_entry is not None:
            slope, entry = las_entry
            placed.append((self.lent_las.setdefault(t, {}).setdefault(slope, []), entry))
        self._lent[key] = placed
        if self.aged_at_s - r.started_at_s < self.config.min_runtime_s:
            # young as of aged_at_s: counted once age() finds it has run long enough
            placed = [*placed, (self.young.setdefault(t, []), (-r.started_at_s, -r.attempt_id, c))]
        else:
            self._count_aged(c, 1)
        _insert_all(placed, bulk)

    def _unlend(self, key: int, c: Candidate) -> None:
        for into, entry in self._lent.pop(key):
            del into[bisect.bisect_left(into, entry)]
        # In its type's young list as of aged_at_s, or counted.
        r = c.run
        if self.aged_at_s - r.started_at_s < self.config.min_runtime_s:
            young = self.young[r.gpu_type]
            del young[bisect.bisect_left(young, (-r.started_at_s, -r.attempt_id, c))]
        else:
            self._count_aged(c, -1)

    def _count_aged(self, c: Candidate, sign: int) -> None:
        t = c.run.gpu_type
        per_node = self.aged_gpus.setdefault(t, {})
        for node, count in c.nodes.items():
            left = per_node.get(node, 0) + sign * count
            if left:
                per_node[node] = left
            else:
                del per_node[node]
        self.aged_count[t] = self.aged_count.get(t, 0) + sign

    def age(self, now_s: float) -> None:
        """Count the borrowed candidates that have run min_runtime_s by now_s (aged_gpus)."""
        if now_s == self.aged_at_s:
            return
        min_runtime_s = self.config.min_runtime_s
        if now_s < self.aged_at_s:
            # Back in time (not in a scheduling loop): some counted are young again.
            self.young, self.aged_gpus, self.aged_count = {}, {}, {}
            for placed in self._lent.values():
                c = placed[0][1][-1]
                r = c.run
                if now_s - r.started_at_s < min_runtime_s:
                    self.young.setdefault(r.gpu_type, []).append(
                        (-r.started_at_s, -r.attempt_id, c)
                    )
                else:
                    self._count_aged(c, 1)
            for young in self.young.values():
                young.sort()
            self.aged_at_s = now_s
            return
        self.aged_at_s = now_s
        for young in self.young.values():
            # A start ages once now - start reaches min_runtime_s, and that difference only
            # grows as the start falls: the aged are a tail of the youngest-first list.
            while young and not now_s - young[-1][-1].run.started_at_s < min_runtime_s:
                self._count_aged(young.pop()[-1], 1)

    def lent(self, c: Candidate) -> bool:
        """Whether the pool holds this candidate as borrowed (as of the last label())."""
        placed = self._lent.get(id(c.run))
        return placed is not None and placed[0][1][-1] is c


def _insert_all(
    placed: list[tuple[list[Any], Any]], bulk: dict[int, list[PoolEntry]] | None
) -> None:
    """Put each entry into its sorted list: in place, or appended to a list of `bulk`, which
    the caller sorts once when it has taken every attempt."""
    for into, entry in placed:
        if bulk is None:
            bisect.insort(into, entry)
        else:
            into.append(entry)
            bulk[id(into)] = into


def _settle(
    found: list[Candidate], value: Callable[[Candidate], object], key: Callable[[Candidate], Any]
) -> list[Candidate]:
    """A list in the order of a pool's key made exact: every run of neighbours whose
    time-dependent `value` came out equal is sorted by the rule's `key` (see VictimPool)."""
    n = len(found)
    if n < 2:
        return found
    values = list(map(value, found))
    i = 0
    while i < n - 1:
        if values[i] != values[i + 1]:
            i += 1
            continue
        j = i + 1
        while j < n - 1 and values[j + 1] == values[i]:
            j += 1
        found[i : j + 1] = sorted(found[i : j + 1], key=key)
        i = j + 1
    return found


class _Grown(Sequence[Candidate]):
    """A candidate list that grows as far as it is read: `_items` so far, `_more` adds the next
    one (False once there is none). Subclasses say how the next one is found."""

    _items: list[Candidate]

    @abc.abstractmethod
    def _more(self) -> bool:
        """Add the next candidate to `_items`; False once there is none."""

    def __iter__(self) -> Iterator[Candidate]:
        items = self._items
        i = 0
        while i < len(items) or self._more():
            yield items[i]
            i += 1

    def __len__(self) -> int:
        while self._more():
            pass
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items) or self._more()

    @overload
    def __getitem__(self, i: int) -> Candidate: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[Candidate]: ...

    def __getitem__(self, i: int | slice) -> Candidate | Sequence[Candidate]:
        if isinstance(i, slice) or i < 0:
            len(self)
        else:
            while len(self._items) <= i and self._more():
                pass
        return self._items[i]


class _Gate(NamedTuple):
    """Which of a pool's candidates a lazy list hands out, and as of when: borrowed ones only
    (attempt ids; None: any), that have run `min_runtime_s` by `now_s`, refreshed to then."""

    borrowed: set[int] | None
    now_s: float
    min_runtime_s: float
    config: Config


class _Lazy(_Grown):
    """A pool's SRTF list as the searches read it: candidates taken, refreshed and put in the
    exact order (runs of equal remaining time sorted) only as far as a walk goes; a search
    stops at the first candidate whose remaining time is not longer than the job's."""

    def __init__(self, source: list[PoolEntry], gate: _Gate):
        self._source = source
        self._pos = 0
        self._gate = gate
        self._items: list[Candidate] = []

    def _more(self) -> bool:
        source = self._source
        borrowed, now_s, min_runtime_s, config = self._gate
        pos, n = self._pos, len(source)
        first = None
        while pos < n:
            c = source[pos][-1]
            pos += 1
            r = c.run
            if (borrowed is None or r.attempt_id in borrowed) and not (
                now_s - r.started_at_s < min_runtime_s
            ):
                first = c
                break
        if first is None:
            self._pos = pos
            return False
        if first.at_s != now_s:
            first.refresh(now_s, config)
        run = [first]
        while pos < n:
            c = source[pos][-1]
            r = c.run
            if (borrowed is not None and r.attempt_id not in borrowed) or (
                now_s - r.started_at_s < min_runtime_s
            ):
                pos += 1
                continue
            if c.at_s != now_s:
                c.refresh(now_s, config)
            if c.remaining_s != first.remaining_s:
                break
            run.append(c)
            pos += 1
        self._pos = pos
        if len(run) > 1:
            run.sort(key=_srtf_key)
        self._items.extend(run)
        return True


def _las_base(r: Running) -> tuple[float, float, float]:
    """(slope, base, scale) of an attempt's attained service: from its `attained_as_of_s` on it
    is `attained_service_s + slope x (now - as_of)` (priority.attained_now), that is
    `base + slope x now`, so attempts of one slope keep their order by base as time moves; an
    attempt that states its service as of now (no as_of) has slope 0. `scale` bounds the
    magnitude of the terms, for the rounding allowed in a merge."""
    if r.attained_as_of_s is None:
        return 0.0, r.attained_service_s, abs(r.attained_service_s)
    slope = float(len(r.gpus))
    shift = slope * r.attained_as_of_s
    return slope, r.attained_service_s - shift, abs(r.attained_service_s) + abs(shift)


def _max_slope(groups: dict[float, list[PoolEntry]]) -> float:
    """The largest slope of a LAS list that holds any candidate (0 when none does)."""
    return max((abs(slope) for slope, entries in groups.items() if entries), default=0.0)


# Rounding allowed between an attained service worked out as priority.attained_now does and as
# `base + slope x now`, relative to the magnitude of the terms: float arithmetic errs by a few
# parts in 1e16 there, so this is generous and costs only a few candidates refreshed early.
_LAS_ROUNDING = 1e-9


class _LasLazy(_Grown):
    """A pool's LAS candidates of one type (a tenant's, or any tenant's borrowed ones) in the
    LAS victim order (_las_key: latest queue, most attained service, youngest), merged from the
    pool's lists per slope only as far as a walk goes.

    Within a slope the lists are in order of base (attained service = base + slope x now); a
    candidate is taken out of its list, refreshed and put in a heap by its exact key once the
    bound of the list's next base (plus slope x now, plus the rounding allowed) reaches the
    service of the best candidate in the heap. Every candidate left in the lists then has less
    service than the one handed out, so the walk is the list sorted by _las_key. The queue
    comes first in that key, but it only grows with the service, so the service orders alike.
    """

    def __init__(
        self,
        groups: dict[float, list[PoolEntry]],
        gate: _Gate,
        scale: float,
        slopes: float | None = None,
    ):
        # `slopes`: the largest slope the rounding allowed is worked out for (default: that of
        # these groups)
        self._groups = [(slope, entries, [0]) for slope, entries in groups.items() if entries]
        self._gate = gate
        now_s = self._now_s = gate.now_s
        if slopes is None:
            slopes = _max_slope(groups)
        self._slack = _LAS_ROUNDING * (scale + slopes * abs(now_s)) + _LAS_ROUNDING
        self._heap: list[tuple[tuple[float, ...], Candidate]] = []
        self._items: list[Candidate] = []

    def _more(self) -> bool:
        heap = self._heap
        borrowed, now_s, min_runtime_s, config = self._gate
        slack = self._slack
        best = heap[0][1].attained_s if heap else None
        for slope, entries, at in self._groups:
            pos, n = at[0], len(entries)
            lift = slope * now_s + slack
            while pos < n:
                entry = entries[pos]
                if best is not None and -entry[0] + lift < best:
                    break
                pos += 1
                c = entry[-1]
                r = c.run
                if (borrowed is not None and r.attempt_id not in borrowed) or (
                    now_s - r.started_at_s < min_runtime_s
                ):
                    continue
                if c.at_s != now_s:
                    c.refresh(now_s, config)
                heapq.heappush(heap, (_las_key(c), c))
                if best is None or c.attained_s > best:
                    best = c.attained_s
            at[0] = pos
        if not heap:
            return False
        self._items.append(heapq.heappop(heap)[1])
        return True


def _lost(c: Candidate) -> float:
    return c.lost_s


def _priority_lost(c: Candidate) -> tuple[int, float]:
    return (c.run.priority, c.lost_s)


def _srtf_key(c: Candidate) -> tuple[float, ...]:
    return (-c.remaining_s, *_youngest(c))


def _las_key(c: Candidate) -> tuple[float, ...]:
    return (-c.queue, -c.attained_s, *_youngest(c))


class Search:
    """What one waiting job needs from a preemption."""

    __slots__ = (
        "tenant",
        "gpu_type",
        "gpus",
        "priority",
        "predicted_s",
        "queue",
        "cross",
        "own",
        "baseline",
        "need_quota",
        "free_node",
        "defer_until_s",
    )

    def __init__(
        self,
        tenant: str,
        gpu_type: str,
        gpus: int,
        priority: int,
        predicted_s: float,
        queue: int,
    ):
        self.tenant = tenant
        self.gpu_type = gpu_type
        self.gpus = gpus
        self.priority = priority
        self.predicted_s = predicted_s
        self.queue = queue
        self.cross = False  # may take borrowed GPUs of other tenants
        self.own = False  # may take its own tenant's lower-priority GPUs
        self.baseline: Ordering | None = None  # SRTF / LAS rule
        self.need_quota = 0  # GPUs of its own tenant that must be given back first
        self.free_node: int | None = None  # a node it fits on already, when quota is the block
        # Set when it is better to preempt later, once a victim has saved its next checkpoint.
        self.defer_until_s: float | None = None


def find_victims(
    s: Search,
    victims: Victims,
    ti: TypeIndex,
    books: dict[str, Book],
    done: set[int],
    fits: Fits | None,
    protected: set[int],
    nodes_ok: Callable[[int], bool] | None = None,
) -> tuple[list[tuple[Candidate, str]], int | None] | None:
    """The fewest victims, in preference order, that let the job start; None if none do.

    Returns (victim, rule) pairs, the rule naming why it goes (a key of `reason_for`), and the
    node the job will go to (None for a gang over several nodes). `nodes_ok`, when given, says
    which nodes the job may use at all (those with its volumes): only GPUs there count.
    """
    n = s.gpus
    single = n <= ti.max_node_cap
    need_capacity = not (single and s.free_node is not None)
    if (
        single
        and need_capacity
        and s.cross
        and not s.own
        and s.baseline is None
        and not s.need_quota
        and victims.by_lost_work
    ):
        if not (victims.has_cross(s.gpu_type) and victims.most(ti) >= n):
            return None
        return _least_lost(s, victims, ti, books, done, fits, protected)
    chosen: list[tuple[Candidate, str]] = []
    seen: set[int] = set()
    tentative: dict[str, int] = {}
    freed: dict[int, int] = {}
    own_given = 0
    target = s.free_node
    freed_total = 0
    if s.cross or s.baseline is not None:
        victims.cross_counts(s.gpu_type)
    cross_gpus = victims.cross_gpus.get(s.gpu_type, {})
    # (No nested functions here: compiled by mypyc, they and the function's locals would form
    # a reference cycle at every search, left to the cyclic collector; scheduler.native.)
    # What a gang has before any victim: free and soon-free GPUs on the nodes it may use.
    if nodes_ok is None:
        gang_base = ti.total_free + ti.soon_total
    else:
        gang_base = sum(ti.free_on(i) + ti.soon.get(i, 0) for i in ti.node_cap if nodes_ok(i))

    sources = _sources(s, victims, ti, need_capacity)
    if s.need_quota:
        # Only the tenant's own attempts give quota back: without enough of them, stop here.
        # The ones a rule lets go lead each list, so counting stops at the first that does not
        # qualify, or as soon as there are enough (a full partition asks this for every job).
        own_gpus = 0
        for source, cands, key in sources:
            if key is not None:
                continue
            for c in cands:
                if own_gpus >= s.need_quota or not _qualifies(s, source, c):
                    break
                if c.run.attempt_id not in done:
                    own_gpus += c.size
        if own_gpus < s.need_quota:
            return None
    satisfied = False
    for source, cands, skip_key in sources:
        # Borrowed attempts already preempted, or whose tenant is back at its guarantee, stay
        # out for the rest of the cycle: skip them for good instead of for every job again.
        first = victims.start.get(skip_key, 0) if skip_key else 0
        leading = skip_key  # the key while still in the skippable prefix, then None
        for i, c in enumerate(islice(cands, first, None), first):
            aid = c.run.attempt_id
            if aid in done or aid in seen:
                if leading is not None and aid in done:
                    victims.start[leading] = i + 1
                continue
            if (
                leading is not None
                and c.tenant != s.tenant
                and c.tenant not in tentative
                and not books[c.tenant].over_guarantee(s.gpu_type)
            ):
                victims.start[leading] = i + 1
                continue
            leading = None
            if not _qualifies(s, source, c):
                break  # each list is sorted so that none further qualifies either
            if c.tenant != s.tenant:
                if not books[c.tenant].over_guarantee(s.gpu_type, tentative.get(c.tenant, 0)):
                    continue
                if (
                    need_capacity
                    and single
                    and not any(
                        ti.free_on(node) + ti.soon.get(node, 0) + cross_gpus.get(node, 0) >= n
                        for node in c.nodes
                    )
                ):
                    continue
                if need_capacity and nodes_ok is not None and not _usable_gpus(c, nodes_ok):
                    continue
            seen.add(aid)
            chosen.append((c, source))
            tentative[c.tenant] = tentative.get(c.tenant, 0) + c.size
            if c.tenant == s.tenant:
                own_given += c.size
            for node, count in c.nodes.items():
                freed[node] = freed.get(node, 0) + count
            freed_total += _usable_gpus(c, nodes_ok)
            if need_capacity:
                if single:
                    if target is None:
                        for node in sorted(c.nodes):
                            if ti.free_on(node) + ti.soon.get(node, 0) + freed[
                                node
                            ] >= n and _node_usable(ti, n, protected, fits, node):
                                target = node
                                break
                    capacity_ok = target is not None
                else:
                    capacity_ok = gang_base + freed_total >= n
            else:
                capacity_ok = True
            if capacity_ok and own_given >= s.need_quota:
                satisfied = True
                break
        if satisfied:
            break
    if not satisfied:
        return None

    # Only victims that help: on the target node, anywhere for a gang, or the tenant's own for
    # quota. Then give back every one that is not needed, last chosen first.
    kept = []
    for c, source in chosen:
        if c.tenant == s.tenant and s.need_quota:
            helps = True
        elif not need_capacity:
            helps = False
        elif single:
            helps = target in c.nodes
        else:
            helps = nodes_ok is None or _usable_gpus(c, nodes_ok) > 0
        if helps:
            kept.append((c, source))
    for pair in reversed(list(kept)):
        without = pair[0]
        rest = [c for c, _ in kept if c is not without]
        if sum(c.size for c in rest if c.tenant == s.tenant) < s.need_quota:
            continue
        if need_capacity:
            if single:
                assert target is not None, "a job on one node is satisfied only once it has a node"
                got = ti.free_on(target) + ti.soon.get(target, 0)
                got += sum(c.nodes.get(target, 0) for c in rest)
            else:
                got = gang_base + sum(_usable_gpus(c, nodes_ok) for c in rest)
            if got < n:
                continue
        kept.remove(pair)
    rules = {"cross": "cross", "own": "own", "baseline": str(s.baseline)}
    return [(c, rules[source]) for c, source in kept], (target if single else None)


def _node_usable(ti: TypeIndex, n: int, protected: set[int], fits: Fits | None, node: int) -> bool:
    return (
        ti.node_cap.get(node, 0) >= n and node not in protected and (fits is None or fits(node, n))
    )


def _usable_gpus(c: Candidate, nodes_ok: Callable[[int], bool] | None) -> int:
    """The GPUs a victim frees on the nodes the job may use."""
    if nodes_ok is None:
        return sum(c.nodes.values())
    return sum(count for node, count in c.nodes.items() if nodes_ok(node))


def _least_lost(
    s: Search,
    victims: Victims,
    ti: TypeIndex,
    books: dict[str, Book],
    done: set[int],
    fits: Fits | None,
    protected: set[int],
) -> tuple[list[tuple[Candidate, str]], int | None] | None:
    """For a job on one node that only borrowed work may make room for: the victims that lose
    the least work in all, over every node the job could go to.

    Walking the victims in order of work lost per GPU and stopping at the first node with
    enough is not that: it takes an 8-GPU attempt that checkpointed a minute ago for a 1-GPU
    job when a 1-GPU attempt that started two minutes ago costs a quarter of it. Per node, the
    cheapest set that frees what is missing there is a small knapsack (a node holds a few
    attempts); nodes are tried in order of the least their set could cost, until none can beat
    the best found.

    A cycle runs this for many jobs over the same candidates, so the per-node lists are built
    once per cycle (Victims.cross_by_node) and a node is first judged on what costs nothing to
    know (its GPUs missing, the borrowed GPUs still there); only the nodes tried are filtered
    for the victims this search may take.
    """
    n = s.gpus
    t = s.gpu_type
    by_node = victims.cross_by_node(t)
    cross_gpus = victims.cross_gpus.get(t, {})

    def may_take(c: Candidate) -> bool:
        return c.run.attempt_id not in done and (
            c.tenant == s.tenant or books[c.tenant].over_guarantee(t)
        )

    # node -> GPUs missing there, for every node that could take the job at all
    eligible: dict[int, int] = {}
    # (a lower bound of what the node's victims could lose, node): each list is in the victim
    # order, the least lost per GPU first, so its head bounds any set of it from below
    bounds: list[tuple[float, int]] = []
    for node, on_node in by_node.items():
        missing = n - ti.free_on(node) - ti.soon.get(node, 0)
        if missing <= 0 or cross_gpus.get(node, 0) < missing:
            continue
        if ti.node_cap.get(node, 0) < n or node in protected:
            continue
        eligible[node] = missing
        bounds.append((on_node[0].lost_s * missing, node))
    bounds.sort()
    best: tuple[float, int, int, list[Candidate]] | None = None
    fitting: dict[int, bool] = {}

    def fits_on(node: int) -> bool:
        ok = fitting.get(node)
        if ok is None:
            ok = fitting[node] = fits is None or fits(node, n)
        return ok

    for bound, node in bounds:
        if best is not None and bound >= best[0]:
            break
        missing = eligible[node]
        live = [c for c in by_node[node] if may_take(c)]
        if sum(c.nodes[node] for c in live) < missing or not fits_on(node):
            continue
        chosen = _cheapest_set(live, node, missing, s, books)
        if chosen is None:
            continue
        cost = sum(c.lost_s * c.size for c in chosen)
        if best is None or (cost, len(chosen), node) < best[:3]:
            best = (cost, len(chosen), node, chosen)
    if best is None:
        return None
    # Waiting for a victim's next checkpoint can beat preempting now: waiting costs the job its
    # GPUs' worth of time (the victim's work goes on meanwhile), preempting now throws work away.
    now_s = victims.now_s
    restart_s = victims.restart_cost_s
    defer: tuple[float, float] | None = None  # (net GPU-seconds saved, preempt at)
    for c in victims.cross_checkpointing(t):
        interval_s = c.run.checkpoint_interval_s
        if not interval_s or interval_s <= 0 or not may_take(c):
            continue
        if not any(
            node in eligible and count >= eligible[node] and fits_on(node)
            for node, count in c.nodes.items()
        ):
            continue
        since_s = max(c.run.started_at_s, c.run.last_checkpoint_s or c.run.started_at_s)
        next_s = since_s + math.ceil(max(now_s - since_s, 1e-9) / interval_s) * interval_s
        # Preempted then, it saves that checkpoint within its notice.
        at_s = next_s - c.run.grace_s
        if at_s <= now_s:
            continue
        net = best[0] - restart_s * c.size - (at_s - now_s) * n
        if net > 0 and (defer is None or (net, -at_s) > (defer[0], -defer[1])):
            defer = (net, at_s)
    if defer is not None:
        s.defer_until_s = defer[1]
        return None
    return [(c, "cross") for c in best[3]], best[2]


def _cheapest_set(
    on_node: list[Candidate], node: int, missing: int, s: Search, books: dict[str, Book]
) -> list[Candidate] | None:
    """The victims on a node that free `missing` GPUs there for the least lost work in all.

    A knapsack over GPUs freed (capped at what is missing): dp[g] is the cheapest set found
    that frees g. Every tenant must stay over its guarantee until its last victim is taken (so
    the largest goes last); a cheapest set that breaks that gives way to the walk in order.
    """
    dp: list[tuple[float, int, tuple[int, ...]] | None] = [None] * (missing + 1)
    dp[0] = (0.0, 0, ())
    for i, c in enumerate(on_node):
        gives = min(c.nodes[node], missing)
        cost = c.lost_s * c.size
        for got in range(missing, -1, -1):
            entry = dp[got]
            if entry is None:
                continue
            to = min(missing, got + gives)
            new = (entry[0] + cost, entry[1] + 1, (*entry[2], i))
            old = dp[to]
            if old is None or new[:2] < old[:2]:
                dp[to] = new
    result = dp[missing]
    if result is None:
        return None
    chosen = [on_node[i] for i in result[2]]
    if _keeps_guarantees(chosen, s, books):
        return chosen
    # Rare: the walk in order, with the tenants' tentative losses, then the give-back.
    taken: list[Candidate] = []
    tentative: dict[str, int] = {}
    got = 0
    for c in on_node:
        if c.tenant != s.tenant and not books[c.tenant].over_guarantee(
            s.gpu_type, tentative.get(c.tenant, 0)
        ):
            continue
        taken.append(c)
        tentative[c.tenant] = tentative.get(c.tenant, 0) + c.size
        got += c.nodes[node]
        if got >= missing:
            break
    if got < missing:
        return None
    for c in reversed(list(taken)):
        if got - c.nodes[node] >= missing:
            taken.remove(c)
            got -= c.nodes[node]
    return taken


def _keeps_guarantees(chosen: list[Candidate], s: Search, books: dict[str, Book]) -> bool:
    """Whether every other tenant is still over its guarantee before its last victim goes."""
    total: dict[str, int] = {}
    largest: dict[str, int] = {}
    for c in chosen:
        if c.tenant != s.tenant:
            total[c.tenant] = total.get(c.tenant, 0) + c.size
            largest[c.tenant] = max(largest.get(c.tenant, 0), c.size)
    return all(
        books[tenant].over_guarantee(s.gpu_type, total[tenant] - largest[tenant])
        for tenant in total
    )


def reclaim_node(
    s: Search,
    victims: Victims,
    ti: TypeIndex,
    books: dict[str, Book],
    done: set[int],
    fits: Fits | None,
    protected: set[int],
    nodes_ok: Callable[[int], bool] | None = None,
) -> tuple[list[tuple[Candidate, str]], int] | None:
    """A node for a job within its tenant's guarantee that needs several GPUs on one node,
    where the borrowed attempts alone free none: victims among every attempt of the tenants
    that use more than their guarantee, each such tenant keeping its whole guarantee.

    Which of a tenant's attempts are the borrowed ones is a matter of order (those that pushed
    it past its guarantee when they started, quota.label_borrowed), and they run wherever GPUs
    were free then. In a full cluster they are scattered one or two to a node among the same
    tenants' older attempts, so no node holds enough of them for a gang, and the owner of the
    GPUs waited until some node happened to drain (up to five hours at L = 8 in the Philly
    replays, docs/simulator-saturation.md) although the tenants holding its GPUs used more
    than their guarantees. A guarantee promises a number of GPUs, not particular attempts: so
    here any attempt of a tenant over its guarantee may go, as long as what that tenant gives
    up stays within what it uses beyond every guarantee covering the type (Book.excess): it
    keeps as many GPUs as if its borrowed attempts had gone.

    Over every node the job could go to, the cheapest set found: on each node the candidates
    in the victim order, passing over one whose tenant cannot spare it, until what is missing
    there is freed; then those not needed after all are given back, last chosen first. The
    node whose set loses the least work wins (then the fewest victims, then the lowest node).
    """
    n = s.gpus
    t = s.gpu_type

    def usable(node: int) -> bool:
        return (
            ti.node_cap.get(node, 0) >= n
            and node not in protected
            and (nodes_ok is None or nodes_ok(node))
        )

    # Where borrowed work will make room once it has run its minimum, the job waits for that
    # (the rule of find_victims) rather than throw away work that has run for longer.
    if victims.room_once_aged(ti, n, done, usable):
        return None
    spare: dict[str, int] = {}

    def spare_of(tenant: str) -> int:
        got = spare.get(tenant)
        if got is None:
            # Its own tenant's attempts are not others' surplus: the own-priority rule has them.
            got = spare[tenant] = 0 if tenant == s.tenant else books[tenant].excess(t)
        return got

    best: tuple[float, int, int, list[Candidate]] | None = None
    for node, on_node in victims.takeable_by_node(t).items():
        missing = n - ti.free_on(node) - ti.soon.get(node, 0)
        if missing <= 0 or not usable(node):
            continue
        live = [c for c in on_node if c.run.attempt_id not in done and spare_of(c.tenant) > 0]
        if sum(c.nodes[node] for c in live) < missing:
            continue
        taken: list[Candidate] = []
        given: dict[str, int] = {}
        got = 0
        for c in live:
            gives = given.get(c.tenant, 0) + c.size
            if gives > spare_of(c.tenant):
                continue
            given[c.tenant] = gives
            taken.append(c)
            got += c.nodes[node]
            if got >= missing:
                break
        if got < missing or (fits is not None and not fits(node, n)):
            continue
        for c in reversed(list(taken)):
            if got - c.nodes[node] >= missing:
                taken.remove(c)
                got -= c.nodes[node]
        cost = sum(c.lost_s * c.size for c in taken)
        if best is None or (cost, len(taken), node) < best[:3]:
            best = (cost, len(taken), node, taken)
    if best is None:
        return None
    return [(c, "reclaim") for c in best[3]], best[2]


# (rule, its candidates in walking order, the key of Victims.start its skipped prefix is kept
# by, or None when the list is walked from its head every time)
Source = tuple[str, Sequence[Candidate], tuple[str, str] | None]


def _sources(s: Search, victims: Victims, ti: TypeIndex, need_capacity: bool) -> list[Source]:
    """The candidate lists to walk, in order, each with the key its skipped prefix is kept by.

    Borrowed work of other tenants goes first, unless the job must first get some of its own
    tenant's quota back: only its own attempts can give that, so they go first then.
    """
    t = s.gpu_type
    # Borrowed work of other tenants is walked only where it could make room on a node.
    others_help = not (need_capacity and s.gpus <= ti.max_node_cap) or victims.most(ti) >= s.gpus
    others: list[Source] = []
    own: list[Source] = []
    if s.cross and others_help:
        others.append(("cross", victims.cross(t), ("cross", t)))
    if s.baseline is not None:
        if others_help:
            others.append(("baseline", victims.baseline(t), ("baseline", t)))
        own.append(("baseline", victims.baseline(t, s.tenant), None))
    if s.own:
        own.append(("own", victims.own(s.tenant, t), None))
    return own + others if s.need_quota else others + own


def srtf_span(s: Search, victims: Victims, ti: TypeIndex) -> tuple[float, float, float, float]:
    """The predicted durations for which the SRTF lists a search walks (any tenant's borrowed
    ones, where _sources walks them; the tenant's own) let the job take the same candidates as
    this one's: (low, high) per list, each a duration p with low <= p < high. _qualifies takes
    those with a longer remaining time, the lists are sorted longest first and a walk stops at
    the first one past them that it does not skip, so a search alike but in its predicted
    duration, within both spans, walks alike (Admission._failed)."""
    t = s.gpu_type
    single = s.gpus <= ti.max_node_cap
    need_capacity = not (single and s.free_node is not None)
    others_help = not (need_capacity and single) or victims.most(ti) >= s.gpus
    low, high = _span(victims.baseline(t), s.predicted_s) if others_help else (-math.inf, math.inf)
    own_low, own_high = _span(victims.baseline(t, s.tenant), s.predicted_s)
    return low, high, own_low, own_high


def _span(cands: Sequence[Candidate], predicted_s: float) -> tuple[float, float]:
    """(low, high): the durations p, low <= p < high, for which the same leading candidates of
    a list sorted longest remaining time first have a remaining time longer than p as for
    predicted_s (a lazy list is grown as far as that)."""
    items = cands
    if isinstance(cands, _Grown):
        grown = cands._items
        while (not grown or grown[-1].remaining_s > predicted_s) and cands._more():
            pass
        items = grown
    cut = bisect.bisect_left(items, -predicted_s, key=_less_remaining)
    return (
        items[cut].remaining_s if cut < len(items) else -math.inf,
        items[cut - 1].remaining_s if cut else math.inf,
    )


def _less_remaining(c: Candidate) -> float:
    return -c.remaining_s


def _qualifies(s: Search, source: str, c: Candidate) -> bool:
    """Whether the rule of a list lets this job take this candidate."""
    if source == "baseline":
        if s.baseline is Ordering.SRTF:
            return c.remaining_s > s.predicted_s
        return c.queue > s.queue
    if source == "own":
        return c.run.priority < s.priority
    return True


def reason_for(source_rule: str, for_job_id: int) -> str:
    """Why an attempt was preempted, in words stored with it."""
    return {
        "cross": f"its borrowed GPUs are reclaimed for job {for_job_id}, which is within its "
        "tenant's guarantee",
        "reclaim": f"its tenant uses more than its guarantee, and job {for_job_id}, which is "
        "within its own tenant's guarantee, needs these GPUs on one node",
        "own": f"preempted for job {for_job_id} of the same tenant, which has a higher priority",
        "srtf": f"preempted for job {for_job_id}, which has a shorter remaining time",
        "las": f"preempted for job {for_job_id}, which has received less GPU service",
        "drain": "node draining",
    }[source_rule]
