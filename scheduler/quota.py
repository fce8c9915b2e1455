"""Quota accounting: what each tenant uses of its guarantee and of its limit, per GPU type.

A quota of type ANY_GPU_TYPE caps the tenant's GPUs summed over all types; a quota of a named
type caps that type. A tenant with neither for a type may not use that type at all: a missing
quota row means "not granted", as in the control plane's Quota model.

Two usages are kept. `total` counts every attempt that holds GPUs, including those told to stop:
their GPUs are still occupied, so the limit (what a tenant may occupy) is checked against it.
`active` leaves stopping attempts out: they are going away, so whether a tenant is within its
guarantee (and so whether its work may be preempted, and whether a start is borrowed) is judged
on what stays. GPUs claimed this cycle for a job that waits for a preemption count in both.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable
from itertools import accumulate, compress
from operator import is_not, itemgetter

from scheduler.model import ANY_GPU_TYPE, Config, ReasonCode, Running, Snapshot, Tenant

ANY = ANY_GPU_TYPE


class Book:
    """One tenant's quotas and usage during a cycle."""

    __slots__ = (
        "name",
        "weight",
        "guaranteed",
        "limit",
        "active",
        "total",
        "running_jobs",
        "max_running_jobs",
        "hold",
        "no_borrowing",
        "share",
        "version",
        "known",
        "lowest_preemptible",
        "fixed",
    )

    def __init__(self, tenant: Tenant, known: bool = True):
        self.name = tenant.name
        self.known = known  # False: named by a job or attempt but not among snapshot.tenants
        # type -> lowest priority among attempts that may be preempted now (own-tenant rule)
        self.lowest_preemptible: dict[str, int] = {}
        self.weight = tenant.weight if tenant.weight > 0 else 1.0
        self.guaranteed: dict[str, int] = {}
        self.limit: dict[str, int] = {}
        for q in tenant.quotas:
            self.guaranteed[q.gpu_type] = q.guaranteed_gpus
            self.limit[q.gpu_type] = max(q.limit_gpus, q.guaranteed_gpus)
        self.active: dict[str, int] = {}
        self.total: dict[str, int] = {}
        # GPUs of its attempts that cannot be taken back (not preemptible, or at the preemption
        # bound), not stopping: they fill its guarantee first (label_borrowed)
        self.fixed: dict[str, int] = {}
        self.running_jobs = 0
        self.max_running_jobs = tenant.max_running_jobs
        self.hold = tenant.budget_action == "hold"
        self.no_borrowing = tenant.budget_action == "no_borrowing"
        self.share = 0.0  # weighted dominant share, kept by scheduler.fairness
        self.version = 0  # bumped whenever share changes, so stale queue entries are noticed

    def has_quota(self, gpu_type: str) -> bool:
        """Whether any quota (of the type or ANY) lets the tenant use this type at all."""
        return gpu_type in self.limit or ANY in self.limit

    def add(
        self, gpu_type: str, n: int, *, active: bool = True, total: bool = True, fixed: bool = False
    ) -> None:
        """Count n GPUs of a type (and of the ANY sum) as used; `fixed`: by an attempt that
        cannot be taken back."""
        if fixed:
            f = self.fixed
            f[gpu_type] = f.get(gpu_type, 0) + n
            if gpu_type != ANY:
                f[ANY] = f.get(ANY, 0) + n
        if active:
            a = self.active
            a[gpu_type] = a.get(gpu_type, 0) + n
            if gpu_type != ANY:
                a[ANY] = a.get(ANY, 0) + n
        if total:
            t = self.total
            t[gpu_type] = t.get(gpu_type, 0) + n
            if gpu_type != ANY:
                t[ANY] = t.get(ANY, 0) + n

    def within_guarantee(self, gpu_type: str, n: int) -> bool:
        """Whether n more GPUs of this type stay inside every guarantee that covers the type."""
        g = self.guaranteed
        has = False
        if gpu_type in g:
            has = True
            if self.active.get(gpu_type, 0) + n > g[gpu_type]:
                return False
        if ANY in g:
            has = True
            if self.active.get(ANY, 0) + n > g[ANY]:
                return False
        return has

    def over_guarantee(self, gpu_type: str, less: int = 0) -> bool:
        """Whether the tenant, less `less` GPUs of this type, still uses more than a guarantee."""
        g = self.guaranteed
        if gpu_type in g and self.active.get(gpu_type, 0) - less > g[gpu_type]:
            return True
        if ANY in g and self.active.get(ANY, 0) - less > g[ANY]:
            return True
        return not (gpu_type in g or ANY in g) and self.active.get(gpu_type, 0) - less > 0

    def excess(self, gpu_type: str) -> int:
        """GPUs of this type the tenant could give up and still hold every guarantee that
        covers the type (all it uses of the type when none covers it)."""
        g, active = self.guaranteed, self.active
        spare = [active.get(key, 0) - g[key] for key in (gpu_type, ANY) if key in g]
        if not spare:
            return active.get(gpu_type, 0)
        return max(min(spare), 0)

    def figures(self, gpu_type: str, n: int = 0) -> tuple[str, int, int, int]:
        """(quota type, used, guaranteed, limit) of the quota that binds n more GPUs of a type.

        Of a type's own quota and the ANY one, the one with less room left binds.
        """
        limit, total = self.limit, self.total
        key = ANY
        if gpu_type and gpu_type in limit:
            key = gpu_type
            if ANY in limit and limit[ANY] - total.get(ANY, 0) < limit[key] - total.get(key, 0):
                key = ANY
        elif ANY not in limit:
            return gpu_type, total.get(gpu_type, 0), 0, 0
        return key, total.get(key, 0), self.guaranteed.get(key, 0), limit[key]


class Verdict:
    """The outcome of a quota check (a few shared instances: checks run once per job)."""

    __slots__ = ("ok", "wait", "code", "borrowed", "detail")

    def __init__(
        self, ok: bool, wait: bool, code: ReasonCode | None, borrowed: bool, detail: str = ""
    ):
        self.ok = ok
        self.wait = wait  # blocked only by the tenant's own stopping attempts: they free it soon
        self.code = code
        self.borrowed = borrowed
        self.detail = detail


_WITHIN = Verdict(True, False, None, False)
_BORROWED = Verdict(True, False, None, True)
_OWN_STOPPING = Verdict(False, True, ReasonCode.WAITING_FOR_PREEMPTION, False, "own_stopping")
_NO_QUOTA = Verdict(False, False, ReasonCode.QUOTA_LIMIT, False, "no_quota")
_AT_LIMIT = Verdict(False, False, ReasonCode.QUOTA_LIMIT, False)
_STATIC = Verdict(False, False, ReasonCode.STATIC_PARTITION, False)
_BUDGET = Verdict(False, False, ReasonCode.BUDGET_NO_BORROWING, False)
_NOT_PREEMPTIBLE = Verdict(False, False, ReasonCode.QUOTA_LIMIT, False, "not_preemptible")
_PREEMPTION_CAP = Verdict(False, False, ReasonCode.QUOTA_LIMIT, False, "preemption_cap")


class PreemptionBound:
    """Config.max_preemptions as it applies to each job.

    A job preempted that many times is not preempted again, and may then start only within its
    tenant's guarantee, as a job that cannot be preempted (check, label_borrowed): GPUs it
    borrowed could not be given back. That holds a promise only where the guarantee can hold
    the job. A job larger than its tenant's guarantee for its type (every job of a tenant with
    none, which only ever borrows) could never start within it, and the bound would make it
    wait for ever; such a job stays within the rules' reach, preempted whenever they say so,
    and its restarts are counted as any other's.
    """

    __slots__ = ("max_preemptions", "_guaranteed", "key")

    def __init__(self, max_preemptions: int | None = None, tenants: Iterable[Tenant] = ()) -> None:
        self.max_preemptions = max_preemptions
        guaranteed: dict[str, dict[str, int]] = {}
        if max_preemptions is not None:
            for t in tenants:
                guaranteed[t.name] = {q.gpu_type: q.guaranteed_gpus for q in t.quotas}
        self._guaranteed = guaranteed
        # Equal keys, equal bounds: what a memo compares to keep what it summed under one.
        self.key: tuple[object, ...] = (
            max_preemptions,
            tuple(sorted((name, tuple(sorted(g.items()))) for name, g in guaranteed.items())),
        )

    def reached(self, tenant: str, gpu_type: str, gpus: int, preemptions: int) -> bool:
        """Whether a job of `tenant` on `gpus` GPUs of `gpu_type` (ANY: not yet placed),
        preempted `preemptions` times already, is at the bound: not preempted again, and
        borrowing nothing."""
        bound = self.max_preemptions
        if bound is None or preemptions < bound:
            return False
        return self.holds(tenant, gpu_type, gpus)

    def takeable(self, r: Running) -> bool:
        """Whether a running attempt can be taken back from its tenant (preempted): not when it
        cannot be preempted, nor at the bound. Work that cannot fills its tenant's guarantee
        first (label_borrowed) and counts against it alone (Book.fixed, check)."""
        return r.preemptible and not self.reached(r.tenant, r.gpu_type, len(r.gpus), r.preemptions)

    def holds(self, tenant: str, gpu_type: str, gpus: int) -> bool:
        """Whether the tenant's guarantees can hold `gpus` GPUs of `gpu_type` at once (every
        guarantee that covers the type: its own and ANY's)."""
        g = self._guaranteed.get(tenant)
        if not g:
            return False
        whole = g.get(ANY)
        if whole is not None and whole < gpus:
            return False
        if gpu_type:
            typed = g.get(gpu_type)
            return whole is not None if typed is None else typed >= gpus
        return any(n >= gpus for n in g.values())


class RunningTotals:
    """What a snapshot's running attempts add up to, kept up to date from one call to the next.

    A scheduling loop hands plan() a running tuple that differs from the last one in a few
    attempts (the trace simulator: one start or one completion, among thousands running), so a
    memo (scheduler.memo) keeps these sums and applies only the attempts that came and went,
    told apart by identity (the objects are immutable; the totals hold the last ones, so an id
    is never reused while it is counted). A caller that builds every object anew (the control
    plane) pays one pass over them, as before.
    """

    __slots__ = (
        "_seen",
        "_last",
        "held",
        "gpus",
        "jobs",
        "started",
        "by_tenant",
        "kinds",
        "added",
        "removed",
        "replaced",
        "epoch",
        "versions",
        "_stamp",
        "borrowed_by_tenant",
        "stopping",
        "bound",
        "fixed",
    )

    def __init__(self, bound: PreemptionBound | None = None) -> None:
        # An attempt at the preemption bound cannot be taken back (PreemptionBound.takeable).
        self.bound = bound if bound is not None else PreemptionBound()
        self._seen: dict[int, Running] = {}
        self._last: tuple[Running, ...] | None = None  # the tuple of the last update
        # What the last update changed, for other indexes kept beside these sums (the memo's
        # ReleaseIndex): the attempts that came and went, and a count of updates, bumped by
        # every one, so an index that missed one (or a reset) knows to start afresh.
        self.added: list[Running] = []
        self.removed: list[Running] = []
        # Attempts remade with only fields the sums do not read changed, (old, new): the same
        # attempt here, a new object for an index that keeps the objects (VictimPool).
        self.replaced: list[tuple[Running, Running]] = []
        self.epoch = 0
        # tenant -> a stamp, new whenever its attempts not stopping change (never reused), and
        # what _label_sorted found for it: (stamp, guarantees, borrowed attempt ids)
        self.versions: dict[str, int] = {}
        self._stamp = 0
        self.borrowed_by_tenant: dict[
            str, tuple[int, tuple[tuple[str, int], ...], frozenset[int]]
        ] = {}
        self.held: set[str] = set()  # GPU uuids held by any attempt
        self.gpus: dict[tuple[str, str, bool], int] = {}  # (tenant, type, stopping) -> GPUs
        self.jobs: dict[str, int] = {}  # tenant -> attempts not stopping
        # (tenant, type, priority) -> start times, sorted, of preemptible attempts not stopping
        self.started: dict[tuple[str, str, int], list[float]] = {}
        # tenant -> its attempts not stopping, in the order they fill its guarantee (see
        # label_borrowed): (takeable, start, attempt id, type, GPUs), sorted
        self.by_tenant: dict[str, list[tuple[bool, float, int, str, int]]] = {}
        self.kinds: dict[tuple[str, str], int] = {}  # (tenant, type) -> attempts not stopping
        # (tenant, type) -> GPUs of attempts not stopping that cannot be taken back (Book.fixed)
        self.fixed: dict[tuple[str, str], int] = {}
        # id -> the attempts told to stop: a plan that preempts reads when each frees its GPUs
        # (admit's _soon_until_by_node), a few among thousands running
        self.stopping: dict[int, Running] = {}

    def _reset(self) -> None:
        self._seen, self.held, self.gpus, self.jobs, self.started = {}, set(), {}, {}, {}
        self.by_tenant, self.kinds, self.fixed = {}, {}, {}
        self.versions, self.borrowed_by_tenant = {}, {}
        self.stopping = {}

    def update(self, running: tuple[Running, ...]) -> RunningTotals:
        self.epoch += 1
        if running is self._last:
            # The very same tuple (a caller that keeps it while nothing ran or ended).
            self.added, self.removed, self.replaced = [], [], []
            return self
        last = self._last
        self._last = running
        seen = self._seen
        removed: list[Running] = []
        # The last tuple's attempts are the keys of `seen` when none was in it twice.
        changes = None if last is None or len(seen) != len(last) else _changes(last, running, seen)
        if changes is not None:
            gone = {id(r) for r in changes[0]}
            now = {id(r): r for r in changes[1]}
            new = set(now)
        else:
            now = dict(zip(map(id, running), running, strict=True))
            if len(seen) > 2 * len(now) + 64:
                # Most of it went: counting afresh is cheaper than taking each away.
                removed = list(seen.values())
                self._reset()
                seen = self._seen
            gone = seen.keys() - now.keys()
            new = now.keys() - seen.keys()
        replaced: list[tuple[Running, Running]] = []
        if gone and new:
            # An attempt remade with only what the sums do not look at changed (under LAS the
            # simulator remakes every attempt with its attained service) counts as the same.
            same: dict[tuple[object, ...], int] = {_counted(seen[k]): k for k in gone}
            for key in list(new):
                old = same.pop(_counted(now[key]), None)
                if old is not None:
                    was = seen.pop(old)
                    replaced.append((was, now[key]))
                    seen[key] = now[key]
                    if was.stopping:
                        # its notice (grace_s, stop_by_s) may be what was remade
                        del self.stopping[old]
                        self.stopping[key] = now[key]
                    gone.discard(old)
                    new.discard(key)
        for key in gone:
            r = seen.pop(key)
            removed.append(r)
            self._count(r, -1)
        added: list[Running] = []
        for key in new:
            r = now[key]
            seen[key] = r
            added.append(r)
            self._count(r, 1)
        self.added, self.removed, self.replaced = added, removed, replaced
        return self

    def _count(self, r: Running, sign: int) -> None:
        if sign > 0:
            self.held.update(r.gpus)
        else:
            self.held.difference_update(r.gpus)
        if r.stopping:
            if sign > 0:
                self.stopping[id(r)] = r
            else:
                del self.stopping[id(r)]
        key = (r.tenant, r.gpu_type, r.stopping)
        n = self.gpus.get(key, 0) + sign * len(r.gpus)
        if n:
            self.gpus[key] = n
        else:
            self.gpus.pop(key, None)
        if not r.stopping:
            self._stamp += 1
            self.versions[r.tenant] = self._stamp
            back = self.bound.takeable(r)
            entry = (back, r.started_at_s, r.attempt_id, r.gpu_type, len(r.gpus))
            if not back:
                kind = (r.tenant, r.gpu_type)
                fixed = self.fixed.get(kind, 0) + sign * len(r.gpus)
                if fixed:
                    self.fixed[kind] = fixed
                else:
                    self.fixed.pop(kind, None)
            filling = self.by_tenant.get(r.tenant)
            if sign > 0:
                if filling is None:
                    self.by_tenant[r.tenant] = [entry]
                else:
                    bisect.insort(filling, entry)
            elif filling is not None:
                del filling[bisect.bisect_left(filling, entry)]
                if not filling:
                    del self.by_tenant[r.tenant]
            kind = (r.tenant, r.gpu_type)
            alike = self.kinds.get(kind, 0) + sign
            if alike:
                self.kinds[kind] = alike
            else:
                self.kinds.pop(kind, None)
            count = self.jobs.get(r.tenant, 0) + sign
            if count:
                self.jobs[r.tenant] = count
            else:
                self.jobs.pop(r.tenant, None)
            if back:
                held = (r.tenant, r.gpu_type, r.priority)
                times = self.started.get(held)
                if sign > 0:
                    if times is None:
                        self.started[held] = [r.started_at_s]
                    else:
                        bisect.insort(times, r.started_at_s)
                elif times is not None:
                    del times[bisect.bisect_left(times, r.started_at_s)]
                    if not times:
                        del self.started[held]


# More attempts come or go between two updates than this: compared as sets instead of in step.
_FEW_CHANGES = 64


def _changes(
    last: tuple[Running, ...], running: tuple[Running, ...], seen: dict[int, Running]
) -> tuple[list[Running], list[Running]] | None:
    """The attempts of `last` that `running` no longer holds and those it holds anew (by
    identity), or None when there are more than a few, or `running` holds one twice.

    A caller that keeps its attempts in one order (the simulator: a dict of the running ones,
    new ones appended) hands tuples that agree with the last one in long runs, and those runs
    are skipped at C speed; building a dict of every attempt and comparing key sets was a tenth
    of a plan at saturation. Where the two disagree, the step that lines them up again is
    guessed; a guess cannot make the result wrong, only longer: every attempt put aside from
    `last` is one `running` does not hold, since the same object in `running` would have been
    put aside too, as new, and a new one that `seen` (the last tuple's attempts) holds sends
    the caller to the sets.
    """
    gone: list[Running] = []
    new: list[Running] = []
    n, m = len(last), len(running)
    # One pass over both: the pairs compared are last[k + skip_last] and running[k +
    # skip_running]; where the two are out of step, the element that lines them up again is
    # taken off its iterator (next()), so no run of alike pairs is walked twice.
    last_it, running_it = iter(last), iter(running)
    differ = compress(itertools.count(), map(is_not, last_it, running_it))
    skip_last = skip_running = 0
    for k in differ:
        i, j = k + skip_last, k + skip_running
        if i + 1 < n and last[i + 1] is running[j]:
            gone.append(last[i])
            next(last_it)  # last[i + 1], the same as running[j]
            skip_last += 1
        elif j + 1 < m and running[j + 1] is last[i]:
            new.append(running[j])
            next(running_it)  # running[j + 1], the same as last[i]
            skip_running += 1
        else:
            gone.append(last[i])
            new.append(running[j])
        if len(gone) + len(new) > _FEW_CHANGES:
            return None
    # map() stops at the shorter iterator: every pair up to there was compared.
    pairs = min(n - skip_last, m - skip_running)
    gone.extend(last[pairs + skip_last :])
    new.extend(running[pairs + skip_running :])
    if len(gone) + len(new) > _FEW_CHANGES:
        return None
    ids = {id(r) for r in new}
    if len(ids) != len(new) or any(key in seen for key in ids):
        return None
    return gone, new


def _counted(r: Running) -> tuple[object, ...]:
    """What RunningTotals and the indexes kept beside it (scheduler.memo) read of an attempt."""
    return (
        r.attempt_id,
        r.tenant,
        r.gpu_type,
        r.gpus,
        r.stopping,
        r.preemptible,
        r.priority,
        r.started_at_s,
        r.predicted_end_s,
        r.preemptions,
    )


def build_books(
    snapshot: Snapshot, config: Config, totals: RunningTotals | None = None
) -> dict[str, Book]:
    """A book per tenant named anywhere in the snapshot, with what its attempts use now.

    ``totals``: the snapshot's running attempts summed already (RunningTotals.update).
    """
    books = {t.name: Book(t) for t in snapshot.tenants}
    old_enough_s = snapshot.now_s - config.min_runtime_s
    if totals is None:
        bound = PreemptionBound(config.max_preemptions, snapshot.tenants)
        totals = RunningTotals(bound).update(snapshot.running)
    lowest: dict[tuple[str, str], int] = {}
    for (tenant, gpu_type, priority), times in totals.started.items():
        if times[0] <= old_enough_s:
            held = (tenant, gpu_type)
            if priority < lowest.get(held, priority + 1):
                lowest[held] = priority
    # GPUs are summed per (tenant, type, stopping) first and booked once per group.
    for (tenant, gpu_type, stopping), n in sorted(totals.gpus.items()):
        book = books.get(tenant)
        if book is None:
            book = books[tenant] = Book(Tenant(name=tenant), known=False)
        book.add(gpu_type, n, active=not stopping)
    for (tenant, gpu_type), n in totals.fixed.items():
        books[tenant].add(gpu_type, n, active=False, total=False, fixed=True)
    for tenant, count in totals.jobs.items():
        book = books.get(tenant)
        if book is None:  # its attempts hold no GPU
            book = books[tenant] = Book(Tenant(name=tenant), known=False)
        book.running_jobs += count
    for (tenant, gpu_type), priority in lowest.items():
        books[tenant].lowest_preemptible[gpu_type] = priority
    for p in snapshot.pending:
        if p.tenant not in books:
            books[p.tenant] = Book(Tenant(name=p.tenant), known=False)
    return books


def check(
    book: Book, gpu_type: str, n: int, preemptible: bool, config: Config, capped: bool = False
) -> Verdict:
    """May the tenant start n GPUs of this (named) type now, and would they be borrowed?

    `capped`: the job is at the preemption bound (PreemptionBound.reached), so it is not
    preempted again and borrows nothing, as a job that cannot be preempted."""
    # Those two may use only the tenant's guarantee: borrowed GPUs must be given back when their
    # owner asks. Such an attempt fills the guarantee before the tenant's attempts that can be
    # taken back (label_borrowed), so only its like count against it there, and those others
    # become the borrowed ones; counting them all made it wait for as long as its own tenant
    # borrowed, which in a full cluster is for ever.
    limit = book.limit
    has_type = gpu_type in limit
    has_any = ANY in limit
    if not (has_type or has_any):
        return _NO_QUOTA
    g = book.guaranteed
    active_type = book.active.get(gpu_type, 0) + n
    active_any = book.active.get(ANY, 0) + n
    within = (not has_type or active_type <= g[gpu_type]) and (not has_any or active_any <= g[ANY])
    # What caps the tenant here: its limit, or only its guarantee when it may not borrow.
    if not config.borrowing:
        cap, blocked = g, _STATIC
    elif book.no_borrowing:
        cap, blocked = g, _BUDGET
    else:
        cap, blocked = limit, _AT_LIMIT
        if not preemptible or capped:
            fixed = book.fixed
            if (has_type and fixed.get(gpu_type, 0) + n > g[gpu_type]) or (
                has_any and fixed.get(ANY, 0) + n > g[ANY]
            ):
                return _PREEMPTION_CAP if preemptible else _NOT_PREEMPTIBLE
            within = True
    total = book.total
    if (not has_type or total.get(gpu_type, 0) + n <= cap[gpu_type]) and (
        not has_any or total.get(ANY, 0) + n <= cap[ANY]
    ):
        return _WITHIN if within else _BORROWED
    if (not has_type or active_type <= cap[gpu_type]) and (not has_any or active_any <= cap[ANY]):
        return _OWN_STOPPING
    return blocked


def quota_need(book: Book, gpu_type: str, n: int, config: Config) -> int:
    """GPUs of its own the tenant would have to give back before n more fit its cap."""
    guaranteed_only = not config.borrowing or book.no_borrowing
    cap = book.guaranteed if guaranteed_only else book.limit
    need = 0
    for key in (gpu_type, ANY) if gpu_type != ANY else (ANY,):
        if key in cap:
            need = max(need, book.total.get(key, 0) + n - cap[key])
    return need


def label_borrowed(
    running: tuple[Running, ...],
    books: dict[str, Book],
    summed: RunningTotals | None = None,
    bound: PreemptionBound | None = None,
) -> set[int]:
    """Attempt ids that run beyond their tenant's guarantee.

    Attempts fill the guarantee in the order they started (ones that cannot be taken back
    first: not preemptible, or at the preemption `bound`): those that pushed the tenant past a
    guarantee are the borrowed ones, as the start that created them was marked borrowed,
    unless work that cannot be taken back started later within the guarantee and pushed them
    out of it. ``summed``: `running` summed already (RunningTotals.update, which has its own
    bound), whose attempts are kept in that order per tenant.
    """
    if summed is not None:
        return _label_sorted(summed, books)
    by_tenant: dict[str, list[Running]] = {}
    for r in running:
        if not r.stopping:
            by_tenant.setdefault(r.tenant, []).append(r)
    borrowed: set[int] = set()
    takeable = (bound if bound is not None else PreemptionBound()).takeable
    for tenant, attempts in by_tenant.items():
        g = books[tenant].guaranteed
        # Usage only grows as attempts are counted in: a tenant whose whole usage fits every
        # guarantee covering its types borrows nothing (always so on static partitions).
        totals: dict[str, int] = {}
        for r in attempts:
            totals[r.gpu_type] = totals.get(r.gpu_type, 0) + len(r.gpus)
        if _fits(g, totals):
            continue
        attempts.sort(
            key=lambda r: (
                takeable(r),
                r.started_at_s,
                r.attempt_id,
            )
        )
        borrowed |= _beyond(g, ((r.attempt_id, r.gpu_type, len(r.gpus)) for r in attempts))
    return borrowed


def _fits(g: dict[str, int], held: dict[str, int]) -> bool:
    """Whether a tenant holding `held` GPUs per type is within every guarantee covering them
    (then none of its attempts is borrowed)."""
    return (
        all(t in g or ANY in g for t in held)
        and all(n <= g[t] for t, n in held.items() if t in g)
        and (ANY not in g or sum(held.values()) <= g[ANY])
    )


def _beyond(g: dict[str, int], attempts: Iterable[tuple[int, str, int]]) -> set[int]:
    """The ids of (attempt id, GPU type, GPUs), counted in the order given, that pushed their
    tenant past a guarantee (or that no guarantee covers)."""
    found: set[int] = set()
    used: dict[str, int] = {}
    for attempt_id, t, n in attempts:
        used[t] = used.get(t, 0) + n
        used[ANY] = used.get(ANY, 0) + n if t != ANY else used[t]
        over = not (t in g or ANY in g)
        if t in g and used[t] > g[t]:
            over = True
        if ANY in g and used[ANY] > g[ANY]:
            over = True
        if over:
            found.add(attempt_id)
    return found


def _beyond_one(
    guaranteed: int, attempts: list[tuple[bool, float, int, str, int]]
) -> frozenset[int]:
    """_beyond for a tenant whose one guarantee covers every type (the shared pool's quotas):
    an attempt is past it once the GPUs counted so far, its own included, exceed it, and the
    count only grows, so the borrowed ones are the tail from the first such attempt. Found by
    a bisect over the running sums, since a tenant at saturation holds thousands of attempts
    and is labelled again whenever one of them starts or ends."""
    sums = list(accumulate(map(itemgetter(4), attempts)))
    first = bisect.bisect_right(sums, guaranteed)
    return frozenset(map(itemgetter(2), attempts[first:]))


def _label_sorted(totals: RunningTotals, books: dict[str, Book]) -> set[int]:
    """label_borrowed over the attempts RunningTotals keeps sorted per tenant.

    A tenant's labels depend only on its own attempts and guarantees: they are kept with the
    totals (borrowed_by_tenant) and worked out again only for a tenant whose attempts or
    guarantees changed since.
    """
    borrowed: set[int] = set()
    usage: dict[str, dict[str, int]] | None = None
    gpus = totals.gpus
    kept = totals.borrowed_by_tenant
    versions = totals.versions
    for tenant, attempts in totals.by_tenant.items():
        g = books[tenant].guaranteed
        version = versions[tenant]
        guarantees = tuple(g.items())
        known = kept.get(tenant)
        if known is not None and known[0] == version and known[1] == guarantees:
            borrowed |= known[2]
            continue
        if usage is None:
            usage = {}
            for name, gpu_type in totals.kinds:
                usage.setdefault(name, {})[gpu_type] = gpus.get((name, gpu_type, False), 0)
        held = usage.get(tenant, {})
        if _fits(g, held):
            frozen: frozenset[int] = frozenset()
        elif len(g) == 1 and ANY in g:
            frozen = _beyond_one(g[ANY], attempts)
        else:
            frozen = frozenset(_beyond(g, ((aid, t, n) for _, _, aid, t, n in attempts)))
        kept[tenant] = (version, guarantees, frozen)
        borrowed |= frozen
    return borrowed
