"""A what-if request: its parameters, parsed from command-line or form strings and checked
against the database, with errors that name the argument at fault."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from django.utils import timezone

from controlplane.cluster.models import GPU, Pool
from controlplane.tenancy.models import Tenant
from scheduler import model as m
from scheduler.simulator.policies import PRESETS

# The policy production runs: the preset "ours" is replayed with production's own config.
PRODUCTION_PRESET = "ours"
ANY_TYPE_WORDS = ("any", "*", "")


class WhatIfError(ValueError):
    """A what-if request that cannot run, naming the argument at fault."""

    def __init__(self, argument: str, message: str):
        self.argument = argument
        self.message = message
        super().__init__(f"{argument}: {message}")


@dataclass(frozen=True, slots=True)
class QuotaChange:
    tenant: str
    gpu_type: str  # m.ANY_GPU_TYPE for the sum over all types
    guaranteed_gpus: int
    limit_gpus: int

    def describe(self) -> str:
        return f"{self.tenant}:{self.gpu_type or 'any'}={self.guaranteed_gpus}:{self.limit_gpus}"


@dataclass(frozen=True)
class WhatIfParams:
    since: dt.datetime
    until: dt.datetime
    policy: str = PRODUCTION_PRESET
    weights: dict[str, float] = field(default_factory=dict)
    quotas: tuple[QuotaChange, ...] = ()
    power_budgets_w: dict[str, float | None] = field(default_factory=dict)  # None: no budget
    cycle_s: float | None = None  # None: the production loop's interval

    @property
    def changes_anything(self) -> bool:
        return bool(
            self.policy != PRODUCTION_PRESET or self.weights or self.quotas or self.power_budgets_w
        )

    def to_json(self) -> dict:
        return {
            "since": self.since.isoformat(),
            "until": self.until.isoformat(),
            "policy": self.policy,
            "weights": dict(self.weights),
            "quotas": [dataclasses.asdict(q) for q in self.quotas],
            "power_budgets_w": dict(self.power_budgets_w),
            "cycle_s": self.cycle_s,
        }

    @classmethod
    def from_json(cls, data: dict) -> WhatIfParams:
        return cls(
            since=dt.datetime.fromisoformat(data["since"]),
            until=dt.datetime.fromisoformat(data["until"]),
            policy=data.get("policy", PRODUCTION_PRESET),
            weights={k: float(v) for k, v in (data.get("weights") or {}).items()},
            quotas=tuple(QuotaChange(**q) for q in data.get("quotas") or ()),
            power_budgets_w=dict(data.get("power_budgets_w") or {}),
            cycle_s=data.get("cycle_s"),
        )


def parse_time(text: str, argument: str) -> dt.datetime:
    """A date (midnight UTC) or an ISO 8601 time (UTC when it names no zone)."""
    try:
        value = dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise WhatIfError(
            argument, f"{text!r} is not a date (YYYY-MM-DD) or an ISO 8601 time"
        ) from None
    return value.astimezone(dt.UTC) if timezone.is_aware(value) else value.replace(tzinfo=dt.UTC)


_WEIGHT = re.compile(r"^\s*([\w.-]+)\s*=\s*([0-9]*\.?[0-9]+(?:[eE][-+]?\d+)?)\s*$")
_QUOTA = re.compile(r"^\s*([\w.-]+)\s*:\s*([^=]*?)\s*=\s*(\d+)\s*:\s*(\d+)\s*$")
_BUDGET = re.compile(r"^\s*([\w.-]+)\s*=\s*(none|[0-9]*\.?[0-9]+)\s*$", re.IGNORECASE)


def parse_weight(text: str) -> tuple[str, float]:
    match = _WEIGHT.match(text)
    if not match:
        raise WhatIfError("--weight", f"{text!r} is not TENANT=WEIGHT (e.g. vision=2)")
    weight = float(match.group(2))
    if weight <= 0:
        raise WhatIfError("--weight", f"{text!r}: a weight must be above 0")
    return match.group(1), weight


def parse_quota(text: str) -> QuotaChange:
    match = _QUOTA.match(text)
    if not match:
        raise WhatIfError(
            "--quota",
            f"{text!r} is not TENANT:GPU_TYPE=GUARANTEED:LIMIT "
            "(e.g. vision:H100-SXM-80GB=8:16; GPU_TYPE 'any' for all types together)",
        )
    tenant, gpu_type, guaranteed, limit = match.groups()
    gpu_type = m.ANY_GPU_TYPE if gpu_type.lower() in ANY_TYPE_WORDS else gpu_type
    change = QuotaChange(tenant, gpu_type, int(guaranteed), int(limit))
    if change.limit_gpus < change.guaranteed_gpus:
        raise WhatIfError("--quota", f"{text!r}: the limit is below the guarantee")
    return change


def parse_power_budget(text: str) -> tuple[str, float | None]:
    match = _BUDGET.match(text)
    if not match:
        raise WhatIfError("--power-budget", f"{text!r} is not POOL=WATTS or POOL=none")
    value = match.group(2)
    if value.lower() == "none":
        return match.group(1), None
    watts = float(value)
    if watts <= 0:
        raise WhatIfError("--power-budget", f"{text!r}: a budget must be above 0 W")
    return match.group(1), watts


def build_params(
    *,
    since: str | dt.datetime | None,
    until: str | dt.datetime | None,
    policy: str = PRODUCTION_PRESET,
    weights: Iterable[str] = (),
    quotas: Iterable[str] = (),
    power_budgets: Iterable[str] = (),
    cycle_s: float | None = None,
) -> WhatIfParams:
    """Parse a request (command-line or form strings) and check it against the database.

    Until defaults to now, since to 30 days before until. Raises WhatIfError naming the argument.
    """
    if isinstance(until, str):
        until = parse_time(until, "--until")
    until = until or timezone.now()
    if isinstance(since, str):
        since = parse_time(since, "--since")
    since = since or until - dt.timedelta(days=30)
    if since >= until:
        raise WhatIfError(
            "--since", f"{since.isoformat()} is not before --until {until.isoformat()}"
        )
    if policy not in PRESETS:
        raise WhatIfError("--policy", f"unknown policy {policy!r}; known: {', '.join(PRESETS)}")
    if cycle_s is not None and cycle_s <= 0:
        raise WhatIfError("--cycle-s", "the cycle interval must be above 0 s")
    weight_map = dict(parse_weight(w) for w in weights)
    quota_changes: dict[tuple[str, str], QuotaChange] = {}
    for text in quotas:
        change = parse_quota(text)
        quota_changes[(change.tenant, change.gpu_type)] = change  # the last one given wins
    budgets = dict(parse_power_budget(b) for b in power_budgets)
    params = WhatIfParams(
        since=since,
        until=until,
        policy=policy,
        weights=weight_map,
        quotas=tuple(quota_changes.values()),
        power_budgets_w=budgets,
        cycle_s=cycle_s,
    )
    _check_against_cluster(params)
    return params


def _check_against_cluster(params: WhatIfParams) -> None:
    tenants = set(Tenant.objects.values_list("slug", flat=True))
    known_tenants = ", ".join(sorted(tenants)) or "none"
    for tenant in params.weights:
        if tenant not in tenants:
            raise WhatIfError("--weight", f"unknown tenant {tenant!r} (known: {known_tenants})")
    gpu_types = set(GPU.objects.values_list("model", flat=True).distinct())
    for q in params.quotas:
        if q.tenant not in tenants:
            raise WhatIfError("--quota", f"unknown tenant {q.tenant!r} (known: {known_tenants})")
        if q.gpu_type and q.gpu_type not in gpu_types:
            raise WhatIfError(
                "--quota",
                f"no GPU of type {q.gpu_type!r} in the cluster "
                f"(types: {', '.join(sorted(gpu_types)) or 'none'}; or 'any')",
            )
    pools = set(Pool.objects.values_list("name", flat=True))
    for pool in params.power_budgets_w:
        if pool not in pools:
            raise WhatIfError(
                "--power-budget",
                f"unknown pool {pool!r} (known: {', '.join(sorted(pools)) or 'none'})",
            )
