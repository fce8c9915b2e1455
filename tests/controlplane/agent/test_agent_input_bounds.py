"""Every number and every piece of text the agent API takes is checked once, where it is parsed:
numbers within what GPUs, hosts and runtimes can report, text that PostgreSQL can store. A
registration or a log chunk with a bad field is a 400 naming it; a heartbeat keeps its valid
part (the node's liveness, its attempts' exits) and names what it left out. Never a 500."""

import json

import pytest

from agents import limits
from controlplane.cluster.models import GPU, JoinToken, Node
from controlplane.jobs.models import AttemptState, JobAttempt, LogChunk

from .conftest import exited, gpu_reading, inventory, readings, running

NUL = "a\x00b"
SURROGATE = "a\ud800b"
# Beyond anything a float column or Python's float() can take.
HUGE_INT = 10**400


@pytest.fixture
def job(make_job, vision, alice):
    return make_job(vision, alice)


def raw(body: dict) -> str:
    """JSON with NaN and Infinity allowed, as a broken agent might send."""
    return json.dumps(body, allow_nan=True)


# --- registration: refused whole, naming the field -------------------------------------------

GPU_NUMBER_FIELDS = {
    "index": (-1, limits.MAX_GPU_INDEX + 1),
    "memory_mib": (-1, limits.MAX_GPU_MEMORY_MIB + 1),
    "power_min_w": (-1.0, limits.MAX_GPU_POWER_W + 1),
    "power_max_w": (-1.0, 1e12),
    "power_default_w": (-0.5, 1e12),
}
NODE_NUMBER_FIELDS = {
    "cpus": (-1, limits.MAX_HOST_CPUS + 1),
    "memory_mib": (-1, limits.MAX_HOST_MEMORY_MIB + 1),
}


def bad_registration_numbers():
    for key, (low, high) in NODE_NUMBER_FIELDS.items():
        for value in (low, high, HUGE_INT, float("nan"), float("inf"), True, "7"):
            yield pytest.param(key, None, value, id=f"{key}={value!r}"[:40])
    for key, (low, high) in GPU_NUMBER_FIELDS.items():
        for value in (low, high, HUGE_INT, float("nan"), float("-inf"), False, "1"):
            yield pytest.param(key, 1, value, id=f"gpus[1].{key}={value!r}"[:40])


@pytest.mark.parametrize(("key", "gpu", "value"), bad_registration_numbers())
def test_a_registration_number_outside_what_hardware_reports_is_refused_naming_it(
    agent, key, gpu, value
):
    body = inventory("node-01", gpus=2)
    (body if gpu is None else body["gpus"][gpu])[key] = value

    response = agent.post("register", raw(body), agent.join_token)

    field = key if gpu is None else f"gpus[{gpu}].{key}"
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert not Node.objects.exists()
    assert JoinToken.objects.get().uses == 0


def bad_registration_texts():
    for bad in (NUL, SURROGATE):
        kind = "nul" if bad == NUL else "surrogate"
        yield pytest.param(lambda b, s=bad: b.update(name=s), "name", id=f"name-{kind}")
        yield pytest.param(
            lambda b, s=bad: b.update(agent_version=s), "agent_version", id=f"version-{kind}"
        )
        yield pytest.param(lambda b, s=bad: b.update(runtime=s), "runtime", id=f"runtime-{kind}")
        yield pytest.param(
            lambda b, s=bad: b.update(labels={"rack": s}), "labels.rack", id=f"label-value-{kind}"
        )
        yield pytest.param(
            lambda b, s=bad: b.update(labels={s: "x"}), "labels", id=f"label-name-{kind}"
        )
        yield pytest.param(
            lambda b, s=bad: b["gpus"][0].update(uuid="GPU-" + s), "gpus[0].uuid", id=f"uuid-{kind}"
        )
        yield pytest.param(
            lambda b, s=bad: b["gpus"][1].update(model=s), "gpus[1].model", id=f"model-{kind}"
        )
    yield pytest.param(
        lambda b: b.update(labels={f"k{i}": "v" for i in range(limits.MAX_LABELS + 1)}),
        "labels",
        id="too-many-labels",
    )
    yield pytest.param(
        lambda b: b["gpus"][0].update(uuid="GPU with spaces"), "gpus[0].uuid", id="uuid-spaces"
    )


@pytest.mark.parametrize(("change", "field"), bad_registration_texts())
def test_registration_text_postgresql_cannot_store_is_refused_naming_it(agent, change, field):
    body = inventory("node-01", gpus=2)
    change(body)

    response = agent.post("register", body, agent.join_token)

    assert response.status_code == 400, response.content
    assert field in response.json()
    assert not Node.objects.exists()


def test_the_largest_readings_hardware_can_report_are_accepted(agent):
    body = inventory("node-01", gpus=1)
    body.update(cpus=limits.MAX_HOST_CPUS, memory_mib=limits.MAX_HOST_MEMORY_MIB)
    body["gpus"][0].update(
        index=limits.MAX_GPU_INDEX,
        memory_mib=limits.MAX_GPU_MEMORY_MIB,
        power_max_w=limits.MAX_GPU_POWER_W,
        power_default_w=limits.MAX_GPU_POWER_W,
    )

    assert agent.post("register", body, agent.join_token).status_code == 201


# --- heartbeat: the valid part lands, the rest is named --------------------------------------

READING_BOUNDS = {
    key: (lowest, highest) for key, (lowest, highest) in limits.GPU_READING_RANGES.items()
}


def bad_readings():
    for key, (lowest, highest) in READING_BOUNDS.items():
        too_low = lowest - 1
        too_high = highest * 10 if highest else 1.0
        for value in (too_low, too_high, HUGE_INT, float("nan"), float("inf"), True, "5"):
            yield pytest.param(key, value, id=f"{key}={value!r}"[:40])
    for value in (-1, 2**63, 1.5, "3"):
        yield pytest.param("ecc_errors", value, id=f"ecc_errors={value!r}")
    for value in ([NUL], [SURROGATE], ["r" * 65], ["x"] * 65, "sw_power_cap"):
        yield pytest.param("throttle_reasons", value, id=f"throttle_reasons={value!r}"[:40])
    yield pytest.param("healthy", "yes", id="healthy=yes")


@pytest.mark.parametrize(("key", "value"), bad_readings())
def test_a_reading_outside_what_hardware_reports_is_left_out_and_the_heartbeat_lands(
    agent, node01, job, admit, key, value
):
    node, token = node01
    attempt = admit(job, node, gpu_indexes=(0,))
    agent.heartbeat(token, readings(node), [running(attempt)])
    Node.objects.filter(pk=node.pk).update(ready=False)
    gpus = readings(node, power_draw_w=321.0)
    gpus[0][key] = value
    body = agent.heartbeat_body(gpus, [exited(attempt, 0)])

    response = agent.post("heartbeat", raw(body), token)

    assert response.status_code == 200, response.content
    assert list(response.json()["warnings"]) == [f"gpus[0].{key}"]
    # Liveness, the exit and the other readings landed; the bad one is "not reported".
    assert Node.objects.get(pk=node.pk).ready
    assert JobAttempt.objects.get(pk=attempt.pk).state == AttemptState.SUCCEEDED
    rows = {g.index: g for g in GPU.objects.filter(node=node)}
    assert rows[1].power_draw_w == 321.0
    if key in READING_BOUNDS:
        assert getattr(rows[0], key) is None
        assert rows[0].power_draw_w == (None if key == "power_draw_w" else 321.0)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("utilization_pct", 100),
        ("power_draw_w", limits.MAX_GPU_POWER_W),
        ("temperature_c", limits.MIN_TEMPERATURE_C),
        ("energy_j", limits.MAX_ENERGY_J),
        ("ecc_errors", limits.MAX_COUNT),
    ],
)
def test_readings_at_the_edge_of_what_hardware_reports_are_kept(agent, node01, key, value):
    node, token = node01
    answer = agent.heartbeat(token, [gpu_reading("GPU-node-01-0", **{key: value})])

    assert "warnings" not in answer
    assert getattr(GPU.objects.get(uuid="GPU-node-01-0"), key) == value


def bad_attempt_fields():
    for key in ("started_at", "finished_at"):
        for value in (-1.0, limits.MAX_UNIX_TIME_S * 10, HUGE_INT, float("nan"), "now"):
            yield pytest.param(key, value, id=f"{key}={value!r}"[:40])
    for value in (-1.0, limits.MAX_ENERGY_J * 2, float("inf"), "1"):
        yield pytest.param("energy_j", value, id=f"energy_j={value!r}"[:40])
    for value in (2**40, -(2**40), 256, -256, HUGE_INT, 1.5, None):
        yield pytest.param("exit_code", value, id=f"exit_code={value!r}"[:40])
    for value in (NUL, SURROGATE, "m" * (limits.MAX_MESSAGE_CHARS + 1), 5):
        yield pytest.param("message", value, id=f"message={value!r}"[:30])
    yield pytest.param("energy_estimated", "yes", id="energy_estimated=yes")


@pytest.mark.parametrize(("key", "value"), bad_attempt_fields())
def test_an_exit_report_with_an_unreadable_field_still_lands(agent, node01, job, admit, key, value):
    node, token = node01
    attempt = admit(job, node, gpu_indexes=(0,))
    agent.heartbeat(token, readings(node), [running(attempt)])
    report = exited(attempt, 3)
    report[key] = value

    response = agent.post("heartbeat", raw(agent.heartbeat_body(readings(node), [report])), token)

    assert response.status_code == 200, response.content
    assert list(response.json()["warnings"]) == [f"attempts[0].{key}"]
    job.refresh_from_db()
    attempt.refresh_from_db()
    assert attempt.state == AttemptState.FAILED  # the exit landed; its GPUs are free
    assert not attempt.allocations.filter(active=True).exists()
    if key == "exit_code":
        assert attempt.exit_code is None
        assert "exit code unknown" in job.state_reason
    else:
        assert attempt.exit_code == 3


def test_an_exit_code_of_a_signal_is_kept(agent, node01, job, admit):
    node, token = node01
    attempt = admit(job, node)
    agent.heartbeat(token, readings(node), [running(attempt)])

    agent.heartbeat(token, readings(node), [exited(attempt, -9)])

    assert JobAttempt.objects.get(pk=attempt.pk).exit_code == -9


def test_a_report_that_cannot_be_tied_to_an_attempt_makes_no_attempt_vanish(
    agent, node01, job, admit
):
    node, token = node01
    attempt = admit(job, node)
    agent.heartbeat(token, readings(node), [running(attempt)])

    body = agent.heartbeat_body(readings(node), [{"attempt_id": 2**70, "state": "running"}])
    response = agent.post("heartbeat", body, token)

    assert response.status_code == 200
    assert list(response.json()["warnings"]) == ["attempts[0].attempt_id"]
    # Its report may have been the unreadable one: it is not declared gone from the node.
    assert JobAttempt.objects.get(pk=attempt.pk).state == AttemptState.RUNNING
    assert [a["attempt_id"] for a in response.json()["attempts"]] == [attempt.pk]


@pytest.mark.parametrize(
    ("condition", "field", "kept"),
    [
        ({"type": NUL}, "conditions[0].type", False),
        ({"type": SURROGATE}, "conditions[0].type", False),
        ({"type": "GpuLost", "message": NUL}, "conditions[0].message", True),
        ({"type": "GpuLost", "message": SURROGATE}, "conditions[0].message", True),
        ({"type": "GpuLost", "gpu_uuid": "GPU-" + NUL}, "conditions[0].gpu_uuid", False),
        ({"type": "GpuLost", "message": 7}, "conditions[0].message", True),
    ],
)
def test_a_condition_with_text_postgresql_cannot_store_is_named_not_a_500(
    agent, node01, condition, field, kept
):
    node, token = node01

    body = agent.heartbeat_body(readings(node), conditions=[condition])
    response = agent.post("heartbeat", body, token)

    assert response.status_code == 200, response.content
    assert list(response.json()["warnings"]) == [field]
    node.refresh_from_db()
    assert node.ready
    assert [c["type"] for c in node.conditions] == (["GpuLost"] if kept else [])


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda b: b.update(seq=-1), "seq"),
        (lambda b: b.update(seq=2**63), "seq"),
        (lambda b: b.update(sent_at=-1.0), "sent_at"),
        (lambda b: b.update(sent_at=1e300), "sent_at"),
        (lambda b: b.update(sent_at=float("nan")), "sent_at"),
        (lambda b: b.update(sent_at=HUGE_INT), "sent_at"),
        (lambda b: b.update(gpus="all"), "gpus"),
        (lambda b: b.update(attempts=None), "attempts"),
    ],
)
def test_a_heartbeat_that_cannot_be_accepted_at_all_says_precisely_why(
    agent, node01, change, field
):
    node, token = node01
    body = agent.heartbeat_body(readings(node))
    change(body)

    response = agent.post("heartbeat", raw(body), token)

    assert response.status_code == 400
    assert list(response.json()) == [field]


# --- the whole agent API: JSON it cannot read is a 400 ------------------------------------------


@pytest.mark.parametrize("path", ["register", "heartbeat", "watch", "logs"])
@pytest.mark.parametrize(
    "body",
    ["[" * 5000 + "]" * 5000, '{"a":' * 5000 + "1" + "}" * 5000, "1" * 5000, "{"],
    ids=["deep-list", "deep-object", "huge-integer", "truncated"],
)
def test_json_the_agent_api_cannot_read_is_a_400(agent, node01, path, body):
    _, token = node01
    credential = agent.join_token if path == "register" else token

    response = agent.post(path, body, credential)

    assert response.status_code == 400, response.content
    assert list(response.json()) == ["non_field_errors"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"attempt_id": 2**63, "offset": 0, "data": "x"}, "attempt_id"),
        ({"attempt_id": 1, "offset": 2**63, "data": "x"}, "offset"),
        ({"attempt_id": 1, "offset": 1.5, "data": "x"}, "offset"),
        ({"attempt_id": True, "offset": 0, "data": "x"}, "attempt_id"),
    ],
)
def test_log_chunk_numbers_outside_a_64_bit_column_are_refused_naming_them(
    agent, node01, body, field
):
    response = agent.post("logs", body, node01[1])

    assert response.status_code == 400
    assert field in response.json()
    assert not LogChunk.objects.exists()


def test_a_watch_timeout_that_is_not_a_finite_number_is_refused(agent, node01):
    response = agent.post("watch", raw({"timeout_s": float("nan")}), node01[1])
    assert response.status_code == 400
    assert "timeout_s" in response.json()
