"""Job dependencies (`depends_on`): a job that may start only after others ended as it says.

A submit may carry `depends_on: [{"job": 12, "condition": "succeeded"}, {"array": 5}]`:

- `succeeded` (the default, Slurm's afterok): the job ended SUCCEEDED; for an array, every task
  did. An array's `succeeded` can no longer be met as soon as one task ends otherwise.
- `failed` (afternotok): the job ended FAILED (its process failed, or it was lost and not
  restarted). A cancelled job did not fail: use `finished` to run after either. For an array:
  once every task ended, at least one of them FAILED.
- `finished` (afterany): the job ended, however; for an array, every task ended.

The dependent job is held (Job.hold = Hold.DEPENDENCY, see controlplane.jobs.holds), with its
reason in words ("waiting for job 12 to succeed"), so the scheduler never reads it. Each end of
a job passes through jobs_finished below, in the transaction that ended it: the dependencies on
it are resolved (met, or never), a dependent whose dependencies are all met is released, and a
dependent with one that can never be met is cancelled, saying why (Slurm's
DependencyNeverSatisfied) - which ends it in turn, so its own dependents are resolved in the
same loop, round by round, a set of jobs per round, never one call per job.

What a submit may name: jobs and arrays of the job's own tenant. An unknown id and another
tenant's id get the same answer (404 naming `depends_on[i].job`, "No job 12 in this tenant":
the REST API answers 404 when that is all that is wrong, see refers_only_to_unknown), so the
answer never tells whether another tenant's job exists. A dependency that can already
never be met (the job already failed, and it was to succeed) is refused, saying so. Cycles
cannot be expressed: a submit may only name jobs that exist before it, so every dependency
points from a newer job to an older one (and a job's own id, or a later one of its batch, is
unknown when it is validated, hence refused).

Resolved is final: a late report that turns a FAILED job into SUCCEEDED (a node declared lost
comes back; jobs.actions.record_late_exit) does not revisit the dependencies already resolved
on its first end, as Slurm does not: the dependents that ran or were cancelled stay so, and the
job's timeline tells the correction.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Count, Q
from django.utils import timezone

from controlplane import bulk, event_metrics, wakeups
from controlplane.jobs.holds import Finished
from controlplane.jobs.models import (
    FINISHED_JOB_STATES,
    DependencyCondition,
    DependencyState,
    Hold,
    Job,
    JobArray,
    JobDependency,
    JobEvent,
    JobState,
)
from controlplane.jobs.transitions import PENDING_ONLY_FIELDS, is_allowed
from controlplane.validators import text_problem

MAX_DEPENDENCIES = 64
# Larger than any id a row will get; beyond it a number is refused before any query.
MAX_ID = 2**63 - 1

CONDITIONS = tuple(c.value for c in DependencyCondition)
REASON_CODE = "dependency"
# A released task of an array with max_parallel, until array_slots.fill gives it a slot.
ARRAY_REASON_CODE = "array_limit"
ARRAY_REASON = "waiting for a free slot of its array (max_parallel)"

_VERB: dict[str, str] = {
    DependencyCondition.SUCCEEDED: "succeed",
    DependencyCondition.FAILED: "fail",
    DependencyCondition.FINISHED: "finish",
}
_ENDED: dict[str, str] = {
    JobState.SUCCEEDED: "succeeded",
    JobState.FAILED: "failed",
    JobState.CANCELLED: "was cancelled",
}


@dataclass(frozen=True, slots=True)
class DependencySpec:
    """One validated `depends_on` item: a job or an array of the same tenant, and a condition."""

    condition: str
    job_id: int | None = None
    array_id: int | None = None

    @property
    def target(self) -> str:
        return f"job {self.job_id}" if self.job_id is not None else f"array {self.array_id}"


# What a job's or an array's end says of a condition: MET, NEVER, or WAITING (not yet known).


def job_outcome(state: str, condition: str) -> str:
    if state not in FINISHED_JOB_STATES:
        return DependencyState.WAITING
    met = condition == DependencyCondition.FINISHED or (
        (condition == DependencyCondition.SUCCEEDED and state == JobState.SUCCEEDED)
        or (condition == DependencyCondition.FAILED and state == JobState.FAILED)
    )
    return DependencyState.MET if met else DependencyState.NEVER


@dataclass(frozen=True, slots=True)
class ArrayProgress:
    tasks: int
    ended: int
    succeeded: int
    failed: int

    def outcome(self, condition: str) -> str:
        if condition == DependencyCondition.SUCCEEDED and self.ended > self.succeeded:
            # One task ended otherwise: "every task succeeded" is out of reach already.
            return DependencyState.NEVER
        if self.ended < self.tasks:
            return DependencyState.WAITING
        if condition == DependencyCondition.FAILED and not self.failed:
            return DependencyState.NEVER
        return DependencyState.MET


def _array_progress(array_ids: Iterable[int]) -> dict[int, ArrayProgress]:
    rows = (
        Job.objects.filter(array_id__in=list(array_ids))
        .values("array_id")
        .annotate(
            tasks=Count("id"),
            ended=Count("id", filter=Q(state__in=FINISHED_JOB_STATES)),
            succeeded=Count("id", filter=Q(state=JobState.SUCCEEDED)),
            failed=Count("id", filter=Q(state=JobState.FAILED)),
        )
        .order_by()
    )
    return {
        r["array_id"]: ArrayProgress(r["tasks"], r["ended"], r["succeeded"], r["failed"])
        for r in rows
    }


def _never_story(target: str, condition: str, state: str | None, progress=None) -> str:
    """Why a dependency can no longer be met, e.g. 'job 12 failed; it was to succeed'."""
    if state is not None:
        return f"{target} {_ENDED[state]}; it was to {_VERB[condition]}"
    if condition == DependencyCondition.SUCCEEDED:
        return f"a task of {target} did not succeed; every task was to succeed"
    return f"every task of {target} ended and none failed; one was to fail"


# Validation at the submit boundary.


def _item_id(item: dict, key: str, at: str, errors: dict[str, list[str]]) -> int | None:
    value = item.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 19:
            value = int(value)  # a form's text input (19 digits: beyond any id)
        else:
            errors[f"{at}.{key}"] = [f"Must be the {key}'s id, a positive whole number."]
            return None
    if not 1 <= value <= MAX_ID:
        errors[f"{at}.{key}"] = [f"No {key} {value} in this tenant."]
        return None
    return value


_UNKNOWN_TARGET = re.compile(r"No (job|array) [0-9]+ in this tenant\.")
_TARGET_FIELD = re.compile(r"depends_on\[[0-9]+\]\.(job|array)")


def unknown_target(kind: str, target_id: object) -> str:
    """What a submit naming a job or array it cannot see is told (unknown or another
    tenant's: the same words, so nothing tells them apart)."""
    return f"No {kind} {target_id} in this tenant."


def refers_only_to_unknown(detail: object) -> bool:
    """Whether a refused submit's errors (a field -> messages dict, or a batch's item -> dict)
    are all about jobs or arrays it cannot see: the API then answers 404, as for a URL naming
    another tenant's object, still naming the field at fault."""

    def leaves(node: object, field: str | None):
        if isinstance(node, dict):
            for key, value in node.items():
                yield from leaves(value, str(key))
        elif isinstance(node, list):
            for value in node:
                yield from leaves(value, field)
        else:
            yield field, str(node)

    found = list(leaves(detail, None))
    return bool(found) and all(
        field is not None
        and _TARGET_FIELD.fullmatch(field) is not None
        and _UNKNOWN_TARGET.fullmatch(message) is not None
        for field, message in found
    )


def parse(raw: object, *, tenant, user=None) -> list[DependencySpec]:
    """Validate a submit's `depends_on`; raises ValidationError naming each item at fault.

    Reads the named jobs and arrays of `tenant` (two queries at most), writes nothing. `user`
    is not consulted: any member who may submit to the tenant may name any of its jobs.
    """
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ValidationError(
            {"depends_on": ['Must be a list of {"job": id, "condition": "succeeded"} objects.']}
        )
    if len(raw) > MAX_DEPENDENCIES:
        raise ValidationError({"depends_on": [f"At most {MAX_DEPENDENCIES} dependencies."]})
    errors: dict[str, list[str]] = {}
    parsed: list[tuple[str, DependencySpec]] = []
    for i, item in enumerate(raw):
        at = f"depends_on[{i}]"
        if not isinstance(item, dict):
            errors[at] = ['Must be an object: {"job": id} or {"array": id}, and a condition.']
            continue
        unknown = sorted((str(k) for k in set(item) - {"job", "array", "condition"}), key=str)
        for key in unknown:
            shown = key if text_problem(key) is None else "?"
            errors[f"{at}.{shown}"] = ["Unknown field."]
        if ("job" in item) == ("array" in item):
            errors[at] = ['Name exactly one of "job" or "array".']
            continue
        key = "job" if "job" in item else "array"
        target = _item_id(item, key, at, errors)
        condition = item.get("condition", DependencyCondition.SUCCEEDED.value)
        if condition not in CONDITIONS:
            errors[f"{at}.condition"] = [f"Must be one of {', '.join(CONDITIONS)}."]
            continue
        if target is None:
            continue
        spec = (
            DependencySpec(str(condition), job_id=target)
            if key == "job"
            else DependencySpec(str(condition), array_id=target)
        )
        parsed.append((f"{at}.{key}", spec))
    job_ids = {s.job_id for _, s in parsed if s.job_id is not None}
    array_ids = {s.array_id for _, s in parsed if s.array_id is not None}
    job_states = (
        dict(Job.objects.filter(tenant=tenant, pk__in=job_ids).values_list("pk", "state"))
        if job_ids
        else {}
    )
    arrays = (
        set(JobArray.objects.filter(tenant=tenant, pk__in=array_ids).values_list("pk", flat=True))
        if array_ids
        else set()
    )
    progress = _array_progress(arrays) if arrays else {}
    specs: list[DependencySpec] = []
    seen: dict[DependencySpec, str] = {}
    for at, spec in parsed:
        if spec in seen:
            errors.setdefault(at, []).append(f"The same dependency as {seen[spec]}.")
            continue
        seen[spec] = at
        if spec.job_id is not None:
            if spec.job_id not in job_states:
                errors.setdefault(at, []).append(unknown_target("job", spec.job_id))
                continue
            state = job_states[spec.job_id]
            if job_outcome(state, spec.condition) == DependencyState.NEVER:
                errors.setdefault(at, []).append(
                    f"Job {spec.job_id} already {_ENDED[state]}: it can never "
                    f"{_VERB[spec.condition]}."
                )
                continue
        else:
            if spec.array_id not in arrays:
                errors.setdefault(at, []).append(unknown_target("array", spec.array_id))
                continue
            found = progress.get(spec.array_id)
            if found is not None and found.outcome(spec.condition) == DependencyState.NEVER:
                story = _never_story(f"array {spec.array_id}", spec.condition, None)
                errors.setdefault(at, []).append(f"It can never be met: {story}.")
                continue
        specs.append(spec)
    if errors:
        raise ValidationError(errors)
    return specs


def waiting_reason(specs: Iterable[DependencySpec]) -> str:
    """'waiting for job 12 to succeed and array 5 to finish'."""
    parts = [f"{s.target} to {_VERB[s.condition]}" for s in specs]
    if not parts:
        return ""
    listed = parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"
    return f"waiting for {listed}"


def _spec_of(row: Mapping[str, Any]) -> DependencySpec:
    return DependencySpec(row["condition"], row["on_job_id"], row["on_array_id"])


# Writes: inside the caller's transaction (a submit's, or the one that ended a job).


def attach(jobs: Sequence[Job], specs: Sequence[DependencySpec]) -> None:
    """Record `specs` for every job of `jobs` in the submit transaction, holding them.

    The targets are locked first: a job's end locks its row (and an array task's end, its
    array's), so either that end committed before (and its state is read here) or it waits for
    this submit and then finds the dependency rows and has_dependents set. A dependency found
    impossible here (its target ended between validation and now) cancels the new jobs, with
    the reason, as it would have a moment later.
    """
    if not specs:
        for job in jobs:
            # A new job's answer shows its (no) dependencies without a query.
            _show(job, [])
        return
    now = timezone.now()
    job_ids = sorted({s.job_id for s in specs if s.job_id is not None})
    array_ids = sorted({s.array_id for s in specs if s.array_id is not None})
    states: dict[int, str] = {}
    if job_ids:
        states = dict(
            Job.objects.select_for_update(no_key=True)
            .filter(pk__in=job_ids)
            .order_by("pk")
            .values_list("pk", "state")
        )
        Job.objects.filter(pk__in=job_ids, has_dependents=False).update(has_dependents=True)
    progress: dict[int, ArrayProgress] = {}
    if array_ids:
        list(JobArray.objects.select_for_update().filter(pk__in=array_ids).order_by("pk"))
        JobArray.objects.filter(pk__in=array_ids, has_dependents=False).update(has_dependents=True)
        progress = _array_progress(array_ids)
    outcomes: dict[DependencySpec, str] = {}
    for spec in specs:
        if spec.job_id is not None:
            outcomes[spec] = job_outcome(states.get(spec.job_id, ""), spec.condition)
        else:
            found = progress.get(spec.array_id or 0)
            outcomes[spec] = found.outcome(spec.condition) if found else DependencyState.WAITING
    rows = [
        JobDependency(
            job=job,
            on_job_id=spec.job_id,
            on_array_id=spec.array_id,
            condition=spec.condition,
            state=outcomes[spec],
            resolved_at=None if outcomes[spec] == DependencyState.WAITING else now,
        )
        for job in jobs
        for spec in specs
    ]
    JobDependency.objects.bulk_create(rows, batch_size=5000)
    for job in jobs:
        # What the submit's answer shows, without reading them back.
        _show(job, [r for r in rows if r.job_id == job.pk])
    never = [s for s in specs if outcomes[s] == DependencyState.NEVER]
    if never:
        spec = never[0]
        story = _never_story(spec.target, spec.condition, states.get(spec.job_id or 0))
        _cancel({job.pk: story for job in jobs}, now)
        for job in jobs:
            job.state = JobState.CANCELLED
            job.hold = Hold.NONE
            job.state_reason = _cancel_reason(story)
        return
    waiting = [s for s in specs if outcomes[s] == DependencyState.WAITING]
    if not waiting:
        return  # all met already: the jobs stay as they were
    reason = waiting_reason(waiting)
    Job.objects.filter(pk__in=[j.pk for j in jobs]).update(
        hold=Hold.DEPENDENCY, pending_reason_code=REASON_CODE, pending_reason=reason
    )
    for job in jobs:
        job.hold = Hold.DEPENDENCY
        job.pending_reason_code = REASON_CODE
        job.pending_reason = reason


def _show(job: Job, rows: list[JobDependency]) -> None:
    """Give `job` these rows as its prefetched dependencies (what a prefetch_related would)."""
    # A job without dependencies gets the empty queryset, whose every refinement is empty too:
    # building filter(job=job) costs a submit about as much as one of its round trips.
    shown = JobDependency.objects.filter(job=job) if rows else JobDependency.objects.none()
    shown._result_cache = rows
    shown._prefetch_done = True  # type: ignore[attr-defined]
    cache = getattr(job, "_prefetched_objects_cache", {})
    job._prefetched_objects_cache = {**cache, "dependencies": shown}  # type: ignore[attr-defined]


def _cancel_reason(story: str) -> str:
    return f"Dependency never satisfied: {story}"


def _cancel(stories: dict[int, str], now) -> list[Finished]:
    """Cancel these PENDING jobs, each with its story, as actions.transition would: the same
    columns and event, in a few statements whatever their number. Returns their ends."""
    if not is_allowed(JobState.PENDING, JobState.CANCELLED):  # the state machine's word
        raise AssertionError("PENDING jobs may no longer be cancelled")
    cleared = {**PENDING_ONLY_FIELDS, "hold": Hold.NONE, "finished_at": now}
    bulk.update_rows(
        Job,
        ("state", "state_reason", *cleared),
        [
            (pk, JobState.CANCELLED, _cancel_reason(story), *cleared.values())
            for pk, story in stories.items()
        ],
        only_if={"state": JobState.PENDING},
    )
    bulk.insert_rows(
        JobEvent,
        [
            {
                "job_id": pk,
                "kind": "cancelled",
                "from_state": JobState.PENDING,
                "to_state": JobState.CANCELLED,
                "message": _cancel_reason(story),
                "data": {"dependency_never_satisfied": True},
            }
            for pk, story in stories.items()
        ],
        common={"at": now},
    )
    rows = list(
        Job.objects.filter(pk__in=list(stories)).values_list(
            "pk", "array_id", "has_dependents", "tenant_id"
        )
    )
    # Real ends like any other: /metrics counts them once this transaction commits.
    if event_metrics.enabled():
        outcomes = [(tenant_id, JobState.CANCELLED) for *_, tenant_id in rows]
        transaction.on_commit(lambda: event_metrics.record_jobs_finished(outcomes))
    return [
        Finished(pk, JobState.CANCELLED, array_id, has_dependents)
        for pk, array_id, has_dependents, _ in rows
    ]


@dataclass(frozen=True, slots=True)
class ForArrays:
    """What resolving dependencies leaves for controlplane.jobs.arrays to do (the caller,
    jobs.actions, passes it on: this module does not import arrays, which imports it)."""

    # Arrays some of whose tasks were released into their queue: fill their free slots.
    fill: list[int]
    # Array tasks cancelled here (a dependency never met): their slots are free.
    ended: list[Finished]


def jobs_finished(finished: Sequence[Finished]) -> ForArrays:
    """Resolve the dependencies on these jobs (and on arrays whose end this makes known).

    Round by round: each round resolves the dependencies on the jobs that ended in the round
    before, releases the dependents whose dependencies are now all met and cancels those with
    one that can never be met; the latter are the next round's ends. A chain of n dependents
    is n rounds of a few statements each, with no recursion.
    """
    now = timezone.now()
    released_arrays: set[int] = set()
    cancelled_tasks: list[Finished] = []
    released_any = False
    frontier = list(finished)
    while frontier:
        resolved_jobs, stories = _resolve(frontier, now)
        if not resolved_jobs:
            break
        cancel, release, still = _verdicts(resolved_jobs, stories)
        if release:
            released_any = True
            released_arrays |= _release(release)
        if still:
            bulk.update_rows(
                Job,
                ("pending_reason",),
                [(pk, reason) for pk, reason in still.items()],
                only_if={"state": JobState.PENDING, "hold": Hold.DEPENDENCY},
            )
        frontier = _cancel(cancel, now) if cancel else []
        cancelled_tasks.extend(f for f in frontier if f.array_id is not None)
        frontier = [f for f in frontier if f.has_dependents or f.array_id is not None]
    if released_any:
        transaction.on_commit(lambda: wakeups.request_cycle("dependency"))
    return ForArrays(fill=sorted(released_arrays), ended=cancelled_tasks)


def _resolve(frontier: Sequence[Finished], now) -> tuple[set[int], dict[int, str]]:
    """Resolve the waiting dependencies on these ends; returns the dependent jobs touched, and
    for each dependency made impossible, its dependent's story (the first one found)."""
    ended = {f.job_id: f.state for f in frontier if f.has_dependents}
    task_arrays = sorted({f.array_id for f in frontier if f.array_id is not None})
    progress: dict[int, ArrayProgress] = {}
    if task_arrays:
        # Every array locked, whether someone depends on it or not: a submit naming it (attach)
        # sets has_dependents under the same lock, and a filter on has_dependents would skip a
        # row being set without waiting for it. Under the lock, the latest value is read: the
        # submit either committed first (its rows are seen here) or waits and then sees this
        # end. The array's other task ends wait for this one, as array_slots.fill needs them to.
        watched = [
            pk
            for pk, has_dependents in JobArray.objects.select_for_update()
            .filter(pk__in=task_arrays)
            .order_by("pk")
            .values_list("pk", "has_dependents")
            if has_dependents
        ]
        progress = _array_progress(watched) if watched else {}
    if not ended and not progress:
        return set(), {}
    waiting = JobDependency.objects.filter(state=DependencyState.WAITING).filter(
        Q(on_job_id__in=list(ended)) | Q(on_array_id__in=list(progress))
    )
    met: list[int] = []
    never: list[int] = []
    touched: set[int] = set()
    stories: dict[int, str] = {}
    for row in waiting.values("pk", "job_id", "on_job_id", "on_array_id", "condition"):
        spec = _spec_of(row)
        if spec.job_id is not None:
            state = ended[spec.job_id]
            outcome = job_outcome(state, spec.condition)
        else:
            state = None
            outcome = progress[spec.array_id or 0].outcome(spec.condition)
        if outcome == DependencyState.WAITING:
            continue
        touched.add(row["job_id"])
        if outcome == DependencyState.MET:
            met.append(row["pk"])
        else:
            never.append(row["pk"])
            stories.setdefault(row["job_id"], _never_story(spec.target, spec.condition, state))
    if met:
        JobDependency.objects.filter(pk__in=met).update(state=DependencyState.MET, resolved_at=now)
    if never:
        JobDependency.objects.filter(pk__in=never).update(
            state=DependencyState.NEVER, resolved_at=now
        )
    return touched, stories


def _verdicts(
    dependents: set[int], stories: dict[int, str]
) -> tuple[dict[int, str], list[int], dict[int, str]]:
    """For the held dependents among these: those to cancel (with their story), those to
    release, and the reasons of those still waiting."""
    held = list(
        Job.objects.select_for_update(no_key=True)
        .filter(pk__in=sorted(dependents), state=JobState.PENDING, hold=Hold.DEPENDENCY)
        .order_by("pk")
        .values_list("pk", flat=True)
    )
    cancel = {pk: stories[pk] for pk in held if pk in stories}
    others = [pk for pk in held if pk not in cancel]
    waiting: dict[int, list[DependencySpec]] = defaultdict(list)
    if others:
        for row in JobDependency.objects.filter(
            job_id__in=others, state=DependencyState.WAITING
        ).values("job_id", "on_job_id", "on_array_id", "condition"):
            waiting[row["job_id"]].append(_spec_of(row))
    release = [pk for pk in others if pk not in waiting]
    still = {pk: waiting_reason(specs) for pk, specs in waiting.items()}
    return cancel, release, still


def _release(job_ids: list[int]) -> set[int]:
    """Lift the dependency hold of these jobs: a task of an array with max_parallel joins its
    array's queue (Hold.ARRAY; the caller fills the array), any other job the scheduler's.
    Returns the arrays to fill."""
    throttled = dict(
        Job.objects.filter(pk__in=job_ids, array__max_parallel__isnull=False).values_list(
            "pk", "array_id"
        )
    )
    if throttled:
        Job.objects.filter(pk__in=list(throttled)).update(
            hold=Hold.ARRAY, pending_reason_code=ARRAY_REASON_CODE, pending_reason=ARRAY_REASON
        )
    free = [pk for pk in job_ids if pk not in throttled]
    if free:
        Job.objects.filter(pk__in=free).update(
            hold=Hold.NONE, pending_reason_code="", pending_reason=""
        )
    return set(throttled.values())
