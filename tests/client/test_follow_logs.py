"""follow_logs reads from where it was, follows a requeued job's next attempt, and stops at
the job's end (the API's pages scripted with httpx's mock transport)."""

import time

import httpx
from gpucp.client import Client

from tests.threads import in_this_thread


def page(attempt, attempts, text, offset, *, attempt_finished=False, finished=False):
    return {
        "attempt": attempt,
        "attempts": attempts,
        "node": "n1",
        "text": text,
        "offset": offset,
        "next_offset": offset + len(text.encode()),
        "attempt_finished": attempt_finished,
        "finished": finished,
    }


def test_it_resumes_from_next_offset_and_moves_on_to_the_next_attempt():
    pages = [
        page(None, [], "", 0),
        page(1, [1], "one\n", 0),
        page(1, [1, 2], "", 4, attempt_finished=True),
        page(2, [1, 2], "twö\n", 0),
        page(2, [1, 2], "", 5, attempt_finished=True, finished=True),
    ]
    asked = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(dict(request.url.params))
        return httpx.Response(200, json=pages.pop(0))

    client = Client("http://cp.test", "t", transport=httpx.MockTransport(answer))
    started = []
    text = "".join(
        client.follow_logs(7, poll_s=0.001, on_attempt=lambda p: started.append(p["attempt"]))
    )
    assert text == "one\ntwö\n" and started == [1, 2] and not pages
    assert [(q.get("attempt"), q["offset"], q["follow"]) for q in asked] == [
        (None, "0", "true"),
        (None, "0", "true"),
        ("1", "4", "true"),
        ("2", "0", "true"),
        ("2", "5", "true"),
    ]


def test_a_follower_told_it_asks_too_often_waits_as_told_and_loses_nothing(monkeypatch):
    pages = [
        page(1, [1], "one\n", 0),
        None,  # 429: the person's request rate is used up (other terminals, other scripts)
        page(1, [1], "two\n", 4),
        page(1, [1], "", 8, attempt_finished=True, finished=True),
    ]
    asked = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.params["offset"])
        answer = pages.pop(0)
        if answer is None:
            return httpx.Response(
                429, json={"detail": "Request was throttled."}, headers={"Retry-After": "3"}
            )
        return httpx.Response(200, json=answer)

    slept = []
    monkeypatch.setattr("gpucp.client.time.sleep", in_this_thread(slept.append, time.sleep))
    client = Client("http://cp.test", "t", transport=httpx.MockTransport(answer))

    assert "".join(client.follow_logs(7, poll_s=0.001)) == "one\ntwo\n"
    assert asked == ["0", "4", "4", "8"] and slept == [3.0]


def test_lists_are_read_page_after_page_through_the_clients_own_host():
    asked = []

    def answer(request: httpx.Request) -> httpx.Response:
        asked.append(str(request.url))
        if request.url.params.get("offset") == "2":
            return httpx.Response(200, json={"results": [{"id": 3}], "next": None})
        # The server's link names the host it thinks it has, behind a proxy and a path prefix.
        following = "http://internal:8000/pre/api/v1/jobs/?limit=2&offset=2&state=RUNNING"
        return httpx.Response(200, json={"results": [{"id": 1}, {"id": 2}], "next": following})

    client = Client("https://cp.example.org", "t", transport=httpx.MockTransport(answer))
    assert [job["id"] for job in client.jobs(state="RUNNING", limit=2)] == [1, 2, 3]
    assert asked == [
        "https://cp.example.org/api/v1/jobs/?state=RUNNING&limit=2",
        "https://cp.example.org/pre/api/v1/jobs/?limit=2&offset=2&state=RUNNING",
    ]
