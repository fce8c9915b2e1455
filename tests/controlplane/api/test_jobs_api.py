"""Jobs through the API: detail, filters, cancel (409 once finished), logs."""

from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.jobs import actions
from controlplane.jobs.models import Job, JobAttempt, JobEvent, JobState, LogChunk


def admit(world, job, gpus=1, borrowed=False):
    node = world.node
    attempt = actions.admit_job(
        job, node=node, gpus=list(node.gpus.order_by("index")[:gpus]), borrowed=borrowed
    )
    actions.mark_attempt_running(attempt)
    return attempt


def finish(attempt, exit_code=0):
    actions.finish_attempt(JobAttempt.objects.get(pk=attempt.pk), exit_code=exit_code)


def test_the_detail_shows_attempts_with_node_and_gpus_and_the_timeline(world):
    job = world.vision_job
    attempt = admit(world, job, gpus=2, borrowed=True)
    response = world.client("viewer").get(f"/api/v1/jobs/{job.pk}/")
    assert response.status_code == 200
    body = response.json()
    assert body["state"] == JobState.RUNNING
    [shown] = body["attempts"]
    assert shown["number"] == 1 and shown["node"] == "gpu-a.example" and shown["borrowed"]
    assert [g["uuid"] for g in shown["gpus"]] == ["GPU-gpu-a.example-0", "GPU-gpu-a.example-1"]
    assert {g["node"] for g in shown["gpus"]} == {"gpu-a.example"}
    assert shown["id"] == attempt.pk
    assert [e["kind"] for e in body["events"]] == ["submitted", "admitted", "running"]
    assert body["events"][0]["actor"] == "alice"


def test_the_detail_says_why_a_job_waits_and_when_it_may_start(world):
    job = world.vision_job
    start = timezone.now() + timedelta(minutes=20)
    # What the scheduling cycle writes for a pending job.
    Job.objects.filter(pk=job.pk).update(
        pending_reason_code="quota_limit",
        pending_reason="vision is at its limit of 16 H100-SXM-80GB GPUs",
        queue_position=3,
        estimated_start_at=start,
        predicted_duration_s=5400.0,
    )
    body = world.client("member").get(f"/api/v1/jobs/{job.pk}/").json()
    assert body["pending_reason_code"] == "quota_limit"
    assert "limit" in body["pending_reason"]
    assert body["queue_position"] == 3
    assert body["predicted_duration_s"] == 5400.0
    assert body["estimated_start_at"].startswith(start.strftime("%Y-%m-%dT%H:%M"))


def test_cancelling_a_finished_job_is_a_409_that_changes_nothing(world):
    job = world.vision_job
    finish(admit(world, job), exit_code=0)
    events_before = JobEvent.objects.filter(job=job).count()
    response = world.client("member").post(f"/api/v1/jobs/{job.pk}/cancel/")
    assert response.status_code == 409
    assert "already finished" in response.json()["detail"]
    assert "SUCCEEDED" in response.json()["detail"]
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED
    assert JobEvent.objects.filter(job=job).count() == events_before


def test_cancelling_twice_is_a_409_the_second_time(world):
    job = world.vision_job
    client = world.client("member")
    assert client.post(f"/api/v1/jobs/{job.pk}/cancel/").status_code == 200
    assert client.post(f"/api/v1/jobs/{job.pk}/cancel/").status_code == 409


def test_cancelling_a_pending_job_records_who_did_it(world):
    job = world.vision_job
    response = world.client("member").post(f"/api/v1/jobs/{job.pk}/cancel/")
    assert response.status_code == 200
    assert response.json()["state"] == JobState.CANCELLED
    event = JobEvent.objects.filter(job=job).last()
    assert (event.kind, event.to_state, event.actor) == ("cancelled", "CANCELLED", world.alice)


def test_cancelling_a_running_job_tells_its_attempt_to_stop(world):
    job = world.vision_job
    attempt = admit(world, job)
    response = world.client("tenant_admin").post(f"/api/v1/jobs/{job.pk}/cancel/")
    assert response.status_code == 200
    attempt.refresh_from_db()
    assert attempt.stop_requested_at is not None and attempt.stop_reason == "cancelled"
    assert response.json()["attempts"][0]["stop_reason"] == "cancelled"


def test_a_member_cannot_cancel_another_members_job_but_a_tenant_admin_can(world):
    job = world.fixture("make_job")(world.vision, world.users["tenant_admin"])
    world.ensure("users")
    response = world.client("member").post(f"/api/v1/jobs/{job.pk}/cancel/")
    assert response.status_code == 403
    job.refresh_from_db()
    assert job.state == JobState.PENDING
    assert world.client("cluster_admin").post(f"/api/v1/jobs/{job.pk}/cancel/").status_code == 200


def test_jobs_filter_by_state_tenant_user_and_name(world):
    make_job = world.fixture("make_job")
    world.ensure("node", "users")
    a = make_job(world.vision, world.alice, name="resnet-50")
    b = make_job(world.vision, world.users["tenant_admin"], name="bert-large")
    c = make_job(world.nlp, world.bob, name="resnet-tiny")
    finish(admit(world, a))
    client = world.client("cluster_admin")

    def ids(query):
        response = client.get(f"/api/v1/jobs/?{query}")
        assert response.status_code == 200, response.content
        return sorted(j["id"] for j in response.json()["results"])

    assert ids("state=SUCCEEDED") == [a.pk]
    assert ids("state=PENDING&state=SUCCEEDED") == sorted([a.pk, b.pk, c.pk])
    assert ids("tenant=nlp") == [c.pk]
    assert ids("user=vera") == [b.pk]
    assert ids("name=bert-large") == [b.pk]
    assert ids("name_contains=RESNET") == sorted([a.pk, c.pk])
    assert ids("tenant=vision&name_contains=resnet") == [a.pk]
    assert client.get("/api/v1/jobs/?state=SLEEPING").status_code == 400


def test_filtering_by_another_tenant_shows_nothing_of_it(world):
    world.ensure("nlp_job")
    response = world.client("member").get("/api/v1/jobs/?tenant=nlp")
    assert response.status_code == 200
    assert response.json()["results"] == []


def test_lists_are_paginated(world):
    make_job = world.fixture("make_job")
    world.ensure("node")
    for i in range(3):
        make_job(world.vision, world.alice, name=f"job-{i}")
    body = world.client("member").get("/api/v1/jobs/?limit=2").json()
    assert body["count"] == 3 and len(body["results"]) == 2 and body["next"]


def store_log(attempt, *pieces):
    offset = 0
    for piece in pieces:
        LogChunk.objects.create(attempt=attempt, offset=offset, data=piece)
        offset += len(piece.encode())


def test_logs_are_read_whole_or_by_tail_from_the_latest_attempt(world):
    job = world.vision_job
    attempt = admit(world, job)
    store_log(attempt, "epoch 1\nepoch 2\n", "epoch 3\népoch 4\n", "done\n")
    client = world.client("viewer")

    whole = client.get(f"/api/v1/jobs/{job.pk}/logs/").json()
    assert whole["text"] == "epoch 1\nepoch 2\nepoch 3\népoch 4\ndone\n"
    assert whole["attempt"] == 1 and whole["attempts"] == [1] and whole["node"] == "gpu-a.example"
    assert whole["size_bytes"] == len(whole["text"].encode()) and not whole["truncated"]

    tail = client.get(f"/api/v1/jobs/{job.pk}/logs/?tail=2").json()
    assert tail["text"] == "époch 4\ndone\n" and tail["tail"] == 2


def test_logs_of_an_earlier_attempt_can_be_asked_for(world):
    job = world.vision_job
    first = admit(world, job)
    store_log(first, "first try\n")
    actions.request_stop(first, reason="preempted", message="preempted for a test")
    finish(first, exit_code=137)
    job.refresh_from_db()
    second = admit(world, job)
    store_log(second, "second try\n")
    client = world.client("member")
    assert client.get(f"/api/v1/jobs/{job.pk}/logs/").json()["text"] == "second try\n"
    earlier = client.get(f"/api/v1/jobs/{job.pk}/logs/?attempt=1").json()
    assert earlier["text"] == "first try\n" and earlier["attempts"] == [1, 2]


def test_an_overlapping_resent_chunk_is_shown_once(world):
    attempt = admit(world, world.vision_job)
    LogChunk.objects.create(attempt=attempt, offset=0, data="abcdef\n")
    LogChunk.objects.create(attempt=attempt, offset=4, data="ef\nghi\n")
    text = world.client("member").get(f"/api/v1/jobs/{attempt.job_id}/logs/").json()["text"]
    assert text == "abcdef\nghi\n"


def test_logs_of_a_job_that_never_ran_are_empty(world):
    body = world.client("member").get(f"/api/v1/jobs/{world.vision_job.pk}/logs/").json()
    assert (body["attempt"], body["attempts"], body["text"]) == (None, [], "")


@pytest.mark.parametrize(
    ("query", "field"), [("tail=-1", "tail"), ("tail=x", "tail"), ("attempt=9", "attempt")]
)
def test_bad_log_parameters_are_named(world, query, field):
    admit(world, world.vision_job)
    response = world.client("member").get(f"/api/v1/jobs/{world.vision_job.pk}/logs/?{query}")
    assert response.status_code == 400
    assert field in response.json()
