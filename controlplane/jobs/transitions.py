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


def is_allowed(from_state: str, to_state: str) -> bool:
    return to_state in ALLOWED_TRANSITIONS.get(from_state, frozenset())
