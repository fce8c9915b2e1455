"""A generated past week for the demo, so that a fresh install has history to show.

What-if replays, usage and chargeback, duration predictions and job charts all read the cluster's
own past; a new demo has none, and the README's `manage.py whatif` example would answer "no
finished job was submitted". This module draws a plausible week for the demo's tenants on the
nodes that exist (deterministic for a seed), and writes it through the actions layer:

- Jobs come from a few recurring kinds per tenant (a sweep of 1-GPU runs, fine-tunes on 2-4 GPUs,
  8-GPU pre-training, short evaluation shards), so a duration predictor has repeats to learn from.
  Durations are log-normal around each kind's median (the shape of the Philly and Helios traces).
- Arrivals are a Poisson process whose rate follows the working day (busier 8:00-20:00 UTC,
  quieter at night and at the weekend), sized so the week keeps the GPUs roughly half busy.
- Placement is first-come first-served with out-of-order starts, on a node of the job's GPU
  model: each job starts at the earliest time some node has enough of its GPUs free, so no GPU
  ever holds two jobs at once and queueing happens where load peaks. It is not the scheduler's
  policy (the what-if replay compares the policies against this record).
- Power: every minute, the GPUs in use share the pool's budget left after the idle ones, each
  capped between its limits (as the cap planner keeps a pool under its budget), and draw what
  scheduler.gpu_model says a typical training job draws under that cap. Attempts are charged
  that energy; the last day (what telemetry keeps) also gets its per-minute telemetry, so the
  charts of recent jobs agree with what they were charged.
- About 8 % fail (exit code 1, part-way) and 3 % are cancelled by their owner while running.
"""

from __future__ import annotations

import datetime as dt
import math
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler import gpu_model
from scheduler.model import PowerProfile

DEMO_HISTORY_DAYS = 7.0
# Share of the week's GPU-hours the arrivals ask for (the placement then decides the queueing).
TARGET_LOAD = 0.5
MINUTE_S = 60.0
FAIL_SHARE = 0.08
CANCEL_SHARE = 0.03
PROFILE = PowerProfile()


@dataclass(frozen=True, slots=True)
class JobKind:
    name: str
    gpus: int
    gpu_type: str
    median_s: float
    sigma: float  # of the log-normal duration
    weight: float  # share of the tenant's submissions
    command: tuple[str, ...]


H100, A100 = "H100-SXM-80GB", "A100-SXM4-80GB"
JOB_KINDS: dict[str, tuple[JobKind, ...]] = {
    "vision": (
        JobKind("resnet50-imagenet", 8, H100, 5 * 3600, 0.35, 0.06, ("python", "train.py")),
        JobKind("vit-b16-finetune", 4, H100, 2 * 3600, 0.5, 0.14, ("python", "finetune.py")),
        JobKind("detr-lr-sweep", 1, A100, 90 * 60, 0.6, 0.45, ("python", "sweep.py")),
        JobKind("coco-eval-shard", 1, A100, 15 * 60, 0.4, 0.35, ("python", "evaluate.py")),
    ),
    "nlp": (
        JobKind("llama-7b-sft", 8, H100, 6 * 3600, 0.4, 0.05, ("torchrun", "sft.py")),
        JobKind("bert-large-glue", 2, H100, 90 * 60, 0.5, 0.2, ("python", "glue.py")),
        JobKind("tokenizer-build", 1, A100, 40 * 60, 0.5, 0.25, ("python", "tokenize.py")),
        JobKind("lm-eval-harness", 1, A100, 20 * 60, 0.45, 0.5, ("python", "-m", "lm_eval")),
    ),
}


@dataclass(frozen=True, slots=True)
class NodeShape:
    name: str
    gpu_type: str
    # (index, power_min_w, power_max_w) of each GPU
    gpus: tuple[tuple[int, float, float], ...]


@dataclass(slots=True)
class PastRun:
    """One finished job of the generated week: what jobs.actions.import_finished_jobs writes."""

    tenant: str
    kind: JobKind
    submitted_at: dt.datetime
    started_at: dt.datetime
    finished_at: dt.datetime
    node: str
    gpu_indexes: tuple[int, ...]
    outcome: str  # "succeeded", "failed" or "cancelled"
    exit_code: int | None
    energy_j: float = 0.0


@dataclass(frozen=True, slots=True)
class TelemetryPoint:
    node: str
    gpu_index: int
    at: dt.datetime
    utilization_pct: float
    power_draw_w: float
    power_cap_w: float


def _arrival_rate_weight(at: dt.datetime) -> float:
    """How busy submissions are at this hour, relative to a working-day peak of 1."""
    weekend = at.weekday() >= 5
    hour = at.hour + at.minute / 60.0
    day = 1.0 if 8.0 <= hour < 20.0 else 0.3
    return day * (0.35 if weekend else 1.0)


def _mean_gpu_s(kinds: Sequence[JobKind]) -> float:
    total = sum(k.weight for k in kinds)
    # The mean of a log-normal is median * exp(sigma^2 / 2).
    return sum(k.weight / total * k.gpus * k.median_s * math.exp(k.sigma**2 / 2) for k in kinds)


def generate(
    nodes: Sequence[NodeShape],
    tenants: Sequence[str],
    *,
    end: dt.datetime,
    days: float = DEMO_HISTORY_DAYS,
    seed: int = 1,
) -> list[PastRun]:
    """The week's finished jobs, placed on `nodes`, all ended before `end`."""
    rng = random.Random(seed)
    begin = end - dt.timedelta(days=days)
    gpus_of_type: dict[str, int] = defaultdict(int)
    for node in nodes:
        gpus_of_type[node.gpu_type] += len(node.gpus)
    # Only kinds the cluster can run: a model no node has, or more GPUs than its biggest node.
    largest: dict[str, int] = defaultdict(int)
    for node in nodes:
        largest[node.gpu_type] = max(largest[node.gpu_type], len(node.gpus))
    kinds = {
        t: tuple(k for k in JOB_KINDS.get(t, ()) if k.gpus <= largest.get(k.gpu_type, 0))
        for t in tenants
    }
    kinds = {t: ks for t, ks in kinds.items() if ks}
    if not kinds:
        return []
    mean_weight = sum(
        _arrival_rate_weight(begin + dt.timedelta(hours=h)) for h in range(int(days * 24))
    ) / max(int(days * 24), 1)
    # One arrival stream per GPU model, its peak rate sized so that the week asks for
    # TARGET_LOAD of that model's GPUs: a model with few GPUs is not drowned by the other's work.
    streams: list[tuple[float, list[tuple[str, JobKind]]]] = []
    for gpu_type in sorted({k.gpu_type for ks in kinds.values() for k in ks}):
        choices = [(t, k) for t, ks in sorted(kinds.items()) for k in ks if k.gpu_type == gpu_type]
        mean_gpu_s = _mean_gpu_s([k for _, k in choices])
        peak_rate_per_s = TARGET_LOAD * gpus_of_type[gpu_type] / (mean_gpu_s * mean_weight)
        streams.append((peak_rate_per_s, choices))

    # Thinning: draw at the peak rate, keep each arrival with the hour's weight.
    arrivals: list[tuple[dt.datetime, str, JobKind]] = []
    span_s = days * 86400.0
    for peak_rate_per_s, choices in streams:
        t_s = 0.0
        while True:
            t_s += rng.expovariate(peak_rate_per_s)
            if t_s >= span_s:
                break
            at = begin + dt.timedelta(seconds=t_s)
            if rng.random() > _arrival_rate_weight(at):
                continue
            tenant, kind = rng.choices(choices, weights=[k.weight for _, k in choices])[0]
            arrivals.append((at, tenant, kind))
    arrivals.sort(key=lambda a: a[0])

    free_at: dict[tuple[str, int], dt.datetime] = {
        (n.name, g[0]): begin for n in nodes for g in n.gpus
    }
    runs: list[PastRun] = []
    for submitted_at, tenant, kind in arrivals:
        duration_s = max(30.0, rng.lognormvariate(math.log(kind.median_s), kind.sigma))
        roll = rng.random()
        exit_code: int | None = 0
        outcome = "succeeded"
        if roll < FAIL_SHARE:
            outcome, exit_code = "failed", 1
            duration_s *= rng.uniform(0.05, 0.6)
        elif roll < FAIL_SHARE + CANCEL_SHARE:
            outcome, exit_code = "cancelled", None
            duration_s *= rng.uniform(0.1, 0.8)
        best: tuple[dt.datetime, str, tuple[int, ...]] | None = None
        for node in nodes:
            if node.gpu_type != kind.gpu_type or len(node.gpus) < kind.gpus:
                continue
            by_free = sorted(node.gpus, key=lambda g: (free_at[(node.name, g[0])], g[0]))
            chosen = by_free[: kind.gpus]
            start = max(submitted_at, free_at[(node.name, chosen[-1][0])])
            # A few seconds from the admission to the container running, as on a real node.
            start += dt.timedelta(seconds=rng.uniform(1.0, 4.0))
            if best is None or start < best[0]:
                best = (start, node.name, tuple(sorted(g[0] for g in chosen)))
        if best is None:
            continue
        started_at, node_name, indexes = best
        finished_at = started_at + dt.timedelta(seconds=duration_s)
        if finished_at >= end:
            continue  # still running "now": a history holds finished jobs only
        for index in indexes:
            free_at[(node_name, index)] = finished_at
        runs.append(
            PastRun(
                tenant=tenant,
                kind=kind,
                submitted_at=submitted_at,
                started_at=started_at,
                finished_at=finished_at,
                node=node_name,
                gpu_indexes=indexes,
                outcome=outcome,
                exit_code=exit_code,
            )
        )
    return runs


def charge_power(
    runs: list[PastRun],
    nodes: Sequence[NodeShape],
    *,
    power_budget_w: float | None,
    end: dt.datetime,
    telemetry_s: float,
) -> list[TelemetryPoint]:
    """Set each run's energy_j from a per-minute power model; the telemetry of the last
    `telemetry_s` seconds before `end` (busy GPUs only, as buckets the charts read)."""
    if not runs:
        return []
    shapes = {(n.name, g[0]): (n.gpu_type, g[1], g[2]) for n in nodes for g in n.gpus}

    def idle_w(key) -> float:
        gpu_type, min_w, max_w = shapes[key]
        known = gpu_model.GPU_TYPES.get(gpu_type)
        return min(known.idle_w if known else 0.12 * max_w, min_w)

    begin = min(r.started_at for r in runs)
    start_minute = math.floor(begin.timestamp() / MINUTE_S)
    end_minute = math.ceil(end.timestamp() / MINUTE_S)
    # Which run holds each GPU in each minute, from the runs' intervals.
    holding: dict[int, list[tuple[int, tuple[str, int], float]]] = defaultdict(list)
    for i, run in enumerate(runs):
        first = math.floor(run.started_at.timestamp() / MINUTE_S)
        last = math.floor(run.finished_at.timestamp() / MINUTE_S)
        for minute in range(first, last + 1):
            lo = max(run.started_at.timestamp(), minute * MINUTE_S)
            hi = min(run.finished_at.timestamp(), (minute + 1) * MINUTE_S)
            if hi <= lo:
                continue
            for index in run.gpu_indexes:
                holding[minute].append((i, (run.node, index), hi - lo))
    all_idle_w = sum(idle_w(k) for k in shapes)
    telemetry_from = end.timestamp() - telemetry_s
    points: list[TelemetryPoint] = []
    for minute in range(start_minute, end_minute):
        held = holding.get(minute)
        if not held:
            continue
        busy = {key for _, key, _ in held}
        left_w = (
            None
            if power_budget_w is None
            else power_budget_w - (all_idle_w - sum(idle_w(k) for k in busy))
        )
        max_sum_w = sum(shapes[k][2] for k in busy)
        caps: dict[tuple[str, int], float] = {}
        for key in busy:
            _, min_w, max_w = shapes[key]
            share_w = max_w if left_w is None else left_w * max_w / max_sum_w
            caps[key] = min(max(share_w, min_w), max_w)
        at = dt.datetime.fromtimestamp(minute * MINUTE_S, tz=dt.UTC)
        for i, key, seconds in held:
            _, _, max_w = shapes[key]
            draw_w = gpu_model.power_draw_w(PROFILE, caps[key], max_w, idle_w(key))
            runs[i].energy_j += draw_w * seconds
        if minute * MINUTE_S >= telemetry_from:
            for key in sorted(busy):
                _, _, max_w = shapes[key]
                cap_w = caps[key]
                points.append(
                    TelemetryPoint(
                        node=key[0],
                        gpu_index=key[1],
                        at=at,
                        utilization_pct=round(
                            100.0 * gpu_model.gpu_utilization(PROFILE, cap_w, max_w), 1
                        ),
                        power_draw_w=round(
                            gpu_model.power_draw_w(PROFILE, cap_w, max_w, idle_w(key)), 1
                        ),
                        power_cap_w=round(cap_w, 1),
                    )
                )
    return points
