"""What-if pages, for cluster admins: replay a period of the cluster's history under changed
quotas, weights, power budgets or policy, watch the replay's progress, and read its report.

The form takes the very arguments of `manage.py whatif` and checks them with the same parser,
so a mistake reads the same in both. The run itself is a Celery task (a thread in the embedded
mode); the run page polls its progress with htmx and shows the report when it is done.
"""

from __future__ import annotations

import datetime as dt
import re

from django import forms
from django.contrib import messages
from django.shortcuts import get_object_or_404, redirect, render
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

from controlplane.scheduling.models import WhatIfRun, WhatIfState
from controlplane.scheduling.whatif import WhatIfError, WhatIfParams, build_params
from controlplane.scheduling.whatif_tasks import launch_whatif
from frontend.views import page, staff_required
from scheduler.simulator.policies import PRESETS

POLL_S = 2
RECENT_RUNS = 20
STATE_BADGE = {
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
        (run, _describe(run), STATE_BADGE.get(run.state, "info"))
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
    context = {
        "run": run,
        "described": _describe(run),
        "badge_class": STATE_BADGE.get(run.state, "info"),
        "report_html": render_markdown(run.report_markdown) if run.report_markdown else "",
        "poll_s": POLL_S,
        "progress_pct": round(100 * run.progress),
    }
    if request.htmx:
        return render(request, "frontend/whatif/live.html", {**context, "fragment": True})
    return page(request, "frontend/whatif/detail.html", context, nav="whatif")


def _initial_period() -> dict:
    today = dt.datetime.now(dt.UTC).date()
    return {"since": today - dt.timedelta(days=30), "until": today + dt.timedelta(days=1)}


def _describe(run: WhatIfRun) -> dict:
    """The period, policy and changes of a run, for a person."""
    try:
        params = WhatIfParams.from_json(run.params)
    except (KeyError, TypeError, ValueError):
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


# --- a small Markdown renderer: the subset the what-if report uses, everything escaped -----------

_INLINE_CODE = re.compile(r"`([^`]+)`")
_IMAGE = re.compile(r"!\[([^\]]*)\]\([^)]*\)")
_TABLE_SEPARATOR = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")


def _inline(text: str) -> str:
    # Escape first: nothing from the report reaches the page as markup.
    html = escape(text)
    html = _IMAGE.sub(lambda m: f"<em>(plot: {m.group(1)})</em>", html)
    return _INLINE_CODE.sub(lambda m: f"<code>{m.group(1)}</code>", html)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def render_markdown(text: str) -> SafeString:
    """Headings, paragraphs, bullet lists, tables and code blocks, as escaped HTML.

    Headings drop one level (the page has its own h1), so the report's title is an h2.
    """
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    paragraph: list[str] = []

    def flush() -> None:
        if paragraph:
            out.append(f"<p>{_inline(' '.join(paragraph))}</p>")
            paragraph.clear()

    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped.startswith("```"):
            flush()
            body = []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith("```"):
                body.append(lines[i])
                i += 1
            out.append(f'<pre class="code">{escape(chr(10).join(body))}</pre>')
        elif heading := re.match(r"^(#{1,5})\s+(.*)$", stripped):
            flush()
            level = min(len(heading.group(1)) + 1, 6)
            out.append(f"<h{level}>{_inline(heading.group(2))}</h{level}>")
        elif stripped.startswith("- "):
            flush()
            items = []
            while i < len(lines) and lines[i].strip().startswith("- "):
                items.append(f"<li>{_inline(lines[i].strip()[2:])}</li>")
                i += 1
            out.append("<ul>" + "".join(items) + "</ul>")
            continue
        elif (
            stripped.startswith("|")
            and i + 1 < len(lines)
            and _TABLE_SEPARATOR.match(lines[i + 1].strip())
        ):
            flush()
            header = _cells(stripped)
            numeric = [c.endswith(":") for c in _cells(lines[i + 1])]
            i += 2
            rows = []
            while i < len(lines) and lines[i].strip().startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            out.append(_table(header, numeric, rows))
            continue
        elif not stripped:
            flush()
        else:
            paragraph.append(stripped)
        i += 1
    flush()
    # Safe: every piece of text above went through escape().
    return mark_safe("\n".join(out))


def _table(header: list[str], numeric: list[bool], rows: list[list[str]]) -> str:
    def css(k: int) -> str:
        return ' class="num nowrap"' if k < len(numeric) and numeric[k] else ""

    head = "".join(f'<th scope="col"{css(k)}>{_inline(c)}</th>' for k, c in enumerate(header))
    body = []
    for row in rows:
        cells = [f'<th scope="row">{_inline(row[0])}</th>'] if row else []
        cells += [f"<td{css(k)}>{_inline(c)}</td>" for k, c in enumerate(row[1:], start=1)]
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (
        f'<div class="table-wrap"><table><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div>"
    )
