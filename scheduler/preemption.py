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
type), in the preference order above, until enough GPUs (and, for a job blocked by its own
tenant's limit, enough of the tenant's quota) would be free; then every chosen victim that is
not needed after all is given back, last chosen first, so no more is evicted than needed.
GPUs of attempts already stopping count as free soon and are used before anything new is
evicted, so a job never causes a second preemption for GPUs it is already owed.
"""

from __future__ import annotations

from scheduler.model import Config, Ordering, Running
from scheduler.placement import ClusterIndex, Fits, TypeIndex
from scheduler.priority import las_queue
from scheduler.quota import Book


class Candidate:
    """A running attempt that may be preempted, with where its GPUs are."""

    __slots__ = ("run", "tenant", "size", "nodes", "borrowed", "remaining_s", "queue")

    def __init__(self, run: Running, nodes: dict[int, int], borrowed: bool, remaining_s: float):
        self.run = run
        self.tenant = run.tenant
        self.size = len(run.gpus)
        self.nodes = nodes
        self.borrowed = borrowed
        self.remaining_s = remaining_s
        self.queue = las_queue(run.attained_service_s)


class Victims:
    """The preemptible attempts of a cycle, in the orders the rules above walk them."""

    def __init__(
        self,
        running: tuple[Running, ...],
        index: ClusterIndex,
        borrowed: set[int],
        config: Config,
        now_s: float,
    ):
        self.cross: dict[str, list[Candidate]] = {}  # type -> borrowed, youngest first
        self.own: dict[tuple[str, str], list[Candidate]] = {}  # (tenant, type) -> lowest first
        self.baseline: dict[str, list[Candidate]] = {}  # type -> SRTF / LAS order
        self.cross_gpus: dict[str, dict[int, int]] = {}  # type -> node -> borrowed GPUs there
        every: dict[str, list[Candidate]] = {}
        for r in running:
            if r.stopping or not r.preemptible or now_s - r.started_at_s < config.min_runtime_s:
                continue
            if r.remaining_s is not None:
                remaining_s = r.remaining_s
            elif r.predicted_end_s is not None:
                remaining_s = max(r.predicted_end_s - now_s, 0.0)
            else:
                remaining_s = max(r.started_at_s + config.default_duration_s - now_s, 0.0)
            c = Candidate(r, index.nodes_of(r), r.attempt_id in borrowed, remaining_s)
            every.setdefault(r.gpu_type, []).append(c)
            self.own.setdefault((r.tenant, r.gpu_type), []).append(c)
            if c.borrowed:
                self.cross.setdefault(r.gpu_type, []).append(c)
                per_node = self.cross_gpus.setdefault(r.gpu_type, {})
                for node, count in c.nodes.items():
                    per_node[node] = per_node.get(node, 0) + count
        youngest = lambda c: (-c.run.started_at_s, -c.run.attempt_id)  # noqa: E731
        for cands in self.cross.values():
            cands.sort(key=youngest)
        for cands in self.own.values():
            cands.sort(key=lambda c: (c.run.priority, -c.run.started_at_s, -c.run.attempt_id))
        if config.ordering is Ordering.SRTF:
            for t, cands in every.items():
                self.baseline[t] = sorted(cands, key=lambda c: (-c.remaining_s, *youngest(c)))
        elif config.ordering is Ordering.LAS:
            for t, cands in every.items():
                self.baseline[t] = sorted(
                    cands, key=lambda c: (-c.queue, -c.run.attained_service_s, *youngest(c))
                )

    def evicted(self, c: Candidate) -> None:
        """Forget a victim's GPUs in the per-node potential once it is preempted."""
        if c.borrowed:
            per_node = self.cross_gpus[c.run.gpu_type]
            for node, count in c.nodes.items():
                per_node[node] -= count


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

    def __init__(self, tenant, gpu_type, gpus, priority, predicted_s, queue):
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
    cross_gpus = victims.cross_gpus.get(s.gpu_type, {})

    def node_usable(node: int) -> bool:
        return (
            ti.node_cap.get(node, 0) >= n
            and node not in protected
            and (fits is None or fits(node, n))
        )

    def potential(node: int) -> int:
        return ti.free_on(node) + ti.soon.get(node, 0) + cross_gpus.get(node, 0)

    satisfied = False
    for source, cands in _sources(s, victims):
        for c in cands:
            aid = c.run.attempt_id
            if aid in done or aid in seen:
                continue
            if source == "baseline":
                if s.baseline is Ordering.SRTF and not c.remaining_s > s.predicted_s:
                    break  # sorted longest first: none further is longer
                if s.baseline is Ordering.LAS and not c.queue > s.queue:
                    break
            elif source == "own" and not c.run.priority < s.priority:
                break  # sorted lowest first
            if c.tenant != s.tenant:
                if not books[c.tenant].over_guarantee(s.gpu_type, tentative.get(c.tenant, 0)):
                    continue
                if (
                    need_capacity
                    and single
                    and source == "cross"
                    and not any(potential(node) >= n for node in c.nodes)
                ):
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


def _sources(s: Search, victims: Victims):
    if s.cross:
        yield "cross", victims.cross.get(s.gpu_type, ())
    if s.baseline is not None:
        yield "baseline", victims.baseline.get(s.gpu_type, ())
    if s.own:
        yield "own", victims.own.get((s.tenant, s.gpu_type), ())


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
