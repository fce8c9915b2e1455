"""Admission._failed: a preemption search that found nothing is not run again for a job just
like it while nothing it reads changed; under SRTF, for any predicted duration within the spans
of preemption.srtf_span. Both compared with the straightforward computation."""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

import scheduler.admit as admit
from scheduler.model import Config, Ordering, Snapshot
from scheduler.policy import plan
from scheduler.preemption import _Grown, _span
from tests.scheduler.test_plan_properties import configs, plan_with_admission, snapshots


class _Forgets(dict):
    """A memo that never recalls anything: every search is then run."""

    def get(self, key, default=None):
        return default


class _Searches(admit.Admission):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._failed = _Forgets()


def _crowded(snap: Snapshot, copies: int, durations: list[float]) -> Snapshot:
    """The queue with every job repeated (new ids, the predicted durations varied), so that
    searches alike follow each other as behind a full cluster."""
    pending = list(snap.pending)
    top = max((j.job_id for j in snap.pending), default=0) + 1
    for k in range(copies):
        for i, job in enumerate(snap.pending):
            duration = durations[(k + i) % len(durations)] if durations else None
            pending.append(
                replace(
                    job,
                    job_id=top + k * len(snap.pending) + i,
                    predicted_duration_s=duration if duration else job.predicted_duration_s,
                )
            )
    return replace(snap, pending=tuple(pending))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    snapshots(),
    configs,
    st.integers(1, 3),
    st.lists(st.sampled_from([0.0, 50.0, 600.0, 3000.0, 7000.0, 15000.0]), max_size=4),
)
def test_remembered_failures_give_the_plan_every_search_gives(snap, config, copies, durations):
    snap = _crowded(snap, copies, durations)
    assert plan_with_admission(_Searches, snap, config) == plan(snap, config)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(snapshots(), st.integers(2, 4), st.lists(st.floats(0, 20_000), min_size=1, max_size=5))
def test_remembered_failures_under_srtf_and_las(snap, copies, durations):
    for ordering in (Ordering.SRTF, Ordering.LAS):
        config = Config(ordering=ordering, borrowing=True, preemption=True, backfill=False)
        crowded = _crowded(snap, copies, durations)
        assert plan_with_admission(_Searches, crowded, config) == plan(crowded, config)


class _Cand:
    def __init__(self, remaining_s: float):
        self.remaining_s = remaining_s


class _Growing(_Grown):
    """A lazy list handing out one item at a time, as the pool's lists do."""

    def __init__(self, items):
        self._source = list(items)
        self._items = []

    def _more(self) -> bool:
        if len(self._items) < len(self._source):
            self._items.append(self._source[len(self._items)])
            return True
        return False


REMAINING = st.sampled_from([0.0, 10.0, 60.0, 60.0, 500.0, 3000.0])


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(REMAINING, max_size=12), REMAINING, st.lists(REMAINING, max_size=6), st.booleans())
def test_span_holds_the_durations_with_the_same_qualifying_candidates(
    remaining, predicted_s, others, lazy
):
    items = [_Cand(r) for r in sorted(remaining, reverse=True)]
    low, high = _span(_Growing(items) if lazy else items, predicted_s)
    assert low <= predicted_s < high

    def qualifying(p: float) -> list[bool]:
        return [c.remaining_s > p for c in items]

    for p in [*others, low, high, predicted_s + 1.0, predicted_s - 1.0]:
        if math.isinf(p):
            continue
        same = qualifying(p) == qualifying(predicted_s)
        assert same == (low <= p < high) or (same and not items), (p, low, high)
