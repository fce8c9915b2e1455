"""A plan leaves no reference cycle behind: its state is freed as it ends, not by the cyclic
collector, which would otherwise walk all of it after every plan (scheduler.admit._Borrowed)."""

from __future__ import annotations

import gc
import types
from dataclasses import replace

from hypothesis import given, settings

from scheduler.memo import PlanMemo
from scheduler.policy import plan
from tests.scheduler.test_plan_properties import configs, snapshots


def _of_the_core(obj: object) -> bool:
    """An object of the scheduling core: an instance of one of its classes, or one of its
    functions (a closure in a cycle). Other threads of the test process (a telemetry flush
    left by an earlier test on this worker) make garbage of their own, which is not counted."""
    if isinstance(obj, types.FunctionType | types.MethodType):
        module = getattr(obj, "__module__", "") or ""
    else:
        module = type(obj).__module__ or ""
    return module == "scheduler" or module.startswith("scheduler.")


@settings(max_examples=60, deadline=None, derandomize=True)
@given(snapshots(), configs)
def test_a_plan_frees_its_state_without_the_cyclic_collector(snap, config):
    config = replace(config, preemption=True)
    memo = PlanMemo()
    plan(snap, config, memo)  # the memo's own indexes are built and kept, not garbage
    collecting = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector would free lands in gc.garbage
    try:
        gc.collect()
        gc.garbage.clear()
        result = plan(snap, config, memo)
        gc.collect()
        left = [type(o).__qualname__ for o in gc.garbage if _of_the_core(o)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if collecting:
            gc.enable()
    assert left == []
    assert result is not None
