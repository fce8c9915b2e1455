"""Each running attempt's power profile, learned from its own GPUs' telemetry.

Until telemetry has refined it, an attempt carries the default profile, which the cap planner
budgets at the board's maximum (scheduler.power.planning_profile): safe, and wasteful for a job
that draws far less. Here the history buckets (GpuTelemetry) of the attempt's GPUs while it ran,
and their latest readings until a bucket has closed, become PowerSamples, summarised per cap,
and scheduler.power_fit fits the profile to them.

Cheap enough for every cycle: an attempt is first looked at once it has run
PROFILE_UNSEEN_RECHECK_S, again only PROFILE_RECHECK_S after the last look (that sooner while
nothing is learned of it), reads only the buckets it has not summarised yet, and is refitted only
when what it has seen has moved; at most MAX_FITS_PER_LOAD fits per load, the longest-waiting
first. The step costs two queries when some attempts are due, however many, and none
otherwise. Fitted profiles live in this process's memory: a restarted worker refits from the
last PROFILE_WINDOW_S of history.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

from django.conf import settings

from controlplane.cluster.models import GPU, GpuTelemetry
from controlplane.scheduling.rows import from_unix_s, raw_rows, unix_s
from scheduler import model as m
from scheduler.power_fit import CapSummary, PowerSample, fit_profile, samples_moved

# How long a fitted profile is trusted before the attempt's newer telemetry is read.
PROFILE_RECHECK_S = float(getattr(settings, "SCHEDULER_PROFILE_RECHECK_S", 20.0))
# An attempt with nothing learned yet is budgeted at the board's maximum: looked at sooner.
PROFILE_UNSEEN_RECHECK_S = 5.0
# History further back than this is not read (a worker that restarts under a long job).
PROFILE_WINDOW_S = 3600.0
# Attempts looked at per load at most, and fits at most (a fit takes some 10-30 ms; a cycle has
# 2 s in all): a cluster full of new jobs learns their profiles over a few cycles instead.
MAX_CHECKS_PER_LOAD = 500
MAX_FITS_PER_LOAD = 10
# Nelder-Mead iterations per start of a fit: the summaries have a few points, and converge
# well before this.
FIT_ITERATIONS = 80
# A reading below this utilization is a job starting up or waiting, not its working draw.
MIN_BUSY_UTILIZATION_PCT = 5.0
# Caps within this many watts are one operating point.
CAP_BIN_W = 5.0
# A refit is worth it once an operating point's mean moved this much (or a new one appeared).
REFIT_POWER_W = 3.0
REFIT_UTILIZATION = 0.02

_BUCKET_S = float(getattr(settings, "TELEMETRY_BUCKET_S", 60.0))


@dataclass(slots=True)
class _Learned:
    """What this process knows of one attempt's power."""

    started_s: float
    profile: m.PowerProfile = field(default_factory=m.PowerProfile)
    checked_s: float | None = None
    last_bucket_s: float = float("-inf")  # buckets up to this one are in the summary
    summary: CapSummary = field(default_factory=lambda: CapSummary(CAP_BIN_W))
    fitted_on: tuple[PowerSample, ...] = ()


_learned: dict[int, _Learned] = {}
_lock = threading.Lock()


def forget_all() -> None:
    """Drop every learned profile (tests that reuse attempt ids across databases)."""
    with _lock:
        _learned.clear()


def with_learned_profiles(running: tuple[m.Running, ...], now_s: float) -> tuple[m.Running, ...]:
    """``running`` with each attempt's learned power profile (the default where none is)."""
    with _lock:
        live = {r.attempt_id for r in running}
        for attempt_id in [a for a in _learned if a not in live]:
            del _learned[attempt_id]
        for r in running:
            entry = _learned.get(r.attempt_id)
            if entry is None or entry.started_s != r.started_at_s:
                _learned[r.attempt_id] = _Learned(started_s=r.started_at_s)
        due = [r for r in running if r.gpus and _is_due(_learned[r.attempt_id], now_s)]
        if due:
            # Never looked at first, then the longest unlooked-at: every attempt gets its turn.
            due.sort(
                key=lambda r: (_learned[r.attempt_id].checked_s or float("-inf"), r.attempt_id)
            )
            _refresh(due[:MAX_CHECKS_PER_LOAD], now_s)
        return tuple(
            r
            if _learned[r.attempt_id].profile == r.power_profile
            else replace(r, power_profile=_learned[r.attempt_id].profile)
            for r in running
        )


def _is_due(entry: _Learned, now_s: float) -> bool:
    if entry.checked_s is None:
        # First looked at once it has run PROFILE_UNSEEN_RECHECK_S: what its GPUs show before
        # that is its start-up, and a flood of short jobs cost two queries a cycle for attempts
        # that had ended before any reading of theirs could exist.
        return now_s - entry.started_s >= PROFILE_UNSEEN_RECHECK_S
    wait_s = PROFILE_RECHECK_S if entry.profile.samples else PROFILE_UNSEEN_RECHECK_S
    return now_s - entry.checked_s >= wait_s


def _refresh(due: list[m.Running], now_s: float) -> None:
    uuids = sorted({u for r in due for u in r.gpus})
    latest: dict[
        str, tuple[int, float, float | None, float | None, float | None, float | None]
    ] = {}
    for gpu_id, uuid, max_w, cap_w, power_w, utilization_pct, reading_s in raw_rows(
        GPU.objects.filter(uuid__in=uuids).values_list(
            "id",
            "uuid",
            "power_max_w",
            "power_cap_w",
            "power_draw_w",
            "utilization_pct",
            unix_s("telemetry_at"),
        )
    ):
        latest[uuid] = (gpu_id, max_w, cap_w, power_w, utilization_pct, reading_s)
    since_s = max(
        min(max(_learned[r.attempt_id].last_bucket_s, r.started_at_s) for r in due),
        now_s - PROFILE_WINDOW_S,
    )
    buckets: dict[int, list[tuple[float, float | None, float | None, float | None]]] = {}
    for gpu_id, bucket_s, cap_w, power_w, utilization_pct in raw_rows(
        GpuTelemetry.objects.filter(
            gpu_id__in=[row[0] for row in latest.values()],
            bucket_at__gte=from_unix_s(since_s),
            # Only closed buckets: an open one's mean still moves.
            bucket_at__lte=from_unix_s(now_s - _BUCKET_S),
        )
        .order_by("bucket_at")
        .values_list(
            "gpu_id", unix_s("bucket_at"), "power_cap_w", "power_draw_w", "utilization_pct"
        )
    ):
        buckets.setdefault(gpu_id, []).append((bucket_s, cap_w, power_w, utilization_pct))

    fits = 0
    for r in due:
        entry = _learned[r.attempt_id]
        gpus = [latest[u] for u in r.gpus if u in latest]
        if not gpus:
            entry.checked_s = now_s
            continue
        max_w = min(g[1] for g in gpus)
        newest = entry.last_bucket_s
        for gpu_id, gpu_max_w, *_ in gpus:
            for bucket_s, cap_w, power_w, utilization_pct in buckets.get(gpu_id, ()):
                # A bucket that began before the attempt mixes in someone else's draw.
                if bucket_s <= entry.last_bucket_s or bucket_s < entry.started_s:
                    continue
                if _busy(power_w, utilization_pct):
                    entry.summary.add(
                        gpu_max_w if cap_w is None else cap_w, power_w, _share(utilization_pct)
                    )
                newest = max(newest, bucket_s)
        entry.last_bucket_s = newest
        fitted = entry.summary.samples()
        if not fitted:
            # No bucket has closed yet: the latest readings stand in, until one has.
            latest_summary = CapSummary(CAP_BIN_W)
            for _, gpu_max_w, cap_w, power_w, utilization_pct, reading_s in gpus:
                if reading_s is not None and reading_s >= entry.started_s:
                    if _busy(power_w, utilization_pct):
                        latest_summary.add(
                            gpu_max_w if cap_w is None else cap_w, power_w, _share(utilization_pct)
                        )
            fitted = latest_summary.samples()
        if not fitted:
            entry.checked_s = now_s
            continue
        if entry.profile.samples and not samples_moved(
            entry.fitted_on, fitted, REFIT_POWER_W, REFIT_UTILIZATION
        ):
            weight = round(sum(s.weight for s in fitted))
            entry.profile = replace(entry.profile, samples=max(weight, entry.profile.samples))
            entry.checked_s = now_s
            continue
        if fits >= MAX_FITS_PER_LOAD:
            continue  # still due: first in line next load
        entry.profile = fit_profile(fitted, max_w, iterations=FIT_ITERATIONS)
        entry.fitted_on = tuple(fitted)
        entry.checked_s = now_s
        fits += 1


def _share(utilization_pct: float | None) -> float | None:
    return None if utilization_pct is None else utilization_pct / 100.0


def _busy(power_w: float | None, utilization_pct: float | None) -> bool:
    if power_w is None:
        return False
    # Without a utilization reading (not every board reports it) the draw is taken as it is.
    return utilization_pct is None or utilization_pct >= MIN_BUSY_UTILIZATION_PCT
