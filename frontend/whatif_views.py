"""What-if pages, for cluster admins: replay a period of the cluster's history under changed
quotas, weights, power budgets or policy, watch the replay's progress, and read its report.

The form takes the very arguments of `manage.py whatif` and checks them with the same parser,
so a mistake reads the same in both. The run itself is a Celery task (a thread in the embedded
mode); the run page polls its progress with htmx and, when it is done, renders the report from
the run's structured summary with templates (the Markdown download is written from that same
summary).
"""

from __future__ import annotations

import datetime as dt
import re

from django import forms
from django.contrib import messages
from django.http import Http404, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render

from controlplane.scheduling.models import WhatIfRun, WhatIfState
from controlplane.scheduling.whatif.params import WhatIfError, WhatIfParams, build_params
from controlplane.scheduling.whatif.report import Report, report_of
from controlplane.scheduling.whatif_tasks import launch_whatif
from frontend.bar_charts import BarChart, Group, render_bars
from frontend.pages import page, staff_required
from scheduler.simulator.policies import PRESETS

POLL_S = 2
RECENT_RUNS = 20
STATE_BADGE: dict[str, str] = {
    WhatIfState.QUEUED: "warn",
    WhatIfState.RUNNING: "info",
    WhatIfState.DONE: "ok",
    WhatIfState.FAILED: "bad",
}
# Which form field a parser error belongs to.
_FIELD_OF_ARGUMENT = {
    "--since": "since",
    "--until": "until",
    "--policy": "policy",
    "--weight": "weights",
    "--quota": "quotas",
    "--power-budget": "power_budgets",
}


def _entries(text: str) -> list[str]:
    # None of the formats has spaces or commas in it, so any of them separates entries.
    return [e for e in re.split(r"[\s,;]+", text or "") if e]


class WhatIfForm(forms.Form):
    since = forms.DateField(
        label="From", widget=forms.DateInput(attrs={"type": "date"}), help_text="UTC midnight."
    )
    until = forms.DateField(
        label="Until (not included)",
        widget=forms.DateInput(attrs={"type": "date"}),
        help_text="Jobs submitted in the period and finished since are replayed.",
    )
    policy = forms.ChoiceField(
        choices=[(name, f"{name}: {p.description}") for name, p in PRESETS.items()],
        initial="ours",
    )
    weights = forms.CharField(
        label="Tenant weights",
        required=False,
        widget=forms.Textarea(attrs={"rows": 2, "placeholder": "vision=2"}),
        help_text="One per line: tenant=weight.",
    )
    quotas = forms.CharField(
        label="Quotas",
        required=False,
        widget=forms.Textarea(attrs={"rows": 2, "placeholder": "vision:H100-SXM-80GB=8:16"}),
        help_text="One per line: tenant:GPU type=guaranteed:limit (GPU type 'any' for all types).",
    )
    power_budgets = forms.CharField(
        label="Pool power budgets",
        required=False,
        widget=forms.Textarea(attrs={"rows": 2, "placeholder": "default=5000"}),
        help_text="One per line: pool=watts, or pool=none for no budget.",
    )

    def clean(self):
        data = super().clean()
        if self.errors:
            return data
        try:
            self.params = build_params(
                since=_midnight(data["since"]),
                until=_midnight(data["until"]),
                policy=data["policy"],
                weights=_entries(data.get("weights", "")),
                quotas=_entries(data.get("quotas", "")),
                power_budgets=_entries(data.get("power_budgets", "")),
            )
        except WhatIfError as exc:
            field = _FIELD_OF_ARGUMENT.get(exc.argument)
            if field is None:
                raise forms.ValidationError(exc.message) from exc
            self.add_error(field, exc.message)
        return data


def _midnight(day: dt.date) -> dt.datetime:
    return dt.datetime.combine(day, dt.time.min, tzinfo=dt.UTC)


@staff_required
def whatif_list(request):
    form = WhatIfForm(request.POST or None, initial=_initial_period())
    if request.method == "POST" and form.is_valid():
        run = launch_whatif(form.params, requested_by=request.user)
        messages.success(request, f"What-if {run.pk} queued: this page shows it as it runs.")
        return redirect("whatif-detail", pk=run.pk)
    runs = [
        (run, _describe(_params(run)), STATE_BADGE.get(run.state, "info"))
        for run in WhatIfRun.objects.select_related("requested_by")[:RECENT_RUNS]
    ]
    return page(
        request,
        "frontend/whatif/list.html",
        {"form": form, "runs": runs},
        nav="whatif",
        status=400 if form.errors else 200,
    )


@staff_required
def whatif_detail(request, pk: int):
    run = get_object_or_404(WhatIfRun.objects.select_related("requested_by"), pk=pk)
    params = _params(run)
    context = {
        "run": run,
        "described": _describe(params),
        "badge_class": STATE_BADGE.get(run.state, "info"),
        "report": _report(run, params),
        "report_charts": report_charts(run.summary) if run.state == WhatIfState.DONE else [],
        "poll_s": POLL_S,
        "progress_pct": round(100 * run.progress),
    }
    if request.htmx:
        return render(request, "frontend/whatif/live.html", {**context, "fragment": True})
    return page(request, "frontend/whatif/detail.html", context, nav="whatif")


@staff_required
def whatif_markdown(request, pk: int):
    """A finished run's report as Markdown, as `manage.py whatif` prints it."""
    run = get_object_or_404(WhatIfRun, pk=pk)
    if not run.report_markdown:
        raise Http404("This what-if has no report (yet).")
    response = HttpResponse(run.report_markdown, content_type="text/markdown; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="whatif-{run.pk}.md"'
    return response


def report_charts(summary: dict) -> list:
    """The report's comparison as bar charts: each row's completion and queueing times, and
    each tenant's mean queue (the table below them holds every figure)."""
    rows = [r for r in summary.get("rows", ()) if isinstance(r, dict)]
    if not rows:
        return []
    labels = [str(r.get("policy", "?")) for r in rows]
    times = (
        ("mean JCT", "mean_jct_s"),
        ("median JCT", "median_jct_s"),
        ("p99 JCT", "p99_jct_s"),
        ("mean queue", "mean_queue_s"),
        ("p99 queue", "p99_queue_s"),
    )
    seconds = [r.get(key) for r in rows for _, key in times]
    scale_s, unit = _time_unit([v for v in seconds if isinstance(v, int | float)])
    charts = [
        render_bars(
            BarChart(
                title="Job completion and queueing times",
                unit=unit,
                series=labels,
                groups=[
                    Group(name, [_scaled(r.get(key), scale_s) for r in rows]) for name, key in times
                ],
            )
        )
    ]
    tenants = sorted({t.get("tenant") for r in rows for t in r.get("tenants") or () if t})
    if tenants:
        queue_s = [t.get("mean_queue_s") for r in rows for t in r.get("tenants") or ()]
        t_scale_s, t_unit = _time_unit([v for v in queue_s if isinstance(v, int | float)])
        by_tenant = [{t.get("tenant"): t for t in r.get("tenants") or ()} for r in rows]
        charts.append(
            render_bars(
                BarChart(
                    title="Mean queue per tenant",
                    unit=t_unit,
                    series=labels,
                    groups=[
                        Group(
                            str(tenant),
                            [
                                _scaled((row.get(tenant) or {}).get("mean_queue_s"), t_scale_s)
                                for row in by_tenant
                            ],
                        )
                        for tenant in tenants
                    ],
                )
            )
        )
    return charts


def _time_unit(values_s: list[float]) -> tuple[float, str]:
    """Hours for a comparison of long times, minutes for shorter ones, seconds below that."""
    top_s = max(values_s, default=0.0)
    if top_s >= 2 * 3600:
        return 3600.0, "h"
    if top_s >= 120:
        return 60.0, "min"
    return 1.0, "s"


def _scaled(value, scale_s: float) -> float | None:
    # A figure the summary could not have (None for NaN) stays unknown, not zero.
    return value / scale_s if isinstance(value, int | float) else None


def _report(run: WhatIfRun, params: WhatIfParams | None) -> Report | None:
    """The report of a done run, read from its summary; None while there is none."""
    if run.state != WhatIfState.DONE or not run.summary.get("rows") or params is None:
        return None
    return report_of(params, run.summary)


def _params(run: WhatIfRun) -> WhatIfParams | None:
    try:
        return WhatIfParams.from_json(run.params)
    except (KeyError, TypeError, ValueError):
        return None


def _initial_period() -> dict:
    today = dt.datetime.now(dt.UTC).date()
    return {"since": today - dt.timedelta(days=30), "until": today + dt.timedelta(days=1)}


def _describe(params: WhatIfParams | None) -> dict:
    """The period, policy and changes of a run, for a person."""
    if params is None:
        return {"period": "?", "policy": "?", "changes": []}
    changes = [f"{t} weight {w:g}" for t, w in sorted(params.weights.items())]
    changes += [f"quota {q.describe()}" for q in params.quotas]
    changes += [
        f"pool {p} budget {'none' if w is None else f'{w:,.0f} W'}"
        for p, w in sorted(params.power_budgets_w.items())
    ]
    return {
        "period": f"{params.since:%Y-%m-%d} to {params.until:%Y-%m-%d}",
        "policy": params.policy,
        "changes": changes,
    }
