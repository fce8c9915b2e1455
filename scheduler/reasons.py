"""Why a job is still pending, in words a researcher understands, and where it stands.

The admission step records, for every job it leaves pending, a `Waiting` with the facts of that
moment (the tenant's usage, the free GPUs, the job the GPUs are reserved for); this step turns
them into PendingDecisions. Sentences are built last, once, so the admission loop stays cheap.
"""

from __future__ import annotations

from scheduler.model import PendingDecision, ReasonCode

RC = ReasonCode


class Waiting:
    """The facts behind one pending decision (class attributes are the defaults)."""

    quota_type = ""  # the type of the quota that binds ("" for the ANY one)
    free = 0
    used = 0
    guaranteed = 0
    limit = 0
    head: int | None = None  # the job the free GPUs are reserved for
    start_s: float | None = None
    count = 0

    def __init__(self, job, code: ReasonCode, gpu_type: str = "", detail: str = ""):
        self.job = job
        self.code = code
        self.gpu_type = gpu_type  # the type the facts are about (for any-type jobs: the best one)
        self.detail = detail


def decisions(waiting: list[Waiting], now_s: float) -> tuple[PendingDecision, ...]:
    """One PendingDecision per waiting job, numbered in the order the cycle considered them."""
    return tuple(
        PendingDecision(
            job_id=w.job.job_id,
            reason_code=w.code,
            reason=sentence(w, now_s),
            queue_position=position,
            estimated_start_s=w.start_s,
        )
        for position, w in enumerate(waiting, start=1)
    )


def sentence(w: Waiting, now_s: float) -> str:
    """The reason as a sentence."""
    job = w.job
    tenant = job.tenant
    kind = w.gpu_type or "GPUs"
    if job.gpu_type:
        what = f"{job.gpus} x {job.gpu_type}"
    else:
        what = f"{job.gpus} GPU{'' if job.gpus == 1 else 's'} of any type"
    head = f"waiting for {what}"
    usage = f"tenant {tenant} uses {w.used} of its {w.guaranteed} guaranteed"
    code = w.code
    if code is RC.BUDGET_HOLD:
        return (
            f"held: tenant {tenant} has used up its budget, so none of its jobs start until the "
            "budget renews or is raised"
        )
    if code is RC.MAX_RUNNING_JOBS:
        return f"{head}: tenant {tenant} already runs {w.count} jobs, its maximum"
    if code is RC.QUOTA_LIMIT:
        if w.detail == "unknown_tenant":
            return f"{head}: tenant {tenant} is unknown, so it has no quota"
        if w.detail == "no_quota":
            on = f"{w.gpu_type} GPUs" if w.gpu_type else "GPUs"
            return f"{head}: tenant {tenant} has no quota for {on}"
        if w.detail == "not_preemptible":
            return (
                f"{head}: the job cannot be preempted, so it may only use guaranteed GPUs, and "
                f"{usage}"
            )
        return (
            f"{head}: tenant {tenant} uses {w.used} of its limit of {w.limit} "
            f"{w.quota_type or 'GPUs'}"
        )
    if code is RC.STATIC_PARTITION:
        return f"{head}: {usage}, and without borrowing it may not use more"
    if code is RC.BUDGET_NO_BORROWING:
        return (
            f"{head}: tenant {tenant} has used up its budget, so it may only start work within "
            f"its guarantee, and it uses {w.used} of its {w.guaranteed} guaranteed"
        )
    if code is RC.NO_MATCHING_GPUS:
        if w.detail == "no_type":
            return f"{head}: no schedulable node has {kind}"
        if w.detail == "resources":
            cpus = f"{job.cpus:g} CPUs and " if job.cpus else ""
            return (
                f"{head}: no schedulable node with {kind} has {cpus}{job.memory_mib} MiB of "
                "memory for it"
                if job.memory_mib
                else f"{head}: no schedulable node with {kind} has {job.cpus:g} CPUs for it"
            )
        return f"{head}: only {w.count} healthy {kind} exist on schedulable nodes"
    if code is RC.WAITING_FOR_PREEMPTION:
        if w.detail == "own_stopping":
            return (
                f"{head}: tenant {tenant}'s jobs that are stopping still count against its "
                "quota; it can start once they have stopped"
            )
        if w.detail == "victims":
            jobs = "1 running job is" if w.count == 1 else f"{w.count} running jobs are"
            return f"{head}: {jobs} being preempted to free GPUs for it; it starts once stopped"
        return (
            f"{head}: GPUs of jobs that are stopping are set aside for it; it starts once they "
            "are released"
        )
    if code is RC.RESERVED or (w.head is not None and w.head != job.job_id):
        if 0 < w.count < w.free:
            free = f"{w.count} of the {w.free} free {kind} {'is' if w.count == 1 else 'are'}"
        else:
            free = _free_phrase(w.free, kind)
        return (
            f"{head}: {usage}, and {free} reserved for job {w.head}, which is first in line "
            f"for {kind}"
        )
    if code is RC.GANG_FRAGMENTED:
        text = f"{head}: {w.free} {kind} are free, but no node has {job.gpus} of them free together"
    else:
        text = f"{head}: {usage}, and only {w.free} {kind} are free"
    if w.head == job.job_id and w.start_s is not None:
        text += f"; it is first in line for {kind} and should start {_when(w.start_s - now_s)}"
    return text


def _free_phrase(free: int, kind: str) -> str:
    if free == 1:
        return f"the 1 free {kind} is"
    return f"the {free} free {kind} are"


def _when(delay_s: float) -> str:
    if delay_s < 30:
        return "within a minute"
    if delay_s < 5400:
        return f"in about {max(1, round(delay_s / 60))} min"
    if delay_s < 2 * 86400:
        return f"in about {round(delay_s / 3600)} h"
    return f"in about {round(delay_s / 86400)} days"
