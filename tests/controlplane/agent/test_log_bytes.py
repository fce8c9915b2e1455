"""Job output is bytes, and nothing a program prints is lost: a NUL, bytes that are not UTF-8, a
character cut between two chunks. Stored exactly, shown escaped (NUL and each invalid byte as
\\xNN) in the API and the job page, downloadable exactly from the full-log link."""

import base64
import datetime as dt

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.test import Client
from django.urls import reverse
from rest_framework.test import APIClient

from controlplane.jobs.logs import display_text
from controlplane.jobs.models import JobAttempt, LogChunk

from .conftest import exited, readings, running


@pytest.fixture
def attempt(node01, make_job, vision, alice, admit):
    node, _ = node01
    return admit(make_job(vision, alice), node)


def ship(agent, token, attempt, offset, **data):
    response = agent.post("logs", {"attempt_id": attempt.pk, "offset": offset, **data}, token)
    assert response.status_code == 200, response.content
    return response.json()["next_offset"]


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def stored(attempt) -> bytes:
    return b"".join(LogChunk.objects.filter(attempt=attempt).values_list("data", flat=True))


def api_text(user, attempt) -> str:
    client = APIClient()
    client.force_authenticate(user)
    response = client.get(f"/api/v1/jobs/{attempt.job_id}/logs/")
    assert response.status_code == 200
    return response.json()["text"]


def test_a_job_that_prints_a_nul_keeps_its_whole_log(agent, node01, attempt, alice):
    _, token = node01
    # An agent of before base64 sends output as text; a NUL was a 500 on every retry.
    assert ship(agent, token, attempt, 0, data="line one\n") == 9
    assert ship(agent, token, attempt, 9, data="nul here:\x00!\n") == 21
    assert ship(agent, token, attempt, 21, data="after\n") == 27

    assert stored(attempt) == b"line one\nnul here:\x00!\nafter\n"
    assert JobAttempt.objects.get(pk=attempt.pk).log_bytes == 27
    assert api_text(alice, attempt) == "line one\nnul here:\\x00!\nafter\n"


def test_any_bytes_survive_the_trip_as_base64(agent, node01, attempt, alice):
    _, token = node01
    raw = bytes(range(256)) + b"\n"

    assert ship(agent, token, attempt, 0, data_b64=b64(raw)) == 257

    assert stored(attempt) == raw
    assert api_text(alice, attempt) == display_text(raw)
    assert "\\xff" in api_text(alice, attempt) and "\\x00" in api_text(alice, attempt)


def test_the_api_gives_the_exact_bytes_where_the_text_would_be_ambiguous(
    agent, node01, attempt, alice
):
    _, token = node01
    # One program wrote a NUL, another printed the four characters \x00: the same text.
    raw = b"real nul:\x00 printed:\\x00 latin-1:\xe9 tail \xf0\x9f\x98\x80\n"
    ship(agent, token, attempt, 0, data_b64=b64(raw))
    client = APIClient()
    client.force_authenticate(alice)

    plain = client.get(f"/api/v1/jobs/{attempt.job_id}/logs/").json()
    exact = client.get(f"/api/v1/jobs/{attempt.job_id}/logs/", {"encoding": "base64"}).json()
    tail = client.get(
        f"/api/v1/jobs/{attempt.job_id}/logs/", {"encoding": "base64", "tail": 1}
    ).json()

    assert "data_b64" not in plain
    assert plain["text"] == "real nul:\\x00 printed:\\x00 latin-1:\\xe9 tail \U0001f600\n"
    assert base64.b64decode(exact["data_b64"]) == raw and exact["text"] == plain["text"]
    assert base64.b64decode(tail["data_b64"]) == raw
    refused = client.get(f"/api/v1/jobs/{attempt.job_id}/logs/", {"encoding": "hex"})
    assert refused.status_code == 400 and "encoding" in refused.json()


def test_a_character_cut_between_two_chunks_reads_whole(agent, node01, attempt, alice):
    _, token = node01
    text = "température 61 °C\n".encode()
    cut = text.index("é".encode()) + 1  # inside the two bytes of é

    ship(agent, token, attempt, 0, data_b64=b64(text[:cut]))
    ship(agent, token, attempt, cut, data_b64=b64(text[cut:]))

    assert api_text(alice, attempt) == "température 61 °C\n"


def test_an_overlapping_binary_resend_adds_only_the_new_bytes(agent, node01, attempt):
    _, token = node01
    ship(agent, token, attempt, 0, data_b64=b64(b"\x00\x01\x02\xff"))

    assert ship(agent, token, attempt, 2, data_b64=b64(b"\x02\xff\xfe\x00")) == 6

    assert stored(attempt) == b"\x00\x01\x02\xff\xfe\x00"


def test_surrogate_escaped_bytes_are_stored_as_the_bytes_they_stand_for(agent, node01, attempt):
    _, token = node01
    # What Python's surrogateescape makes of b"\x80\xff": an agent decoding that way round-trips.
    assert ship(agent, token, attempt, 0, data="a\udc80\udcffb") == 4
    assert stored(attempt) == b"a\x80\xffb"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"data": "lone \ud800 surrogate"}, "data"),
        ({"data": "lone \udfff"}, "data"),
        ({"data_b64": "not base64!"}, "data_b64"),
        ({"data_b64": "YWJ"}, "data_b64"),
        ({"data_b64": "é"}, "data_b64"),
        ({"data_b64": 5}, "data_b64"),
        ({"data": "x", "data_b64": "eA=="}, "data_b64"),
        ({"data_b64": b64(b"x" * (1024 * 1024 + 1))}, "data_b64"),
    ],
    ids=[
        "high-surrogate",
        "low-surrogate",
        "bad-alphabet",
        "bad-padding",
        "non-ascii",
        "not-a-string",
        "both",
        "too-large",
    ],
)
def test_a_chunk_that_is_neither_text_nor_base64_is_refused_naming_the_field(
    agent, node01, attempt, body, field
):
    response = agent.post("logs", {"attempt_id": attempt.pk, "offset": 0, **body}, node01[1])

    assert response.status_code == 400
    assert field in response.json()
    assert not LogChunk.objects.exists()


def test_the_job_page_shows_escapes_and_the_full_log_link_serves_the_exact_bytes(
    agent, node01, attempt, alice
):
    node, token = node01
    agent.heartbeat(token, readings(node), [running(attempt)])
    raw = b"ok\n\x00 and \xff\xfe here\n"
    ship(agent, token, attempt, 0, data_b64=b64(raw))
    agent.heartbeat(token, readings(node), [exited(attempt, 0)])
    client = Client()
    client.force_login(alice)

    page = client.get(reverse("job-detail", args=[attempt.job_id]))
    download = client.get(reverse("job-log", args=[attempt.job_id]))

    assert page.status_code == 200
    assert "\\x00 and \\xff\\xfe here" in page.content.decode()
    assert download.status_code == 200
    assert download.content == raw


@pytest.mark.django_db(transaction=True)
def test_the_migration_turns_stored_text_into_its_utf8_bytes_byte_for_byte(
    node01, make_job, vision, alice, admit
):
    node, _ = node01
    attempt = admit(make_job(vision, alice), node)
    executor = MigrationExecutor(connection)
    executor.migrate([("jobs", "0003_submit_key")])
    texts = ["plain\n", "C:\\new\\table \\x00 \\\\ é 😀\n", "\\000 octal-looking\n"]
    with connection.cursor() as cursor:
        offset = 0
        for text in texts:
            cursor.execute(
                'INSERT INTO jobs_logchunk (attempt_id, "offset", data, received_at) '
                "VALUES (%s, %s, %s, %s)",
                [attempt.pk, offset, text, dt.datetime.now(dt.UTC)],
            )
            offset += len(text.encode())
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(executor.loader.graph.leaf_nodes())

    assert stored(attempt) == "".join(texts).encode()
