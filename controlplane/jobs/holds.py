"""Pending jobs kept from the scheduler until they may run: dependents and throttled array tasks.

A held job is PENDING with Job.hold set (Hold.DEPENDENCY or Hold.ARRAY). The scheduling loop
reads only jobs that are not held (the `job_schedulable` index), so any number of them costs a
cycle nothing, and the scheduler core never learns of dependencies or arrays. What lifts a hold
happens in the transaction that ends a job: controlplane.jobs.actions, whichever way it moves a
job to SUCCEEDED, FAILED or CANCELLED, passes it as a Finished to the jobs that depend on it
(controlplane.jobs.dependencies) and to its array, whose freed slot goes to the next task
(controlplane.jobs.arrays). This module only names holds: it imports neither, so the two may
import it without a loop. Because both happen in that same transaction, a crash cannot leave
a dependent waiting for a job that has already ended.

A hold's reason is written with it (Job.pending_reason_code / pending_reason), since the cycle,
which writes every other pending job's reason, never sees a held one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Finished:
    """A job that has just reached a finished state, with what its end may release."""

    job_id: int
    state: str  # SUCCEEDED, FAILED or CANCELLED
    array_id: int | None
    has_dependents: bool
