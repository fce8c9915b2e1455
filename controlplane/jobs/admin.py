"""Django admin for ops: jobs, their attempts and timelines. Read-only but for cancel, which goes
through jobs.actions like every other change of a job's state."""

from django.contrib import admin, messages

from controlplane.jobs import actions
from controlplane.jobs.models import Job, JobAttempt, JobEvent, SubmitKey


class ReadOnlyInline(admin.TabularInline):
    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


class ReadOnlyAdmin(admin.ModelAdmin):
    """History, written only through the actions: admins look, never add, edit or delete."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class JobAttemptInline(ReadOnlyInline):
    model = JobAttempt
    fields = ("number", "node", "state", "borrowed", "started_at", "finished_at", "exit_code")
    readonly_fields = fields


class JobEventInline(ReadOnlyInline):
    model = JobEvent
    fields = ("at", "kind", "from_state", "to_state", "message", "actor")
    readonly_fields = fields
    show_change_link = False


@admin.register(Job)
class JobAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "name",
        "tenant",
        "submitted_by",
        "state",
        "gpus",
        "gpu_type",
        "priority",
        "submitted_at",
    ]
    list_filter = ["state", "tenant", "priority", "gpu_type"]
    search_fields = ["name", "submitted_by__username", "image"]
    list_select_related = ["tenant", "submitted_by"]
    date_hierarchy = "submitted_at"
    inlines = [JobAttemptInline, JobEventInline]
    # Jobs are submitted through the API or the web form, which validate them; history is kept.
    actions = ["cancel"]

    @admin.action(description="Cancel the selected jobs")
    def cancel(self, request, queryset):
        cancelled = skipped = 0
        for job in queryset:
            if job.is_finished:
                skipped += 1
                continue
            try:
                actions.cancel_job(job, actor=request.user)
                cancelled += 1
            except (actions.IllegalTransition, actions.ConcurrentUpdate):
                skipped += 1
        self.message_user(request, f"Cancelled {cancelled} job(s).", messages.SUCCESS)
        if skipped:
            self.message_user(
                request,
                f"{skipped} had already finished and were left as they are.",
                messages.WARNING,
            )


@admin.register(JobAttempt)
class JobAttemptAdmin(ReadOnlyAdmin):
    list_display = [
        "id",
        "job",
        "number",
        "node",
        "state",
        "borrowed",
        "started_at",
        "finished_at",
        "energy_j",
    ]
    list_filter = ["state", "borrowed", "node"]
    list_select_related = ["job", "node"]
    search_fields = ["job__name"]


@admin.register(SubmitKey)
class SubmitKeyAdmin(ReadOnlyAdmin):
    """Idempotency-Keys of submits, to answer "did my retry make a second job?"."""

    list_display = ["id", "user", "key", "job", "created_at"]
    list_select_related = ["user", "job"]
    search_fields = ["key", "user__username"]
    date_hierarchy = "created_at"
    raw_id_fields = ["job"]

    # Written only by a submit, in the job's transaction; deleted by the expiry task.
