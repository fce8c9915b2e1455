"""Where each tenant stands against its energy and GPU-hour budgets this period.

Usage is booked on attempts (JobAttempt.gpu_seconds / energy_j, kept current by heartbeats for
running attempts); a period is the current UTC day, ISO week (from Monday) or calendar month.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from django.db.models import Q, Sum
from django.utils import timezone

from controlplane.audit import trail
from controlplane.audit.models import AuditEvent
from controlplane.jobs.models import JobAttempt
from controlplane.tenancy.models import Budget, BudgetKind

J_PER_KWH = 3.6e6


class PeriodOutOfRange(ValueError):
    """The period around a moment does not fit in the calendar (year 1 to 9999, in UTC)."""


def period_bounds(period: str, now: dt.datetime) -> tuple[dt.datetime, dt.datetime]:
    """[start, end) of the period that contains now, in UTC.

    PeriodOutOfRange when it would start before year 1 or end after 9999 (the week of
    9999-12-31 ends in the year 10000).
    """
    try:
        return _period_bounds(period, now)
    except OverflowError:
        raise PeriodOutOfRange(
            f"The {period} around {now.date().isoformat()} does not fit in the calendar "
            "(years 1 to 9999, UTC)."
        ) from None


def _period_bounds(period: str, now: dt.datetime) -> tuple[dt.datetime, dt.datetime]:
    now = now.astimezone(dt.UTC)
    day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        return day, day + dt.timedelta(days=1)
    if period == "week":
        start = day - dt.timedelta(days=day.weekday())
        return start, start + dt.timedelta(days=7)
    if period == "month":
        start = day.replace(day=1)
        end = (start + dt.timedelta(days=32)).replace(day=1)
        return start, end
    raise ValueError(f"unknown budget period {period!r}")


@dataclass(frozen=True)
class Usage:
    gpu_seconds: float = 0.0
    energy_j: float = 0.0

    @property
    def gpu_hours(self) -> float:
        return self.gpu_seconds / 3600.0

    @property
    def energy_kwh(self) -> float:
        return self.energy_j / J_PER_KWH


def usage_by_tenant(start: dt.datetime, end: dt.datetime, tenant_ids=None) -> dict[int, Usage]:
    """GPU-seconds and joules of attempts that ended in [start, end), plus those still running.

    An attempt is booked to the period it ends in, so a finished period's figures never change.
    """
    in_period = Q(finished_at__gte=start, finished_at__lt=end) | Q(
        finished_at__isnull=True, created_at__lt=end
    )
    rows = JobAttempt.objects.filter(in_period)
    if tenant_ids is not None:
        rows = rows.filter(job__tenant_id__in=tenant_ids)
    totals = rows.values("job__tenant_id").annotate(
        gpu_s=Sum("gpu_seconds"), energy=Sum("energy_j")
    )
    return {r["job__tenant_id"]: Usage(r["gpu_s"] or 0.0, r["energy"] or 0.0) for r in totals}


@dataclass(frozen=True)
class BudgetState:
    budget_id: int
    tenant_id: int
    kind: str
    period: str
    amount: float
    used: float
    action: str
    period_start: dt.datetime
    period_end: dt.datetime
    warn_at_fraction: float

    @property
    def fraction_used(self) -> float:
        return self.used / self.amount if self.amount else 0.0

    @property
    def exhausted(self) -> bool:
        return self.used >= self.amount

    def power_pace_w(self, now: dt.datetime) -> float | None:
        """Average watts the tenant may still draw for the rest of the period."""
        if self.kind != BudgetKind.ENERGY_KWH:
            return None
        remaining_s = max(1.0, (self.period_end - now).total_seconds())
        remaining_j = max(0.0, (self.amount - self.used) * J_PER_KWH)
        return remaining_j / remaining_s


def budget_states(now: dt.datetime | None = None, period: str | None = None) -> list[BudgetState]:
    """Every budget (of one period, if given) with its use this period, in a query per distinct
    period (at most three)."""
    now = now or timezone.now()
    selected = Budget.objects.all()
    budgets = list(selected if period is None else selected.filter(period=period))
    usage_cache: dict[str, dict[int, Usage]] = {}
    states = []
    for budget in budgets:
        start, end = period_bounds(budget.period, now)
        if budget.period not in usage_cache:
            usage_cache[budget.period] = usage_by_tenant(start, end)
        usage = usage_cache[budget.period].get(budget.tenant_id, Usage())
        used = usage.energy_kwh if budget.kind == BudgetKind.ENERGY_KWH else usage.gpu_hours
        states.append(
            BudgetState(
                budget_id=budget.pk,
                tenant_id=budget.tenant_id,
                kind=budget.kind,
                period=budget.period,
                amount=budget.amount,
                used=used,
                action=budget.action,
                period_start=start,
                period_end=end,
                warn_at_fraction=budget.warn_at_fraction,
            )
        )
    return states


# When several budgets of a tenant are spent, the strictest action wins.
ACTION_SEVERITY = {"throttle": 0, "no_borrowing": 1, "hold": 2}


@dataclass(frozen=True)
class TenantBudgetView:
    """What the scheduling core needs to know of a tenant's budgets this cycle."""

    budget_action: str | None
    power_pace_w: float | None


def scheduler_view(states: list[BudgetState], now: dt.datetime) -> dict[int, TenantBudgetView]:
    action: dict[int, str] = {}
    pace: dict[int, float] = {}
    for s in states:
        if s.exhausted and ACTION_SEVERITY[s.action] >= ACTION_SEVERITY.get(
            action.get(s.tenant_id, ""), -1
        ):
            action[s.tenant_id] = s.action
        p = s.power_pace_w(now)
        if p is not None:
            pace[s.tenant_id] = min(p, pace.get(s.tenant_id, p))
    return {t: TenantBudgetView(action.get(t), pace.get(t)) for t in set(action) | set(pace)}


def record_budget_warnings(states: list[BudgetState]) -> int:
    """Write one audit row per budget and period when use crosses the warning threshold or runs out."""
    written = 0
    for s in states:
        for kind, crossed in (
            ("budget.exhausted", s.exhausted),
            ("budget.warning", s.fraction_used >= s.warn_at_fraction),
        ):
            if not crossed:
                continue
            key = {"budget": s.budget_id, "period_start": s.period_start.isoformat()}
            seen = AuditEvent.objects.filter(
                tenant_id=s.tenant_id,
                action=kind,
                after__budget=s.budget_id,
                after__period_start=key["period_start"],
            )
            if seen.exists():
                continue
            unit = "kWh" if s.kind == BudgetKind.ENERGY_KWH else "GPU-hours"
            verb = "is spent" if kind == "budget.exhausted" else f"is {s.fraction_used:.0%} used"
            trail.record(
                kind,
                actor_label="budget check",
                tenant=s.tenant_id,
                object_type="budget",
                object_id=s.budget_id,
                message=f"The {s.period}ly {unit} budget ({s.amount:g} {unit}) {verb}; action: {s.action}.",
                after={**key, "used": s.used, "amount": s.amount},
            )
            written += 1
            break  # exhausted implies the warning; say the stronger one only
    return written
