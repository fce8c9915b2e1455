"""Run in a fresh interpreter by test_plan_garbage.py: a plan leaves no reference cycle behind.

A plan's state must be freed as it ends, not by the cyclic collector, which would otherwise walk
all of it after every plan (scheduler.admit._Borrowed is the fix of one such cycle). Inside the
test process other tests' threads free objects of their own while a plan runs, so the check runs
here, where nothing but the plan makes garbage, and counts every object the collector frees.
"""

from __future__ import annotations

import gc
import sys
from dataclasses import replace

from hypothesis import given, settings

from scheduler.memo import PlanMemo
from scheduler.policy import plan
from tests.scheduler.test_plan_properties import configs, snapshots

EXAMPLES = 40


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None)
@given(snapshots(), configs)
def check(snap, config) -> None:
    config = replace(config, preemption=True)
    memo = PlanMemo()
    plan(snap, config, memo)  # the memo's own indexes are built and kept, not garbage
    gc.disable()
    gc.collect()  # frees what came before (the example's own cycles), so none is counted
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector would free now lands in gc.garbage
    try:
        plan(snap, config, memo)
        gc.collect()
        left = sorted({f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not left, f"a plan left reference cycles of: {', '.join(left)}"


if __name__ == "__main__":
    check()
    print("no reference cycle in", EXAMPLES, "plans", file=sys.stderr)
