"""Submitting with an Idempotency-Key: a retry gets the first job back, never a second one.

The bug this guards against: a POST answered with an error had created its job, and the
client's retry created a duplicate.
"""

import threading
from datetime import timedelta
from unittest import mock

import pytest
from django.db import DatabaseError, connection
from django.utils import timezone
from drf_spectacular.generators import SchemaGenerator
from rest_framework.test import APIClient

from controlplane.jobs import actions
from controlplane.jobs.api.views import JobViewSet
from controlplane.jobs.models import Job, JobEvent, SubmitKey
from controlplane.jobs.tasks import delete_expired_submit_keys
from controlplane.tenancy.models import Membership
from tests.controlplane.api.helpers import job_body

URL = "/api/v1/jobs/"


def submit(world, key=None, role="member", client=None, **overrides):
    world.ensure("node")
    headers = {} if key is None else {"Idempotency-Key": key}
    client = client or world.client(role)
    return client.post(URL, job_body(**overrides), format="json", headers=headers)


def test_a_retry_with_the_same_key_answers_the_first_job_and_creates_no_second(world):
    first = submit(world, "retry-1")
    again = submit(world, "retry-1")
    assert first.status_code == again.status_code == 201, again.content
    assert again.json()["id"] == first.json()["id"]
    assert set(again.json()) == set(first.json())
    assert again["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first
    assert Job.objects.count() == 1
    assert JobEvent.objects.count() == 1


def test_a_submit_without_the_key_behaves_as_before(world):
    first, second = submit(world), submit(world)
    assert first.status_code == second.status_code == 201
    assert first.json()["id"] != second.json()["id"]
    assert "Idempotent-Replayed" not in second
    assert SubmitKey.objects.count() == 0


def test_an_answer_lost_after_the_commit_is_replayed_by_the_retry(world):
    client = world.client("member")
    client.raise_request_exception = False
    # The answer is built after the commit: a failure there loses it, not the job.
    with mock.patch.object(JobViewSet, "_created", side_effect=ConnectionError("lost")):
        lost = submit(world, "lost-answer", client=client)
    assert lost.status_code == 500
    job = Job.objects.get()
    retry = submit(world, "lost-answer", client=client)
    assert retry.status_code == 201, retry.content
    assert retry.json()["id"] == job.pk
    assert retry["Idempotent-Replayed"] == "true"
    assert Job.objects.count() == 1


def test_a_job_whose_key_cannot_be_recorded_is_not_created_either(world):
    client = world.client("member")
    client.raise_request_exception = False
    with mock.patch.object(SubmitKey.objects, "create", side_effect=DatabaseError("disk full")):
        response = submit(world, "k", client=client)
    assert response.status_code == 500
    assert Job.objects.count() == 0
    assert JobEvent.objects.count() == 0


def test_the_same_key_with_a_different_body_is_a_422_naming_the_header(world):
    first = submit(world, "k-1", name="first")
    other = submit(world, "k-1", name="second")
    assert first.status_code == 201
    assert other.status_code == 422, other.content
    assert "Idempotency-Key" in other.json()
    assert list(Job.objects.values_list("name", flat=True)) == ["first"]


def test_the_body_is_compared_as_json_whatever_its_key_order_and_spacing(world):
    world.ensure("node")
    client = world.client("member")
    body = job_body()
    compact = "{" + ",".join(f'"{k}":{_json(v)}' for k, v in body.items()) + "}"
    spaced = "{ " + ", ".join(f'"{k}": {_json(v)}' for k, v in reversed(body.items())) + " }"
    headers = {"Idempotency-Key": "order"}
    first = client.post(URL, compact, content_type="application/json", headers=headers)
    again = client.post(URL, spaced, content_type="application/json", headers=headers)
    assert (first.status_code, again.status_code) == (201, 201)
    assert again["Idempotent-Replayed"] == "true"
    assert Job.objects.count() == 1


def _json(value):
    import json

    return json.dumps(value)


def test_keys_are_per_user_and_never_reveal_another_users_job(world):
    world.ensure("carol_membership")
    carol = world.carol_membership.user
    carol_client = APIClient()
    carol_client.force_authenticate(carol)
    alices = submit(world, "shared", name="alices")
    # Another body under the same key: for carol it is a new key, not a 422 about alice's.
    carols = submit(world, "shared", client=carol_client, name="carols")
    bobs = submit(world, "shared", role="other_tenant", tenant="nlp", name="bobs")
    assert (alices.status_code, carols.status_code, bobs.status_code) == (201, 201, 201)
    assert len({alices.json()["id"], carols.json()["id"], bobs.json()["id"]}) == 3
    assert "Idempotent-Replayed" not in carols and "Idempotent-Replayed" not in bobs
    assert carols.json()["submitted_by"] == "carol"
    assert SubmitKey.objects.filter(key="shared").count() == 3


BAD_KEYS = ["", "   ", '""', "x" * 256, "clé", "tab\there", "nul\x00"]


@pytest.mark.parametrize("key", BAD_KEYS, ids=repr)
def test_a_malformed_key_is_a_400_naming_the_header_and_nothing_is_written(world, key):
    response = submit(world, key)
    assert response.status_code == 400, response.content
    assert "Idempotency-Key" in response.json()
    assert Job.objects.count() == 0
    assert SubmitKey.objects.count() == 0


def test_a_key_of_255_printable_characters_is_accepted(world):
    key = ("a-Z_0.9 ~!" * 26)[:255]
    assert submit(world, key).status_code == 201
    assert SubmitKey.objects.get().key == key


def test_the_drafts_quoted_key_and_the_bare_key_are_the_same_key(world):
    first = submit(world, '"8e03978e-40d5-43e8-bc93-6894a57f9324"')
    again = submit(world, "8e03978e-40d5-43e8-bc93-6894a57f9324")
    assert again["Idempotent-Replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]


def test_a_refused_submit_does_not_use_up_its_key(world):
    refused = submit(world, "fix-and-retry", gpus=-1)
    assert refused.status_code == 400
    fixed = submit(world, "fix-and-retry", gpus=-1 + 2)
    assert fixed.status_code == 201
    assert "Idempotent-Replayed" not in fixed


def test_a_replay_does_not_validate_again(world):
    # The first submit went through; the cluster changed since. The retry still gets its job.
    first = submit(world, "before-the-change", gpus=2)
    world.node.gpus.all().delete()
    again = submit(world, "before-the-change", gpus=2)
    assert again.status_code == 201
    assert again.json()["id"] == first.json()["id"]


def test_a_replay_is_not_shown_to_a_user_who_has_left_the_tenant(world):
    submit(world, "then-left")
    Membership.objects.filter(user=world.alice, tenant=world.vision).delete()
    again = submit(world, "then-left")
    assert again.status_code == 404
    assert Job.objects.count() == 1


def test_an_expired_key_submits_a_new_job(world, settings):
    settings.IDEMPOTENCY_KEY_TTL_S = 3600
    first = submit(world, "daily")
    SubmitKey.objects.update(created_at=timezone.now() - timedelta(seconds=3601))
    again = submit(world, "daily")
    assert again.status_code == 201
    assert "Idempotent-Replayed" not in again
    assert again.json()["id"] != first.json()["id"]
    assert SubmitKey.objects.get().job_id == again.json()["id"]


def test_the_expiry_task_deletes_only_expired_keys(world, settings):
    settings.IDEMPOTENCY_KEY_TTL_S = 3600
    submit(world, "old")
    submit(world, "new")
    SubmitKey.objects.filter(key="old").update(created_at=timezone.now() - timedelta(seconds=3601))
    assert delete_expired_submit_keys() == 1
    assert list(SubmitKey.objects.values_list("key", flat=True)) == ["new"]
    assert Job.objects.count() == 2  # the jobs stay; only their keys go


def test_the_expiry_task_runs_on_the_beat_schedule(settings):
    tasks = {entry["task"] for entry in settings.CELERY_BEAT_SCHEDULE.values()}
    assert delete_expired_submit_keys.name in tasks


def test_the_schema_documents_the_header_and_the_422():
    schema = SchemaGenerator().get_schema(request=None, public=True)
    create = schema["paths"]["/api/v1/jobs/"]["post"]
    header = next(p for p in create["parameters"] if p["name"] == "Idempotency-Key")
    assert header["in"] == "header" and not header.get("required", False)
    assert "422" in create["responses"]
    assert "Idempotent-Replayed" in create["responses"]["201"]["headers"]


# ----- two requests racing with one key, on their own connections --------------------------------


def _race(world, bodies: list[dict]) -> list:
    """POST the bodies at once with one key, each from its own thread (and connection), both
    past the look-up of the key before either inserts it."""
    both_looked = threading.Barrier(len(bodies), timeout=20)
    real_submit_one = actions.submit_one

    def submit_once_all_have_looked(**fields):
        both_looked.wait()
        return real_submit_one(**fields)

    answers: list = [None] * len(bodies)

    def post(i):
        try:
            client = APIClient()
            client.force_authenticate(world.alice)
            answers[i] = client.post(
                URL, bodies[i], format="json", headers={"Idempotency-Key": "race"}
            )
        except Exception as exc:  # the test reads it
            answers[i] = exc
        finally:
            connection.close()

    with mock.patch.object(actions, "submit_one", submit_once_all_have_looked):
        threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    return answers


@pytest.mark.django_db(transaction=True)
def test_two_racing_submits_with_one_key_create_one_job(world):
    world.ensure("node", "users")
    answers = _race(world, [job_body(), job_body()])
    assert [getattr(a, "status_code", a) for a in answers] == [201, 201]
    assert answers[0].json()["id"] == answers[1].json()["id"]
    assert sorted(a.get("Idempotent-Replayed", "") for a in answers) == ["", "true"]
    assert Job.objects.count() == 1
    assert JobEvent.objects.count() == 1
    assert SubmitKey.objects.get().job_id == answers[0].json()["id"]


@pytest.mark.django_db(transaction=True)
def test_two_racing_submits_with_one_key_and_different_bodies_create_one_job(world):
    world.ensure("node", "users")
    answers = _race(world, [job_body(name="a"), job_body(name="b")])
    assert sorted(getattr(a, "status_code", a) for a in answers) == [201, 422]
    assert Job.objects.count() == 1
