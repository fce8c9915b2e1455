"""The job page of a job over several nodes: each attempt's members, and each one's own output."""

import re

import pytest
from django.urls import reverse

from controlplane.cluster.models import Node
from controlplane.jobs import actions
from controlplane.jobs.models import AttemptMember, LogChunk

pytestmark = pytest.mark.django_db


def text_of(response) -> str:
    html = response.content.decode()
    html = re.sub(r"<(script|style)[^>]*>.*?</\1>", " ", html, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)).replace("&amp;", "&")


@pytest.fixture
def gang_job(vision, alice, make_job, make_node):
    """A 4-GPU job over gpu-a (10.0.0.1, rank 0) and gpu-b (10.0.0.2, rank 1), each member with
    output of its own."""
    a = make_node("gpu-a", gpus=2, advertise_address="10.0.0.1", job_port_min=29600)
    b = make_node("gpu-b", gpus=2, advertise_address="10.0.0.2")
    job = make_job(vision, alice, name="ddp", gpus=4)
    attempt = actions.admit_job(
        job, node=a, gpus=[*a.gpus.order_by("index"), *b.gpus.order_by("index")], borrowed=False
    )
    for member in AttemptMember.objects.filter(attempt=attempt):
        LogChunk.objects.create(
            attempt=attempt, member=member, offset=0, data=f"hello from rank {member.rank}\n"
        )
    return job


def test_the_job_page_lists_each_member_with_its_rank_node_address_and_state(
    client, alice, gang_job
):
    client.force_login(alice)
    page = text_of(client.get(reverse("job-detail", args=[gang_job.pk])))
    assert "Over 2 nodes; master port 29600" in page
    assert "0 gpu-a 10.0.0.1 2 ADMITTED" in page
    assert "1 gpu-b 10.0.0.2 2 ADMITTED" in page
    # The live output is rank 0's.
    assert "hello from rank 0" in page and "hello from rank 1" not in page


@pytest.mark.parametrize("rank", [0, 1])
def test_each_members_full_log_is_its_own(client, alice, gang_job, rank):
    client.force_login(alice)
    response = client.get(reverse("job-log", args=[gang_job.pk]), {"attempt": 1, "rank": rank})
    assert response.content.decode() == f"hello from rank {rank}\n"


def test_the_logs_api_serves_each_rank_and_names_its_node(client, alice, gang_job):
    client.force_login(alice)
    url = f"/api/v1/jobs/{gang_job.pk}/logs/"
    one = client.get(url, {"rank": 1}).json()
    assert (one["rank"], one["node"], one["ranks"]) == (1, "gpu-b", [0, 1])
    assert one["text"] == "hello from rank 1\n"
    missing = client.get(url, {"rank": 2})
    assert missing.status_code == 400 and "rank" in missing.json()
    detail = client.get(f"/api/v1/jobs/{gang_job.pk}/").json()
    (attempt,) = detail["attempts"]
    assert attempt["master_port"] == 29600
    assert [(m["rank"], m["node"], m["address"]) for m in attempt["members"]] == [
        (0, "gpu-a", "10.0.0.1"),
        (1, "gpu-b", "10.0.0.2"),
    ]
    assert Node.objects.get(name="gpu-a").advertise_address == "10.0.0.1"


@pytest.mark.parametrize("rank", [0, 1])
def test_following_a_rank_reads_only_that_members_output_from_its_own_offsets(
    client, alice, gang_job, rank
):
    from controlplane.jobs.models import AttemptMember, LogChunk

    # More output of each member, each at its own offsets: rank 1's bytes never show in rank
    # 0's stream, nor shift its offsets.
    attempt = gang_job.attempts.get()
    for member in AttemptMember.objects.filter(attempt=attempt):
        first = f"hello from rank {member.rank}\n"
        LogChunk.objects.create(
            attempt=attempt, member=member, offset=len(first), data=f"step 2 of {member.rank}\n"
        )
    client.force_login(alice)
    url = reverse("job-logs", args=[gang_job.pk])
    start = len(f"hello from rank {rank}\n")
    answer = client.get(url, {"rank": rank, "offset": start}).json()
    assert answer["text"] == f"step 2 of {rank}\n"
    assert (answer["offset"], answer["rank"]) == (start, rank)
    assert answer["next_offset"] == start + len(f"step 2 of {rank}\n")
