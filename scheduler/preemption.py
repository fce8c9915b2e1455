"""Preemption: which running attempts to stop so that a waiting job can start.

Who may be stopped, always only a preemptible attempt that has run at least
`Config.min_runtime_s` (restarting work that just began wastes more than it frees) and is not
already stopping:

- for a job within its tenant's guarantee: borrowed attempts of other tenants that are still
  over their own guarantee, youngest first (they lose the least work);
- in FAIR, for any job: attempts of its own tenant with a lower priority, lowest first;
- under SRTF: attempts with a longer remaining time than the job's predicted duration; under
  LAS: attempts in a later attained-service queue than the job's. Other tenants' attempts only
  while they are borrowed, so a guarantee is never taken away by a baseline either.

The victims are chosen on one node the job fits on (a gang larger than any node: over the whole
type), in the preference order above (other tenants' borrowed work first, unless the job must
first win back some of its own tenant's quota, which only its own attempts can give), until
enough GPUs and quota would be free; then every chosen victim that is not needed after all is
given back, last chosen first, so no more is evicted than needed. A tenant brought back to its
guarantee stays out of the searches for the rest of the cycle.
GPUs of attempts already stopping count as free soon and are used before anything new is
evicted, so a job never causes a second preemption for GPUs it is already owed.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from scheduler.model import Config, Ordering, Running
from scheduler.placement import ClusterIndex, Fits, TypeIndex
from scheduler.priority import las_queue
from scheduler.quota import Book


class Candidate:
    """A running attempt that may be preempted, with where its GPUs are."""

    __slots__ = ("run", "tenant", "size", "nodes", "remaining_s", "queue")

    def __init__(self, run: Running, nodes: dict[int, int], remaining_s: float):
        self.run = run
        self.tenant = run.tenant
        self.size = len(run.gpus)
        self.nodes = nodes
        self.remaining_s = remaining_s
        self.queue = las_queue(run.attained_service_s)


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
    ):
        self._running = running
        self._index = index
        self._borrowed = borrowed
        self._config = config
        self._now_s = now_s
        self._by_type: dict[str, list[Running]] | None = None
        self._by_owner: dict[tuple[str, str], list[Running]] = {}
        self._candidates: dict[int, Candidate] = {}
        self._cross: dict[str, list[Candidate]] = {}
        self._own: dict[tuple[str, str], list[Candidate]] = {}
        self._baseline: dict[tuple[str, str | None], list[Candidate]] = {}
        self._cross_ids: set[int] = set()
        # (rule, type) -> index of the first candidate of that list still worth looking at
        self.start: dict[tuple[str, str], int] = {}
        # type -> max-heap of (-potential, node), stale entries dropped when met; see most()
        self._potential: dict[str, list[tuple[int, int]]] = {}
        self.cross_gpus: dict[str, dict[int, int]] = {}  # type -> node -> borrowed GPUs there

    def _group(self) -> dict[str, list[Running]]:
        if self._by_type is None:
            by_type: dict[str, list[Running]] = {}
            min_runtime_s = self._config.min_runtime_s
            now_s = self._now_s
            by_owner = self._by_owner
            for r in self._running:
                if r.stopping or not r.preemptible or now_s - r.started_at_s < min_runtime_s:
                    continue
                by_type.setdefault(r.gpu_type, []).append(r)
                by_owner.setdefault((r.tenant, r.gpu_type), []).append(r)
            self._by_type = by_type
        return self._by_type

    def _candidate(self, r: Running) -> Candidate:
        c = self._candidates.get(r.attempt_id)
        if c is None:
            if r.remaining_s is not None:
                remaining_s = r.remaining_s
            elif r.predicted_end_s is not None:
                remaining_s = max(r.predicted_end_s - self._now_s, 0.0)
            else:
                remaining_s = max(
                    r.started_at_s + self._config.default_duration_s - self._now_s, 0.0
                )
            c = self._candidates[r.attempt_id] = Candidate(r, self._index.nodes_of(r), remaining_s)
        return c

    def cross(self, gpu_type: str) -> list[Candidate]:
        """Borrowed attempts of a type, youngest first."""
        found = self._cross.get(gpu_type)
        if found is None:
            borrowed = self._borrowed()
            found = [
                self._candidate(r)
                for r in self._group().get(gpu_type, ())
                if r.attempt_id in borrowed
            ]
            found.sort(key=_youngest)
            per_node: dict[int, int] = {}
            for c in found:
                self._cross_ids.add(c.run.attempt_id)
                for node, count in c.nodes.items():
                    per_node[node] = per_node.get(node, 0) + count
            self.cross_gpus[gpu_type] = per_node
            self._cross[gpu_type] = found
        return found

    def own(self, tenant: str, gpu_type: str) -> list[Candidate]:
        """A tenant's attempts of a type, lowest priority first, then youngest."""
        key = (tenant, gpu_type)
        found = self._own.get(key)
        if found is None:
            self._group()
            found = [self._candidate(r) for r in self._by_owner.get(key, ())]
            found.sort(key=lambda c: (c.run.priority, *_youngest(c)))
            self._own[key] = found
        return found

    def baseline(self, gpu_type: str, tenant: str | None = None) -> list[Candidate]:
        """The SRTF / LAS candidates: borrowed ones of any tenant (tenant None) or a tenant's own.

        SRTF sorts the longest remaining time first; LAS the latest attained-service queue.
        """
        key = (gpu_type, tenant)
        found = self._baseline.get(key)
        if found is None:
            found = list(self.cross(gpu_type) if tenant is None else self.own(tenant, gpu_type))
            if self._config.ordering is Ordering.SRTF:
                found.sort(key=lambda c: (-c.remaining_s, *_youngest(c)))
            else:
                found.sort(key=lambda c: (-c.queue, -c.run.attained_service_s, *_youngest(c)))
            self._baseline[key] = found
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
            self.cross(t)
            cross_gpus = self.cross_gpus[t]
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
        if c.run.attempt_id in self._cross_ids:
            per_node = self.cross_gpus[c.run.gpu_type]
            for node, count in c.nodes.items():
                per_node[node] -= count
            index_changed = self._index.types[c.run.gpu_type].changed
            index_changed.extend(c.nodes)


def _youngest(c: Candidate) -> tuple[float, int]:
    return (-c.run.started_at_s, -c.run.attempt_id)


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


def find_victims(
    s: Search,
    victims: Victims,
    ti: TypeIndex,
    books: dict[str, Book],
    done: set[int],
    fits: Fits | None,
    protected: set[int],
) -> tuple[list[tuple[Candidate, str]], int | None] | None:
    """The fewest victims, in preference order, that let the job start; None if none do.

    Returns (victim, rule) pairs, the rule naming why it goes (a key of `reason_for`), and the
    node the job will go to (None for a gang over several nodes).
    """
    n = s.gpus
    single = n <= ti.max_node_cap
    need_capacity = not (single and s.free_node is not None)
    chosen: list[tuple[Candidate, str]] = []
    seen: set[int] = set()
    tentative: dict[str, int] = {}
    freed: dict[int, int] = {}
    own_given = 0
    target = s.free_node
    freed_total = 0
    if s.cross or s.baseline is not None:
        victims.cross(s.gpu_type)
    cross_gpus = victims.cross_gpus.get(s.gpu_type, {})

    def node_usable(node: int) -> bool:
        return (
            ti.node_cap.get(node, 0) >= n
            and node not in protected
            and (fits is None or fits(node, n))
        )

    def potential(node: int) -> int:
        return ti.free_on(node) + ti.soon.get(node, 0) + cross_gpus.get(node, 0)

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
        for i in range(first, len(cands)):
            c = cands[i]
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
                if need_capacity and single and not any(potential(node) >= n for node in c.nodes):
                    continue
            seen.add(aid)
            chosen.append((c, source))
            tentative[c.tenant] = tentative.get(c.tenant, 0) + c.size
            if c.tenant == s.tenant:
                own_given += c.size
            for node, count in c.nodes.items():
                freed[node] = freed.get(node, 0) + count
                freed_total += count
            if need_capacity:
                if single:
                    if target is None:
                        for node in sorted(c.nodes):
                            if ti.free_on(node) + ti.soon.get(node, 0) + freed[
                                node
                            ] >= n and node_usable(node):
                                target = node
                                break
                    capacity_ok = target is not None
                else:
                    capacity_ok = ti.total_free + ti.soon_total + freed_total >= n
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
    def helps(c: Candidate) -> bool:
        if c.tenant == s.tenant and s.need_quota:
            return True
        if not need_capacity:
            return False
        return (not single) or (target in c.nodes)

    kept = [(c, source) for c, source in chosen if helps(c)]

    def enough(without: Candidate) -> bool:
        rest = [c for c, _ in kept if c is not without]
        if sum(c.size for c in rest if c.tenant == s.tenant) < s.need_quota:
            return False
        if not need_capacity:
            return True
        if single:
            assert target is not None, "a job on one node is satisfied only once it has a node"
            got = ti.free_on(target) + ti.soon.get(target, 0)
            got += sum(c.nodes.get(target, 0) for c in rest)
        else:
            got = ti.total_free + ti.soon_total + sum(sum(c.nodes.values()) for c in rest)
        return got >= n

    for pair in reversed(list(kept)):
        if enough(pair[0]):
            kept.remove(pair)
    rules = {"cross": "cross", "own": "own", "baseline": str(s.baseline)}
    return [(c, rules[source]) for c, source in kept], (target if single else None)


# (rule, its candidates in walking order, the key of Victims.start its skipped prefix is kept
# by, or None when the list is walked from its head every time)
Source = tuple[str, list[Candidate], tuple[str, str] | None]


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
        "own": f"preempted for job {for_job_id} of the same tenant, which has a higher priority",
        "srtf": f"preempted for job {for_job_id}, which has a shorter remaining time",
        "las": f"preempted for job {for_job_id}, which has received less GPU service",
        "drain": "node draining",
    }[source_rule]
