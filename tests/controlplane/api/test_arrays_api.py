"""Job arrays through the API: the spec, the limit, templating, throttling holds, tenancy, cancel."""

import pytest

from controlplane.audit.models import AuditEvent
from controlplane.jobs import actions
from controlplane.jobs.models import Hold, Job, JobArray, JobAttempt, JobEvent, JobState
from tests.controlplane.api.helpers import job_body, results


def array_body(**overrides) -> dict:
    return job_body(**{"array": "0-3", **overrides})


def submit(world, role="member", **overrides):
    world.ensure("node")
    return world.client(role).post("/api/v1/arrays/", array_body(**overrides), format="json")


def written() -> tuple[int, int, int]:
    return JobArray.objects.count(), Job.objects.count(), JobEvent.objects.count()


def tasks_of(array_id: int) -> list[Job]:
    return list(Job.objects.filter(array_id=array_id).order_by("array_index"))


@pytest.mark.parametrize(
    "spec, indexes",
    [
        ("0-3", [0, 1, 2, 3]),
        ("1,3,5-7", [1, 3, 5, 6, 7]),
        ("0-9:3", [0, 3, 6, 9]),
        (" 4 - 4 ".replace(" ", ""), [4]),
        (5, [0, 1, 2, 3, 4]),
        ("3", [0, 1, 2]),  # a number alone is a count, as a JSON number or a string
    ],
)
def test_the_spec_gives_one_task_per_index(world, spec, indexes):
    response = submit(world, array=spec)
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["size"] == len(indexes) and body["state"] == "pending"
    assert body["counts"]["pending"] == len(indexes)
    assert [t.array_index for t in tasks_of(body["id"])] == indexes
    assert {t.state for t in tasks_of(body["id"])} == {JobState.PENDING}


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "a-b",
        "3-1",
        "0-9:0",
        "1,1",
        "0-5,3",
        "-1",
        "1,,2",
        "0-99999999",
        "1" * 500,
        "5\x00",
        0,
        -4,
        True,
        None,
        [1, 2],
        {"a": 1},
        1.5,
        10**40,
    ],
)
def test_a_bad_spec_is_a_400_naming_array_and_writes_nothing(world, spec):
    world.ensure("node", "users")
    before = written()
    response = submit(world, array=spec)
    assert response.status_code == 400, response.content
    assert "array" in response.json()
    assert written() == before


def test_an_array_beyond_the_tenants_limit_is_refused_whole(world):
    world.ensure("node", "users")
    world.vision.max_array_size = 50
    world.vision.save()
    before = written()
    for spec in (51, "0-50", "0-40,100-109"):
        response = submit(world, array=spec)
        assert response.status_code == 400
        assert list(response.json()) == ["array"]
        assert "50" in response.json()["array"][0]
    assert written() == before
    assert submit(world, array="0-49").status_code == 201


def test_the_ceiling_bounds_a_tenants_limit(world, settings):
    world.ensure("node", "users")
    settings.MAX_ARRAY_SIZE_CEILING = 10
    before = written()
    response = submit(world, array=11)
    assert response.status_code == 400 and "array" in response.json()
    assert written() == before


def test_without_array_the_submit_names_it(world):
    world.ensure("node")
    body = job_body()
    response = world.client("member").post("/api/v1/arrays/", body, format="json")
    assert response.status_code == 400 and "array" in response.json()


@pytest.mark.parametrize("max_parallel", [0, -1, 5, "2", 2.5, True])
def test_max_parallel_must_be_between_one_and_the_size(world, max_parallel):
    world.ensure("node", "users")
    before = written()
    response = submit(world, array="0-3", max_parallel=max_parallel)
    assert response.status_code == 400
    assert "max_parallel" in response.json()
    assert written() == before


def test_every_field_at_fault_is_named_at_once(world):
    response = submit(world, array="x", gpus=-1, max_parallel=0, env={"GPUCP_ARRAY_INDEX": "9"})
    assert response.status_code == 400
    # max_parallel is judged against the size, which a bad spec does not give.
    assert {"array", "gpus", "env"} <= set(response.json())


def test_each_task_gets_its_index_in_its_command_and_env(world):
    response = submit(
        world,
        array="2,5",
        command=["python", "sweep.py", "--point={{array_index}}/{{array_size}}"],
        env={"POINT": "p{{array_index}}", "KEEP": "as is"},
    )
    assert response.status_code == 201
    array_id = response.json()["id"]
    first, second = tasks_of(array_id)
    assert first.command == ["python", "sweep.py", "--point=2/2"]
    assert second.command == ["python", "sweep.py", "--point=5/2"]
    assert second.env == {
        "POINT": "p5",
        "KEEP": "as is",
        "GPUCP_ARRAY_ID": str(array_id),
        "GPUCP_ARRAY_INDEX": "5",
        "GPUCP_ARRAY_SIZE": "2",
    }
    # The array shows what was submitted, placeholders kept.
    template = response.json()["template"]
    assert template["command"][-1] == "--point={{array_index}}/{{array_size}}"
    assert template["env"] == {"POINT": "p{{array_index}}", "KEEP": "as is"}


def test_max_parallel_holds_the_tasks_past_it_saying_why(world):
    response = submit(world, array=5, max_parallel=2)
    body = response.json()
    assert body["counts"] == {
        "pending": 2,
        "held": 3,
        "running": 0,
        "succeeded": 0,
        "failed": 0,
        "cancelled": 0,
    }
    tasks = tasks_of(body["id"])
    assert [t.hold for t in tasks] == [""] * 2 + [Hold.ARRAY] * 3
    assert tasks[4].pending_reason_code == "array_limit"
    assert tasks[4].pending_reason == (
        f"Waiting for a slot: array {body['id']} runs at most 2 tasks at once."
    )
    shown = world.client("member").get(f"/api/v1/jobs/{tasks[4].pk}/").json()
    assert (shown["array"], shown["array_index"], shown["hold"]) == (body["id"], 4, "array")


def test_the_jobs_list_filters_by_array(world):
    one = submit(world, array=3).json()["id"]
    submit(world, array=2)
    listed = results(world.client("member").get(f"/api/v1/jobs/?array={one}"))
    assert sorted(j["array_index"] for j in listed) == [0, 1, 2]
    assert {j["array"] for j in listed} == {one}


def test_another_tenants_array_is_404_and_viewers_cannot_submit_or_cancel(world):
    array_id = submit(world, array=2).json()["id"]
    bob = world.client("other_tenant")
    assert bob.get(f"/api/v1/arrays/{array_id}/").status_code == 404
    assert bob.post(f"/api/v1/arrays/{array_id}/cancel/").status_code == 404
    assert array_id not in [a["id"] for a in results(bob.get("/api/v1/arrays/"))]
    # bob may not submit into vision either: the tenant is unknown to him.
    assert submit(world, role="other_tenant").status_code == 404
    viewer = world.client("viewer")
    assert viewer.get(f"/api/v1/arrays/{array_id}/").status_code == 200
    before = written()
    assert submit(world, role="viewer").status_code == 403
    assert viewer.post(f"/api/v1/arrays/{array_id}/cancel/").status_code == 403
    assert written() == before
    assert {t.state for t in tasks_of(array_id)} == {JobState.PENDING}
    admin_ids = [a["id"] for a in results(world.client("cluster_admin").get("/api/v1/arrays/"))]
    assert array_id in admin_ids


def test_cancelling_an_array_cancels_every_unfinished_task_and_stops_running_ones(world):
    body = submit(world, array=4, max_parallel=2).json()
    tasks = tasks_of(body["id"])
    node = world.node
    attempt = actions.admit_job(tasks[0], node=node, gpus=[node.gpus.first()], borrowed=False)
    actions.mark_attempt_running(attempt)
    actions.finish_attempt(JobAttempt.objects.get(pk=attempt.pk), exit_code=0)
    running = actions.admit_job(
        Job.objects.get(pk=tasks[1].pk), node=node, gpus=[node.gpus.last()], borrowed=False
    )
    actions.mark_attempt_running(running)
    response = world.client("member").post(f"/api/v1/arrays/{body['id']}/cancel/")
    assert response.status_code == 200
    shown = response.json()
    assert shown["state"] == "cancelled" and shown["cancelled_at"]
    assert shown["counts"]["succeeded"] == 1 and shown["counts"]["cancelled"] == 3
    states = [t.state for t in tasks_of(body["id"])]
    assert states == [JobState.SUCCEEDED] + [JobState.CANCELLED] * 3
    assert {t.hold for t in tasks_of(body["id"])} == {""}
    running.refresh_from_db()
    assert running.stop_requested_at is not None and running.stop_reason == "cancelled"
    assert AuditEvent.objects.filter(action="array.cancel", object_id=str(body["id"])).exists()
    again = world.client("member").post(f"/api/v1/arrays/{body['id']}/cancel/")
    assert again.status_code == 409


def test_a_member_cancels_only_their_own_arrays(world):
    carol = world.carol_membership.user
    array_id = submit(world, array=2).json()["id"]
    client = world.client("member")
    client.force_authenticate(carol)
    assert client.post(f"/api/v1/arrays/{array_id}/cancel/").status_code == 403
    assert (
        world.client("tenant_admin").post(f"/api/v1/arrays/{array_id}/cancel/").status_code == 200
    )


def test_an_idempotency_key_replays_the_array(world):
    world.ensure("node")
    client = world.client("member")
    headers = {"Idempotency-Key": "sweep-1"}
    first = client.post("/api/v1/arrays/", array_body(), format="json", headers=headers)
    again = client.post("/api/v1/arrays/", array_body(), format="json", headers=headers)
    assert first.status_code == again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json()["id"] == first.json()["id"]
    assert JobArray.objects.count() == 1 and Job.objects.count() == 4
    other = client.post("/api/v1/arrays/", array_body(array=9), format="json", headers=headers)
    assert other.status_code == 422


def test_the_submit_is_audited_once(world):
    array_id = submit(world, array=20).json()["id"]
    rows = AuditEvent.objects.filter(action="array.submit", object_id=str(array_id))
    assert rows.count() == 1 and rows.get().after["size"] == 20


def test_cluster_admins_set_a_tenants_array_limit_up_to_the_ceiling(world, settings):
    world.ensure("users")
    url = "/api/v1/tenants/vision/"
    admin = world.client("cluster_admin")
    response = admin.patch(url, {"max_array_size": 20}, format="json")
    assert response.status_code == 200 and response.json()["max_array_size"] == 20
    world.vision.refresh_from_db()
    assert world.vision.max_array_size == 20
    assert AuditEvent.objects.filter(action="tenant.update", after__max_array_size=20).exists()
    for refused in (0, settings.MAX_ARRAY_SIZE_CEILING + 1, "many", None):
        response = admin.patch(url, {"max_array_size": refused}, format="json")
        assert response.status_code == 400 and "max_array_size" in response.json()
    assert (
        world.client("tenant_admin").patch(url, {"max_array_size": 5}, format="json").status_code
        == 403
    )
    world.vision.refresh_from_db()
    assert world.vision.max_array_size == 20
    assert submit(world, array=21).status_code == 400


def test_a_submit_costs_the_same_statements_for_10_tasks_as_for_1000(world):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    world.ensure("node", "users")
    submit(world, array=1)  # the caches of the cluster's shape, as any later request has them
    statements = []
    for spec in ("0-9", "0-999"):
        with CaptureQueriesContext(connection) as queries:
            assert submit(world, array=spec, max_parallel=5).status_code == 201
        statements.append(len(queries))
    assert statements[0] == statements[1]
    assert Job.objects.count() == 1011


def test_the_array_list_reads_a_page_in_the_same_statements_whatever_its_length(world):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    client = world.client("member")
    submit(world, array=3)
    client.get("/api/v1/arrays/")  # the user's session and caches, as any later request has
    with CaptureQueriesContext(connection) as one:
        assert len(results(client.get("/api/v1/arrays/"))) == 1
    for _ in range(4):
        submit(world, array=3)
    with CaptureQueriesContext(connection) as five:
        assert len(results(client.get("/api/v1/arrays/"))) == 5
    assert len(five) == len(one)
