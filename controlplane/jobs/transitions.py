"""The job state machine: which transitions are legal. Pure data, used by jobs.actions."""

from controlplane.jobs.models import JobState as S

ALLOWED_TRANSITIONS: dict[str, frozenset[str]] = {
    S.PENDING: frozenset({S.ADMITTED, S.CANCELLED}),
    S.ADMITTED: frozenset({S.RUNNING, S.FAILED, S.CANCELLED, S.LOST, S.PREEMPTED}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED, S.PREEMPTED, S.LOST}),
    S.PREEMPTED: frozenset({S.PENDING, S.CANCELLED}),
    S.LOST: frozenset({S.PENDING, S.FAILED, S.CANCELLED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}


# Only a late report may take these: a node declared lost comes back and says that the attempt
# really ended by itself. The job then ends as its process did, even though the loss had
# requeued it (PENDING, or ADMITTED with a copy not yet started) or failed it (not restartable).
LATE_REPORT_TRANSITIONS: dict[str, frozenset[str]] = {
    S.PENDING: frozenset({S.SUCCEEDED, S.FAILED}),
    S.ADMITTED: frozenset({S.SUCCEEDED, S.FAILED}),
    S.FAILED: frozenset({S.SUCCEEDED}),
}


def is_allowed(from_state: str, to_state: str, *, late_report: bool = False) -> bool:
    if to_state in ALLOWED_TRANSITIONS.get(from_state, frozenset()):
        return True
    return late_report and to_state in LATE_REPORT_TRANSITIONS.get(from_state, frozenset())


# What a job shows only while it waits: its reason, its place in the queue, its estimated start.
# Leaving PENDING clears them, whatever the move (an admission, a cancel, a late report), so a
# job that runs or ended never shows a stale wait.
PENDING_ONLY_FIELDS: dict[str, object] = {
    "pending_reason_code": "",
    "pending_reason": "",
    "queue_position": None,
    "estimated_start_at": None,
}
FINAL_STATES = frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED})


def fields_on_entering(to_state: str, now) -> dict[str, object]:
    """The columns a move into to_state writes besides the state itself.

    A move out of PENDING clears what a job shows only while waiting; a move into a final state
    stamps finished_at (a caller that knows a truer end passes its own, which wins).
    """
    fields: dict[str, object] = {}
    if to_state != S.PENDING:
        fields.update(PENDING_ONLY_FIELDS)
        # A held job cancelled while waiting is held no more. Not one of PENDING_ONLY_FIELDS:
        # the scheduling applier writes those on every pending job it sees, and a hold is the
        # dependencies' and arrays' to lift, never the cycle's.
        fields["hold"] = ""
    if to_state in FINAL_STATES:
        fields["finished_at"] = now
    return fields
