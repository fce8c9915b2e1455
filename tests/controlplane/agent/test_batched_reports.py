"""A heartbeat's starts and exits are recorded together (actions.record_reports), and what that
writes is exactly what the one-attempt actions write for the same reports.

Every case a heartbeat can carry is played twice on two identical nodes: once as it is now, and
once with the batch turned off, so that every report takes mark_attempt_running and
finish_attempt one by one, as before the batch existed. Jobs, attempts, events and GPUs must end
the same; and the number of statements must not grow with the number of reports.
"""

import time

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from controlplane.cluster import heartbeat
from controlplane.jobs import actions
from controlplane.jobs.models import Allocation, AttemptState, Job, JobAttempt, JobState

from .conftest import readings, running

pytestmark = pytest.mark.django_db(transaction=True)

STARTED_AT = time.time() - 30
FINISHED_AT = STARTED_AT + 12.5

# name -> (the attempt before the heartbeat, what the heartbeat says of it)
CASES = {
    "starts": ("admitted", {"state": "running"}),
    "starts and succeeds": ("admitted", {"state": "exited", "exit_code": 0}),
    "starts and fails": ("admitted", {"state": "exited", "exit_code": 3}),
    "exit without a start time": (
        "admitted",
        {"state": "exited", "exit_code": 0, "started_at": None},
    ),
    "succeeds": ("running", {"state": "exited", "exit_code": 0}),
    "killed": ("running", {"state": "exited", "exit_code": 137, "energy_j": None}),
    "preempted": ("preempted", {"state": "exited", "exit_code": 143}),
    "cancelled": ("cancelled", {"state": "exited", "exit_code": 143}),
    "fenced": ("running", {"state": "exited", "exit_code": 137, "stop_cause": "fenced"}),
    "failed to start": ("admitted", {"state": "failed_to_start", "message": "no such image"}),
    "unknown exit code": ("running", {"state": "exited", "exit_code": None}),
    "energy beyond the GPU's": ("running", {"state": "exited", "exit_code": 0, "energy_j": 1e9}),
    # The job contract: checkpoints reported with a start and an exit, and the agent's own stop
    # at the max runtime (the one stop that is a common report), left in time or killed.
    "starts with a checkpoint": (
        "admitted",
        {"state": "running", "last_checkpoint_at": STARTED_AT + 5, "checkpoint_bytes": 123},
    ),
    "checkpoints and succeeds": (
        "running",
        {"state": "exited", "exit_code": 0, "last_checkpoint_at": FINISHED_AT - 1},
    ),
    "over max runtime, left": (
        "running",
        {
            "state": "exited",
            "exit_code": 143,
            "stop_signal_at": FINISHED_AT - 3,
            "killed_after_grace": False,
        },
    ),
    "over max runtime, killed": (
        "running",
        {
            "state": "exited",
            "exit_code": 137,
            "stop_signal_at": FINISHED_AT - 30,
            "killed_after_grace": True,
        },
    ),
    "preempted, killed": (
        "preempted",
        {
            "state": "exited",
            "exit_code": 137,
            "stop_signal_at": FINISHED_AT - 30,
            "killed_after_grace": True,
        },
    ),
}


def _play(agent, node, token, make_job, tenant, user, admit, *, batched, monkeypatch):
    if not batched:
        monkeypatch.setattr(heartbeat, "_record_common_reports", lambda *args: set())
    attempts = {}
    names = list(CASES)
    for first in range(0, len(names), 5):
        # A few heartbeats, each with several cases: batches of more than one, and of one kind.
        group = names[first : first + 5]
        for name in group:
            job = make_job(tenant, user, gpus=1, name=name)
            attempts[name] = admit(job, node, gpu_indexes=(names.index(name),))
        started = [
            running(attempts[n], started_at=STARTED_AT) for n in group if CASES[n][0] != "admitted"
        ]
        still_running = [
            running(attempts[n], started_at=STARTED_AT)
            for n in names[:first]
            if CASES[n][1]["state"] == "running"
        ]
        if started:
            agent.heartbeat(token, readings(node), still_running + started)
        for name in group:
            attempt = JobAttempt.objects.get(pk=attempts[name].pk)
            if CASES[name][0] == "preempted":
                actions.request_stop(attempt, reason="preempted", message="Preempted")
            elif CASES[name][0] == "cancelled":
                actions.cancel_job(attempt.job, reason="not needed")
        reports = []
        for name in group:
            report = running(
                attempts[name], started_at=STARTED_AT, finished_at=FINISHED_AT, energy_j=500.0
            )
            report.update(CASES[name][1])
            reports.append(report)
        agent.heartbeat(token, readings(node), still_running + reports)
    monkeypatch.undo()
    return attempts


def _outcome(attempt: JobAttempt, node_name: str) -> dict:
    attempt = JobAttempt.objects.get(pk=attempt.pk)
    job = Job.objects.get(pk=attempt.job_id)

    def plain(text: str) -> str:
        return text.replace(node_name, "<node>")

    return {
        "job": (job.state, plain(job.state_reason), job.exit_code, job.started_at is None),
        "job finished": job.finished_at is not None,
        "attempt": (
            attempt.state,
            attempt.exit_code,
            attempt.started_at,
            attempt.finished_at,
            round(attempt.gpu_seconds, 6),
            round(attempt.energy_j, 6),
            attempt.energy_estimated,
            sorted(attempt.energy_start_j.values()),  # by GPU UUID, which differ per node
            attempt.exit_reported_at is not None,
            attempt.last_checkpoint_at,
            attempt.stop_signal_at,
            attempt.killed_after_grace,
        ),
        "checkpoint bytes": job.checkpoint_bytes,
        "events": [
            (e.kind, e.from_state, e.to_state, plain(e.message), sorted(e.data))
            for e in job.events.order_by("at", "id")
            if e.kind not in ("submitted", "admitted")
        ],
        "active GPUs": Allocation.objects.filter(attempt=attempt, active=True).count(),
    }


def test_a_batch_writes_what_the_one_attempt_actions_write(
    agent, make_job, vision, alice, admit, monkeypatch
):
    from controlplane.cluster.models import Node

    outcomes = {}
    for name, batched in (("node-01", True), ("node-02", False)):
        token = agent.register(name, gpus=len(CASES))
        node = Node.objects.get(name=name)
        attempts = _play(
            agent,
            node,
            token,
            make_job,
            vision,
            alice,
            admit,
            batched=batched,
            monkeypatch=monkeypatch,
        )
        outcomes[batched] = {n: _outcome(a, name) for n, a in attempts.items()}

    for name in CASES:
        assert outcomes[True][name] == outcomes[False][name], name
    # The cases do reach the outcomes they are named for (the comparison alone would pass
    # were both paths wrong alike).
    jobs = {n: o["job"][0] for n, o in outcomes[True].items()}
    assert jobs["starts"] == JobState.RUNNING
    assert jobs["starts and succeeds"] == jobs["succeeds"] == JobState.SUCCEEDED
    assert jobs["starts and fails"] == jobs["killed"] == JobState.FAILED
    assert jobs["preempted"] == jobs["fenced"] == JobState.PENDING
    assert jobs["cancelled"] == JobState.CANCELLED
    assert outcomes[True]["energy beyond the GPU's"]["attempt"][6] is True  # booked as estimated
    assert all(
        o["active GPUs"] == 0
        for n, o in outcomes[True].items()
        if n not in ("starts", "starts with a checkpoint")
    )
    assert outcomes[True]["starts with a checkpoint"]["checkpoint bytes"] == 123
    assert outcomes[True]["checkpoints and succeeds"]["attempt"][9] is not None
    stories = {
        n: [e[3] for e in o["events"] if e[0] == "stop_notice"] for n, o in outcomes[True].items()
    }
    assert stories["over max runtime, left"] == [
        "Attempt 1 over its max runtime: left 3.0 s after SIGTERM (grace 30 s)"
    ]
    assert stories["over max runtime, killed"] == [
        "Attempt 1 over its max runtime: did not leave within its 30 s grace after SIGTERM: killed"
    ]
    assert stories["preempted, killed"] == [
        "Attempt 1 preempted: did not leave within its 30 s grace after SIGTERM: killed"
    ]


def _heartbeat_statements(agent, node, token, attempts, exit_code) -> int:
    reports = [
        running(a, state="exited", exit_code=exit_code, finished_at=time.time()) for a in attempts
    ]
    with CaptureQueriesContext(connection) as queries:
        agent.heartbeat(token, readings(node), reports)
    return len(queries)


def test_the_statements_of_a_heartbeat_do_not_grow_with_its_exits(
    agent, node01, make_job, vision, alice, admit
):
    node, token = node01
    counts = []
    for size in (1, 7):
        attempts = [
            admit(make_job(vision, alice, gpus=1), node, gpu_indexes=(i,)) for i in range(size)
        ]
        agent.heartbeat(token, readings(node), [running(a) for a in attempts])
        counts.append(_heartbeat_statements(agent, node, token, attempts, 0))
        assert set(
            JobAttempt.objects.filter(pk__in=[a.pk for a in attempts]).values_list(
                "state", flat=True
            )
        ) == {AttemptState.SUCCEEDED}
    assert counts[0] == counts[1]
