"""`depends_on`: what a submit may name (and what it may not, with nothing written), and how
the end of a job resolves what waits for it, whichever path ends it."""

from __future__ import annotations

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.jobs import actions
from controlplane.jobs.dependencies import MAX_DEPENDENCIES, DependencySpec
from controlplane.jobs.models import (
    DependencyState,
    Hold,
    Job,
    JobArray,
    JobDependency,
    JobEvent,
    JobState,
)

pytestmark = pytest.mark.django_db

BODY = {"image": "registry.local/team/train:1", "command": ["python", "train.py"], "gpus": 1}


@pytest.fixture
def api(member):
    return member


@pytest.fixture
def job(make_job, vision, alice):
    return make_job(vision, alice, name="first")


def after(*targets, **kwargs) -> dict:
    return {**BODY, "depends_on": list(targets), **kwargs}


def written() -> tuple[int, int, int]:
    return Job.objects.count(), JobDependency.objects.count(), JobEvent.objects.count()


def test_a_dependency_on_a_job_is_shown_with_its_state_and_the_job_is_held(api, job):
    response = api.post("/api/v1/jobs/", after({"job": job.pk}), format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["depends_on"] == [{"job": job.pk, "condition": "succeeded", "state": "waiting"}]
    assert body["hold"] == "dependency"
    assert body["pending_reason"] == f"waiting for job {job.pk} to succeed"
    assert api.get(f"/api/v1/jobs/{body['id']}/").json() == body
    listed = api.get("/api/v1/jobs/").json()["results"]
    assert next(j for j in listed if j["id"] == body["id"])["depends_on"] == body["depends_on"]
    assert Job.objects.get(pk=job.pk).has_dependents


def test_a_dependency_already_met_holds_nothing(api, job):
    actions.cancel_job(job)
    response = api.post(
        "/api/v1/jobs/", after({"job": job.pk, "condition": "finished"}), format="json"
    )
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["hold"] == ""
    assert body["depends_on"][0]["state"] == "met"


def _bad_items(job_id: int, other_id: int, next_id: int) -> list[tuple[object, str]]:
    """(depends_on, the field the answer must name): one of each kind of mistake."""
    return [
        ("12", "depends_on"),
        ({"job": job_id}, "depends_on"),
        ([{"job": job_id}] * (MAX_DEPENDENCIES + 1), "depends_on"),
        (["12"], "depends_on[0]"),
        ([{}], "depends_on[0]"),
        ([{"job": job_id, "array": 1}], "depends_on[0]"),
        ([{"job": "twelve"}], "depends_on[0].job"),
        ([{"job": "1\x00"}], "depends_on[0].job"),
        ([{"job": True}], "depends_on[0].job"),
        ([{"job": 1.5}], "depends_on[0].job"),
        ([{"job": None}], "depends_on[0].job"),
        ([{"job": -job_id}], "depends_on[0].job"),
        ([{"job": 0}], "depends_on[0].job"),
        ([{"job": 2**70}], "depends_on[0].job"),
        ([{"job": "9" * 5000}], "depends_on[0].job"),
        ([{"job": "１２"}], "depends_on[0].job"),
        ([{"array": [job_id]}], "depends_on[0].array"),
        ([{"job": job_id, "condition": "maybe"}], "depends_on[0].condition"),
        ([{"job": job_id, "condition": "succeeded\x00"}], "depends_on[0].condition"),
        ([{"job": job_id, "condition": ["succeeded"]}], "depends_on[0].condition"),
        ([{"job": job_id, "after": 1}], "depends_on[0].after"),
        ([{"job": job_id}, {"job": job_id}], "depends_on[1].job"),
        ([{"job": job_id}, {"array": 2**40}], "depends_on[1].array"),
        ([{"job": 2**40}], "depends_on[0].job"),  # no such job
        ([{"job": other_id}], "depends_on[0].job"),  # another tenant's
        ([{"job": next_id}], "depends_on[0].job"),  # the id this very job would get: a cycle
    ]


def names(answer: dict, field: str) -> bool:
    """The answer names the field: as its key, or (text the input boundary refuses before any
    field is read, e.g. a NUL) in the message of its top-level field."""
    top = field.split("[")[0]
    return field in answer or any(field in m for m in answer.get(top, []))


def test_every_bad_dependency_is_refused_naming_the_item_and_writes_nothing(
    api, job, make_job, nlp, bob
):
    other = make_job(nlp, bob, name="theirs")
    # Ids no job of the tenant has (0, none yet, another tenant's): 404, as in a URL.
    unseen = [[{"job": 2**40}], [{"job": other.pk}], [{"job": other.pk + 1}], [{"job": 0}]]
    unseen.append([{"job": job.pk}, {"array": 2**40}])
    unknown_answer = None
    for depends_on, field in _bad_items(job.pk, other.pk, other.pk + 1):
        before = written()
        response = api.post("/api/v1/jobs/", {**BODY, "depends_on": depends_on}, format="json")
        expected = 404 if depends_on in unseen else 400
        assert response.status_code == expected, (depends_on, response.content)
        assert names(response.json(), field), (depends_on, response.json())
        assert written() == before, depends_on
        if depends_on == [{"job": 2**40}]:
            unknown_answer = response.json()[field]
        if depends_on == [{"job": other.pk}]:
            # Another tenant's job is answered as a job that does not exist.
            assert response.json()[field] == [
                m.replace(str(2**40), str(other.pk)) for m in unknown_answer or []
            ]
    assert not Job.objects.get(pk=other.pk).has_dependents


def test_a_dependency_that_can_never_be_met_is_refused_saying_why(api, job):
    actions.cancel_job(job)
    before = written()
    response = api.post("/api/v1/jobs/", after({"job": job.pk}), format="json")
    assert response.status_code == 400
    assert response.json()["depends_on[0].job"] == [
        f"Job {job.pk} already was cancelled: it can never succeed."
    ]
    assert written() == before


def test_a_batch_cannot_make_one_item_wait_for_another_and_writes_nothing(api, job):
    next_id = job.pk + 1
    before = written()
    response = api.post(
        "/api/v1/jobs/", [BODY, after({"job": next_id}), after({"job": next_id + 1})], format="json"
    )
    # Ids that do not exist yet, as any unknown id: not found, naming each item at fault.
    assert response.status_code == 404
    assert set(response.json()) == {"1", "2"}
    assert "depends_on[0].job" in response.json()["1"]
    assert written() == before


def test_a_batch_may_wait_for_earlier_jobs(api, job):
    response = api.post(
        "/api/v1/jobs/",
        [after({"job": job.pk}), BODY, after({"job": job.pk, "condition": "failed"})],
        format="json",
    )
    assert response.status_code == 201, response.content
    held = [j["hold"] for j in response.json()]
    assert held == ["dependency", "", "dependency"]
    assert JobDependency.objects.filter(on_job=job).count() == 2


def test_a_cluster_admin_names_only_jobs_of_the_tenant_the_job_goes_to(
    cluster_admin, job, make_node, make_job, nlp, bob
):
    make_node("gpu-a", gpus=2)
    client = APIClient()
    client.force_authenticate(cluster_admin)
    theirs = make_job(nlp, bob)
    refused = client.post(
        "/api/v1/jobs/", after({"job": theirs.pk}, tenant="vision"), format="json"
    )
    assert refused.status_code == 404 and "depends_on[0].job" in refused.json()
    accepted = client.post("/api/v1/jobs/", after({"job": job.pk}, tenant="vision"), format="json")
    assert accepted.status_code == 201


# --- resolution, whatever ends the job ------------------------------------------------------


def wait_for(make_job, tenant, user, *specs: DependencySpec, **fields) -> Job:
    return make_job(tenant, user, depends_on=list(specs), **fields)


def test_cancelling_a_job_resolves_what_waits_for_it(api, job, make_job, vision, alice):
    needs_success = wait_for(make_job, vision, alice, DependencySpec("succeeded", job_id=job.pk))
    runs_anyway = wait_for(make_job, vision, alice, DependencySpec("finished", job_id=job.pk))
    response = api.post(f"/api/v1/jobs/{job.pk}/cancel/")
    assert response.status_code == 200
    needs_success.refresh_from_db()
    runs_anyway.refresh_from_db()
    assert needs_success.state == JobState.CANCELLED
    assert needs_success.state_reason == (
        f"Dependency never satisfied: job {job.pk} was cancelled; it was to succeed"
    )
    assert (runs_anyway.state, runs_anyway.hold, runs_anyway.pending_reason) == (
        JobState.PENDING,
        "",
        "",
    )


def _run(job: Job, node) -> object:
    attempt = actions.admit_job(job, node=node, gpus=[node.gpus.get(index=0)], borrowed=False)
    assert attempt is not None
    return attempt


def test_the_bulk_report_path_releases_and_cancels_dependents(
    make_node, job, make_job, vision, alice
):
    node = make_node("gpu-a", gpus=2)
    ok = wait_for(make_job, vision, alice, DependencySpec("succeeded", job_id=job.pk))
    on_failure = wait_for(make_job, vision, alice, DependencySpec("failed", job_id=job.pk))
    attempt = _run(job, node)
    now = timezone.now()
    applied = actions.record_reports(
        [actions.Report(attempt.pk, started_at=now, exit_code=0, finished_at=now)]
    )
    assert applied == {attempt.pk}
    assert Job.objects.get(pk=job.pk).state == JobState.SUCCEEDED
    ok.refresh_from_db()
    on_failure.refresh_from_db()
    assert (ok.state, ok.hold) == (JobState.PENDING, "")
    assert on_failure.state == JobState.CANCELLED
    assert on_failure.state_reason.endswith(f"job {job.pk} succeeded; it was to fail")


def test_a_chain_of_300_is_cancelled_in_one_go(
    job, make_job, vision, alice, django_assert_max_num_queries
):
    chain = [job]
    for _ in range(299):
        chain.append(wait_for(make_job, vision, alice, DependencySpec("succeeded", chain[-1].pk)))
    # A few statements per link, and no recursion: 300 links would overflow Python's stack.
    with django_assert_max_num_queries(300 * 12):
        actions.cancel_job(job)
    states = set(Job.objects.filter(pk__in=[j.pk for j in chain]).values_list("state", flat=True))
    assert states == {JobState.CANCELLED}
    assert JobDependency.objects.filter(state=DependencyState.NEVER).count() == 299
    assert JobEvent.objects.filter(kind="cancelled", job__in=chain).count() == 300


def test_a_late_report_does_not_revisit_what_an_end_resolved(make_node, make_job, vision, alice):
    node = make_node("gpu-a", gpus=2)
    job = make_job(vision, alice, restartable=False)
    needs_success = wait_for(make_job, vision, alice, DependencySpec("succeeded", job_id=job.pk))
    attempt = _run(job, node)
    actions.finish_attempt(attempt, exit_code=None, lost=True)
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert Job.objects.get(pk=needs_success.pk).state == JobState.CANCELLED
    actions.transition(job, JobState.SUCCEEDED, late_report=True, reason="late")
    assert Job.objects.get(pk=needs_success.pk).state == JobState.CANCELLED


# --- arrays ---------------------------------------------------------------------------------


def make_array(vision, alice, size: int, max_parallel: int | None = None) -> JobArray:
    array = JobArray.objects.create(
        tenant=vision,
        submitted_by=alice,
        name="sweep",
        spec=str(size),
        size=size,
        max_parallel=max_parallel,
    )
    Job.objects.bulk_create(
        [
            Job(
                tenant=vision,
                submitted_by=alice,
                name=f"sweep-{i}",
                image=BODY["image"],
                command=BODY["command"],
                array=array,
                array_index=i,
            )
            for i in range(size)
        ]
    )
    return array


def tasks(array: JobArray) -> list[Job]:
    return list(array.tasks.order_by("array_index"))


def test_an_array_dependency_waits_for_every_task(api, make_node, vision, alice):
    node = make_node("gpu-b", gpus=2)
    array = make_array(vision, alice, 2)
    response = api.post(
        "/api/v1/jobs/",
        [after({"array": array.pk}), after({"array": array.pk, "condition": "finished"})],
        format="json",
    )
    assert response.status_code == 201, response.content
    all_ok, any_end = (Job.objects.get(pk=j["id"]) for j in response.json())
    assert all_ok.pending_reason == f"waiting for array {array.pk} to succeed"
    first, second = tasks(array)
    actions.finish_attempt(_run(first, node), exit_code=0)
    assert Job.objects.get(pk=all_ok.pk).hold == Hold.DEPENDENCY
    actions.finish_attempt(_run(second, node), exit_code=0)
    assert Job.objects.get(pk=all_ok.pk).hold == ""
    assert Job.objects.get(pk=any_end.pk).hold == ""


def test_one_failed_task_cancels_what_needed_the_whole_array_at_once(api, make_node, vision, alice):
    node = make_node("gpu-b", gpus=2)
    array = make_array(vision, alice, 3)
    body = [
        after({"array": array.pk}),
        after({"array": array.pk, "condition": "failed"}),
    ]
    response = api.post("/api/v1/jobs/", body, format="json")
    assert response.status_code == 201, response.content
    all_ok, on_failure = (j["id"] for j in response.json())
    first, *rest = tasks(array)
    actions.finish_attempt(_run(first, node), exit_code=2)
    assert Job.objects.get(pk=all_ok).state == JobState.CANCELLED
    assert "a task of array" in Job.objects.get(pk=all_ok).state_reason
    # "failed" waits until every task ended.
    assert Job.objects.get(pk=on_failure).hold == Hold.DEPENDENCY
    for task in rest:
        actions.cancel_job(task)
    assert Job.objects.get(pk=on_failure).hold == ""


def test_a_released_task_of_a_throttled_array_joins_its_array_queue(job, make_job, vision, alice):
    array = make_array(vision, alice, 2, max_parallel=1)
    from controlplane.jobs import dependencies

    dependencies.attach(tasks(array), [DependencySpec("finished", job_id=job.pk)])
    assert {t.hold for t in tasks(array)} == {Hold.DEPENDENCY}
    actions.cancel_job(job)
    # Both wait no more for the job; the array lets one of them at the scheduler, the first.
    assert [t.hold for t in sorted(tasks(array), key=lambda t: t.array_index)] == [
        Hold.NONE,
        Hold.ARRAY,
    ]
