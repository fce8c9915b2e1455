"""Submitting a list of jobs in one POST: all of them or none, in order, as one submit each.

And what makes a single submit cheaper must not change its answer: the 201 is the job as a
GET reads it back.
"""

import threading
import time

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.test import APIClient

from controlplane import wakeups
from controlplane.cluster.models import GPU, Node
from controlplane.jobs import actions, validation
from controlplane.jobs.api.views import MAX_BATCH_JOBS
from controlplane.jobs.models import Job, JobEvent, SubmitKey
from controlplane.tenancy.models import Membership
from tests.controlplane.api.helpers import job_body

URL = "/api/v1/jobs/"


def post(client, body, key=None):
    headers = {} if key is None else {"Idempotency-Key": key}
    return client.post(URL, body, format="json", headers=headers)


def bodies(n, **overrides):
    return [job_body(name=f"job-{i}", **overrides) for i in range(n)]


@pytest.fixture
def cycles(monkeypatch):
    """The cycle requests made (once a submit's transaction commits: see committed)."""
    asked: list[str] = []
    monkeypatch.setattr(wakeups, "request_cycle", asked.append)
    return asked


@pytest.fixture
def committed(django_capture_on_commit_callbacks):
    """Run what the requests made inside it registered to run on commit, as a commit would."""
    return lambda: django_capture_on_commit_callbacks(execute=True)


def nothing_created():
    return Job.objects.count() == 0 and JobEvent.objects.count() == 0


# --- the happy path -------------------------------------------------------------------------------


def test_a_list_creates_every_job_in_order_with_its_event_and_asks_for_one_cycle(
    world, cycles, committed
):
    world.ensure("node")
    client = world.client("member")
    with committed():
        response = post(client, bodies(5, gpus=2))
    assert response.status_code == 201, response.content
    created = response.json()
    assert [job["name"] for job in created] == [f"job-{i}" for i in range(5)]
    assert all(job["state"] == "PENDING" and job["gpus"] == 2 for job in created)
    assert Job.objects.count() == 5
    for job in created:
        (event,) = JobEvent.objects.filter(job_id=job["id"])
        assert (event.kind, event.to_state, event.actor) == ("submitted", "PENDING", world.alice)
    assert cycles == ["submit"]
    # Each job of the answer is that job as it reads back.
    for job in created:
        assert client.get(f"{URL}{job['id']}/").json() == job


def test_a_list_of_one_is_a_list_and_a_body_is_one_job(world):
    world.ensure("node")
    client = world.client("member")
    listed = post(client, [job_body()])
    single = post(client, job_body())
    assert listed.status_code == single.status_code == 201
    assert isinstance(listed.json(), list) and len(listed.json()) == 1
    assert isinstance(single.json(), dict)


def test_the_longest_list_allowed_is_taken_whole(world, cycles, committed):
    world.ensure("node")
    with committed():
        response = post(world.client("member"), [job_body(name="many")] * MAX_BATCH_JOBS)
    assert response.status_code == 201
    ids = [job["id"] for job in response.json()]
    assert len(set(ids)) == MAX_BATCH_JOBS
    assert Job.objects.filter(name="many").count() == MAX_BATCH_JOBS
    assert cycles == ["submit"]


def test_a_list_costs_the_same_queries_for_few_jobs_and_many(world):
    world.ensure("node")
    client = world.client("member")
    post(client, bodies(2))  # the cluster's shape is read once, then reused

    def queries(n):
        with CaptureQueriesContext(connection) as captured:
            assert post(client, bodies(n)).status_code == 201
        return len(captured.captured_queries)

    # 30: one INSERT per table on SQLite too, which splits longer lists at 999 parameters.
    assert queries(3) == queries(30)


# --- all or nothing -------------------------------------------------------------------------------


def test_one_invalid_item_refuses_the_list_naming_the_item_and_field(world, cycles, committed):
    world.ensure("node")
    items = bodies(4)
    items[1]["gpus"] = -1
    items[2]["colour"] = "blue"
    with committed():
        response = post(world.client("member"), items)
    assert response.status_code == 400, response.content
    errors = response.json()
    assert set(errors) == {"1", "2"}
    assert set(errors["1"]) == {"gpus"}
    assert errors["2"] == {"colour": ["Unknown field."]}
    assert nothing_created()
    assert cycles == []


def test_an_item_refused_by_the_cluster_or_the_quota_refuses_the_list(world):
    world.ensure("node")  # one node of 2 GPUs; vision may use 16
    items = bodies(3)
    items[0]["gpus"] = 3
    items[2]["gpus"] = 17
    response = post(world.client("member"), items)
    assert response.status_code == 400
    assert "in all: 3 cannot be given" in response.json()["0"]["gpus"][0]
    assert "quota" in response.json()["2"]["gpus"][0]
    assert nothing_created()


def test_an_item_messages_are_the_ones_a_single_submit_gets(world):
    world.ensure("node")
    bad = job_body(gpus=-1, image="train:1", command=["python", 3], env={"A-B": "1"})
    client = world.client("member")
    single = post(client, bad).json()
    listed = post(client, [job_body(), bad]).json()
    assert listed == {"1": single}


# --- bad input at the boundary: 400 naming what is wrong, never a 500, nothing written -------------

BAD_LISTS = {
    "empty": ([], "non_field_errors"),
    "too long": ([job_body()] * (MAX_BATCH_JOBS + 1), "non_field_errors"),
    "numbers": ([1, 2], "0"),
    "strings": (["train"], "0"),
    "nulls": ([job_body(), None], "1"),
    "a list in a list": ([[job_body()]], "0"),
    "nested garbage in a field": ([job_body(command=[[["python"]]], env={"A": {"B": []}})], "0"),
    "a tenant that is no slug": ([job_body(tenant=["vision"])], "0"),
    "a tenant that is an object": ([job_body(tenant={"slug": "vision"})], "0"),
    "a number as tenant": ([job_body(tenant=7)], "0"),
    "NUL in a name": ([job_body(), job_body(name="a\x00b")], None),
    "NUL in a key": ([{**job_body(), "na\x00me": "x"}], None),
}


@pytest.mark.parametrize(("body", "named"), BAD_LISTS.values(), ids=BAD_LISTS.keys())
def test_a_bad_list_is_a_400_naming_what_is_wrong(world, body, named):
    world.ensure("node")
    response = post(world.client("member"), body)
    assert response.status_code == 400, response.content
    if named is not None:
        assert named in response.json()
    else:  # refused by the body parser, which names the item and field in its message
        assert "[" in str(response.json())
    assert nothing_created()


def test_a_lone_surrogate_in_an_item_is_a_400(world):
    world.ensure("node")
    text = '[{"image": "registry.local/team/train:1", "command": ["python", "\\ud800"]}]'
    response = world.client("member").post(URL, text, content_type="application/json")
    assert response.status_code == 400
    assert "[0].command[1]" in str(response.json())
    assert nothing_created()


def test_a_list_too_long_says_how_long_it_may_be(world):
    world.ensure("node")
    response = post(world.client("member"), [job_body()] * (MAX_BATCH_JOBS + 1))
    assert str(MAX_BATCH_JOBS) in response.json()["non_field_errors"][0]


def test_a_list_nested_too_deep_is_a_400(world):
    world.ensure("node")
    deep = "[" * 100 + "]" * 100
    response = world.client("member").post(URL, deep, content_type="application/json")
    assert response.status_code == 400
    assert nothing_created()


def test_a_refusal_of_many_bad_items_stays_short(world):
    world.ensure("node")
    response = post(world.client("member"), [{"gpus": -1}] * 500)
    assert response.status_code == 400
    assert 0 < len(response.json()) <= 50
    assert "0" in response.json()


# --- tenants --------------------------------------------------------------------------------------


def test_an_item_for_another_tenant_is_a_404_and_nothing_is_created(world):
    world.ensure("node", "users")
    items = bodies(3)
    items[1]["tenant"] = "nlp"
    response = post(world.client("member"), items)
    assert response.status_code == 404
    assert "Item 1" in response.json()["detail"]
    assert nothing_created()


def test_an_item_for_a_tenant_that_does_not_exist_reads_the_same_as_another_tenants(world):
    world.ensure("node", "users")
    theirs = post(world.client("member"), [job_body(tenant="nlp")])
    nobodys = post(world.client("member"), [job_body(tenant="no-such-lab")])
    assert theirs.status_code == nobodys.status_code == 404
    assert theirs.json()["detail"].replace("nlp", "X") == nobodys.json()["detail"].replace(
        "no-such-lab", "X"
    )


def test_a_viewer_may_not_submit_a_list(world):
    world.ensure("node")
    response = post(world.client("viewer"), bodies(2))
    assert response.status_code == 403
    assert nothing_created()


def test_a_list_may_name_several_tenants_its_sender_may_submit_to(world):
    world.ensure("node", "users")
    Membership.objects.create(user=world.alice, tenant=world.nlp, role="member")
    response = post(world.client("member"), [job_body(), job_body(tenant="nlp"), job_body()])
    assert response.status_code == 201, response.content
    assert [job["tenant"] for job in response.json()] == ["vision", "nlp", "vision"]


def test_a_member_of_one_tenant_may_leave_the_tenant_out_of_every_item(world):
    world.ensure("node")
    items = [{k: v for k, v in body.items() if k != "tenant"} for body in bodies(2)]
    response = post(world.client("member"), items)
    assert response.status_code == 201
    assert {job["tenant"] for job in response.json()} == {"vision"}


# --- Idempotency-Key: the key stands for the whole list -------------------------------------------


def test_a_list_retried_with_its_key_gets_the_same_jobs_back_in_order(world, cycles, committed):
    world.ensure("node")
    client = world.client("member")
    with committed():
        first = post(client, bodies(4), key="sweep-1")
        again = post(client, bodies(4), key="sweep-1")
    assert first.status_code == again.status_code == 201
    assert again.json() == first.json()
    assert again["Idempotent-Replayed"] == "true"
    assert "Idempotent-Replayed" not in first
    assert Job.objects.count() == 4
    assert SubmitKey.objects.count() == 1
    assert cycles == ["submit"]


def test_a_lists_key_with_another_body_is_a_422(world):
    world.ensure("node")
    client = world.client("member")
    assert post(client, bodies(2), key="k").status_code == 201
    assert post(client, bodies(3), key="k").status_code == 422
    assert post(client, job_body(), key="k").status_code == 422
    assert Job.objects.count() == 2


def test_a_single_jobs_key_sent_with_a_list_is_a_422(world):
    world.ensure("node")
    client = world.client("member")
    assert post(client, job_body(), key="k").status_code == 201
    assert post(client, [job_body()], key="k").status_code == 422
    assert Job.objects.count() == 1


def test_a_refused_list_does_not_use_up_its_key(world):
    world.ensure("node")
    client = world.client("member")
    assert post(client, [job_body(), job_body(gpus=-1)], key="fix").status_code == 400
    fixed = post(client, [job_body(), job_body(gpus=1)], key="fix")
    assert fixed.status_code == 201
    assert "Idempotent-Replayed" not in fixed


def test_a_replayed_list_is_not_shown_to_a_user_who_has_left_a_tenant_of_it(world):
    world.ensure("node", "users")
    Membership.objects.create(user=world.alice, tenant=world.nlp, role="member")
    items = [job_body(), job_body(tenant="nlp")]
    client = world.client("member")
    assert post(client, items, key="two-labs").status_code == 201
    Membership.objects.filter(user=world.alice, tenant=world.nlp).delete()
    assert post(client, items, key="two-labs").status_code == 404
    assert Job.objects.count() == 2


def test_a_replay_finds_its_own_list_among_lists_sent_at_the_same_moment(world):
    # Other submits of the same user share nothing with the key's list but the user: the
    # replay returns exactly the key's jobs.
    world.ensure("node")
    client = world.client("member")
    first = post(client, bodies(3), key="mine")
    post(client, bodies(2))
    post(client, job_body())
    again = post(client, bodies(3), key="mine")
    assert [j["id"] for j in again.json()] == [j["id"] for j in first.json()]


# --- the rate: each job of a list counts ----------------------------------------------------------


@pytest.fixture
def one_window():
    if 60 - time.time() % 60 < 10:
        time.sleep(60 - time.time() % 60 + 0.01)


def user_rate(settings, rate):
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_RATES": {**settings.API_THROTTLE_RATES, "user": rate},
    }


def test_each_job_of_a_list_counts_against_the_users_rate(one_window, world, settings):
    world.ensure("node")
    user_rate(settings, "5/minute")
    client = world.client("member")
    assert post(client, bodies(3)).status_code == 201
    refused = post(client, bodies(3))  # 6 jobs in the window: one past the rate
    assert refused.status_code == 429
    assert Job.objects.count() == 3
    # Another person has their own count.
    assert post(world.client("tenant_admin"), bodies(5)).status_code == 201


def test_a_list_longer_than_the_rate_is_refused_whole(one_window, world, settings):
    world.ensure("node")
    user_rate(settings, "5/minute")
    assert post(world.client("member"), bodies(6)).status_code == 429
    assert nothing_created()


def test_a_list_refused_for_its_length_counts_one_request(one_window, world, settings):
    world.ensure("node")
    user_rate(settings, "5/minute")
    client = world.client("member")
    assert post(client, [job_body()] * (MAX_BATCH_JOBS + 1)).status_code == 400
    assert post(client, bodies(4)).status_code == 201


def test_one_job_per_request_counts_one(one_window, world, settings):
    world.ensure("node")
    user_rate(settings, "5/minute")
    client = world.client("member")
    codes = [post(client, job_body()).status_code for _ in range(6)]
    assert codes == [201] * 5 + [429]


# --- one job: the answer is the job as it reads back ----------------------------------------------

SINGLE_BODIES = {
    "defaults": {},
    "everything": {
        "env": {"EPOCHS": "3", "EMPTY": ""},
        "cpus": 2.5,
        "memory_mib": 8192,
        "priority": "high",
        "preemptible": False,
        "restartable": False,
        "max_runtime_s": 600,
        "estimated_duration_s": 60,
        "gpus": 2,
    },
    "no gpu type, no name": {"gpu_type": "", "name": ""},
    "no gpus": {"gpus": 0, "cpus": 1},
}


@pytest.mark.parametrize("overrides", SINGLE_BODIES.values(), ids=SINGLE_BODIES.keys())
@pytest.mark.parametrize("key", [None, "with-a-key"])
def test_a_submits_answer_is_the_job_as_a_get_reads_it(world, overrides, key):
    world.ensure("node")
    client = world.client("member")
    created = post(client, job_body(**overrides), key=key)
    assert created.status_code == 201, created.content
    assert created.json() == client.get(f"{URL}{created.json()['id']}/").json()


def test_a_submit_with_a_token_answers_the_job_as_a_get_reads_it(world):
    from controlplane.tenancy.models import ApiToken

    world.ensure("node")
    _, raw = ApiToken.issue(world.alice, "ci")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    created = post(client, job_body())
    assert created.json() == client.get(f"{URL}{created.json()['id']}/").json()


def test_a_single_submit_costs_six_queries(world):
    """Roles with their tenants, the tenant's quotas; the job and its event in a savepoint. The
    cluster's shape comes from the first submit, the answer from the objects written. (It was
    thirteen: the tenant twice, the shape, and the job read back for the answer.)"""
    world.ensure("node")
    client = world.client("member")
    assert post(client, job_body()).status_code == 201
    with CaptureQueriesContext(connection) as captured:
        assert post(client, job_body()).status_code == 201
    assert len(captured.captured_queries) <= 6, [q["sql"][:80] for q in captured]


def test_a_submit_with_a_token_reads_the_token_and_the_roles_in_one_statement(world):
    """A person's automation submits with a token: the token, its user, their roles and the
    tenants' quotas are one read (two before), then the job and its event are written."""
    from controlplane.tenancy.models import ApiToken, Membership

    world.ensure("node")
    _, raw = ApiToken.issue(world.alice, "ci")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert post(client, job_body()).status_code == 201  # the cluster's shape, last used
    with CaptureQueriesContext(connection) as captured:
        assert post(client, job_body()).status_code == 201
    reads = [q["sql"] for q in captured if q["sql"].startswith("SELECT")]
    assert len(reads) == 1, reads  # the rest writes: the job and its event
    assert "token_hash" in reads[0] and f'"{Membership._meta.db_table}"' in reads[0]


# --- the cluster's shape, read recently: never the reason for a refusal -----------------------------


def test_a_node_added_elsewhere_since_the_shape_was_read_is_seen_before_refusing(world, make_node):
    world.ensure("node")  # 2 GPUs
    client = world.client("member")
    assert post(client, job_body()).status_code == 201
    stale = validation._recent_shape
    make_node("gpu-b.example", gpus=8)
    # As another web process, which saw no signal, would have it: the shape of before the node.
    validation._recent_shape = stale
    response = post(client, job_body(gpus=8))
    assert response.status_code == 201, response.content
    listed = post(client, [job_body(gpus=8)])
    assert listed.status_code == 201, listed.content


def test_a_node_removed_in_this_process_is_seen_by_the_next_submit(world):
    client = world.client("member")
    world.ensure("node")
    assert post(client, job_body(gpus=2)).status_code == 201
    Node.objects.filter(pk=world.node.pk).delete()
    assert not GPU.objects.exists()
    response = post(client, job_body(gpus=2))
    assert response.status_code == 400
    assert "gpu_type" in response.json() or "gpus" in response.json()


# --- two lists racing with one key, on their own connections ---------------------------------------


@pytest.mark.django_db(transaction=True)
def test_two_racing_lists_with_one_key_create_one_batch(world, monkeypatch):
    world.ensure("node", "users")
    both_looked = threading.Barrier(2, timeout=20)
    real_submit_jobs = actions.submit_jobs

    def submit_once_both_have_looked(**kwargs):
        both_looked.wait()  # both past the look-up of the key, neither inserted it yet
        return real_submit_jobs(**kwargs)

    monkeypatch.setattr(actions, "submit_jobs", submit_once_both_have_looked)
    answers: list = [None, None]

    def send(i):
        try:
            client = APIClient()
            client.force_authenticate(world.alice)
            answers[i] = post(client, bodies(3), key="race")
        except Exception as exc:  # the test reads it
            answers[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [getattr(a, "status_code", a) for a in answers] == [201, 201]
    assert answers[0].json() == answers[1].json()
    assert sorted(a.get("Idempotent-Replayed", "") for a in answers) == ["", "true"]
    assert Job.objects.count() == 3
    assert JobEvent.objects.count() == 3


def test_a_malformed_key_with_a_list_is_a_400_naming_the_header(world):
    world.ensure("node")
    response = post(world.client("member"), bodies(2), key="clé")
    assert response.status_code == 400
    assert "Idempotency-Key" in response.json()
    assert nothing_created()
