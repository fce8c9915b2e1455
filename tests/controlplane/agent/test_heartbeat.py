"""Heartbeats: telemetry in, attempts moved on, the desired state out; repeats change nothing."""

import datetime as dt
import time

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from controlplane.cluster.models import GPU, GpuTelemetry, Node
from controlplane.cluster.telemetry import TELEMETRY_BUCKET_S
from controlplane.jobs import actions
from controlplane.jobs.models import AttemptState, Job, JobAttempt, JobEvent, JobState

from .conftest import exited, gpu_reading, readings, running


@pytest.fixture
def job(make_job, vision, alice):
    return make_job(vision, alice, command=["python", "train.py"], env={"EPOCHS": "3"}, gpus=2)


def test_a_heartbeat_records_the_latest_telemetry_on_the_gpu_rows(agent, node01):
    node, token = node01
    agent.heartbeat(token, readings(node))
    gpus = readings(node, power_draw_w=512.5, temperature_c=61.0)
    # NVML cannot read these on GPU 3: omitted or null, and stored as null, never as 0.
    del gpus[3]["power_draw_w"]
    gpus[3]["sm_clock_mhz"] = None
    gpus[5]["healthy"] = False

    agent.heartbeat(token, gpus)

    rows = {g.index: g for g in GPU.objects.filter(node=node)}
    assert rows[0].power_draw_w == 512.5
    assert rows[0].temperature_c == 61.0
    assert rows[0].energy_j == 1_000_000.0
    assert rows[0].telemetry_at is not None
    assert rows[3].power_draw_w is None
    assert rows[3].sm_clock_mhz is None
    assert rows[3].temperature_c == 61.0
    assert rows[5].healthy is False
    assert all(rows[i].healthy for i in (0, 1, 2, 3, 4, 6, 7))
    node.refresh_from_db()
    assert node.ready and node.last_heartbeat_at is not None


def test_a_gpu_the_agent_stops_listing_is_marked_unhealthy(agent, node01):
    node, token = node01
    agent.heartbeat(token, readings(node)[:7])
    assert list(GPU.objects.filter(healthy=False).values_list("index", flat=True)) == [7]


def test_history_keeps_one_row_per_gpu_per_bucket_with_the_mean_of_its_samples(agent, node01):
    node, token = node01
    for draw in (300.0, 400.0, 500.0):
        agent.heartbeat(token, readings(node, power_draw_w=draw, utilization_pct=None))

    rows = GpuTelemetry.objects.filter(gpu__node=node)
    # Three heartbeats within one bucket (unless one crossed its edge, then two buckets).
    assert rows.count() in (8, 16)
    if rows.count() == 8:
        for row in rows:
            assert row.samples == 3
            assert row.power_draw_w == pytest.approx(400.0)
            assert row.utilization_pct is None
            assert row.power_cap_w == 700.0
    assert sum(rows.filter(gpu__index=0).values_list("samples", flat=True)) == 3


def test_a_bucket_in_which_the_cap_came_down_keeps_the_highest_cap_above_its_mean_draw(
    agent, node01
):
    """Draws made under a 700 W cap and then under 200 W average above 200 W: the bucket's cap
    is the highest it had, so no chart shows a mean draw above its cap."""
    node, token = node01
    for cap, draw in ((700.0, 560.0), (200.0, 195.0), (200.0, 190.0)):
        agent.heartbeat(token, readings(node, power_cap_w=cap, power_draw_w=draw))

    for row in GpuTelemetry.objects.filter(gpu__node=node):
        assert row.power_draw_w <= row.power_cap_w
    first = GpuTelemetry.objects.filter(gpu__node=node).order_by("bucket_at").first()
    assert first.power_cap_w == 700.0


def test_history_buckets_are_aligned_to_the_bucket_length(agent, node01):
    node, token = node01
    agent.heartbeat(token, readings(node))
    bucket_at = GpuTelemetry.objects.values_list("bucket_at", flat=True).first()
    assert bucket_at.timestamp() % TELEMETRY_BUCKET_S == 0


def test_the_answer_lists_admitted_attempts_with_what_the_agent_needs(agent, node01, job, admit):
    node, token = node01
    attempt = admit(job, node, gpu_indexes=(2, 5))

    answer = agent.heartbeat(token, readings(node))

    assert answer["attempts"] == [
        {
            "attempt_id": attempt.pk,
            "job_id": job.pk,
            "image": "registry.local/team/train:1",
            "command": ["python", "train.py"],
            "env": {"EPOCHS": "3"},
            "gpu_uuids": ["GPU-node-01-2", "GPU-node-01-5"],
            "cpus": 1.0,
            "memory_mib": 4096,
            "max_runtime_s": 86400,
            "stop_signal": "SIGTERM",
            "grace_s": 30.0,
            "mounts": [],
            "checkpoint": None,
            # A one-node job gets the rendezvous too: one node, rank 0, the master itself.
            "rendezvous": {
                "node_rank": 0,
                "num_nodes": 1,
                "node_addrs": ["node-01"],
                "master_addr": "node-01",
                "master_port": 29500,
                "gpus_per_node": 2,
            },
        }
    ]
    assert answer["heartbeat_interval_s"] == 10.0


def test_a_gang_across_two_nodes_shows_each_node_only_its_own_gpus(agent, make_job, vision, alice):
    from controlplane.jobs.models import Allocation

    token1, token2 = agent.register("node-01"), agent.register("node-02")
    n1, n2 = Node.objects.get(name="node-01"), Node.objects.get(name="node-02")
    job = make_job(vision, alice, gpus=16)
    gpus = list(GPU.objects.filter(node__in=[n1, n2]))
    attempt = actions.admit_job(job, node=n1, gpus=gpus, borrowed=False)
    assert Allocation.objects.filter(attempt=attempt).count() == 16

    a1 = agent.heartbeat(token1, readings(n1))["attempts"]
    a2 = agent.heartbeat(token2, readings(n2))["attempts"]

    assert [a["gpu_uuids"] for a in a1] == [[f"GPU-node-01-{i}" for i in range(8)]]
    assert [a["gpu_uuids"] for a in a2] == [[f"GPU-node-02-{i}" for i in range(8)]]
    # node-02 has not started its part yet: that is no reason to declare the gang lost, and
    # the gang runs only once both parts do.
    agent.heartbeat(token1, readings(n1), [running(attempt)])
    agent.heartbeat(token2, readings(n2))
    attempt.refresh_from_db()
    assert attempt.state == AttemptState.ADMITTED
    agent.heartbeat(token2, readings(n2), [running(attempt)])
    attempt.refresh_from_db()
    assert attempt.state == AttemptState.RUNNING


def test_a_running_report_moves_the_job_to_running_and_records_energy(agent, node01, job, admit):
    node, token = node01
    attempt = admit(job, node, gpu_indexes=(0, 1))
    started = time.time() - 5

    agent.heartbeat(token, readings(node, energy_j=2000.0), [running(attempt, started_at=started)])

    job.refresh_from_db()
    attempt.refresh_from_db()
    assert job.state == JobState.RUNNING
    assert attempt.state == AttemptState.RUNNING
    assert attempt.started_at.timestamp() == pytest.approx(started)
    assert attempt.energy_start_j == {"GPU-node-01-0": 2000.0, "GPU-node-01-1": 2000.0}

    agent.heartbeat(token, readings(node, energy_j=2600.0), [running(attempt, energy_j=1200.0)])

    attempt.refresh_from_db()
    assert attempt.energy_j == 1200.0
    assert attempt.energy_last_j == {"GPU-node-01-0": 2600.0, "GPU-node-01-1": 2600.0}


@pytest.mark.parametrize(
    ("exit_code", "job_state", "attempt_state"),
    [(0, JobState.SUCCEEDED, AttemptState.SUCCEEDED), (3, JobState.FAILED, AttemptState.FAILED)],
)
def test_an_exit_report_ends_the_job_with_its_exit_code_and_energy(
    agent, node01, job, admit, exit_code, job_state, attempt_state
):
    node, token = node01
    attempt = admit(job, node, gpu_indexes=(0, 1))
    # Long enough for two 700 W GPUs to draw 9 kJ: more would be booked at that bound.
    started = time.time() - 60
    agent.heartbeat(token, readings(node), [running(attempt, started_at=started)])

    answer = agent.heartbeat(
        token,
        readings(node),
        [exited(attempt, exit_code, started_at=started, energy_j=9000.0, energy_estimated=True)],
    )

    assert answer["attempts"] == []
    job.refresh_from_db()
    attempt.refresh_from_db()
    assert (job.state, job.exit_code) == (job_state, exit_code)
    assert (attempt.state, attempt.exit_code) == (attempt_state, exit_code)
    assert (attempt.energy_j, attempt.energy_estimated) == (9000.0, True)
    assert attempt.gpu_seconds > 0
    assert not attempt.allocations.filter(active=True).exists()


def test_an_exit_reported_before_any_running_report_still_records_the_start(
    agent, node01, job, admit
):
    node, token = node01
    attempt = admit(job, node)
    started = time.time() - 30

    agent.heartbeat(token, readings(node), [exited(attempt, 0, started_at=started)])

    attempt.refresh_from_db()
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED
    assert attempt.started_at.timestamp() == pytest.approx(started)
    assert attempt.gpu_seconds == pytest.approx(30, abs=2)


def test_a_repeated_heartbeat_changes_nothing(agent, node01, job, admit):
    node, token = node01
    attempt = admit(job, node)
    body = agent.heartbeat_body(readings(node), [exited(attempt, 0)])

    first = agent.post("heartbeat", body, token)
    events = list(JobEvent.objects.filter(job=job).values_list("kind", flat=True))
    again = agent.post("heartbeat", body, token)

    assert first.status_code == again.status_code == 200
    assert first.json() == again.json()
    assert list(JobEvent.objects.filter(job=job).values_list("kind", flat=True)) == events
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED


def test_a_failed_to_start_report_fails_the_job_with_the_message(agent, node01, job, admit):
    node, token = node01
    attempt = admit(job, node)
    report = {
        "attempt_id": attempt.pk,
        "state": "failed_to_start",
        "exit_code": None,
        "message": "image registry.local/team/train:1 not found",
    }

    answer = agent.heartbeat(token, readings(node), [report])

    assert answer["attempts"] == []
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert "image registry.local/team/train:1 not found" in job.state_reason
    assert job.exit_code is None
    assert JobAttempt.objects.get(pk=attempt.pk).state == AttemptState.FAILED


def test_an_attempt_told_to_stop_is_left_out_of_the_answer(agent, node01, job, admit, alice):
    node, token = node01
    attempt = admit(job, node)
    agent.heartbeat(token, readings(node), [running(attempt)])

    actions.cancel_job(job, actor=alice)
    answer = agent.heartbeat(token, readings(node), [running(attempt)])

    assert answer["attempts"] == []
    # Its GPU stays held until the agent confirms the container is gone.
    assert attempt.allocations.filter(active=True).exists()
    agent.heartbeat(token, readings(node), [exited(attempt, 137)])
    attempt.refresh_from_db()
    assert attempt.state == AttemptState.STOPPED
    assert not attempt.allocations.filter(active=True).exists()
    assert Job.objects.get(pk=job.pk).state == JobState.CANCELLED


def test_a_running_attempt_the_agent_no_longer_reports_is_lost_not_started_again(
    agent, node01, job, admit
):
    node, token = node01
    attempt = admit(job, node, gpu_indexes=(0, 1))
    agent.heartbeat(token, readings(node), [running(attempt, started_at=time.time() - 10)])

    # The agent's state was wiped: it reports nothing about the attempt it ran.
    answer = agent.heartbeat(token, readings(node), [])

    assert answer["attempts"] == []
    attempt.refresh_from_db()
    job.refresh_from_db()
    assert attempt.state == AttemptState.LOST
    assert job.state == JobState.PENDING
    assert "no longer runs it" in JobEvent.objects.filter(job=job, kind="lost").get().message


def test_an_admitted_attempt_not_yet_reported_stays_wanted(agent, node01, job, admit):
    node, token = node01
    attempt = admit(job, node)
    for _ in range(2):
        answer = agent.heartbeat(token, readings(node), [])
        assert [a["attempt_id"] for a in answer["attempts"]] == [attempt.pk]


def test_reports_about_another_nodes_attempt_change_nothing(agent, node01, job, admit):
    node, token = node01
    token2 = agent.register("node-02")
    attempt = admit(job, node)

    answer = agent.heartbeat(
        token2, readings(Node.objects.get(name="node-02")), [exited(attempt, 0)]
    )

    assert answer["attempts"] == []
    attempt.refresh_from_db()
    assert attempt.state == AttemptState.ADMITTED


def test_desired_caps_are_answered_and_the_enforced_cap_is_recorded(agent, node01):
    node, token = node01
    GPU.objects.filter(node=node, index__in=(1, 4)).update(desired_power_cap_w=450.0)

    answer = agent.heartbeat(token, readings(node, power_cap_w=450.0))

    assert answer["power_caps_w"] == {"GPU-node-01-1": 450.0, "GPU-node-01-4": 450.0}
    assert set(GPU.objects.filter(node=node).values_list("power_cap_w", flat=True)) == {450.0}


def test_conditions_are_stored_on_the_node_and_keep_the_time_first_seen(agent, node01):
    node, token = node01
    condition = {"type": "PowerCapFailed", "gpu_uuid": "GPU-node-01-1", "message": "no permission"}
    agent.heartbeat(token, readings(node), conditions=[condition])
    node.refresh_from_db()
    first_seen = node.conditions[0]["since"]

    agent.heartbeat(token, readings(node), conditions=[condition])
    node.refresh_from_db()
    assert node.conditions == [{**condition, "since": first_seen}]

    agent.heartbeat(token, readings(node), conditions=[])
    node.refresh_from_db()
    assert node.conditions == []


def test_a_heartbeat_costs_the_same_queries_for_one_gpu_as_for_sixteen(
    agent, make_job, vision, alice
):
    counts = {}
    for gpus in (1, 16):
        name = f"node-{gpus}"
        token = agent.register(name, gpus=gpus)
        node = Node.objects.get(name=name)
        attempts = [
            actions.admit_job(make_job(vision, alice, gpus=1), node=node, gpus=[g], borrowed=False)
            for g in node.gpus.all()
        ]
        agent.heartbeat(token, readings(node), [running(a) for a in attempts])
        body = agent.heartbeat_body(readings(node), [running(a, energy_j=99.0) for a in attempts])
        with CaptureQueriesContext(connection) as queries:
            assert agent.post("heartbeat", body, token).status_code == 200
        counts[gpus] = len(queries)
    assert counts[1] == counts[16]
    assert counts[16] <= 10


def test_a_heartbeat_with_the_clock_ahead_does_not_start_jobs_in_the_future(
    agent, node01, job, admit
):
    node, token = node01
    attempt = admit(job, node)
    agent.heartbeat(token, readings(node), [running(attempt, started_at=time.time() + 3600)])
    attempt.refresh_from_db()
    assert attempt.started_at <= dt.datetime.now(dt.UTC)


# A heartbeat whose frame cannot be read is refused whole, naming the field.
BAD_FRAMES = [
    (lambda b: b.pop("seq"), "seq"),
    (lambda b: b.update(sent_at="now"), "sent_at"),
    (lambda b: b.update(gpus=None), "gpus"),
    (lambda b: b.update(attempts={}), "attempts"),
]


@pytest.mark.parametrize(("change", "field"), BAD_FRAMES, ids=[f for _, f in BAD_FRAMES])
def test_a_heartbeat_whose_frame_is_malformed_is_refused_naming_the_field(
    agent, node01, change, field
):
    node, token = node01
    body = agent.heartbeat_body([gpu_reading("GPU-node-01-0")])
    change(body)

    response = agent.post("heartbeat", body, token)

    assert response.status_code == 400
    assert list(response.json()) == [field]
    assert GPU.objects.get(uuid="GPU-node-01-0").telemetry_at is None


# A bad part of a heartbeat is left out and named; the rest (liveness, the other readings) lands.
BAD_PARTS = [
    (lambda b: b["gpus"].append(7), "gpus[1]"),
    (lambda b: b["gpus"][0].pop("uuid"), "gpus[0].uuid"),
    (lambda b: b["gpus"][0].update(power_draw_w="512"), "gpus[0].power_draw_w"),
    (lambda b: b["gpus"][0].update(power_draw_w=True), "gpus[0].power_draw_w"),
    (lambda b: b["gpus"][0].update(utilization_pct=-1), "gpus[0].utilization_pct"),
    (lambda b: b["gpus"][0].update(healthy="yes"), "gpus[0].healthy"),
    (lambda b: b["gpus"][0].update(throttle_reasons="sw_power_cap"), "gpus[0].throttle_reasons"),
    (lambda b: b["attempts"].append({"state": "running"}), "attempts[0].attempt_id"),
    (lambda b: b["attempts"].append({"attempt_id": 1, "state": "gone"}), "attempts[0].state"),
    (lambda b: b["attempts"].append({"attempt_id": 1, "state": "exited"}), "attempts[0].exit_code"),
    (lambda b: b.update(conditions=[{"message": "x"}]), "conditions[0].type"),
]


@pytest.mark.parametrize(("change", "field"), BAD_PARTS, ids=[f for _, f in BAD_PARTS])
def test_a_malformed_part_of_a_heartbeat_is_named_and_the_rest_is_applied(
    agent, node01, change, field
):
    node, token = node01
    Node.objects.filter(pk=node.pk).update(ready=False)
    body = agent.heartbeat_body([gpu_reading("GPU-node-01-0")])
    change(body)

    response = agent.post("heartbeat", body, token)

    assert response.status_code == 200, response.content
    assert list(response.json()["warnings"]) == [field]
    assert Node.objects.get(pk=node.pk).ready  # its liveness landed
    assert response.json()["lease_s"] > 0


def test_non_finite_numbers_are_left_out_and_named(agent, node01):
    _, token = node01
    body = (
        '{"seq": 1, "sent_at": 1.0, "gpus": [{"uuid": "GPU-node-01-0", "power_draw_w": NaN,'
        ' "temperature_c": 40}], "attempts": []}'
    )
    response = agent.post("heartbeat", body, token)
    assert response.status_code == 200
    assert "gpus[0].power_draw_w" in response.json()["warnings"]
    gpu = GPU.objects.get(uuid="GPU-node-01-0")
    assert (gpu.power_draw_w, gpu.temperature_c) == (None, 40.0)
