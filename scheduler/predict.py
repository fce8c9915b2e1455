"""Duration prediction, Helios QSSF style: a job runs about as long as its kind ran before.

"Its kind" is the same name, once digits and run suffixes are normalised away
(`resnet50-lr0.1-seed3-v2` and `resnet18-lr0.01-seed1` are both `resnet#-lr#`), with the same
GPU count. The same user's history is asked first, then the tenant's, because people repeat
their own experiments far more reliably than their colleagues'. Without history the user's
estimate is taken, then the job's runtime limit (it is killed there anyway), then the
configured default. A prediction never exceeds the runtime limit.

A job of a sweep (a job array: Pending.group) asks its finished siblings before anything else,
once there are GROUP_MIN_RUNS of them: the same program on the same data with another
parameter is the closest kind there is, closer than what the user ran last week.

The median of the matching runs is used, not the mean: one run that crashed after a minute or
hung for a day must not move the prediction much.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from scheduler.model import Config, HistoryRecord, Pending

_DIGITS = re.compile(r"\d+")
# Trailing tokens that number or tag reruns of the same experiment.
_SUFFIX = re.compile(
    r"(?:[-_.\s]+(?:#|v#|r#|run#|try#|trial#|seed#|rep#|copy|retry|rerun|final|new|old|tmp|bak))+$"
)
_SEPARATORS = re.compile(r"[-_.\s]+$")

# Siblings that must have finished before they are trusted over the user's and tenant's
# history: the median of three is not moved by one that crashed at once.
GROUP_MIN_RUNS = 3

_normalised: dict[str, str] = {}
_NORMALISED_MAX = 100_000


def normalise_name(name: str) -> str:
    """The kind of job a name stands for: lower case, digits as '#', rerun suffixes dropped."""
    found = _normalised.get(name)
    if found is not None:
        return found
    s = _DIGITS.sub("#", name.strip().lower())
    s = _SEPARATORS.sub("", _SUFFIX.sub("", s))
    if len(_normalised) >= _NORMALISED_MAX:
        _normalised.clear()
    _normalised[name] = s
    return s


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2.0


class HistoryIndex:
    """Durations of finished runs by (user, kind, GPUs), by (tenant, kind, GPUs) and by group
    and GPUs."""

    __slots__ = ("by_user", "by_tenant", "by_group")

    def __init__(self, history: tuple[HistoryRecord, ...]):
        by_user: dict[tuple[str, str, int], list[float]] = {}
        by_tenant: dict[tuple[str, str, int], list[float]] = {}
        by_group: dict[tuple[int, int], list[float]] = {}
        cache = _normalised
        for rec in history:
            if rec.group is not None:
                by_group.setdefault((rec.group, rec.gpus), []).append(rec.duration_s)
            kind = cache.get(rec.name)
            if kind is None:
                kind = normalise_name(rec.name)
            key = (rec.user, kind, rec.gpus)
            runs = by_user.get(key)
            if runs is None:
                by_user[key] = [rec.duration_s]
            else:
                runs.append(rec.duration_s)
            key = (rec.tenant, kind, rec.gpus)
            runs = by_tenant.get(key)
            if runs is None:
                by_tenant[key] = [rec.duration_s]
            else:
                runs.append(rec.duration_s)
        self.by_user = by_user
        self.by_tenant = by_tenant
        self.by_group = by_group


def predict_durations(
    pending: tuple[Pending, ...],
    history: tuple[HistoryRecord, ...],
    config: Config,
    index_of: Callable[[tuple[HistoryRecord, ...]], HistoryIndex] = HistoryIndex,
) -> dict[int, float]:
    """Job id -> predicted duration in seconds, for every pending job.

    `index_of` builds the history's index; a caller that plans again and again passes its
    memo's (scheduler.memo), which reuses it while the history tuple stays the same.
    """
    out: dict[int, float] = {}
    index = None
    found: dict[int, float] = {}  # id of a list of runs -> its median, for repeated kinds
    for p in pending:
        if p.predicted_duration_s is not None:
            out[p.job_id] = _bounded(p.predicted_duration_s, p)
            continue
        guess = None
        if history:
            kind = _normalised.get(p.name)
            if kind is None:
                kind = normalise_name(p.name)
            if index is None:
                index = index_of(history)
            runs = None
            if p.group is not None:
                siblings = index.by_group.get((p.group, p.gpus))
                if siblings is not None and len(siblings) >= GROUP_MIN_RUNS:
                    runs = siblings
            runs = (
                runs
                or index.by_user.get((p.user, kind, p.gpus))
                or index.by_tenant.get((p.tenant, kind, p.gpus))
            )
            if runs:
                key = id(runs)
                guess = found.get(key)
                if guess is None:
                    guess = found[key] = _median(runs)
        if guess is None:
            if p.estimated_duration_s is not None:
                guess = p.estimated_duration_s
            elif p.max_runtime_s is not None:
                guess = p.max_runtime_s
            else:
                guess = config.default_duration_s
        out[p.job_id] = _bounded(guess, p)
    return out


def _bounded(duration_s: float, p: Pending) -> float:
    if p.max_runtime_s is not None and duration_s > p.max_runtime_s:
        duration_s = p.max_runtime_s
    return max(duration_s, 0.0)
