"""Log shipping: chunks keyed by byte offset, so resends and overlaps never duplicate output."""

import pytest

from controlplane.jobs.models import JobAttempt, LogChunk


@pytest.fixture
def attempt(node01, make_job, vision, alice, admit):
    node, _ = node01
    return admit(make_job(vision, alice), node)


def output(attempt) -> str:
    chunks = LogChunk.objects.filter(attempt=attempt).values_list("data", flat=True)
    return b"".join(chunks).decode()


def ship(agent, token, attempt, offset, data):
    response = agent.post("logs", {"attempt_id": attempt.pk, "offset": offset, "data": data}, token)
    assert response.status_code == 200, response.content
    return response.json()["next_offset"]


def test_chunks_are_stored_at_their_offsets_and_a_resent_chunk_is_stored_once(
    agent, node01, attempt
):
    _, token = node01
    assert ship(agent, token, attempt, 0, "epoch 1\n") == 8
    assert ship(agent, token, attempt, 8, "epoch 2\n") == 16
    # The answer to the second chunk was lost; the agent sends it again.
    assert ship(agent, token, attempt, 8, "epoch 2\n") == 16

    assert output(attempt) == "epoch 1\nepoch 2\n"
    assert LogChunk.objects.filter(attempt=attempt).count() == 2
    assert JobAttempt.objects.get(pk=attempt.pk).log_bytes == 16


def test_an_overlapping_chunk_adds_only_the_bytes_not_stored_yet(agent, node01, attempt):
    _, token = node01
    ship(agent, token, attempt, 0, "abcdef")

    assert ship(agent, token, attempt, 3, "defghi") == 9

    assert output(attempt) == "abcdefghi"


def test_offsets_count_utf8_bytes_not_characters(agent, node01, attempt):
    _, token = node01
    assert ship(agent, token, attempt, 0, "température 61 °C\n") == len(
        "température 61 °C\n".encode()
    )
    assert JobAttempt.objects.get(pk=attempt.pk).log_bytes == 20


def test_a_chunk_past_a_gap_is_not_stored_and_the_answer_says_where_to_resume(
    agent, node01, attempt
):
    _, token = node01
    ship(agent, token, attempt, 0, "one\n")

    assert ship(agent, token, attempt, 100, "later\n") == 4

    assert output(attempt) == "one\n"


def test_logs_of_another_nodes_attempt_are_404(agent, node01, attempt):
    token2 = agent.register("node-02")
    response = agent.post("logs", {"attempt_id": attempt.pk, "offset": 0, "data": "x"}, token2)
    assert response.status_code == 404
    assert not LogChunk.objects.exists()
    missing = agent.post("logs", {"attempt_id": 999999, "offset": 0, "data": "x"}, node01[1])
    assert missing.status_code == 404


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"offset": 0, "data": "x"}, "attempt_id"),
        ({"attempt_id": 1, "offset": -1, "data": "x"}, "offset"),
        ({"attempt_id": 1, "offset": 0, "data": 5}, "data"),
    ],
)
def test_a_malformed_chunk_is_refused_naming_the_field(agent, node01, body, field):
    response = agent.post("logs", body, node01[1])
    assert response.status_code == 400
    assert field in response.json()
