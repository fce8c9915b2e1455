"""Admission: walk the queue once and decide, for each job, start, wait, or preempt for it.

For every job, in the order scheduler.priority gives:

1. a tenant unknown to the snapshot, on budget hold, or at its maximum of running jobs, starts
   nothing;
2. the GPU type must exist in a size that can ever hold the job, on nodes that have every
   volume it mounts (a job only ever goes to such nodes; MISSING_VOLUME when there are none);
3. the tenant's quota must allow it (scheduler.quota): within its limit, or only its guarantee
   when it may not borrow; a job blocked by its own tenant may preempt that tenant's lower-
   priority work;
4. it starts if placement finds GPUs for it (scheduler.placement) that no reservation of an
   earlier job needs (scheduler.backfill);
5. otherwise, where a preemption rule lets it (scheduler.preemption), it takes GPUs that are
   already being freed, or has attempts preempted for it: either way those GPUs and the free
   ones it needs beside them are set aside for it, and it starts once the victims have stopped,
   at the latest when their notice (grace) ends, which is its estimated start;
6. otherwise the first such job of its GPU type gets the reservation, and the job waits with a
   reason (scheduler.reasons).

A long queue behind a full cluster must not cost a search per job: once a type has fewer free
GPUs than a job asks for, step 4 costs nothing; a failed preemption search is remembered per
type (what it could not find, a larger job cannot either); and what a job blocked on capacity
got is remembered by everything that decided it (type, size, resources, whether it is within
its guarantee, its tenant's own lower-priority work, the reservation) until anything of its GPU
type changes, so the jobs behind it that look the same are decided by one lookup.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from scheduler import backfill, fairness, placement, quota
from scheduler.backfill import Release, Reservation
from scheduler.model import (
    ANY_GPU_TYPE,
    Config,
    Ordering,
    Pending,
    Preemption,
    ReasonCode,
    Running,
    Snapshot,
    Start,
)
from scheduler.placement import ClusterIndex, Fits, TypeIndex
from scheduler.preemption import (
    Candidate,
    Search,
    VictimPool,
    Victims,
    find_victims,
    reason_for,
    reclaim_node,
    srtf_span,
)
from scheduler.priority import las_queue
from scheduler.quota import Book
from scheduler.reasons import Waiting

RC = ReasonCode
# Quota verdicts that no preemption can turn (quota.check).
_NO_SEARCH = frozenset({"no_quota", "not_preemptible", "preemption_cap"})

# What decides the answer of a job blocked on capacity (see Admission._blocked): type, GPUs,
# CPUs, memory, volumes, within the guarantee, the tenant whose own work it may preempt,
# priority, the job the type is reserved for, and whether the type could not be reserved.
HopelessKey = tuple[str, int, float, int, tuple[str, ...], bool, str | None, int, int | None, bool]


# A preemption search that found nothing (Admission._failed): the spans of predicted durations
# it holds for (preemption.srtf_span) and the instant it deferred to.
FailedSearch = tuple[float, float, float, float, float | None]
_ANY_DURATION = (-math.inf, math.inf, -math.inf, math.inf)

# A type a job could run on, with what its tenant's quota says about it.
Option = tuple[TypeIndex, quota.Verdict]


def _preference(option: Option) -> tuple[bool, bool]:
    return (not option[1].ok, option[1].borrowed)


def _blocked_preference(option: Option) -> tuple[bool, bool]:
    return (not option[1].ok, not option[1].wait)


class _Borrowed:
    """Attempt ids running beyond their tenant's guarantee (quota.label_borrowed), worked out
    when first asked for.

    Held apart from the Admission: the victims read it, and a closure over the Admission
    (which holds the victims) made a reference cycle of every plan's whole state, so none of
    it was freed when the plan ended but by the cyclic collector, which then walked it all
    (a tenth of a preempting replay).
    """

    __slots__ = ("_running", "_books", "_totals", "_bound", "_ids")

    def __init__(
        self,
        running: tuple[Running, ...],
        books: dict[str, Book],
        totals: quota.RunningTotals | None,
        bound: quota.PreemptionBound,
    ):
        self._running = running
        self._books = books
        self._totals = totals
        self._bound = bound
        self._ids: set[int] | None = None

    def __call__(self) -> set[int]:
        if self._ids is None:
            self._ids = quota.label_borrowed(self._running, self._books, self._totals, self._bound)
        return self._ids


class Admission:
    """The mutable state of one cycle's admission, and the decisions it made."""

    def __init__(
        self,
        snapshot: Snapshot,
        config: Config,
        index: ClusterIndex,
        books: dict[str, Book],
        predicted_s: dict[int, float],
        releases: backfill.ReleaseIndex | None = None,
        totals: quota.RunningTotals | None = None,
        candidates: dict[int, tuple[Running, Candidate]] | None = None,
        pool: VictimPool | None = None,
    ):
        # `pool`: candidates kept across instants (PlanMemo.victim_pool).
        self._pool = pool
        # `candidates`: victims made by earlier plans at this instant (PlanMemo.candidates).
        self._kept_candidates = candidates
        # `totals`: snapshot.running summed in the caller's memo (PlanMemo.running_totals).
        self._totals = totals
        # `releases`: the running attempts' ends kept in the caller's memo (PlanMemo.releases);
        # built from the snapshot when a reservation is first made otherwise.
        self._release_index = releases
        self.snapshot = snapshot
        self.config = config
        self.now_s = snapshot.now_s
        self.index = index
        self.books = books
        self.predicted_s = predicted_s
        # Config.max_preemptions as it applies to each job (the one the totals were summed under).
        self.bound = (
            totals.bound
            if totals is not None
            else quota.PreemptionBound(config.max_preemptions, snapshot.tenants)
        )
        self._borrowed = _Borrowed(snapshot.running, books, totals, self.bound)
        self.capacity = {t: ti.total_cap for t, ti in index.types.items()}
        self.types = list(index.types)  # sorted by name
        self.reservations: dict[str, Reservation] = {}
        self.unreservable: set[str] = set()
        # GPUs this cycle started or set aside, by type, with when they free up again.
        self.occupied: dict[str, list[Release]] = {}
        self.starts: list[Start] = []
        self.preemptions: list[Preemption] = []
        self.waiting: list[Waiting] = []
        self.preempted: set[int] = set()  # attempt ids
        self._evicted: list[Running] = []  # the attempts of `preempted`
        # type -> jobs left waiting when GPUs of the type being freed were last seen unclaimed
        # after a decision (Plan.soon_left_after)
        self.soon_left_after: dict[str, int] = {}
        self.search_failed_at: dict[str, int] = {}  # type -> fewest GPUs a search failed for
        self._victims: Victims | None = None
        self._max_resources: dict[str, tuple[float, int]] = {}
        # what a capacity-blocked job got, by what decided it (see _blocked)
        self._hopeless: dict[HopelessKey, tuple[int, ReasonCode, int | None, int]] = {}
        # Bumped by every change a preemption search reads beyond its type's index (which has
        # its own version): a job booked or started (quota, CPUs and memory, GPUs set aside),
        # an eviction, a reservation made. See _preempt.
        self._changes = 0
        # Preemption searches that found nothing, by everything they read (see _failed_key),
        # with the defer instant they set: a job just like one that failed, with nothing
        # changed since, fails the same way.
        # The predicted durations it holds for under SRTF (preemption.srtf_span) come with it.
        self._failed: dict[tuple[object, ...], list[FailedSearch]] = {}
        # Node reclaims that found nothing, by everything they read (see _reclaim).
        self._reclaim_failed: set[tuple[object, ...]] = set()
        # (type, node) -> when the last of its soon-free GPUs is free: attempts keep their GPUs
        # through their notice (grace). Built when first needed; None until then.
        self._soon_until: dict[tuple[str, int], float] | None = None
        # (type, volumes) -> (most GPUs on one node that has them all, GPUs on all such nodes)
        self._volume_caps: dict[tuple[str, tuple[str, ...]], tuple[int, int]] = {}
        self._own_rule = config.preemption and config.ordering is Ordering.FAIR
        self._reclaim_rule = config.preemption and config.ordering not in (
            Ordering.SRTF,
            Ordering.LAS,
        )

    @property
    def borrowed(self) -> set[int]:
        """Attempt ids running beyond their tenant's guarantee (worked out when first needed)."""
        return self._borrowed()

    @property
    def victims(self) -> Victims:
        """The preemption candidates of this cycle, built when a job first needs them."""
        if self._victims is None:
            running = self.snapshot.running
            pool = self._pool if self._totals is not None else None
            if self.preempted:
                running = tuple(r for r in running if r.attempt_id not in self.preempted)
                pool = None  # it holds the snapshot's attempts, not these
            self._victims = Victims(
                running,
                self.index,
                self._borrowed,
                self.config,
                self.now_s,
                self._kept_candidates,
                pool,
                self._totals,
                self.bound,
            )
        return self._victims

    # ----- the steps ---------------------------------------------------------------------------

    def drain(self) -> None:
        """Preempt borrowed attempts on draining nodes: they are lent, and the node must empty."""
        topo = self.index.topo
        if not any(topo.draining):
            return
        gpu_node = topo.gpu_node
        for r in sorted(self.snapshot.running, key=lambda r: r.attempt_id):
            if r.stopping or not r.preemptible or r.attempt_id not in self.borrowed:
                continue
            if self.now_s - r.started_at_s < self.config.min_runtime_s:
                continue
            if any(topo.draining[gpu_node[u]] for u in r.gpus if u in gpu_node):
                self._evict(r, len(r.gpus), reason_for("drain", 0), None)

    def run(self, queue: Iterable[Pending]) -> None:
        """Decide every job of the queue, in order; note where GPUs being freed were left over
        (soon_left_after)."""
        types = self.index.types
        left = self.soon_left_after
        for ti in types.values():
            if ti.soon_total:
                left[ti.gpu_type] = 0
        for job in queue:
            self._decide(job)
            # GPUs being freed exist only after a preemption (or one under way): most cycles
            # skip this at the cost of one test.
            if self.preemptions or left:
                at = len(self.waiting)
                for ti in types.values():
                    if ti.soon_total:
                        left[ti.gpu_type] = at

    # ----- one job -----------------------------------------------------------------------------

    def _decide(self, job: Pending) -> None:
        book = self.books[job.tenant]
        if not book.known:
            self._wait(job, RC.QUOTA_LIMIT, job.gpu_type, "unknown_tenant")
            return
        if book.hold:
            self._wait(job, RC.BUDGET_HOLD)
            return
        if book.max_running_jobs is not None and book.running_jobs >= book.max_running_jobs:
            self._wait(job, RC.MAX_RUNNING_JOBS).count = book.running_jobs
            return
        n = job.gpus
        if n <= 0:
            self._start_without_gpus(job, book)
            return
        types = self.index.types
        if job.gpu_type:
            ti = types.get(job.gpu_type)
            if ti is None:
                self._wait(job, RC.NO_MATCHING_GPUS, job.gpu_type, "no_type")
                return
            if ti.total_cap < n:
                self._wait(job, RC.NO_MATCHING_GPUS, job.gpu_type, "too_big").count = ti.total_cap
                return
            if not self._resources_possible(job, ti):
                self._wait(job, RC.NO_MATCHING_GPUS, job.gpu_type, "resources")
                return
            if job.volumes and not self._volumes_possible(job, ti):
                self._wait(job, RC.MISSING_VOLUME, job.gpu_type)
                return
            capped = self.bound.reached(job.tenant, ti.gpu_type, n, job.preemptions)
            verdict = quota.check(book, ti.gpu_type, n, job.preemptible, self.config, capped)
            if verdict.ok and self._place(job, ti, book, verdict.borrowed):
                return
            self._blocked(job, ti, book, verdict)
            return
        options: list[Option] = []
        biggest = 0
        volumes_missing = False
        for t in self.types:
            ti = types[t]
            if ti.total_cap < n:
                biggest = max(biggest, ti.total_cap)
            elif not self._resources_possible(job, ti):
                biggest = -1
            elif job.volumes and not self._volumes_possible(job, ti):
                volumes_missing = True
            else:
                capped = self.bound.reached(job.tenant, t, n, job.preemptions)
                options.append((ti, quota.check(book, t, n, job.preemptible, self.config, capped)))
        if not options:
            if volumes_missing:
                self._wait(job, RC.MISSING_VOLUME)
            elif biggest < 0:
                self._wait(job, RC.NO_MATCHING_GPUS, "", "resources")
            else:
                self._wait(
                    job, RC.NO_MATCHING_GPUS, "", "too_big" if biggest else "no_type"
                ).count = biggest
            return
        # Within the guarantee beats borrowing; then the type's name, so the choice is stable.
        if len(options) > 1:
            options.sort(key=_preference)
        for ti, verdict in options:
            if verdict.ok and self._place(job, ti, book, verdict.borrowed):
                return
        ti, verdict = min(options, key=_blocked_preference)
        self._blocked(job, ti, book, verdict)

    def _blocked(self, job: Pending, ti: TypeIndex, book: Book, verdict: quota.Verdict) -> None:
        n = job.gpus
        t = ti.gpu_type
        if verdict.wait:
            self._wait(job, RC.WAITING_FOR_PREEMPTION, t, "own_stopping")
            return
        if not verdict.ok:
            baseline = self.config.preemption and self.config.ordering in (
                Ordering.SRTF,
                Ordering.LAS,
            )
            # Nothing preempted frees what blocks a job that cannot be taken back: its
            # tenant's guarantee, filled by attempts that cannot be taken back either.
            if verdict.detail not in _NO_SEARCH and (baseline or self._may_preempt_own(job, t)):
                search = self._search(job, ti)
                search.own = self._may_preempt_own(job, t)
                search.baseline = self.config.ordering if baseline else None
                search.need_quota = quota.quota_need(book, t, n, self.config)
                res = self.reservations.get(t)
                restricted, slack = res.limits(job.job_id, self._end(job)) if res else (False, None)
                if n <= ti.max_node_cap and not (
                    restricted and res is not None and not res.allows(n)
                ):
                    where = placement.find(ti, n, self.index.fits_for(job), slack)
                    search.free_node = where[0][0] if where else None
                if self._preempt(job, ti, book, search):
                    return
            assert verdict.code is not None, "a verdict that is not ok names its reason"
            self._wait(job, verdict.code, t, verdict.detail)
            return
        # Jobs alike in what the steps below look at get the same answer while nothing of the
        # type changed: a long queue behind a full cluster is then decided in O(1) per job.
        memo_key: HopelessKey | None = None
        if self.config.ordering not in (Ordering.SRTF, Ordering.LAS):
            res = self.reservations.get(t)
            memo_key = (
                t,
                n,
                job.cpus,
                job.memory_mib,
                job.volumes,
                book.within_guarantee(t, n),
                job.tenant
                if self._may_preempt_own(job, t) or self._may_reclaim(job, ti, book)
                else None,
                job.priority,
                None if res is None else res.job_id,
                t in self.unreservable,
            )
            hit = self._hopeless.get(memo_key)
            if hit is not None and hit[0] == ti.version:
                w = self._wait(job, hit[1], t)
                w.head, w.count = hit[2], hit[3]
                return
        capacity_search = self._capacity_search(job, ti, book)
        if capacity_search is not None:
            if self._claim_stopping(job, ti, book):
                return
            if (
                capacity_search.cross or capacity_search.own or capacity_search.baseline
            ) and self._preempt(job, ti, book, capacity_search):
                return
            if self._may_reclaim(job, ti, book) and self._reclaim(job, ti, book):
                return
        if self.config.backfill and t not in self.reservations and t not in self.unreservable:
            res = self._reserve(job, ti)
            if res is not None:
                self.reservations[t] = res
                self._changes += 1
                w = self._wait(job, self._capacity_code(job, ti), t)
                w.head = job.job_id
                w.start_s = res.start_s
                return
            self.unreservable.add(t)
        res = self.reservations.get(t)
        if (
            res is not None
            and res.job_id != job.job_id
            and n <= ti.total_free
            and placement.find(ti, n, self.index.fits_for(job)) is not None
        ):
            w = self._wait(job, RC.RESERVED, t)
            self._reserved_for(w, ti, res)
        else:
            w = self._wait(job, self._capacity_code(job, ti), t)
            if res is not None and res.job_id != job.job_id:
                self._reserved_for(w, ti, res)
        if memo_key is not None:
            self._hopeless[memo_key] = (ti.version, w.code, w.head, w.count)

    def _reserved_for(self, w: Waiting, ti: TypeIndex, res: Reservation) -> None:
        """Note which of the free GPUs a reservation holds, for the reason."""
        held = ti.free_on(res.node) if res.node is not None else ti.total_free
        held -= min(held, max(res.slack, 0))
        if held:
            w.head = res.job_id
            w.count = held

    def _capacity_code(self, job: Pending, ti: TypeIndex) -> ReasonCode:
        if job.gpus <= ti.max_node_cap and self._free_for(job, ti) >= job.gpus:
            return RC.GANG_FRAGMENTED
        return RC.NO_CAPACITY

    def _free_for(self, job: Pending, ti: TypeIndex) -> int:
        """Free GPUs of the type the job could use: on nodes with all its volumes."""
        has = self._has_volumes(job)
        if has is None:
            return ti.total_free
        return sum(len(free) for node, free in ti.free.items() if has(node))

    # ----- starting ----------------------------------------------------------------------------

    def _end(self, job: Pending) -> float:
        return self.now_s + self.predicted_s[job.job_id]

    def _place(self, job: Pending, ti: TypeIndex, book: Book, borrowed: bool) -> bool:
        n = job.gpus
        if n > ti.total_free:
            return False
        end_s = self._end(job)
        res = self.reservations.get(ti.gpu_type)
        restricted, slack = res.limits(job.job_id, end_s) if res else (False, None)
        if restricted and res is not None and not res.allows(n):
            return False
        where = placement.find(ti, n, self.index.fits_for(job), slack)
        if where is None:
            return False
        if restricted and res is not None:
            res.consume(where)
        placements = placement.commit(self.index, ti, job, where)
        self.starts.append(Start(job_id=job.job_id, placements=placements, borrowed=borrowed))
        self._book(job, ti, book, where, end_s)
        return True

    def _book(
        self, job: Pending, ti: TypeIndex, book: Book, where: list[tuple[int, int]], end_s: float
    ) -> None:
        self._changes += 1
        book.add(
            ti.gpu_type,
            job.gpus,
            fixed=not job.preemptible
            or self.bound.reached(job.tenant, ti.gpu_type, job.gpus, job.preemptions),
        )
        book.running_jobs += 1
        fairness.refresh(book, self.capacity)
        self.occupied.setdefault(ti.gpu_type, []).extend(
            (end_s, node, count) for node, count in where
        )

    def _start_without_gpus(self, job: Pending, book: Book) -> None:
        fits = self.index.fits_for(job)
        for node in self.index.topo.schedulable:
            if fits is None or fits(node, 1):
                self._changes += 1
                self.index.charge(job, [(node, 1)])
                name = self.index.topo.names[node]
                self.starts.append(Start(job.job_id, ((name, ()),), borrowed=False))
                book.running_jobs += 1
                return
        self._wait(job, RC.NO_MATCHING_GPUS, "", "resources")

    def _resources_possible(self, job: Pending, ti: TypeIndex) -> bool:
        """Whether some node of this type is big enough in CPUs and memory, when tracked."""
        if job.gpus > ti.max_node_cap:
            return True
        if not (job.cpus and self.index.track_cpus) and not (
            job.memory_mib and self.index.track_mem
        ):
            return True
        most = self._max_resources.get(ti.gpu_type)
        if most is None:
            most = self._max_resources[ti.gpu_type] = self.index.max_node_resources(ti.gpu_type)
        cpus, mem = most
        return not (self.index.track_cpus and job.cpus > cpus) and not (
            self.index.track_mem and job.memory_mib > mem
        )

    def _has_volumes(self, job: Pending) -> Callable[[int], bool] | None:
        """Whether a node has every volume of the job; None when the job mounts none."""
        if not job.volumes:
            return None
        need = frozenset(job.volumes)
        have = self.index.topo.volumes
        return lambda node: need <= have[node]

    def _volumes_possible(self, job: Pending, ti: TypeIndex) -> bool:
        """Whether nodes of this type that have every volume of the job could ever hold it."""
        most, total = self._volume_cap(ti, job.volumes)
        return most >= job.gpus if job.gpus <= ti.max_node_cap else total >= job.gpus

    def _volume_cap(self, ti: TypeIndex, volumes: tuple[str, ...]) -> tuple[int, int]:
        """(most GPUs on one node, GPUs in all) of this type on nodes with all these volumes."""
        key = (ti.gpu_type, volumes)
        caps = self._volume_caps.get(key)
        if caps is None:
            need = frozenset(volumes)
            have = self.index.topo.volumes
            sizes = [cap for node, cap in ti.node_cap.items() if need <= have[node]]
            caps = self._volume_caps[key] = (max(sizes, default=0), sum(sizes))
        return caps

    # ----- preemption --------------------------------------------------------------------------

    def _search(self, job: Pending, ti: TypeIndex) -> Search:
        return Search(
            job.tenant,
            ti.gpu_type,
            job.gpus,
            job.priority,
            self.predicted_s[job.job_id],
            las_queue(job.attained_service_s),
        )

    def _may_preempt_own(self, job: Pending, gpu_type: str) -> bool:
        if not self._own_rule:
            return False
        lowest = self.books[job.tenant].lowest_preemptible.get(gpu_type)
        return lowest is not None and lowest < job.priority

    def _capacity_search(self, job: Pending, ti: TypeIndex, book: Book) -> Search | None:
        """The preemption rules open to a job that fits its quota but not the free GPUs."""
        if not self.config.preemption:
            return None
        t = ti.gpu_type
        within = book.within_guarantee(t, job.gpus)
        own = self._may_preempt_own(job, t)
        baseline = self.config.ordering in (Ordering.SRTF, Ordering.LAS)
        if not (within or own or baseline):
            return None
        # Entitled to GPUs being freed either way; worth a search only where victims exist.
        search = self._search(job, ti)
        # Borrowed work of others is searched only where it could make room on its own: a job
        # larger than any node's potential skips that walk (and so forgoes the rare mix of
        # borrowed and own lower-priority victims on one node).
        search.cross = (
            within
            and job.gpus < self.search_failed_at.get(t, job.gpus + 1)
            and self.victims.has_cross(t)
            and (job.gpus > ti.max_node_cap or self.victims.most(ti) >= job.gpus)
        )
        search.own = own
        search.baseline = self.config.ordering if baseline else None
        return search

    def _protected(self, job: Pending, ti: TypeIndex) -> set[int] | None:
        """Nodes a job may not set GPUs aside on, or None if it may set none aside at all."""
        res = self.reservations.get(ti.gpu_type)
        if res is None or res.job_id == job.job_id:
            return set()
        if res.node is not None:
            return {res.node}
        return set() if res.allows(job.gpus) else None

    def _claim_stopping(self, job: Pending, ti: TypeIndex, book: Book) -> bool:
        """Set aside GPUs that attempts told to stop are about to free, if they are enough."""
        if not ti.soon_total:
            return False
        n = job.gpus
        protected = self._protected(job, ti)
        if protected is None:
            return False
        if n <= ti.max_node_cap:
            node = ti.soon_best_fit(n, protected, self.index.fits_for(job))
            if node is None:
                return False
            where = self._set_aside(job, ti, book, node)
        else:
            has = self._has_volumes(job)
            if has is None:
                if ti.total_free + ti.soon_total < n:
                    return False
            elif sum(ti.free_on(i) + ti.soon.get(i, 0) for i in ti.node_cap if has(i)) < n:
                return False
            where = self._set_aside(job, ti, book, None)
        w = self._wait(job, RC.WAITING_FOR_PREEMPTION, ti.gpu_type, "stopping")
        w.start_s = self._free_by(ti.gpu_type, where)
        return True

    def _preempt(self, job: Pending, ti: TypeIndex, book: Book, search: Search) -> bool:
        t = ti.gpu_type
        n = job.gpus
        only_cross = search.cross and not search.own and search.baseline is None
        protected = self._protected(job, ti)
        if protected is None:
            return False
        found: tuple[list[tuple[Candidate, str]], int | None] | None = None
        victims = self.victims
        srtf = search.baseline is Ordering.SRTF
        p = search.predicted_s
        key = self._failed_key(job, ti, search, protected, victims)
        for low, high, own_low, own_high, defer_until_s in self._failed.get(key, ()):
            if low <= p < high and own_low <= p < own_high:
                search.defer_until_s = defer_until_s
                break
        else:
            found = find_victims(
                search,
                victims,
                ti,
                self.books,
                self.preempted,
                self.index.fits_for(job),
                protected,
                self._has_volumes(job),
            )
            if found is None or not found[0]:
                # Kept by where the lists' skipped prefixes stand after it: the same search
                # starts there next time and, nothing else changed, skips no further.
                key = self._failed_key(job, ti, search, protected, victims)
                spans = srtf_span(search, victims, ti) if srtf else _ANY_DURATION
                self._failed.setdefault(key, []).append((*spans, search.defer_until_s))
        if found is None and search.defer_until_s is not None:
            # Nothing is set aside: the GPUs stay busy with useful work until then.
            w = self._wait(job, RC.WAITING_FOR_PREEMPTION, t, "checkpoint")
            w.start_s = search.defer_until_s
            return True
        if found is None or not found[0]:
            # What a job restricted to nodes with its volumes did not find, a larger job that
            # may go anywhere still might.
            if only_cross and not job.volumes:
                self.search_failed_at[t] = min(self.search_failed_at.get(t, n), n)
            return False
        pairs, target = found
        if target is None and n <= ti.max_node_cap:
            target = search.free_node
        self._take(job, ti, book, pairs, target)
        return True

    def _take(
        self,
        job: Pending,
        ti: TypeIndex,
        book: Book,
        pairs: list[tuple[Candidate, str]],
        target: int | None,
    ) -> None:
        """Preempt the victims found for a job and set GPUs aside for it on `target` (None: a
        gang over several nodes); it waits for them to stop."""
        for c, rule in pairs:
            self._evict(c.run, c.size, reason_for(rule, job.job_id), job.job_id)
            self.victims.evicted(c)
        where = self._set_aside(job, ti, book, target)
        w = self._wait(job, RC.WAITING_FOR_PREEMPTION, ti.gpu_type, "victims")
        w.count = len(pairs)
        w.start_s = self._free_by(ti.gpu_type, where)

    def _may_reclaim(self, job: Pending, ti: TypeIndex, book: Book) -> bool:
        """Whether a job blocked on capacity may have a node reclaimed from other tenants'
        surplus (preemption.reclaim_node): within its guarantee, several GPUs on one node.

        One GPU needs no node of its own: any node where a borrowed attempt runs has room for
        it once that attempt has run its minimum, so the borrowed work alone serves it. The
        SRTF and LAS baselines keep the victims of the published policies they reproduce.
        """
        return (
            self._reclaim_rule
            and 1 < job.gpus <= ti.max_node_cap
            and book.within_guarantee(ti.gpu_type, job.gpus)
        )

    def _reclaim(self, job: Pending, ti: TypeIndex, book: Book) -> bool:
        """Preempt other tenants' surplus on one node for a job within its guarantee that the
        borrowed attempts alone cannot make room for (preemption.reclaim_node)."""
        protected = self._protected(job, ti)
        if protected is None:
            return False
        key = (
            self._changes,
            ti.version,
            ti.gpu_type,
            job.tenant,
            job.gpus,
            job.cpus,
            job.memory_mib,
            job.volumes,
            tuple(sorted(protected)),
        )
        if key in self._reclaim_failed:
            return False
        found = reclaim_node(
            self._search(job, ti),
            self.victims,
            ti,
            self.books,
            self.preempted,
            self.index.fits_for(job),
            protected,
            self._has_volumes(job),
        )
        if found is None:
            self._reclaim_failed.add(key)
            return False
        pairs, node = found
        self._take(job, ti, book, pairs, node)
        return True

    def _failed_key(
        self, job: Pending, ti: TypeIndex, s: Search, protected: set[int], victims: Victims
    ) -> tuple[object, ...]:
        """Everything find_victims reads for this job, besides the state that _changes and the
        type's version stand for: the search, what decides the job's node checks (CPUs,
        memory, volumes), the nodes it may not use, and where the lists' skipped prefixes
        (Victims.start) begin."""
        t = ti.gpu_type
        start = victims.start
        return (
            self._changes,
            ti.version,
            t,
            s.tenant,
            s.gpus,
            # read only by the rule that compares it (preemption._qualifies)
            s.priority if s.own else None,
            s.queue if s.baseline not in (None, Ordering.SRTF) else None,
            s.cross,
            s.own,
            s.baseline,
            s.need_quota,
            s.free_node,
            job.cpus,
            job.memory_mib,
            job.volumes,
            tuple(sorted(protected)),
            start.get(("cross", t)),
            start.get(("baseline", t)),
        )

    def _evict(self, r: Running, size: int, reason: str, for_job_id: int | None) -> None:
        self._changes += 1
        self.preempted.add(r.attempt_id)
        self._evicted.append(r)
        self.preemptions.append(
            Preemption(
                attempt_id=r.attempt_id, job_id=r.job_id, reason=reason, for_job_id=for_job_id
            )
        )
        self.index.add_soon(r)
        if self._soon_until is not None:
            self._note_soon(self._soon_until, r, self.now_s + r.grace_s)
        victim = self.books[r.tenant]
        victim.add(r.gpu_type, -size, total=False)
        fairness.refresh(victim, self.capacity)

    def _soon_until_by_node(self) -> dict[tuple[str, int], float]:
        """(type, node) -> when the last soon-free GPU there is free, at the end of its notice.

        An attempt told to stop holds its GPUs until it leaves, at the latest when its grace
        ends (stop_by_s); one preempted in this cycle, for its whole grace from now.
        """
        if self._soon_until is None:
            until: dict[tuple[str, int], float] = {}
            now_s = self.now_s
            # The latest end per node: the order the attempts are met in does not matter, so
            # the ones told to stop come from the totals (a few) instead of every running one.
            if self._totals is not None:
                for r in self._totals.stopping.values():
                    by_s = r.stop_by_s if r.stop_by_s is not None else now_s + r.grace_s
                    self._note_soon(until, r, by_s)
                for r in self._evicted:
                    self._note_soon(until, r, now_s + r.grace_s)
            else:
                for r in self.snapshot.running:
                    if r.stopping:
                        by_s = r.stop_by_s if r.stop_by_s is not None else now_s + r.grace_s
                        self._note_soon(until, r, by_s)
                    elif r.attempt_id in self.preempted:
                        self._note_soon(until, r, now_s + r.grace_s)
            self._soon_until = until
        return self._soon_until

    def _note_soon(self, until: dict[tuple[str, int], float], r: Running, by_s: float) -> None:
        by_s = max(by_s, self.now_s)
        for node in self.index.nodes_of(r):
            key = (r.gpu_type, node)
            if by_s > until.get(key, -1.0):
                until[key] = by_s

    def _free_by(self, gpu_type: str, where: list[tuple[int, int]]) -> float:
        """When GPUs set aside on these nodes are all free: the latest notice ending there."""
        until = self._soon_until_by_node()
        return max(
            (until.get((gpu_type, node), self.now_s) for node, _ in where), default=self.now_s
        )

    def _set_aside(
        self, job: Pending, ti: TypeIndex, book: Book, node: int | None
    ) -> list[tuple[int, int]]:
        """Hold GPUs for a job that starts once attempts have stopped: soon-free ones first.

        Returns where, as (node ordinal, GPUs) pairs.
        """
        n = job.gpus
        where: list[tuple[int, int]] = []
        if node is not None:
            soon = min(ti.soon.get(node, 0), n)
            if soon:
                ti.claim_soon(node, soon)
            if n - soon:
                ti.take(node, n - soon)
            where.append((node, n))
        else:
            need = n
            has = self._has_volumes(job)
            vol_fits: Fits | None = None if has is None else (lambda node, count: has(node))
            for node in sorted(ti.soon):
                if has is not None and not has(node):
                    continue
                take = min(ti.soon[node], need)
                ti.claim_soon(node, take)
                where.append((node, take))
                need -= take
                if not need:
                    break
            if need:
                res = self.reservations.get(ti.gpu_type)
                _, slack = res.limits(job.job_id, self._end(job)) if res else (False, None)
                rest = (
                    placement.find(ti, need, vol_fits, slack)
                    or placement.multi_node(ti, need, vol_fits, slack)
                    or placement.multi_node(ti, need, vol_fits)
                )
                for node, count in rest or ():
                    ti.take(node, count)
                    where.append((node, count))
        res = self.reservations.get(ti.gpu_type)
        if res is not None and res.node is None and res.job_id != job.job_id:
            res.consume(where)
        self._book(job, ti, book, where, self._end(job))
        return where

    # ----- reservations ------------------------------------------------------------------------

    def _reserve(self, job: Pending, ti: TypeIndex) -> Reservation | None:
        has = self._has_volumes(job)
        node_ok: Callable[[int], bool] | None = has
        if self._needs_resources(job):
            cpus, mem = self.index.topo.node_cpus, self.index.topo.node_mem

            def roomy(node: int) -> bool:
                return (
                    (has is None or has(node))
                    and (not cpus[node] or cpus[node] >= job.cpus)
                    and (not mem[node] or mem[node] >= job.memory_mib)
                )

            node_ok = roomy

        return backfill.reserve(
            job.job_id,
            job.gpus,
            ti,
            self.now_s,
            self._releases(),
            self._released_besides(ti),
            self.preempted,
            node_ok,
        )

    def _needs_resources(self, job: Pending) -> bool:
        return bool(
            (job.cpus and self.index.track_cpus) or (job.memory_mib and self.index.track_mem)
        )

    def _releases(self) -> backfill.ReleaseIndex:
        """When the running attempts that are not stopping will free their GPUs."""
        if self._release_index is None:
            self._release_index = backfill.ReleaseIndex(
                self.index.topo, self.config.default_duration_s
            ).add_all(self.snapshot.running)
        return self._release_index

    def _released_besides(self, ti: TypeIndex) -> list[Release]:
        """GPUs of a type that free up besides the running attempts' ends: stopping ones (and
        those preempted in this cycle) when their notice ends, this cycle's starts and GPUs
        set aside when they are predicted to end."""
        t = ti.gpu_type
        now_s = self.now_s
        out: list[Release] = []
        if ti.soon:
            until = self._soon_until_by_node()
            out = [(until.get((t, node), now_s), node, count) for node, count in ti.soon.items()]
        out.extend(self.occupied.get(t, ()))
        return out

    # ----- waiting -----------------------------------------------------------------------------

    def _wait(
        self, job: Pending, code: ReasonCode, gpu_type: str = "", detail: str = ""
    ) -> Waiting:
        book = self.books[job.tenant]
        w = Waiting(job, code, gpu_type, detail)
        w.quota_type, w.used, w.guaranteed, w.limit = book.figures(
            gpu_type or job.gpu_type, job.gpus
        )
        if detail in ("not_preemptible", "preemption_cap"):
            # What blocks it is a guarantee held by work that cannot be taken back: the one
            # quota.check found full (the type's own, or the one over every type).
            g, fixed = book.guaranteed, book.fixed
            for key in (gpu_type or job.gpu_type, ANY_GPU_TYPE):
                if key in g and fixed.get(key, 0) + job.gpus > g[key]:
                    w.quota_type, w.used, w.guaranteed = key, fixed.get(key, 0), g[key]
                    break
        ti = self.index.types.get(gpu_type)
        if ti is not None:
            w.free = self._free_for(job, ti)
        self.waiting.append(w)
        return w
