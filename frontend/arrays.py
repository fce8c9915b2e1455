"""Job array pages: the list, one array with its progress and its tasks, and cancelling it."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.shortcuts import get_object_or_404, redirect

from controlplane import queries
from controlplane.jobs import arrays
from controlplane.jobs.models import JobArray
from controlplane.permissions import TenantScope, role_at_least
from controlplane.tenancy.models import Role
from frontend.pages import page

ARRAYS_PER_PAGE = 25
TASKS_PER_PAGE = 50
# The bar's segments, in order, with their colour classes (app.css).
SEGMENTS = (
    ("succeeded", "ok"),
    ("failed", "bad"),
    ("cancelled", "muted"),
    ("running", "run"),
    ("pending", "wait"),
    ("held", "held"),
)


def visible_arrays(user):
    return TenantScope("tenant").filter(
        arrays.with_counts(JobArray.objects.select_related("tenant", "submitted_by")), user
    )


def _progress(array: JobArray) -> dict:
    counts = arrays.counts_of(array)
    size = max(array.size, 1)
    left = 0.0
    segments = []
    for name, css in SEGMENTS:
        width = counts[name] / size * 100.0
        segments.append(
            {"name": name, "css": css, "count": counts[name], "left": left, "width": width}
        )
        left += width
    return {"counts": counts, "state": arrays.state_of(array, counts), "segments": segments}


def may_cancel(user, array: JobArray, state: str) -> bool:
    """As for a job: its submitter (a member at least), or an admin of the tenant."""
    if state in ("succeeded", "failed", "cancelled"):
        return False
    role = queries.role_in(user, array.tenant)
    if role_at_least(role, Role.ADMIN):
        return True
    return role_at_least(role, Role.MEMBER) and array.submitted_by_id == user.pk


@login_required
def array_list(request):
    paginator = Paginator(visible_arrays(request.user), ARRAYS_PER_PAGE)
    page_obj = paginator.get_page(request.GET.get("page"))
    rows = [{"array": a, **_progress(a)} for a in page_obj.object_list]
    return page(
        request, "frontend/arrays/list.html", {"page_obj": page_obj, "rows": rows}, nav="arrays"
    )


@login_required
def array_detail(request, pk: int):
    array = get_object_or_404(visible_arrays(request.user), pk=pk)
    progress = _progress(array)
    tasks = array.tasks.order_by("array_index").only(
        "pk", "name", "array_index", "state", "hold", "pending_reason", "state_reason", "exit_code"
    )
    tasks_page = Paginator(tasks, TASKS_PER_PAGE).get_page(request.GET.get("page"))
    context = {
        "array": array,
        **progress,
        "tasks_page": tasks_page,
        "template": arrays.templates_of([array.pk]).get(array.pk, {}),
        "may_cancel": may_cancel(request.user, array, progress["state"]),
    }
    return page(request, "frontend/arrays/detail.html", context, nav="arrays")


@login_required
def array_cancel(request, pk: int):
    """GET asks "are you sure?"; POST cancels every unfinished task."""
    array = get_object_or_404(visible_arrays(request.user), pk=pk)
    progress = _progress(array)
    if progress["state"] in ("succeeded", "failed", "cancelled"):
        messages.info(
            request, f"Array {array.name} has ended ({progress['state']}); nothing to cancel."
        )
        return redirect("array-detail", pk=array.pk)
    if not may_cancel(request.user, array, progress["state"]):
        raise PermissionDenied("Only the array's owner or a tenant admin may cancel it.")
    if request.method == "POST":
        try:
            count = arrays.cancel_array(array, actor=request.user)
        except arrays.NothingToCancel:
            messages.info(request, f"Array {array.name} has no unfinished task left.")
        else:
            messages.success(
                request, f"Array {array.name} (#{array.pk}) cancelled: {count} tasks stopped."
            )
        return redirect("array-detail", pk=array.pk)
    return page(request, "frontend/arrays/cancel.html", {"array": array, **progress}, nav="arrays")
