"""A plan leaves no reference cycle behind: its state is freed as it ends, not by the cyclic
collector, which would otherwise walk all of it after every plan (scheduler.admit._Borrowed)."""

from __future__ import annotations

import gc
from dataclasses import replace

from hypothesis import given, settings

from scheduler.memo import PlanMemo
from scheduler.policy import plan
from tests.scheduler.test_plan_properties import configs, snapshots


@settings(max_examples=60, deadline=None, derandomize=True)
@given(snapshots(), configs)
def test_a_plan_frees_its_state_without_the_cyclic_collector(snap, config):
    config = replace(config, preemption=True)
    memo = PlanMemo()
    plan(snap, config, memo)  # the memo's own indexes are built and kept, not garbage
    collecting = gc.isenabled()
    gc.disable()
    try:
        gc.collect()
        result = plan(snap, config, memo)
        assert gc.collect() == 0
    finally:
        if collecting:
            gc.enable()
    assert result is not None
