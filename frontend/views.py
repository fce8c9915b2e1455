"""Views of the web UI: short functions that check who may look, read through controlplane.queries,
and write only through the apps' actions (directly, or through the forms in forms.py).

Permission rules are the API's (controlplane.permissions): another tenant's objects are 404,
a role too low is 403, cluster-admin pages refuse everyone else with 403, and anonymous visitors
are sent to sign in. Live parts are fragments that htmx polls; every page works without them.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import shlex

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db.models import Count, Prefetch, ProtectedError, Q
from django.http import Http404, HttpResponse, HttpResponseNotAllowed
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST

from controlplane import queries
from controlplane.cluster import actions as cluster_actions
from controlplane.cluster.models import GPU, Node, NodeState, Pool
from controlplane.cluster.rules import NODE_ACTION_STATES
from controlplane.jobs import actions, arrays, validation
from controlplane.jobs.actions import STOP_NOTICE_EVENT
from controlplane.jobs.logs import display_text, read_log, read_log_bytes
from controlplane.jobs.models import ACTIVE_JOB_STATES, AttemptMember, Job, JobState
from controlplane.permissions import is_cluster_admin, require_role, tenant_roles, visible_tenants
from controlplane.storage import queries as storage_queries
from controlplane.storage.paths import CHECKPOINT_TARGET
from controlplane.tenancy import actions as tenancy_actions
from controlplane.tenancy.models import ApiToken, Budget, Membership, Quota, Role, Tenant
from frontend import charts, node_health, overview
from frontend.forms import (
    ApiTokenForm,
    BudgetForm,
    JobFilterForm,
    JobSubmitForm,
    MembershipForm,
    PoolForm,
    QuotaForm,
    TenantForm,
)
from frontend.invitations import InvitationForm, sent_by_tenant
from frontend.pages import page, staff_required

JOBS_PER_PAGE = 25
LOG_TAIL_LINES = 200


@login_required
def home(request):
    roles = tenant_roles(request.user)
    mine = Tenant.objects.filter(pk__in=roles).order_by("slug").first()
    if mine is not None:
        return redirect("tenant-dashboard", slug=mine.slug)
    if is_cluster_admin(request.user):
        return redirect("cluster-overview")
    return page(request, "frontend/no_tenant.html", nav="dashboard")


@login_required
def tenant_dashboard(request, slug: str):
    tenant = get_object_or_404(visible_tenants(request.user), slug=slug)
    now = timezone.now()
    jobs = Job.objects.filter(tenant=tenant).select_related("submitted_by")
    context = {
        "tenant": tenant,
        "role_label": _role_label(request.user, tenant),
        "may_submit": queries.has_role(request.user, tenant, Role.MEMBER) and tenant.active,
        "may_manage_members": queries.has_role(request.user, tenant, Role.ADMIN),
        "usage": queries.tenant_gpu_usage(tenant),
        "counts": queries.tenant_job_counts(tenant),
        "running": jobs.filter(state__in=[JobState.ADMITTED, JobState.RUNNING]).order_by(
            "-started_at", "-id"
        )[:10],
        "pending": jobs.filter(state=JobState.PENDING).order_by("queue_position", "submitted_at")[
            :10
        ],
        "budgets": queries.tenant_budgets(tenant, now),
        "month_usage": queries.tenant_usage(tenant, "month", now),
        "events": queries.recent_tenant_events(tenant),
        "checkpoints": _checkpoint_storage(tenant),
        "now": now,
    }
    if request.htmx:
        return render(request, "frontend/partials/dashboard_live.html", context)
    return page(request, "frontend/dashboard.html", context, nav="dashboard")


def _checkpoint_storage(tenant, used_bytes: int | None = None) -> dict:
    """What a tenant's checkpoint directories hold against its limit, for a bar."""
    used = storage_queries.checkpoint_usage_bytes(tenant) if used_bytes is None else used_bytes
    limit = tenant.checkpoint_limit_bytes
    return {
        "used_bytes": used,
        "limit_bytes": limit,
        "fraction": used / limit if limit else None,
        "over": limit is not None and used > limit,
    }


def _role_label(user, tenant) -> str:
    role = tenant_roles(user).get(tenant.pk)
    if role is not None:
        return Role(role).label.lower()
    return "cluster admin (not a member)" if is_cluster_admin(user) else ""


# --- jobs -------------------------------------------------------------------------------------


def _whole_number(text: str | None) -> int | None:
    """A query parameter that should be an id or a number: "12" -> 12, anything else None.

    str.isdigit() is no test: it is true for "²", which int() refuses.
    """
    if text and text.isascii() and text.isdigit() and len(text) <= 18:
        return int(text)
    return None


def _states_marker(jobs) -> str:
    """What the live list last showed: "id:STATE,..." so a poll can say what changed."""
    return ",".join(f"{j.pk}:{j.state}" for j in jobs)


def _changes(marker: str, jobs) -> list[str]:
    before = dict(item.split(":", 1) for item in marker.split(",") if ":" in item)
    said = []
    for j in jobs:
        old = before.get(str(j.pk))
        if old is not None and old != j.state:
            said.append(f"Job {j.name} (#{j.pk}) is now {j.state}.")
    return said


@login_required
def job_list(request):
    filter_form = JobFilterForm(request.GET)
    f = filter_form.job_filter()
    jobs = queries.filter_jobs(queries.visible_jobs(request.user), f)
    paginator = Paginator(jobs, JOBS_PER_PAGE)
    page_obj = paginator.get_page(request.GET.get("page"))
    rows = list(page_obj.object_list)
    marker = _states_marker(rows)
    previous = request.GET.get("v")
    if request.htmx and previous is not None and previous == f"{paginator.count}|{marker}":
        # Nothing changed: 204 makes htmx keep the table, so a screen reader hears nothing new.
        return HttpResponse(status=204)
    context = {
        "filter": f,
        "sort": f.sort,
        "page_obj": page_obj,
        "jobs": rows,
        "marker": f"{paginator.count}|{marker}",
        "announcements": _changes(previous.split("|", 1)[-1], rows) if previous else [],
        "states": JobState.values,
        "tenants": visible_tenants(request.user).order_by("slug"),
        "any_filter": any([f.state, f.user, f.name, f.tenant]),
        "may_submit": queries.tenants_with_role(request.user, Role.MEMBER).exists(),
        "updated_at": timezone.now(),
        "filter_errors": filter_form.errors,
    }
    # A filter that cannot be applied is the request's fault: say which, show no list that
    # would look like its answer.
    status = 400 if filter_form.errors else 200
    if request.htmx:
        return render(request, "frontend/jobs/list_results.html", context, status=status)
    return page(request, "frontend/jobs/list.html", context, nav="jobs", status=status)


def _submit_context(request, form: JobSubmitForm) -> dict:
    tenant = form.selected_tenant()
    body, _ = form.api_payload()
    shape = validation.ClusterShape.load()
    usage = queries.tenant_gpu_usage(tenant) if tenant else []
    return {
        "form": form,
        "tenant": tenant,
        "usage": usage,
        "limits": _submit_limits(tenant, usage, shape),
        "curl": _curl(request, body),
        "body_json": json.dumps(body, indent=2),
    }


def _submit_limits(tenant, usage, shape: validation.ClusterShape) -> dict[str, str]:
    """What the tenant and the cluster allow, in words, shown next to each field."""
    limits = {}
    if tenant is not None:
        if usage:
            quota = "; ".join(
                f"{u.label}: limit {u.limit} (guaranteed {u.guaranteed}, {u.in_use} in use now)"
                for u in usage
            )
            limits["gpus"] = f"Quota of {tenant.slug}: {quota}."
        else:
            limits["gpus"] = f"{tenant.slug} has no GPU quota: only 0-GPU jobs can run."
    if shape.largest_gpus_per_node:
        largest = ", ".join(f"{n} × {m}" for m, n in sorted(shape.largest_gpus_per_node.items()))
        limits["gpu_type"] = f"Largest node per type: {largest}."
        # The submit refuses only what no node could hold, down or not; a job larger than what
        # takes work now is accepted and waits, so say what that is when some nodes are out.
        now = shape.largest_gpus_per_node_now
        if any(now.get(m, 0) < n for m, n in shape.largest_gpus_per_node.items()):
            up = ", ".join(f"{now.get(m, 0)} × {m}" for m in sorted(shape.largest_gpus_per_node))
            limits["gpu_type"] += (
                f" Largest taking work now: {up}; a larger job waits for nodes that are down, "
                "cordoned or draining."
            )
    else:
        limits["gpu_type"] = "The cluster has no GPUs yet."
    if shape.max_node_cpus:
        limits["cpus"] = f"The largest node has {shape.max_node_cpus} CPUs."
    if shape.max_node_memory_mib:
        limits["memory_mib"] = f"The largest node has {shape.max_node_memory_mib} MiB."
    limits["max_runtime_s"] = f"At most {validation.MAX_RUNTIME_S} s (30 days)."
    if tenant is not None:
        limits["array"] = f"At most {arrays.limit_for(tenant)} tasks per array for {tenant.slug}."
    limits["preemption_grace_s"] = (
        f"0 to {validation.grace_max_s()} s; "
        f"{validation.clean_preemption_grace_s(None)} s if left empty."
    )
    return limits


def _curl(request, body: dict) -> str:
    url = request.build_absolute_uri("/api/v1/arrays/" if "array" in body else "/api/v1/jobs/")
    payload = json.dumps(body, separators=(", ", ": "))
    return (
        f"curl -sS -X POST {shlex.quote(url)} \\\n"
        '  -H "Authorization: Bearer $GPUCP_TOKEN" \\\n'
        '  -H "Content-Type: application/json" \\\n'
        f"  -d {shlex.quote(payload)}"
    )


def _submit_tenants(request):
    return list(queries.tenants_with_role(request.user, Role.MEMBER).order_by("slug"))


@login_required
def job_submit(request):
    tenants = _submit_tenants(request)
    if not tenants:
        raise PermissionDenied(
            "Your role lets you read jobs, not submit them: ask a tenant admin to make you a member."
        )
    if request.method == "POST":
        form = JobSubmitForm(request.POST, user=request.user, tenants=tenants)
        if request.POST.get("_action") != "preview" and form.is_valid():
            s = form.submission
            if form.array_request is not None:
                spec, indexes, max_parallel = form.array_request
                array = arrays.submit_array(
                    tenant=s.tenant,
                    user=request.user,
                    fields=s.fields,
                    spec=spec,
                    indexes=indexes,
                    max_parallel=max_parallel,
                ).array
                messages.success(
                    request,
                    # No state here: the message stays on the page while the state changes.
                    f"Array {array.name} (#{array.pk}) of {array.size} tasks submitted.",
                )
                return redirect("array-detail", pk=array.pk)
            job = actions.submit_job(tenant=s.tenant, user=request.user, **s.fields)
            # No state here: the message stays above the job's status while it changes.
            messages.success(request, f"Job {job.name} (#{job.pk}) submitted.")
            return redirect("job-detail", pk=job.pk)
        status = 400 if form.errors and request.POST.get("_action") != "preview" else 200
    else:
        form = JobSubmitForm(initial=_prefill(request), user=request.user, tenants=tenants)
        status = 200
    context = _submit_context(request, form)
    if request.htmx and request.GET.get("fragment") == "limits":
        return render(request, "frontend/jobs/submit_form.html", context)
    return page(request, "frontend/jobs/submit.html", context, nav="submit", status=status)


def _prefill(request) -> dict:
    """Initial values: a copy of an existing job (?copy=<id>), then any fields in the query."""
    initial: dict = {}
    source = _whole_number(request.GET.get("copy"))
    if source is not None:
        job = queries.visible_jobs(request.user).filter(pk=source).first()
        if job is not None:
            initial = {
                "tenant": job.tenant.slug,
                "name": job.name,
                "image": job.image,
                "command": shlex.join(job.command),
                "env": "\n".join(f"{k}={v}" for k, v in job.env.items()),
                "gpus": job.gpus,
                "gpu_type": job.gpu_type,
                "cpus": f"{job.cpus:g}",
                "memory_mib": job.memory_mib,
                "priority": job.priority,
                "preemptible": job.preemptible,
                "restartable": job.restartable,
                "max_runtime_s": job.max_runtime_s,
                "estimated_duration_s": job.estimated_duration_s or "",
                "mounts": "\n".join(
                    f"{m['volume']}:{m['path']}" + (":ro" if m.get("read_only") else "")
                    for m in job.mounts
                ),
                "stop_signal": job.stop_signal,
                "preemption_grace_s": job.preemption_grace_s,
                "checkpoint_interval_s": job.checkpoint_interval_s or "",
            }
    for name in JobSubmitForm.base_fields:
        if name in request.GET:
            initial[name] = request.GET[name]
    if request.GET.get("fragment"):
        # A round trip of the form itself (the tenant changed): an unticked box is not sent.
        for name in ("preemptible", "restartable"):
            initial[name] = name in request.GET
    return initial


@login_required
@require_POST
def job_submit_preview(request):
    """The "copy as curl" block for what the form holds now (htmx refreshes it as you type)."""
    tenants = _submit_tenants(request)
    if not tenants:
        raise PermissionDenied
    form = JobSubmitForm(request.POST, user=request.user, tenants=tenants)
    body, _ = form.api_payload()
    return render(
        request,
        "frontend/jobs/curl.html",
        {"curl": _curl(request, body), "body_json": json.dumps(body, indent=2)},
    )


def _job_or_404(request, pk: int) -> Job:
    return get_object_or_404(queries.visible_jobs(request.user), pk=pk)


def _job_live_context(request, job: Job) -> dict[str, object]:
    attempt = queries.current_attempt(job)
    context: dict[str, object] = {
        "job": job,
        "attempt": attempt,
        "usage": queries.job_usage(job),
        "may_cancel": queries.may_cancel(request.user, job),
        "jobs_ahead": queries.pending_jobs_ahead(job),
        # Still live after a cancel until the agent confirms the process is gone.
        "live": not job.is_finished or (attempt is not None and attempt.is_active),
        "now": timezone.now(),
        "attempts": _attempts_with_stops(job),
        "checkpoint_dir": CHECKPOINT_TARGET if job.checkpoint_volume_id else None,
    }
    if attempt is not None:
        gpus = queries.attempt_gpus(attempt)
        text, size_bytes, truncated = read_log(attempt, LOG_TAIL_LINES)
        context |= {
            "gpus": gpus,
            "gpus_alike": _alike(gpus),
            # What "cap N W each" is a figure of (frontend/templatetags/power.py).
            "gpus_cap_of": "gpus:" + "|".join(g.uuid for g in gpus) + ":cap",
            "gpus_requested_of": "gpus:" + "|".join(g.uuid for g in gpus) + ":requested",
            "log_text": text,
            "log_size_bytes": size_bytes,
            "log_truncated": truncated or text.count("\n") >= LOG_TAIL_LINES,
            **_job_charts(attempt),
        }
    return context


def _attempts_with_stops(job: Job) -> list:
    """The job's attempts, each with how its stop went as the timeline told it (stop_story)."""
    stories = {
        e.data.get("attempt"): e.message
        for e in job.events.filter(kind=STOP_NOTICE_EVENT).only("data", "message")
    }
    attempts = list(
        job.attempts.select_related("node")
        .prefetch_related(
            Prefetch("members", queryset=AttemptMember.objects.select_related("node"))
        )
        .order_by("number")
    )
    for a in attempts:
        # For the template's row, not a column: the page's own reading of the timeline.
        setattr(a, "stop_story", stories.get(a.pk, ""))  # noqa: B010
    return attempts


def _alike(gpus) -> bool:
    """Several GPUs of one model at one cap read better as one line than as a list."""
    return (
        len(gpus) > 2 and len({(g.model, g.power_cap_w, g.desired_power_cap_w) for g in gpus}) == 1
    )


def _job_charts(attempt) -> dict:
    series = queries.attempt_telemetry(attempt)
    empty = (
        "No telemetry recorded yet."
        if attempt.is_active
        else "No telemetry was recorded while this attempt ran."
    )
    util = charts.Chart(title="GPU utilization", unit="%", y_max=100, empty=empty)
    power = charts.Chart(title="GPU power draw and cap", unit="W", empty=empty)
    for chart, values_of, suffix in (
        (util, lambda s: s.utilization_pct, ""),
        (power, lambda s: s.power_draw_w, " draw"),
    ):
        # GPUs that reported the same values all along are one line, said to be so: drawn
        # apart, they would hide each other.
        alike: dict[tuple, list] = {}
        for s in series:
            alike.setdefault(tuple(values_of(s)), []).append(s)
        for i, group in enumerate(alike.values()):
            label = group[0].label
            if len(group) > 1:
                label = (
                    f"{len(group)} GPUs, identical (GPU {', '.join(g.label[4:] for g in group)})"
                )
            chart.series.append(
                charts.Series(f"{label}{suffix}", values_of(group[0]), css_class=f"series-{i % 8}")
            )
    caps = {tuple(v for _, v in s.power_cap_w) for s in series}
    if len(caps) == 1 and series:
        # The usual case: every GPU of the job runs at the same cap, so one line says it.
        power.series.append(
            charts.Series("power cap", series[0].power_cap_w, dashed=True, css_class="series-cap")
        )
    else:
        for i, s in enumerate(series):
            power.series.append(
                charts.Series(
                    f"{s.label} cap", s.power_cap_w, dashed=True, css_class=f"series-{i % 8}"
                )
            )
    return {"util_chart": charts.render(util), "power_chart": charts.render(power)}


@login_required
def job_detail(request, pk: int):
    job = _job_or_404(request, pk)
    context = _job_live_context(request, job)
    context["events"] = job.events.select_related("actor").order_by("at", "id")
    context["dependencies"] = queries.job_dependencies(job)
    context["dependents"], context["dependents_total"] = queries.job_dependents(job)
    return page(request, "frontend/jobs/detail.html", context, nav="jobs")


@login_required
def job_live(request, pk: int):
    """The parts of the job page that change while it runs, for htmx to swap in."""
    job = _job_or_404(request, pk)
    context = _job_live_context(request, job)
    previous = request.GET.get("state")
    context["announcements"] = (
        [f"Job {job.name} is now {job.state}."] if previous and previous != job.state else []
    )
    context["events"] = job.events.select_related("actor").order_by("at", "id")
    context["oob"] = True
    context["is_cluster_admin"] = is_cluster_admin(request.user)
    return render(request, "frontend/jobs/live.html", context)


@login_required
def job_output(request, pk: int):
    """An attempt's whole output as a page (the latest attempt, rank 0, unless ?attempt=N and
    ?rank=R), with the site's navigation. While the attempt runs, app.js follows it through the
    same API the `gpucp logs -f` command uses (GET /api/v1/jobs/{id}/logs/?offset&follow)."""
    job = _job_or_404(request, pk)
    attempts = list(job.attempts.order_by("number"))
    number = _whole_number(request.GET.get("attempt"))
    attempt = next((a for a in attempts if a.number == number), None) if number else None
    attempt = attempt or (attempts[-1] if attempts else None)
    if attempt is None:
        raise Http404("This job has not started, so it has no output yet.")
    ranks = sorted(attempt.members.values_list("rank", flat=True)) or [0]
    rank = _whole_number(request.GET.get("rank")) or 0
    if rank not in ranks:
        raise Http404(f"Attempt {attempt.number} has no member of rank {rank}.")
    raw, size_bytes, truncated = read_log_bytes(attempt, None, rank)
    following = attempt.is_active
    context = {
        "job": job,
        "attempt": attempt,
        "attempts": attempts,
        "rank": rank,
        "ranks": ranks,
        "text": display_text(raw),
        "size_bytes": size_bytes,
        "truncated": truncated,
        "following": following,
        "follow_url": (
            f"{reverse('job-logs', args=[job.pk])}?attempt={attempt.number}&rank={rank}"
        ),
    }
    return page(request, "frontend/jobs/output.html", context, nav="jobs")


@login_required
def job_log(request, pk: int):
    """An attempt's whole output as plain text (the latest attempt unless ?attempt=N)."""
    job = _job_or_404(request, pk)
    attempts = job.attempts.order_by("number")
    wanted = request.GET.get("attempt")
    number = _whole_number(wanted)
    attempt = attempts.filter(number=number).first() if number is not None else attempts.last()
    if attempt is None:
        raise Http404("This job has not started, so it has no output yet.")
    # One member's output (rank 0 unless ?rank=R): each node of a job over several writes its own.
    rank = _whole_number(request.GET.get("rank")) or 0
    # The bytes as the program wrote them (NUL, invalid UTF-8 and all); pages show them escaped.
    raw, _, truncated = read_log_bytes(attempt, None, rank)
    if truncated:
        raw = b"[earlier output left out: only the last 4 MiB are shown]\n" + raw
    response = HttpResponse(raw, content_type="text/plain; charset=utf-8")
    response["Content-Disposition"] = (
        f'inline; filename="job-{job.pk}-attempt-{attempt.number}'
        f'{f"-rank-{rank}" if rank else ""}.log"'
    )
    return response


@login_required
def job_cancel(request, pk: int):
    """GET asks "are you sure?"; POST cancels. A viewer or someone else's job (as a member) is 403."""
    job = _job_or_404(request, pk)
    if job.is_finished:
        messages.info(request, f"Job {job.name} already finished ({job.state}); nothing to cancel.")
        return redirect("job-detail", pk=job.pk)
    if not queries.may_cancel(request.user, job):
        raise PermissionDenied("Only the job's owner or a tenant admin may cancel it.")
    if request.method == "POST":
        try:
            actions.cancel_job(job, actor=request.user)
        except (actions.IllegalTransition, actions.ConcurrentUpdate):
            job.refresh_from_db(fields=["state"])
            messages.error(
                request,
                f"Job {job.name} changed meanwhile and is now {job.state}; nothing cancelled.",
            )
        else:
            messages.success(request, f"Job {job.name} (#{job.pk}) cancelled.")
        return redirect("job-detail", pk=job.pk)
    attempt = queries.current_attempt(job)
    return page(
        request,
        "frontend/jobs/cancel.html",
        {"job": job, "attempt": attempt if attempt and attempt.is_active else None},
        nav="jobs",
    )


# --- API tokens -------------------------------------------------------------------------------


@login_required
def tokens(request):
    created = None
    raw = None
    if request.method == "POST":
        form = ApiTokenForm(request.POST, actor=request.user)
        if form.is_valid():
            created = form.save()
            raw = created.raw_token
            form = ApiTokenForm(actor=request.user)
    else:
        form = ApiTokenForm(actor=request.user)
    response = page(
        request,
        "frontend/tokens.html",
        {
            "form": form,
            "created": created,
            "raw_token": raw,
            "tokens": ApiToken.objects.filter(user=request.user).order_by("-created_at"),
            "api_url": request.build_absolute_uri("/api/v1/"),
            "now": timezone.now(),
        },
        nav="tokens",
        status=400 if form.errors else 200,
    )
    # The secret is in this answer only; no cache should keep a copy of it.
    response["Cache-Control"] = "no-store"
    return response


@login_required
@require_POST
def token_revoke(request, pk: int):
    token = get_object_or_404(ApiToken, pk=pk, user=request.user)
    if token.revoked_at is None:
        # With every token minted from it (tenancy.actions.revoke_token).
        tenancy_actions.revoke_token(token, actor=request.user)
        messages.success(
            request, f"Token {token.name} ({token.prefix}…) revoked; it no longer works."
        )
    else:
        messages.info(request, f"Token {token.name} was already revoked.")
    return redirect("tokens")


# --- cluster (cluster admins) -----------------------------------------------------------------


def _pool_chart(pp: queries.PoolPower) -> charts.Chart:
    chart = charts.Chart(title=f"Pool {pp.pool.name}: power draw", unit="W")
    chart.series.append(charts.Series("draw (sum of GPUs)", pp.draw_w, css_class="series-0"))
    # No "sum of caps" line: the budget holds the draw, and idle GPUs sit at their minimum cap
    # while drawing far less, so that sum crossed the budget line on an idle pool that was
    # nowhere near it (the panel beside the chart gives the planner's own worst case).
    if pp.pool.power_budget_w:
        chart.thresholds.append(charts.Threshold("pool budget", pp.pool.power_budget_w))
    return chart


def _overview_stats() -> dict:
    # distinct: the join with allocations repeats a GPU once per attempt it ever held.
    gpu_totals = GPU.objects.aggregate(
        total=Count("id", distinct=True),
        healthy=Count("id", filter=Q(healthy=True), distinct=True),
        allocated=Count("id", filter=Q(allocations__active=True), distinct=True),
    )
    return {
        "gpu_totals": gpu_totals,
        "node_counts": {
            "total": Node.objects.count(),
            "down": Node.objects.filter(ready=False).count(),
            "cordoned": Node.objects.filter(ready=True).exclude(state=NodeState.READY).count(),
        },
        "pending_total": Job.objects.filter(state=JobState.PENDING).count(),
        "running_total": Job.objects.filter(
            state__in=[JobState.ADMITTED, JobState.RUNNING]
        ).count(),
    }


@staff_required
def cluster_overview(request):
    now = timezone.now()
    # The page's live parts poll apart (the stats above the charts over time, the rest below):
    # each answer reads only what it shows.
    if request.htmx and request.GET.get("part") == "stats":
        context = {**_overview_stats(), "now": now}
        return render(request, "frontend/cluster/overview_stats.html", context)
    pools = queries.pool_power()
    allocation = queries.allocation_by_tenant()
    context = {
        "pools": [(pp, charts.render(_pool_chart(pp))) for pp in pools],
        "allocation": allocation,
        "allocation_max": max([a.in_use + a.pending_gpus for a in allocation] + [1]),
        "last_cycle": next(iter(queries.recent_cycles(limit=1)), None),
        "now": now,
    }
    if request.htmx:
        return render(request, "frontend/cluster/overview_live.html", context)
    context |= _overview_stats()
    # The charts over time are not part of the 10 s refresh: their buckets are minutes to hours.
    context |= overview.history_context(request.GET.get("window"), now)
    return page(request, "frontend/cluster/overview.html", context, nav="cluster")


@staff_required
def node_detail(request, name: str):
    node = get_object_or_404(Node.objects.select_related("pool"), name=name)
    [(node, gpus)] = queries.nodes_with_gpus(Node.objects.filter(pk=node.pk))
    now = timezone.now()
    notes = node_health.node_notes(node, gpus, now)
    level = node_health.health_level(node, notes)
    context = {
        "node": node,
        "gpus": gpus,
        "health_notes": notes,
        "health": level,
        "health_label": node_health.HEALTH_LABELS[level],
        "health_badge": node_health.HEALTH_BADGES[level],
        "attempts": queries.node_active_attempts(node),
        "now": now,
    }
    return page(request, "frontend/cluster/node.html", context, nav="nodes")


NODE_ACTION_WORDS = {
    NodeState.CORDONED: "cordoned: it gets no new work",
    NodeState.DRAINING: "draining: no new work, and its borrowed jobs are preempted",
    NodeState.READY: "ready again: it takes new work",
}


# Verbs that ask "are you sure?" first (GET shows what they will do; POST does it): a drain
# preempts running work, which a stray click must not do.
CONFIRMED_NODE_ACTIONS = frozenset({"drain"})


@staff_required
def node_action(request, name: str, verb: str):
    node = get_object_or_404(Node, name=name)
    if verb not in NODE_ACTION_STATES:
        raise Http404
    if request.method != "POST":
        if request.method != "GET" or verb not in CONFIRMED_NODE_ACTIONS:
            return HttpResponseNotAllowed(["POST"])
        attempts = list(queries.node_active_attempts(node))
        return page(
            request,
            "frontend/cluster/node_drain.html",
            {
                "node": node,
                "preempted": [a for a in attempts if a.borrowed],
                "kept": [a for a in attempts if not a.borrowed],
                "next": _local_path(request.GET.get("next", "")),
            },
            nav="nodes",
        )
    state = NODE_ACTION_STATES[verb]
    if cluster_actions.set_node_state(node, state, actor=request.user):
        messages.success(request, f"Node {node.name} is {NODE_ACTION_WORDS[state]}.")
    else:
        messages.info(request, f"Node {node.name} was {node.get_state_display().lower()} already.")
    return redirect(
        _local_path(request.POST.get("next", "")) or reverse("node-detail", args=[node.name])
    )


def _local_path(back: str) -> str:
    """A `next` path to go back to, only when it stays on this site ("" otherwise)."""
    return back if back.startswith("/") and not back.startswith("//") else ""


# --- tenants, quotas, budgets, members, pools --------------------------------------------------


@staff_required
def manage_tenants(request):
    tenants = Tenant.objects.annotate(
        members=Count("memberships", distinct=True),
        active_jobs=Count("jobs", filter=Q(jobs__state__in=ACTIVE_JOB_STATES), distinct=True),
    ).order_by("slug")
    quotas = {}
    for q in Quota.objects.order_by("gpu_type"):
        quotas.setdefault(q.tenant_id, []).append(q)
    budgets = {}
    for b in Budget.objects.order_by("kind"):
        budgets.setdefault(b.tenant_id, []).append(b)
    used = storage_queries.checkpoint_usage_by_tenant()
    rows = [
        (t, quotas.get(t.pk, []), budgets.get(t.pk, []), _checkpoint_storage(t, used.get(t.pk, 0)))
        for t in tenants
    ]
    return page(request, "frontend/manage/tenants.html", {"rows": rows}, nav="tenants")


@staff_required
def tenant_create(request):
    form = TenantForm(request.POST or None, actor=request.user)
    if request.method == "POST" and form.is_valid():
        tenant = form.save()
        messages.success(request, f"Tenant {tenant.slug} created. Give it a quota next.")
        return redirect("manage-tenant", slug=tenant.slug)
    return page(
        request,
        "frontend/manage/form.html",
        {"form": form, "title": "New tenant", "back": reverse("manage-tenants")},
        nav="tenants",
        status=400 if form.errors else 200,
    )


@staff_required
def tenant_edit(request, slug: str):
    tenant = get_object_or_404(Tenant, slug=slug)
    form = TenantForm(request.POST or None, instance=tenant, actor=request.user)
    if request.method == "POST" and form.is_valid():
        tenant = form.save()
        messages.success(request, f"Tenant {tenant.slug} saved.")
        return redirect("manage-tenant", slug=tenant.slug)
    context = {
        "tenant": tenant,
        "form": form,
        "quotas": queries.tenant_gpu_usage(tenant),
        "quota_rows": Quota.objects.filter(tenant=tenant).order_by("gpu_type"),
        "budgets": queries.tenant_budgets(tenant),
        "budget_rows": {b.pk: b for b in Budget.objects.filter(tenant=tenant)},
        "members": Membership.objects.filter(tenant=tenant).select_related("user").count(),
    }
    return page(
        request,
        "frontend/manage/tenant.html",
        context,
        nav="tenants",
        status=400 if form.errors else 200,
    )


def _object_form(request, form_class, *, instance, tenant, title, noun):
    form = form_class(request.POST or None, instance=instance, actor=request.user, tenant=tenant)
    if request.method == "POST" and form.is_valid():
        form.save()
        messages.success(request, f"{noun} of {tenant.slug} saved.")
        return redirect("manage-tenant", slug=tenant.slug)
    return page(
        request,
        "frontend/manage/form.html",
        {
            "form": form,
            "title": title,
            "tenant": tenant,
            "back": reverse("manage-tenant", args=[tenant.slug]),
            "delete_url": request.path + "delete/" if instance is not None else None,
        },
        nav="tenants",
        status=400 if form.errors else 200,
    )


@staff_required
def quota_create(request, slug: str):
    tenant = get_object_or_404(Tenant, slug=slug)
    return _object_form(
        request,
        QuotaForm,
        instance=None,
        tenant=tenant,
        title=f"New quota for {tenant.slug}",
        noun="Quota",
    )


@staff_required
def quota_edit(request, pk: int):
    quota = get_object_or_404(Quota.objects.select_related("tenant"), pk=pk)
    title = f"Quota of {quota.tenant.slug}: {quota.gpu_type or 'any type'}"
    return _object_form(
        request, QuotaForm, instance=quota, tenant=quota.tenant, title=title, noun="Quota"
    )


@staff_required
def budget_create(request, slug: str):
    tenant = get_object_or_404(Tenant, slug=slug)
    return _object_form(
        request,
        BudgetForm,
        instance=None,
        tenant=tenant,
        title=f"New budget for {tenant.slug}",
        noun="Budget",
    )


@staff_required
def budget_edit(request, pk: int):
    budget = get_object_or_404(Budget.objects.select_related("tenant"), pk=pk)
    title = f"{budget.get_kind_display()} budget of {budget.tenant.slug}"
    return _object_form(
        request, BudgetForm, instance=budget, tenant=budget.tenant, title=title, noun="Budget"
    )


def _confirm_delete(request, delete, *, what: str, back: str, done: str):
    """`delete`: the action that deletes the object, given who asks."""
    if request.method == "POST":
        try:
            delete(actor=request.user)
        except ProtectedError:
            messages.error(request, f"{what} is still in use; it was not deleted.")
            return redirect(back)
        messages.success(request, f"{what} deleted.")
        return redirect(done)
    return page(
        request,
        "frontend/manage/confirm_delete.html",
        {"what": what, "back": back},
        nav="tenants",
    )


@staff_required
def quota_delete(request, pk: int):
    quota = get_object_or_404(Quota.objects.select_related("tenant"), pk=pk)
    back = reverse("manage-tenant", args=[quota.tenant.slug])
    what = f"The {quota.gpu_type or 'any-type'} quota of {quota.tenant.slug}"
    delete = functools.partial(tenancy_actions.delete_quota, quota)
    return _confirm_delete(request, delete, what=what, back=back, done=back)


@staff_required
def budget_delete(request, pk: int):
    budget = get_object_or_404(Budget.objects.select_related("tenant"), pk=pk)
    back = reverse("manage-tenant", args=[budget.tenant.slug])
    what = f"The {budget.get_kind_display()} budget of {budget.tenant.slug}"
    delete = functools.partial(tenancy_actions.delete_budget, budget)
    return _confirm_delete(request, delete, what=what, back=back, done=back)


def _members_tenant(request, slug: str) -> Tenant:
    """A tenant's membership page: its tenant admins and cluster admins; members get 403."""
    tenant = get_object_or_404(visible_tenants(request.user), slug=slug)
    require_role(request.user, tenant, Role.ADMIN)
    return tenant


@login_required
def tenant_members(request, slug: str):
    tenant = _members_tenant(request, slug)
    # Cluster admins add people directly; tenant admins invite them (tenancy.actions.add_member).
    direct = is_cluster_admin(request.user)
    form = (MembershipForm if direct else InvitationForm)(
        request.POST or None, actor=request.user, tenant=tenant
    )
    if request.method == "POST" and form.is_valid():
        made = form.save()
        role = made.get_role_display().lower()
        if direct:
            messages.success(request, f"{made.user.username} is now {role} of {tenant.slug}.")
        else:
            messages.success(
                request,
                f"{made.invitee} is invited as {role} of {tenant.slug}; "
                "they join when they accept.",
            )
        return redirect("tenant-members", slug=tenant.slug)
    members = (
        Membership.objects.filter(tenant=tenant).select_related("user").order_by("user__username")
    )
    return page(
        request,
        "frontend/manage/members.html",
        {
            "tenant": tenant,
            "form": form,
            "direct": direct,
            "members": members,
            "invitations": sent_by_tenant(tenant),
            "roles": Role.choices,
        },
        nav="members",
        status=400 if form.errors else 200,
    )


@login_required
@require_POST
def membership_change(request, pk: int):
    membership = get_object_or_404(
        Membership.objects.select_related("tenant", "user"),
        pk=pk,
        tenant__in=visible_tenants(request.user),
    )
    tenant = _members_tenant(request, membership.tenant.slug)
    back = reverse("tenant-members", args=[tenant.slug])
    try:
        if request.POST.get("remove"):
            tenancy_actions.remove_membership(membership, actor=request.user)
            messages.success(request, f"{membership.user.username} removed from {tenant.slug}.")
            return redirect(back)
        form = MembershipForm(request.POST, instance=membership, actor=request.user, tenant=tenant)
        if not form.is_valid():
            for error in form.errors.values():
                messages.error(request, " ".join(str(e) for e in error))
            return redirect(back)
        m = form.save()
    except tenancy_actions.LastTenantAdmin as exc:
        messages.error(request, str(exc))
        return redirect(back)
    messages.success(
        request, f"{m.user.username} is now {m.get_role_display().lower()} of {tenant.slug}."
    )
    return redirect(back)


@staff_required
def manage_pools(request):
    pools = Pool.objects.annotate(
        nodes_count=Count("nodes", distinct=True), gpus_count=Count("nodes__gpus", distinct=True)
    ).order_by("name")
    draw = {pp.pool.pk: pp for pp in queries.pool_power(window=dt.timedelta(minutes=0))}
    edit = None
    if request.method == "POST":
        pool = get_object_or_404(Pool, pk=_whole_number(request.POST.get("pool")))
        edit = PoolForm(request.POST, instance=pool, actor=request.user, prefix=f"pool{pool.pk}")
        if edit.is_valid():
            edit.save()
            messages.success(request, f"Power budget of pool {pool.name} saved.")
            return redirect("manage-pools")
    rows = []
    for pool in pools:
        if edit is not None and edit.instance.pk == pool.pk:
            form = edit
        else:
            form = PoolForm(instance=pool, actor=request.user, prefix=f"pool{pool.pk}")
        rows.append((pool, draw.get(pool.pk), form))
    return page(
        request,
        "frontend/manage/pools.html",
        {"rows": rows},
        nav="pools",
        status=400 if edit is not None and edit.errors else 200,
    )
