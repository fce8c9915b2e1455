"""Job arrays: one submission, many tasks (a sweep), each an ordinary job with its index.

The array is one row (JobArray) and its tasks are Jobs pointing at it with their array_index,
so the scheduler, the quotas and the accounting see nothing but jobs. What is an array's own:

- its spec ("0-99", "1,3,5-9", "0-99:2", or a count N meaning 0..N-1), parsed by parse_spec;
- its throttle, max_parallel (Slurm's `%`): a task beyond it waits PENDING with Hold.ARRAY,
  which the scheduler never reads (controlplane.jobs.holds); fill() lifts the holds of the
  lowest-index tasks whenever a slot is free, in the transaction that freed it;
- templating: `{{array_index}}` and `{{array_size}}` in the command's items and the env's values
  become each task's own, and every task's env carries GPUCP_ARRAY_ID, GPUCP_ARRAY_INDEX and
  GPUCP_ARRAY_SIZE;
- cancelling it as a whole (cancel_array).

Every write here is an action: atomic, audited, and asking for a cycle once it commits. A
submit of any size is a fixed handful of statements (the tasks and their events are each one
bulk INSERT), so a sweep of thousands is one request and one short transaction.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Count, Q
from django.utils import timezone

from controlplane import bulk
from controlplane.audit import trail
from controlplane.jobs import actions, dependencies, holds
from controlplane.jobs.models import (
    ACTIVE_ATTEMPT_STATES,
    FINISHED_JOB_STATES,
    Hold,
    Job,
    JobArray,
    JobAttempt,
    JobEvent,
    JobState,
    SubmitKey,
)
from controlplane.jobs.transitions import PENDING_ONLY_FIELDS
from controlplane.storage.models import Volume

# The largest index a task may have: a sweep numbers its points, it does not encode data in them.
MAX_ARRAY_INDEX = 999_999
INDEX_PLACEHOLDER = "{{array_index}}"
SIZE_PLACEHOLDER = "{{array_size}}"
HOLD_REASON_CODE = "array_limit"

_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+)(?::([0-9]+))?)?")
_COUNT = re.compile(r"[0-9]+")
# A task in flight holds (or may be given at once) GPUs: it counts against max_parallel.


def _refuse(message: str, field: str = "array") -> ValidationError:
    return ValidationError({field: [message]})


def limit_for(tenant) -> int:
    """The most tasks one array of `tenant` may have: its own limit, never past the ceiling."""
    return min(tenant.max_array_size, settings.MAX_ARRAY_SIZE_CEILING)


def _number(digits: str) -> int:
    # Seven digits hold every index; more (a typo, or a fuzzer's 10**400) is out of range as
    # it stands, without Python converting it.
    return int(digits) if len(digits) <= 7 else MAX_ARRAY_INDEX + 1


def parse_spec(raw: object, *, limit: int) -> tuple[str, list[int]]:
    """(the spec as stored, its indexes in ascending order) or a ValidationError naming `array`.

    A whole number, as a JSON number or a string of digits, is a count: N tasks, 0..N-1. Else a
    comma-separated list of indexes and ranges, a range with an optional step ("0-99:2"). An
    index given twice is refused (it would be two tasks with one index). The size is checked
    against `limit` before any range is expanded, so a huge spec costs nothing.
    """
    if isinstance(raw, bool) or not isinstance(raw, int | str):
        raise _refuse(
            'Give a count of tasks (e.g. 100) or their indexes (e.g. "0-99" or "1,3,5-9").'
        )
    if isinstance(raw, int) or _COUNT.fullmatch(raw.strip()):
        count = raw if isinstance(raw, int) else _number(raw.strip())
        if not 1 <= count <= limit:
            raise _refuse(f"A count must be between 1 and {limit} (this tenant's max_array_size).")
        return str(count), list(range(count))
    spec = raw.strip()
    if len(spec) > JobArray._meta.get_field("spec").max_length:  # type: ignore[operator]
        raise _refuse("Too long: write long runs of indexes as ranges, e.g. 0-999.")
    ranges: list[range] = []
    for item in (part.strip() for part in spec.split(",")):
        match = _RANGE.fullmatch(item)
        if match is None:
            raise _refuse(
                f"{item!r} is not an index or a range: write 5, 0-99, or 0-99:2 "
                "(every second index)."
            )
        first_s, last_s, step_s = match.groups()
        first = _number(first_s)
        last = first if last_s is None else _number(last_s)
        step = 1 if step_s is None else _number(step_s)
        if max(first, last) > MAX_ARRAY_INDEX:
            raise _refuse(f"Indexes go from 0 to {MAX_ARRAY_INDEX}.")
        if last < first:
            raise _refuse(f"In {item!r} the range ends before it starts.")
        if step < 1:
            raise _refuse(f"In {item!r} the step must be at least 1.")
        ranges.append(range(first, last + 1, step))
    size = sum(len(r) for r in ranges)
    if size > limit:
        raise _refuse(
            f"At most {limit} tasks per array (this tenant's max_array_size); {spec!r} has {size}."
        )
    indexes = sorted(i for r in ranges for i in r)
    repeated = next((a for a, b in zip(indexes, indexes[1:], strict=False) if a == b), None)
    if repeated is not None:
        raise _refuse(f"Index {repeated} is given more than once.")
    return spec, indexes


def parse_max_parallel(raw: object, size: int) -> int | None:
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise _refuse("Must be a whole number of tasks, or null for no limit.", "max_parallel")
    if not 1 <= raw <= size:
        raise _refuse(
            f"Must be between 1 and the array's size ({size}), or null for no limit.",
            "max_parallel",
        )
    return raw


def templated(value: str, index: int, size: int) -> str:
    return value.replace(INDEX_PLACEHOLDER, str(index)).replace(SIZE_PLACEHOLDER, str(size))


def check_templates(fields: dict, indexes: Sequence[int]) -> None:
    """The command and env as the task with the longest index will get them must still be
    valid (a placeholder grows when replaced): a ValidationError naming the field if not."""
    from controlplane.jobs import validation

    index, size = max(indexes), len(indexes)
    errors: dict[str, list[str]] = {}
    for name, clean in (("command", validation.clean_command), ("env", validation.clean_env)):
        try:
            if name == "command":
                clean([templated(item, index, size) for item in fields["command"]])
            else:
                clean({k: templated(v, index, size) for k, v in fields["env"].items()})
        except ValidationError as exc:
            errors[name] = [f"Task {index}: {m}" for m in exc.messages]
    if errors:
        raise ValidationError(errors)


def hold_reason(array_id: int, max_parallel: int) -> str:
    return (
        f"Waiting for a slot: array {array_id} runs at most {max_parallel} "
        f"task{'s' if max_parallel != 1 else ''} at once."
    )


@dataclass(frozen=True)
class SubmittedArray:
    array: JobArray
    first_task: Job


def _checkpoint_volume(volume_id: int | None) -> int | None:
    """The checkpoint volume as validation named it, None if it is gone since (as
    actions._insertable does for one job, read once for all the tasks)."""
    if volume_id is None:
        return None
    return (
        Volume.objects.filter(pk=volume_id, checkpoints=True).values_list("pk", flat=True).first()
    )


@transaction.atomic
def submit_array(
    *,
    tenant,
    user,
    fields: dict,
    spec: str,
    indexes: Sequence[int],
    max_parallel: int | None,
    depends_on: Sequence[dependencies.DependencySpec] = (),
) -> SubmittedArray:
    """Create the array and all its tasks, PENDING, in one transaction: the array row, one
    INSERT of the tasks, one of their 'submitted' events, one audit row.

    `fields` are a job's cleaned fields (jobs.validation), the command and env still holding
    their placeholders. Tasks past the first max_parallel (by index) are held; `depends_on`
    applies to every task (dependencies.attach may hold them all).
    """
    now = timezone.now()
    size = len(indexes)
    fields = dict(fields)
    command, env = fields.pop("command"), fields.pop("env")
    name = fields.pop("name")
    array = JobArray.objects.create(
        tenant=tenant,
        submitted_by=user,
        name=name,
        spec=spec,
        size=size,
        max_parallel=max_parallel,
        submitted_at=now,
    )
    fields["checkpoint_volume_id"] = _checkpoint_volume(fields.get("checkpoint_volume_id"))
    reason = hold_reason(array.pk, max_parallel) if max_parallel else ""
    free = size if max_parallel is None else max_parallel
    # "train-7": the name normalises to the array's own kind for duration prediction.
    stem = name[: Job._meta.get_field("name").max_length - len(str(MAX_ARRAY_INDEX)) - 1]  # type: ignore[operator]
    rows: list[dict[str, Any]] = []
    for position, index in enumerate(indexes):
        held = position >= free
        rows.append(
            {
                "name": f"{stem}-{index}",
                "command": [templated(item, index, size) for item in command],
                "env": {
                    **{k: templated(v, index, size) for k, v in env.items()},
                    "GPUCP_ARRAY_ID": str(array.pk),
                    "GPUCP_ARRAY_INDEX": str(index),
                    "GPUCP_ARRAY_SIZE": str(size),
                },
                "array_index": index,
                "hold": Hold.ARRAY if held else Hold.NONE,
                "pending_reason_code": HOLD_REASON_CODE if held else "",
                "pending_reason": reason if held else "",
            }
        )
    ids = bulk.insert_rows(
        Job,
        rows,
        common={
            **fields,
            "tenant_id": tenant.pk,
            "submitted_by_id": user.pk,
            "array_id": array.pk,
            "state": JobState.PENDING,
            "submitted_at": now,
        },
        returning="array_index",
    )
    template = {"name": name, "command": command, "env": env, **fields}
    template.pop("checkpoint_volume_id", None)
    bulk.insert_rows(
        JobEvent,
        [
            # The first task's event keeps what was submitted, placeholders and all: the array
            # shows it as its template.
            {"job_id": pk, "data": {"array_template": template} if position == 0 else {}}
            for position, pk in enumerate(ids)
        ],
        common={
            "at": now,
            "kind": "submitted",
            "to_state": JobState.PENDING,
            "from_state": "",
            "actor_id": user.pk,
            "message": f"Submitted by {user.username} as task of array {array.pk}",
        },
    )
    if depends_on:
        tasks = [
            Job(
                pk=pk,
                tenant=tenant,
                submitted_by=user,
                array=array,
                array_index=row["array_index"],
                hold=row["hold"],
                state=JobState.PENDING,
                submitted_at=now,
            )
            for pk, row in zip(ids, rows, strict=True)
        ]
        dependencies.attach(tasks, depends_on)
    trail.record(
        "array.submit",
        actor=user,
        tenant=tenant,
        obj=array,
        after={"spec": spec, "size": size, "max_parallel": max_parallel, "first_job": ids[0]},
        message=f"Array {array.pk} of {size} tasks submitted ({spec}).",
    )
    actions.request_cycle("submit")
    first = Job(pk=ids[0], tenant=tenant, submitted_by=user, array=array, submitted_at=now)
    return SubmittedArray(array, first)


def submit_array_once(
    *, user, key: str, request_sha256: str, **kwargs
) -> tuple[SubmitKey, SubmittedArray | None]:
    """submit_array under the user's Idempotency-Key (actions.submit_job_once): the key's row
    points at the array's first task. None for the array when another submit with the key
    committed first (what this one wrote is rolled back)."""
    done: list[SubmittedArray] = []

    def submit() -> Job:
        done.append(submit_array(user=user, **kwargs))
        return done[0].first_task

    row, created = actions._once(user, key, request_sha256, submit)
    return row, (done[0] if created else None)


class NothingToCancel(Exception):
    """The array was cancelled before, or all its tasks have finished."""


@transaction.atomic
def cancel_array(array: JobArray, *, actor=None, reason: str = "") -> int:
    """Cancel every unfinished task of the array; returns how many.

    As actions.cancel_job does for one job: a task with a running attempt is CANCELLED at once
    and its attempt told to stop (its GPUs free when the agent confirms); a pending or held one
    is simply CANCELLED. The array is marked cancelled first, so the slots these ends free are
    given to nobody. Set-based: a few statements whatever the number of tasks.
    """
    reason = reason or (
        f"Cancelled with its array by {actor.username}" if actor else "Cancelled with its array"
    )
    now = timezone.now()
    # Locks in the order every job end takes them: the attempts, then their jobs, both in key
    # order (actions.record_reports), then the array (fill).
    stopping = list(
        JobAttempt.objects.select_for_update(of=("self",))
        .filter(job__array=array, state__in=ACTIVE_ATTEMPT_STATES, stop_requested_at__isnull=True)
        .order_by("pk")
    )
    tasks = list(
        Job.objects.select_for_update(no_key=True)
        .filter(array=array)
        .exclude(state__in=FINISHED_JOB_STATES)
        .order_by("pk")
        .values_list("pk", "state", "has_dependents")
    )
    if not tasks:
        raise NothingToCancel(f"Array {array.pk} has no unfinished task left to cancel.")
    JobArray.objects.filter(pk=array.pk, cancelled_at__isnull=True).update(cancelled_at=now)
    array.cancelled_at = JobArray.objects.values_list("cancelled_at", flat=True).get(pk=array.pk)
    ids = [pk for pk, _, _ in tasks]
    if stopping:
        JobAttempt.objects.filter(pk__in=[a.pk for a in stopping]).update(
            stop_requested_at=now, stop_reason="cancelled"
        )
    if ids:
        Job.objects.filter(pk__in=ids).update(
            state=JobState.CANCELLED,
            state_reason=reason,
            finished_at=now,
            hold=Hold.NONE,
            **PENDING_ONLY_FIELDS,
        )
        bulk.insert_rows(
            JobEvent,
            [{"job_id": pk, "from_state": state} for pk, state, _ in tasks],
            common={
                "at": now,
                "kind": "cancelled",
                "to_state": JobState.CANCELLED,
                "actor_id": getattr(actor, "pk", None),
                "message": reason,
                "data": {"array": array.pk},
            },
        )
        actions.jobs_finished(
            [holds.Finished(pk, JobState.CANCELLED, array.pk, dep) for pk, _, dep in tasks]
        )
    trail.record(
        "array.cancel",
        actor=actor,
        tenant=array.tenant_id,
        obj=array,
        after={"cancelled_tasks": len(ids), "stopped_attempts": len(stopping)},
        message=f"Array {array.pk} cancelled: {len(ids)} unfinished tasks cancelled.",
    )
    if stopping:
        actions._notify_nodes_on_commit(stopping)
    actions.request_cycle("cancel")
    return len(ids)


# Reads: what the API and the pages show of an array.

COUNT_NAMES = ("pending", "held", "running", "succeeded", "failed", "cancelled")
_COUNTED = {
    "pending": Q(tasks__state=JobState.PENDING, tasks__hold=Hold.NONE),
    "held": Q(tasks__state=JobState.PENDING) & ~Q(tasks__hold=Hold.NONE),
    "running": Q(
        tasks__state__in=[JobState.ADMITTED, JobState.RUNNING, JobState.PREEMPTED, JobState.LOST]
    ),
    "succeeded": Q(tasks__state=JobState.SUCCEEDED),
    "failed": Q(tasks__state=JobState.FAILED),
    "cancelled": Q(tasks__state=JobState.CANCELLED),
}


def with_counts(queryset):
    """Arrays annotated with count_<name> for each of COUNT_NAMES: one query for a page."""
    # An aggregate drops the model's ordering: pages need it back.
    return queryset.annotate(
        **{f"count_{name}": Count("tasks", filter=q) for name, q in _COUNTED.items()}
    ).order_by("-submitted_at", "-id")


def counts_of(array: JobArray) -> dict[str, int]:
    if not hasattr(array, "count_pending"):
        array = with_counts(JobArray.objects.filter(pk=array.pk)).get()
    return {name: getattr(array, f"count_{name}") for name in COUNT_NAMES}


def state_of(array: JobArray, counts: Mapping[str, int]) -> str:
    """One word for the array: cancelled, or, once every task ended, failed if any failed
    (cancelled if any was cancelled, else succeeded); before that running once any task ran,
    else pending."""
    if array.cancelled_at is not None:
        return "cancelled"
    unfinished = counts["pending"] + counts["held"] + counts["running"]
    if unfinished == 0:
        if counts["failed"]:
            return "failed"
        return "cancelled" if counts["cancelled"] else "succeeded"
    ended = counts["succeeded"] + counts["failed"] + counts["cancelled"]
    return "running" if counts["running"] or ended else "pending"


def templates_of(array_ids: Iterable[int]) -> dict[int, dict]:
    """What each array was submitted with (placeholders kept), kept with its first task."""
    found: dict[int, dict] = {}
    for array_id, data in JobEvent.objects.filter(
        kind="submitted", job__array_id__in=list(array_ids), data__has_key="array_template"
    ).values_list("job__array_id", "data"):
        found[array_id] = data["array_template"]
    return found
