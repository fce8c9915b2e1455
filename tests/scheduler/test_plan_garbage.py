"""A plan leaves no reference cycle behind (see plan_garbage_check.py, run in a fresh
interpreter so that no other test's objects are freed while the plan runs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_plan_frees_its_state_without_the_cyclic_collector():
    done = subprocess.run(
        [sys.executable, "-m", "tests.scheduler.plan_garbage_check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
