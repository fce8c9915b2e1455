"""Job arrays through real scheduling cycles, with the nodes' part played here: what a node is
told to run (its desired state) is started, and ended, through the actions agents reach."""

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.cluster.desired_state import current_desired_state
from controlplane.jobs import actions
from controlplane.jobs.models import FINISHED_JOB_STATES, Hold, Job, JobAttempt, JobState
from controlplane.scheduling.cycle import run_scheduling_cycle

pytestmark = pytest.mark.django_db

GPUS_PER_NODE = 8


@pytest.fixture
def nodes(make_node):
    # 16 GPUs, the vision quota's limit: only max_parallel keeps the array below that.
    return [make_node(f"n{i}", gpus=GPUS_PER_NODE) for i in range(2)]


def submit_array(user, **fields) -> int:
    client = APIClient()
    client.force_authenticate(user)
    body = {
        "tenant": "vision",
        "name": "sweep",
        "image": "registry.local/team/sweep:1",
        "command": ["python", "sweep.py", "--point={{array_index}}"],
        "gpus": 1,
        "gpu_type": "H100-SXM-80GB",
        **fields,
    }
    response = client.post("/api/v1/arrays/", body, format="json")
    assert response.status_code == 201, response.content
    return response.json()["id"]


def in_flight(array_id: int) -> int:
    """Tasks holding GPUs or free to be given them: what max_parallel bounds."""
    tasks = Job.objects.filter(array_id=array_id)
    return (
        tasks.filter(
            state__in=[JobState.ADMITTED, JobState.RUNNING, JobState.PREEMPTED, JobState.LOST]
        ).count()
        + tasks.filter(state=JobState.PENDING, hold=Hold.NONE).count()
    )


def told_to_run(nodes) -> list[dict]:
    return [a for node in nodes for a in current_desired_state(node)["attempts"]]


def test_an_array_of_100_with_max_parallel_10_never_runs_more_than_10_and_all_end(nodes, alice):
    array_id = submit_array(alice, array="0-99", max_parallel=10)
    seen: dict[int, tuple[str, str]] = {}  # job id -> (its env's index, its command's point)
    bulk = False
    for _ in range(40):
        assert in_flight(array_id) <= 10
        run_scheduling_cycle(trigger="test")
        assert in_flight(array_id) <= 10
        running = told_to_run(nodes)
        assert 0 < len(running) <= 10
        for work in running:
            seen[work["job_id"]] = (work["env"]["GPUCP_ARRAY_INDEX"], work["command"][-1])
            assert work["env"]["GPUCP_ARRAY_SIZE"] == "100"
            assert work["env"]["GPUCP_ARRAY_ID"] == str(array_id)
        # The nodes start what they were given and, a moment later, it ends: one round through
        # the heartbeat's bulk path, the next through the one-attempt actions.
        attempts = list(JobAttempt.objects.filter(pk__in=[w["attempt_id"] for w in running]))
        now = timezone.now()
        if bulk:
            reports = [
                actions.Report(a.pk, started_at=now, exit_code=0, finished_at=now) for a in attempts
            ]
            assert actions.record_reports(reports) == {a.pk for a in attempts}
        else:
            for attempt in attempts:
                actions.mark_attempt_running(attempt, started_at=now)
                actions.finish_attempt(
                    JobAttempt.objects.get(pk=attempt.pk), exit_code=0, finished_at=now
                )
        bulk = not bulk
        if not Job.objects.filter(array_id=array_id).exclude(state=JobState.SUCCEEDED).exists():
            break
    tasks = list(Job.objects.filter(array_id=array_id).order_by("array_index"))
    assert [t.state for t in tasks] == [JobState.SUCCEEDED] * 100
    # Every task ran once, and saw its own index in its environment and its command.
    by_job = {t.pk: t.array_index for t in tasks}
    assert sorted(seen) == sorted(by_job)
    for job_id, (env_index, point) in seen.items():
        assert env_index == str(by_job[job_id])
        assert point == f"--point={by_job[job_id]}"


def test_cancelling_the_array_midway_cancels_the_rest_and_stops_the_running(nodes, alice):
    array_id = submit_array(alice, array=30, max_parallel=4)
    run_scheduling_cycle(trigger="test")
    first = told_to_run(nodes)
    assert len(first) == 4
    now = timezone.now()
    for work in first[:2]:  # two run, two are still being started
        actions.mark_attempt_running(JobAttempt.objects.get(pk=work["attempt_id"]), started_at=now)
    client = APIClient()
    client.force_authenticate(alice)
    response = client.post(f"/api/v1/arrays/{array_id}/cancel/")
    assert response.status_code == 200
    assert response.json()["counts"]["cancelled"] == 30
    assert set(Job.objects.filter(array_id=array_id).values_list("state", flat=True)) == {
        JobState.CANCELLED
    }
    stopping = JobAttempt.objects.filter(job__array_id=array_id)
    assert stopping.count() == 4
    assert all(a.stop_requested_at and a.stop_reason == "cancelled" for a in stopping)
    # The stops free no slot for anyone, and a later cycle starts nothing of the array.
    for attempt in stopping:
        actions.finish_attempt(attempt, exit_code=143)
    run_scheduling_cycle(trigger="test")
    assert (
        not JobAttempt.objects.filter(job__array_id=array_id)
        .exclude(pk__in=[a.pk for a in stopping])
        .exists()
    )
    assert Job.objects.filter(array_id=array_id).exclude(state__in=FINISHED_JOB_STATES).count() == 0


def test_a_task_ended_in_a_heartbeats_bulk_path_frees_its_slot(nodes, alice):
    array_id = submit_array(alice, array=5, max_parallel=2)
    run_scheduling_cycle(trigger="test")
    running = told_to_run(nodes)
    assert len(running) == 2
    now = timezone.now()
    done = actions.record_reports(
        [actions.Report(running[0]["attempt_id"], started_at=now, exit_code=1, finished_at=now)]
    )
    assert done == {running[0]["attempt_id"]}
    tasks = list(Job.objects.filter(array_id=array_id).order_by("array_index"))
    assert [t.state for t in tasks[:2]].count(JobState.FAILED) == 1
    # A failed task frees its slot as a succeeded one does: the lowest held index gets it.
    assert (tasks[2].hold, tasks[2].pending_reason) == ("", "")
    assert [t.hold for t in tasks[3:]] == [Hold.ARRAY, Hold.ARRAY]
    run_scheduling_cycle(trigger="test")
    assert {w["env"]["GPUCP_ARRAY_INDEX"] for w in told_to_run(nodes)} == {
        running[1]["env"]["GPUCP_ARRAY_INDEX"],
        "2",
    }
