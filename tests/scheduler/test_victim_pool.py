"""Preemption candidates kept across instants (scheduler.preemption.VictimPool) give the lists,
and so the plans, that candidates built afresh at each instant give."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.memo import PlanMemo
from scheduler.model import Config, Ordering, Running, Snapshot, VictimOrder
from scheduler.placement import ClusterIndex, Topology
from scheduler.policy import plan
from scheduler.preemption import Candidate, PoolEntry, VictimPool, Victims, _settle
from scheduler.quota import RunningTotals, build_books, label_borrowed
from tests.scheduler.test_plan_properties import NOW, configs, snapshots

SPLITS = st.lists(st.integers(0, 2), min_size=0, max_size=40)
# Steps of time between two plans: 0 (a plan again at the same instant) or more.
STEPS = st.lists(st.sampled_from([0.0, 0.0, 1.0, 30.0, 61.0, 7_200.0]), min_size=5, max_size=5)


def _regular(running: tuple[Running, ...]) -> tuple[Running, ...]:
    """The attempts as the simulator on the shared pool states them: no remaining time of
    their own, no checkpoint interval (a pool holding either is not used)."""
    return tuple(replace(r, remaining_s=None, checkpoint_interval_s=None) for r in running)


def _as_of_start(running: tuple[Running, ...], lazily: bool) -> tuple[Running, ...]:
    """With `lazily`, the attempts as the simulator states them under LAS on the shared pool:
    attained service as of their start, the plan adds the rest (Running.attained_as_of_s)."""
    if not lazily:
        return running
    return tuple(replace(r, attained_as_of_s=r.started_at_s) for r in running)


def _parts(running: tuple[Running, ...], splits: list[int]) -> list[tuple[Running, ...]]:
    first = tuple(r for r, k in zip(running, splits, strict=False) if k != 1)
    second = tuple(r for r, k in zip(running, splits, strict=False) if k != 0)
    return [first, second, running, first, running]


def _seen(c: Candidate) -> tuple[object, ...]:
    return (c.run.attempt_id, c.remaining_s, c.lost_s, c.attained_s, c.queue, c.nodes)


def _lists(v: Victims, snap: Snapshot, config: Config) -> dict[str, list[tuple[object, ...]]]:
    out: dict[str, list[tuple[object, ...]]] = {}
    types = sorted({r.gpu_type for r in snap.running})
    tenants = sorted({r.tenant for r in snap.running})
    for t in types:
        # Counted first, as a search under SRTF or LAS does, then listed.
        out[f"counts {t}"] = [sorted(v.cross_counts(t).items()), v.has_cross(t)]
        out[f"cross {t}"] = [_seen(c) for c in v.cross(t)]
        if config.ordering in (Ordering.SRTF, Ordering.LAS):
            out[f"baseline {t}"] = [_seen(c) for c in v.baseline(t)]
        for tenant in tenants:
            out[f"own {tenant} {t}"] = [_seen(c) for c in v.own(tenant, t)]
            if config.ordering in (Ordering.SRTF, Ordering.LAS):
                found = v.baseline(t, tenant)
                out[f"baseline {tenant} {t}"] = [_seen(c) for c in found]
    return out


@settings(max_examples=300, deadline=None, derandomize=True)
@given(snapshots(), configs, SPLITS, STEPS, st.booleans(), st.booleans())
def test_pooled_victim_lists_are_the_lists_built_afresh(
    snap, config, splits, steps, regular, lazily
):
    config = replace(config, preemption=True)
    running = _as_of_start(_regular(snap.running) if regular else snap.running, lazily)
    topo = Topology(snap.nodes)
    totals = RunningTotals()
    pool = VictimPool(config, topo)
    now_s = NOW
    for part, step in zip(_parts(running, splits), steps, strict=True):
        now_s += step
        s = replace(snap, running=part, now_s=now_s)
        totals.update(part)
        pool.follow(totals)
        books = build_books(s, config, totals)
        borrowed = label_borrowed(part, books)
        index = ClusterIndex(s.nodes, part, topo)
        pooled = Victims(part, index, lambda b=borrowed: b, config, now_s, None, pool, totals)
        fresh = Victims(part, index, lambda b=borrowed: b, config, now_s)
        assert _lists(pooled, s, config) == _lists(fresh, s, config)


@settings(max_examples=120, deadline=None, derandomize=True)
@given(snapshots(), configs, SPLITS, STEPS, st.booleans(), st.booleans())
def test_a_memo_kept_over_instants_plans_as_a_fresh_one(
    snap, config, splits, steps, regular, lazily
):
    # The simulator hands one memo the same attempt objects instant after instant, a few come
    # and gone: the candidates it keeps, refreshed as time moves, must plan as fresh ones.
    running = _as_of_start(_regular(snap.running) if regular else snap.running, lazily)
    memo = PlanMemo()
    now_s = NOW
    for part, step in zip(_parts(running, splits), steps, strict=True):
        now_s += step
        s = replace(snap, running=part, now_s=now_s)
        assert plan(s, config, memo) == plan(s, config)


def test_losses_that_round_to_one_value_are_ordered_by_the_rule():
    # Work lost is now - since + restart: two attempts that started a hair apart lose the same
    # after rounding, and the victim order then takes the smaller first, not the later start
    # that the pool's key (the start) puts first.
    config = Config(preemption=True, min_runtime_s=0.0, restart_cost_s=7.0)
    now_s = 2.0**-60
    early = Running(1, 1, "a", "u", 100, True, 0.0, ("g1",), "H100")
    late = Running(2, 2, "a", "u", 100, True, 2.0**-61, ("g2", "g3"), "H100")
    cands = [Candidate(r, {0: len(r.gpus)}, 0.0, 0.0) for r in (late, early)]
    for c in cands:
        c.refresh(now_s, config)
    assert cands[0].lost_s == cands[1].lost_s == 7.0
    settled = _settle(list(cands), lambda c: c.lost_s, lambda c: (c.lost_s, c.size))
    assert [c.run.attempt_id for c in settled] == [1, 2]


def test_a_pool_follows_only_the_update_after_the_one_it_holds():
    config = Config(preemption=True, victim_order=VictimOrder.YOUNGEST)
    r1 = Running(1, 1, "a", "u", 100, True, 0.0, ("g1",), "H100")
    r2 = Running(2, 2, "a", "u", 100, True, 5.0, ("g2",), "H100")
    topo = Topology(())
    totals = RunningTotals()
    pool = VictimPool(config, topo)
    totals.update((r1,))
    pool.follow(totals)  # never built: stays stale
    assert pool.epoch == -1
    pool.sync((r1,), totals)
    totals.update((r1, r2))
    pool.follow(totals)
    assert pool.epoch == totals.epoch
    assert [e[-1].run.attempt_id for e in pool.victim["H100"]] == [2, 1]


def test_las_lists_merged_per_slope_are_the_lists_sorted_at_each_instant():
    # Attained service grows at each attempt's own GPU count: a 1-GPU attempt started at 0 and
    # a 2-GPU one started at 50 have attained alike at 100 (a tie broken by the youngest), and
    # the larger has more after that; an attempt with service stated as of now does not grow.
    config = Config(ordering=Ordering.LAS, preemption=True, borrowing=True, min_runtime_s=0.0)
    shapes = [(1, 0.0, 0.0), (2, 50.0, 0.0), (4, 90.0, 20.0), (1, 10.0, 3000.0), (2, 0.0, 0.0)]
    running = []
    for i, (gpus, start_s, service) in enumerate(shapes, start=1):
        held = tuple(f"g{i}-{k}" for k in range(gpus))
        running.append(
            Running(
                i, i, "a", "u", 100, True, start_s, held, "H100",
                attained_service_s=service, attained_as_of_s=start_s,
            )
        )  # fmt: skip
    running.append(
        Running(9, 9, "b", "u", 100, True, 5.0, ("g9",), "H100", attained_service_s=150.0)
    )
    part = tuple(running)
    topo = Topology(())
    totals = RunningTotals()
    pool = VictimPool(config, topo)
    totals.update(part)
    pool.sync(part, totals)
    every = {r.attempt_id for r in part}
    for now_s in (90.0, 100.0, 100.0 + 2.0**-40, 150.0, 4_000.0):
        index = ClusterIndex((), part, topo)
        pooled = Victims(part, index, lambda: every, config, now_s, None, pool, totals)
        fresh = Victims(part, index, lambda: every, config, now_s)
        for tenant in (None, "a", "b"):
            got = [(c.run.attempt_id, c.attained_s) for c in pooled.baseline("H100", tenant)]
            want = [(c.run.attempt_id, c.attained_s) for c in fresh.baseline("H100", tenant)]
            assert got == want, (now_s, tenant)
    index = ClusterIndex((), part, topo)
    at_100 = Victims(part, index, lambda: every, config, 100.0, None, pool, totals)
    assert [c.run.attempt_id for c in at_100.baseline("H100", "a")] == [4, 5, 2, 1, 3]


# Per attempt and step: 0 absent (not started yet, or finished), 1 running, 2 told to stop
# (preempted: a new object); and whether its tenant's quota labels it borrowed.
STATES = st.lists(st.tuples(st.integers(0, 2), st.booleans()), min_size=0, max_size=40)
# The instant of each plan: mostly later than the last, now and then earlier.
INSTANTS = st.sampled_from([NOW - 20_000.0, NOW - 5_000.0, NOW - 61.0, NOW, NOW + 30.0, NOW + 61.0])


def _lent_afresh(pool: VictimPool, borrowed: set[int], now_s: float) -> dict[str, object]:
    """What VictimPool keeps of its borrowed candidates, recounted from all of its lists."""

    def only(entries: list[PoolEntry]) -> list[PoolEntry]:
        return [e for e in entries if e[-1].run.attempt_id in borrowed]

    min_runtime_s = pool.config.min_runtime_s
    out: dict[str, object] = {}
    for t, entries in pool.victim.items():
        kept = [e[-1] for e in entries if e[-1].run.attempt_id in borrowed]
        young = [c for c in kept if now_s - c.run.started_at_s < min_runtime_s]
        aged = [c for c in kept if not now_s - c.run.started_at_s < min_runtime_s]
        gpus: dict[int, int] = {}
        for c in aged:
            for node, count in c.nodes.items():
                gpus[node] = gpus.get(node, 0) + count
        out[f"victim {t}"] = only(entries)
        out[f"young {t}"] = sorted((-c.run.started_at_s, -c.run.attempt_id, c) for c in young)
        out[f"gpus {t}"] = gpus
        out[f"count {t}"] = len(aged)
    for t, entries in pool.srtf_type.items():
        out[f"srtf {t}"] = only(entries)
    for t, groups in pool.las_type.items():
        out[f"las {t}"] = {slope: only(e) for slope, e in groups.items() if only(e)}
    return out


def _lent_kept(pool: VictimPool) -> dict[str, object]:
    out: dict[str, object] = {}
    for t in pool.victim:
        out[f"victim {t}"] = pool.lent_victim.get(t, [])
        out[f"young {t}"] = pool.young.get(t, [])
        out[f"gpus {t}"] = pool.aged_gpus.get(t, {})
        out[f"count {t}"] = pool.aged_count.get(t, 0)
    for t in pool.srtf_type:
        out[f"srtf {t}"] = pool.lent_srtf.get(t, [])
    for t in pool.las_type:
        out[f"las {t}"] = {s: e for s, e in pool.lent_las.get(t, {}).items() if e}
    return out


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    snapshots(),
    configs,
    st.lists(st.tuples(STATES, INSTANTS, st.booleans()), min_size=1, max_size=6),
    st.booleans(),
)
def test_borrowed_candidates_kept_across_plans_are_those_counted_afresh(
    snap, config, steps, lazily
):
    # Attempts start, are preempted and finish between plans, labels flip as tenants' attempts
    # come and go, and time moves: the pool's borrowed lists and the GPUs of those that have
    # run long enough, kept by moving only what changed, must be the pool's candidates with a
    # borrowed label, listed and counted afresh.
    config = replace(config, preemption=True)
    universe = _as_of_start(
        tuple(replace(r, stopping=False) for r in _regular(snap.running)), lazily
    )
    stopped = {r.attempt_id: replace(r, stopping=True) for r in universe}
    topo = Topology(snap.nodes)
    totals = RunningTotals()
    pool = VictimPool(config, topo)
    for i, (states, now_s, aged_first) in enumerate(steps):
        part = tuple(
            r if state == 1 else stopped[r.attempt_id]
            for r, (state, _) in zip(universe, states, strict=False)
            if state
        )
        borrowed = {r.attempt_id for r, (_, lent) in zip(universe, states, strict=False) if lent}
        totals.update(part)
        if i == 0:
            pool.sync(part, totals)
        else:
            pool.follow(totals)
        assert pool.epoch == totals.epoch
        # Aged before or after the labels flip: either way round gives the same.
        if aged_first:
            pool.age(now_s)
        pool.label(borrowed)
        pool.age(now_s)
        assert _lent_kept(pool) == _lent_afresh(pool, borrowed, now_s)
        for c in pool.by_attempt.values():
            assert pool.lent(c) == (c.run.attempt_id in borrowed)
