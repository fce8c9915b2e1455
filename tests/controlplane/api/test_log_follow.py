"""Following a job's output through the API: offsets, waiting for more, text/plain."""

import threading

import pytest
from django.db import connection

from controlplane.jobs.api import views
from controlplane.jobs.models import LogChunk
from tests.controlplane.api.test_jobs_api import admit, finish
from tests.threads import in_this_thread


def logs(world, job, query="", **headers):
    return world.client("member").get(f"/api/v1/jobs/{job.pk}/logs/?{query}", **headers)


def test_reading_from_next_offset_gives_only_what_came_since(world):
    job = world.vision_job
    attempt = admit(world, job)
    LogChunk.objects.create(attempt=attempt, offset=0, data="line 1\n")
    first = logs(world, job, "offset=0").json()
    assert (first["text"], first["offset"], first["next_offset"]) == ("line 1\n", 0, 7)
    assert not first["attempt_finished"] and not first["finished"]

    # A resend overlapping what was read, then a gap the agent gave up on: each byte once, and
    # the follower is carried past the gap.
    LogChunk.objects.create(attempt=attempt, offset=4, data=" 1\nline 2\n")
    LogChunk.objects.create(attempt=attempt, offset=20, data="line 3\n")
    second = logs(world, job, f"offset={first['next_offset']}").json()
    assert second["text"] == "line 2\nline 3\n" and second["next_offset"] == 27

    finish(attempt, exit_code=0)
    last = logs(world, job, f"offset={second['next_offset']}&follow=true").json()
    assert (last["text"], last["attempt_finished"], last["finished"]) == ("", True, True)


def test_a_character_cut_by_a_chunk_waits_for_its_other_bytes(world):
    job = world.vision_job
    attempt = admit(world, job)
    encoded = "née\n".encode()
    LogChunk.objects.create(attempt=attempt, offset=0, data=encoded[:2])
    first = logs(world, job, "offset=0").json()
    assert first["text"] == "n" and first["next_offset"] == 1
    LogChunk.objects.create(attempt=attempt, offset=2, data=encoded[2:])
    assert logs(world, job, "offset=1").json()["text"] == "ée\n"


@pytest.mark.django_db(transaction=True)
def test_a_follower_waits_for_output_written_while_it_waits(world, monkeypatch):
    job = world.vision_job
    attempt = admit(world, job)
    arrived = threading.Event()

    def write_soon():
        arrived.wait(10)
        LogChunk.objects.create(attempt=attempt, offset=0, data="late line\n")
        connection.close()

    writer = threading.Thread(target=write_soon)
    writer.start()
    real_sleep = views.time.sleep

    def sleep(seconds):
        arrived.set()  # the answer is waiting: now write
        real_sleep(seconds)

    monkeypatch.setattr(views.time, "sleep", in_this_thread(sleep, real_sleep))
    body = logs(world, job, "follow=true").json()
    writer.join()
    assert body["text"] == "late line\n" and not body["finished"]


def test_text_plain_answers_the_text_with_the_offsets_in_headers(world):
    job = world.vision_job
    attempt = admit(world, job)
    LogChunk.objects.create(attempt=attempt, offset=0, data="epoch 1\n")
    finish(attempt, exit_code=0)
    response = logs(world, job, "offset=0", HTTP_ACCEPT="text/plain")
    assert response["Content-Type"].startswith("text/plain")
    assert response.content == b"epoch 1\n"
    assert response["X-Log-Next-Offset"] == "8" and response["X-Log-Finished"] == "true"
    # An error stays readable in the same type.
    bad = logs(world, job, "offset=-1", HTTP_ACCEPT="text/plain")
    assert bad.status_code == 400 and b"offset" in bad.content


@pytest.mark.parametrize(
    ("query", "field"),
    [("tail=2&offset=3", "offset"), ("tail=2&follow=true", "follow"), ("offset=x", "offset")],
)
def test_tail_and_following_do_not_mix(world, query, field):
    admit(world, world.vision_job)
    response = logs(world, world.vision_job, query)
    assert response.status_code == 400 and field in response.json()


def test_following_a_job_that_has_not_started_answers_at_once(world, monkeypatch):
    def no_waiting(seconds):
        raise AssertionError("the answer waited for a job with no attempt")

    # The request runs in this thread (tests.threads says why only this one).
    monkeypatch.setattr(views.time, "sleep", in_this_thread(no_waiting, views.time.sleep))
    body = logs(world, world.vision_job, "follow=true").json()
    assert (body["attempt"], body["text"], body["finished"]) == (None, "", False)


@pytest.mark.parametrize("max_bytes", [1, 7, 100, 10_000])
def test_a_follower_reading_in_small_answers_gets_every_byte_once_past_gaps_and_resends(
    world, max_bytes
):
    """Hundreds of chunks (more than one page of the read), a resend overlapping what came
    before, and a gap: reading on from each answer's next offset, whatever the answer size,
    yields the output with the gap skipped and nothing twice."""
    from controlplane.jobs.logs import LOG_READ_PAGE_ROWS, read_log_from

    attempt = admit(world, world.vision_job)
    expected = b""
    offset = 0
    for i in range(3 * LOG_READ_PAGE_ROWS):
        line = f"line {i} é\n".encode()
        if i == 70:
            offset += 5  # bytes the agent gave up on: never stored
        LogChunk.objects.create(attempt=attempt, offset=offset, data=line)
        expected += line
        offset += len(line)
        if i == 100:
            # A resend of this line's last 4 bytes with the next line's first ones.
            following = f"line {i + 1} é\n".encode()
            resend = line[-4:] + following[:3]
            LogChunk.objects.create(attempt=attempt, offset=offset - 4, data=resend)
            expected += following[:3]
            offset += 3
            rest = following[3:]
            LogChunk.objects.create(attempt=attempt, offset=offset, data=rest)
            expected += rest
            offset += len(rest)

    read = b""
    position = 0
    for _ in range(10 * len(expected)):
        piece, position, size_bytes = read_log_from(attempt, position, max_bytes)
        assert size_bytes == offset
        if not piece:
            break
        assert len(piece) <= max_bytes
        read += piece
    assert read == expected and position == offset
