"""Quotas: guarantees, limits, borrowing, budgets and the running-jobs cap."""

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler.model import ANY_GPU_TYPE, Config, ReasonCode, Running
from scheduler.quota import (
    RunningTotals,
    _beyond,
    _beyond_one,
    _changes,
    build_books,
    label_borrowed,
)
from tests.scheduler.builders import cluster, decision, start_of, started


def vision_with_sixteen_one_gpu_jobs():
    c = cluster().nodes(2, gpus=8).tenant("vision", 8, 16).tenant("nlp", 8, 16)
    for job_id in range(1, 17):
        c.pending(job_id, "vision", 1)
    return c


def test_a_tenant_borrows_idle_gpus_up_to_its_limit_and_borrowed_starts_are_marked():
    c = vision_with_sixteen_one_gpu_jobs().pending(17, "vision", 1)
    p = c.plan()
    assert started(p) == set(range(1, 17))
    assert sum(s.borrowed for s in p.starts) == 8
    assert all(not start_of(p, j).borrowed for j in range(1, 9))
    assert decision(p, 17).reason_code is ReasonCode.QUOTA_LIMIT
    assert decision(p, 17).reason == (
        "waiting for 1 GPU of any type: tenant vision uses 16 of its limit of 16 GPUs"
    )


def test_static_partition_baseline_leaves_a_tenant_idle_while_another_queues():
    p = vision_with_sixteen_one_gpu_jobs().plan(borrowing=False)
    assert started(p) == set(range(1, 9))
    assert all(not s.borrowed for s in p.starts)
    assert {decision(p, j).reason_code for j in range(9, 17)} == {ReasonCode.STATIC_PARTITION}
    # Eight GPUs stay idle: nlp's partition, which nlp does not use.
    assert sum(len(s.gpu_uuids) for s in p.starts) == 8


def test_the_any_type_quota_caps_the_sum_over_gpu_types():
    c = (
        cluster()
        .node("h1", gpus=8, type="H100")
        .node("a1", gpus=8, type="A100")
        .tenant("vision", 4, 4, type="H100")
        .quota("vision", "A100", 4, 8)
        .quota("vision", ANY_GPU_TYPE, 6, 9)
        .pending(1, "vision", 4, "H100")
        .pending(2, "vision", 4, "A100")
        .pending(3, "vision", 2, "A100")
        .pending(4, "vision", 2, "H100")
    )
    p = c.plan()
    # Guaranteed work first: job 3 fits the 6 guaranteed beside job 1, job 2 does not.
    assert started(p) == {1, 3}
    assert not start_of(p, 1).borrowed and not start_of(p, 3).borrowed
    # A100 alone would allow 4 more (2 of 8), but the sum would be 10 of 9.
    assert decision(p, 2).reason == (
        "waiting for 4 x A100: tenant vision uses 6 of its limit of 9 GPUs"
    )
    assert decision(p, 4).reason == (
        "waiting for 2 x H100: tenant vision uses 4 of its limit of 4 H100"
    )


def test_a_tenant_without_a_quota_for_a_type_cannot_use_it():
    c = (
        cluster()
        .node("h1", gpus=8, type="H100")
        .tenant("vision", 8, 8, type="A100")
        .pending(1, "vision", 1, "H100")
    )
    d = decision(c.plan(), 1)
    assert d.reason_code is ReasonCode.QUOTA_LIMIT
    assert d.reason == "waiting for 1 x H100: tenant vision has no quota for H100 GPUs"


def test_a_non_preemptible_job_only_uses_the_guarantee():
    def vision(job_1_preemptible: bool):
        return (
            cluster()
            .node("n1", gpus=8)
            .tenant("vision", 2, 8)
            .running(1, "vision", 2, preemptible=job_1_preemptible)
            .pending(2, "vision", 2, preemptible=False)
            .pending(3, "vision", 2)
        )

    # The guarantee is held by work that cannot be stopped either: it waits; job 3 borrows.
    p = vision(job_1_preemptible=False).plan()
    assert started(p) == {3} and start_of(p, 3).borrowed
    assert decision(p, 2).reason_code is ReasonCode.QUOTA_LIMIT
    assert decision(p, 2).reason == (
        "waiting for 2 GPUs of any type: the job cannot be preempted, so it may only use "
        "guaranteed GPUs, and tenant vision's work that cannot be preempted holds 2 of its 2 "
        "guaranteed"
    )
    # Held by work that can be: it takes the guarantee first, and job 1 is borrowed from then on
    # (its tenant's attempts that can be given back fill the guarantee last).
    c = vision(job_1_preemptible=True)
    p = c.plan()
    assert started(p) == {2, 3}
    assert not start_of(p, 2).borrowed and start_of(p, 3).borrowed
    after = (
        cluster()
        .node("n1", gpus=8)
        .tenant("vision", 2, 8)
        .running(1, "vision", 2, ran_s=600)
        .running(2, "vision", 2, ran_s=60, preemptible=False)
        .snapshot()
    )
    assert label_borrowed(after.running, build_books(after, Config())) == {1}


def test_a_job_that_cannot_be_preempted_is_told_which_guarantee_is_full():
    # vision's H100 guarantee (8) has room, its guarantee over every type (4) does not: the
    # reason names the one that blocks, whichever quota binds its limit.
    c = (
        cluster()
        .node("n1", gpus=8)
        .tenant("vision", 4, 16)
        .quota("vision", "H100", 8, 16)
        .running(1, "vision", 4, preemptible=False)
        .pending(2, "vision", 2, "H100", preemptible=False)
    )
    p = c.plan()
    assert started(p) == set()
    assert decision(p, 2).reason.endswith(
        "tenant vision's work that cannot be preempted holds 4 of its 4 guaranteed"
    )


@pytest.mark.parametrize(
    "action, started_jobs, code",
    [
        ("hold", set(), ReasonCode.BUDGET_HOLD),
        ("no_borrowing", {1, 2}, ReasonCode.BUDGET_NO_BORROWING),
        ("throttle", {1, 2, 3, 4}, None),
    ],
)
def test_a_spent_budget_holds_or_stops_borrowing_as_the_tenant_chose(action, started_jobs, code):
    c = cluster().node("n1", gpus=8).tenant("vision", 4, 8, budget_action=action)
    for job_id in (1, 2, 3, 4):
        c.pending(job_id, "vision", 2)
    p = c.plan()
    assert started(p) == started_jobs
    for d in p.pending:
        assert d.reason_code is code


def test_the_running_jobs_cap_holds_the_rest():
    c = cluster().node("n1", gpus=8).tenant("vision", 8, 8, max_running_jobs=3)
    c.running(1, "vision", 1)
    for job_id in (2, 3, 4):
        c.pending(job_id, "vision", 1)
    p = c.plan()
    assert started(p) == {2, 3}
    d = decision(p, 4)
    assert d.reason_code is ReasonCode.MAX_RUNNING_JOBS
    assert (
        d.reason == "waiting for 1 GPU of any type: tenant vision already runs 3 jobs, its maximum"
    )


def test_stopping_attempts_still_count_against_the_limit():
    c = (
        cluster()
        .nodes(2, gpus=8)
        .tenant("vision", 0, 8)
        .running(1, "vision", 8, "n1", stopping=True)
        .pending(2, "vision", 8)
    )
    d = decision(c.plan(), 2)
    assert d.reason_code is ReasonCode.WAITING_FOR_PREEMPTION
    assert "stopping" in d.reason


@pytest.mark.parametrize(
    ("guaranteed", "borrowed"),
    [
        (12, set()),  # everything fits the guarantee
        (8, {3}),  # the latest start pushed it past
        (4, {2, 3}),
        (0, {1, 2, 3}),
    ],
)
def test_attempts_past_the_guarantee_in_start_order_are_the_borrowed_ones(guaranteed, borrowed):
    c = (
        cluster()
        .node("n1", gpus=12)
        .tenant("vision", guaranteed, 12)
        .running(1, "vision", 4, ran_s=3000)
        .running(2, "vision", 4, ran_s=2000)
        .running(3, "vision", 4, ran_s=1000)
        .running(4, "vision", 0, ran_s=500, stopping=True)
    )
    snap = c.snapshot()
    assert label_borrowed(snap.running, build_books(snap, Config())) == borrowed
    # The same from the attempts a memo keeps sorted (RunningTotals), as plan() asks it.
    summed = RunningTotals().update(snap.running)
    assert label_borrowed(snap.running, build_books(snap, Config()), summed) == borrowed


def test_every_attempt_on_a_type_without_quota_is_borrowed():
    c = (
        cluster()
        .node("n1", gpus=4, type="A100")
        .node("n2", gpus=4, type="H100")
        .tenant("vision", 8, 8, type="H100")
        .running(1, "vision", 2, "n1")
        .running(2, "vision", 2, "n2")
    )
    snap = c.snapshot()
    assert label_borrowed(snap.running, build_books(snap, Config())) == {1}
    summed = RunningTotals().update(snap.running)
    assert label_borrowed(snap.running, build_books(snap, Config()), summed) == {1}


@given(
    st.integers(0, 40),
    st.lists(st.tuples(st.sampled_from(["H100", "A100", ANY_GPU_TYPE]), st.integers(0, 8))),
)
def test_one_guarantee_over_every_type_borrows_the_tail_past_it(guaranteed, attempts):
    # The shared pool gives each tenant one guarantee over every type: the bisect over running
    # sums finds what the walk attempt by attempt finds.
    filling = [(True, float(i), i, t, n) for i, (t, n) in enumerate(attempts)]
    walked = _beyond({ANY_GPU_TYPE: guaranteed}, ((aid, t, n) for _, _, aid, t, n in filling))
    assert _beyond_one(guaranteed, filling) == walked


def _attempt(i: int, stopping: bool = False) -> Running:
    return Running(
        attempt_id=i,
        job_id=i,
        tenant="ab"[i % 2],
        user="u",
        priority=100,
        preemptible=i % 3 > 0,
        started_at_s=float(i % 7),
        gpus=tuple(f"g{i}-{k}" for k in range(1 + i % 3)),
        gpu_type="H100",
        stopping=stopping,
    )


# Steps between two updates: keep, drop the attempt at a place, append a new one, remake one
# in place (a field the sums do not read, or one they do), swap two, repeat one.
STEPS = st.lists(
    st.tuples(
        st.sampled_from(["drop", "append", "remake", "restop", "swap", "twice"]), st.integers(0, 99)
    ),
    max_size=6,
)


@given(st.lists(STEPS, min_size=1, max_size=8), st.integers(0, 80))
def test_running_totals_kept_across_updates_are_the_totals_counted_afresh(rounds, size):
    # Most updates find what came and went by walking the two tuples in step; whatever the
    # changes, the totals and what they report as added, removed and replaced must be those of
    # the sets of attempts.
    current = [_attempt(i) for i in range(size)]
    fresh_id = size
    totals = RunningTotals()
    last: tuple[Running, ...] = ()
    for steps in rounds:
        for op, at in steps:
            if op == "append" or not current:
                current.append(_attempt(fresh_id))
                fresh_id += 1
                continue
            k = at % len(current)
            was = current[k]
            if op == "drop":
                del current[k]
            elif op in ("remake", "restop"):
                # Every place that holds it (after "twice"): one attempt, one object.
                remade = (
                    replace(was, user="v")
                    if op == "remake"
                    else replace(was, stopping=not was.stopping)
                )
                current = [remade if r is was else r for r in current]
            elif op == "swap":
                j = (k + 1) % len(current)
                current[k], current[j] = current[j], current[k]
            else:
                current.append(current[k])
        running = tuple(current)
        totals.update(running)
        afresh = RunningTotals().update(running)
        for field in ("held", "gpus", "jobs", "started", "by_tenant", "kinds", "stopping"):
            assert getattr(totals, field) == getattr(afresh, field), field
        before = {id(r): r for r in last}
        now = {id(r): r for r in running}
        gone = before.keys() - now.keys()
        new = now.keys() - before.keys()
        pairs = {(id(old), id(r)) for old, r in totals.replaced}
        assert {a for a, _ in pairs} <= gone and {b for _, b in pairs} <= new
        assert {id(r) for r in totals.removed} == gone - {a for a, _ in pairs}
        assert {id(r) for r in totals.added} == new - {b for _, b in pairs}
        last = running


# Edits of a tuple of attempts: drop at, insert a new one at, remake at, swap at and at + 1,
# repeat the one at.
EDITS = st.lists(
    st.tuples(st.sampled_from(["drop", "insert", "remake", "swap", "twice"]), st.integers(0, 99)),
    max_size=40,
)


@given(st.integers(0, 80), EDITS)
def test_walking_two_tuples_in_step_finds_what_came_and_went(size, edits):
    # _changes walks the last tuple and the new one in step; what it finds, when it answers,
    # must be exactly the attempts (by identity) only the last one held and only the new one
    # holds, each once.
    last = tuple(_attempt(i) for i in range(size))
    current = list(last)
    fresh_id = size
    for op, at in edits:
        k = at % (len(current) + 1)
        if op == "insert" or not current:
            current.insert(k, _attempt(fresh_id))
            fresh_id += 1
            continue
        k %= len(current)
        if op == "drop":
            del current[k]
        elif op == "remake":
            current[k] = replace(current[k], user="v")
        elif op == "swap" and len(current) > 1:
            j = (k + 1) % len(current)
            current[k], current[j] = current[j], current[k]
        elif op == "twice":
            current.append(current[k])
    running = tuple(current)
    seen = {id(r): r for r in last}
    found = _changes(last, running, seen)
    if found is None:
        return
    gone, new = found
    held = {id(r) for r in running}
    assert sorted(map(id, gone)) == sorted(id(r) for r in last if id(r) not in held)
    assert sorted(map(id, new)) == sorted({id(r) for r in running} - seen.keys())
    assert len({id(r) for r in new}) == len(new)
