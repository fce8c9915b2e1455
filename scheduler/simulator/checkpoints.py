"""How often the jobs of a replay checkpoint, and so how much a preemption throws away.

A job checkpoints every `interval` seconds of an attempt's run time, counting from the
attempt's start; its checkpoints persist across attempts. A preempted job resumes from its
last checkpoint, so it loses the work done since then, plus the restart (Config.restart_cost_s
of run time redone). Modes, as the command line spells them:

- ``continuous``: the former model of the simulator, as if every moment were checkpointed: a
  preemption costs only the restart (SimOptions.restart_cost). The default, which keeps the
  figures comparable with the published simulators (ANCHORS.md), that assume the same.
- ``none``: no job checkpoints: a preempted job starts again from zero.
- ``fixed:<seconds>``: every job checkpoints at that interval.
- ``uniform:<lo>-<hi>``: each job's interval is drawn uniformly from [lo, hi] seconds, from a
  generator seeded with the seed and the job id: the same job gets the same interval in every
  replay, whatever else the trace holds.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CheckpointIntervals:
    """The checkpoint interval of every job of a replay (see the module's docstring)."""

    mode: str = "continuous"  # continuous | none | fixed | uniform
    low_s: float = 0.0  # fixed: the interval; uniform: the least one
    high_s: float = 0.0  # uniform: the greatest one
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ("continuous", "none", "fixed", "uniform"):
            raise ValueError(f"unknown checkpoint mode {self.mode!r}")
        if self.mode in ("fixed", "uniform") and not (
            0 < self.low_s and math.isfinite(self.low_s) and math.isfinite(self.high_s)
        ):
            raise ValueError("a checkpoint interval must be a finite number of seconds above 0")
        if self.mode == "uniform" and self.high_s < self.low_s:
            raise ValueError("the upper bound of a checkpoint interval is below the lower one")

    @property
    def continuous(self) -> bool:
        """Whether progress is kept in full across preemptions (the former model)."""
        return self.mode == "continuous"

    def interval_s(self, job_id: int) -> float | None:
        """The job's interval in seconds; None when it never checkpoints (or continuously)."""
        if self.mode == "fixed":
            return self.low_s
        if self.mode == "uniform":
            return random.Random(f"checkpoint/{self.seed}/{job_id}").uniform(
                self.low_s, self.high_s
            )
        return None

    @classmethod
    def parse(cls, text: str, seed: int = 0) -> CheckpointIntervals:
        """``continuous``, ``none``, ``fixed:<seconds>`` or ``uniform:<lo>-<hi>``."""
        mode, _, arg = text.strip().partition(":")
        try:
            if mode in ("continuous", "none") and not arg:
                return cls(mode, seed=seed)
            if mode == "fixed":
                return cls(mode, float(arg), seed=seed)
            if mode == "uniform":
                low, high = arg.split("-")
                return cls(mode, float(low), float(high), seed=seed)
        except ValueError as exc:
            raise ValueError(f"bad checkpoint interval {text!r}: {exc}") from None
        raise ValueError(
            f"bad checkpoint interval {text!r}: expected continuous, none, fixed:<seconds> or "
            "uniform:<lo>-<hi>"
        )
