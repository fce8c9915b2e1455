"""Submitting a job: every bad input is a 400 that names the field, and nothing is written."""

import pytest
from django.core.exceptions import ValidationError

from controlplane.jobs.models import Job, JobEvent, JobState
from controlplane.jobs.validation import validate_submission
from controlplane.tenancy.models import Membership, Quota
from tests.controlplane.api.helpers import job_body

DIGEST = "sha256:" + "ab" * 32


def submit(world, role="member", **overrides):
    world.ensure("node")  # two H100 GPUs, 64 CPUs, 512 GiB
    return world.client(role).post("/api/v1/jobs/", job_body(**overrides), format="json")


def assert_refused(response, field, status=400):
    assert response.status_code == status, response.content
    if field is not None:
        assert field in response.json(), response.json()
    assert Job.objects.count() == 0
    assert JobEvent.objects.count() == 0


BAD_FIELDS = [
    ("gpus", -1),
    ("gpus", "2"),
    ("gpus", 1.5),
    ("gpus", True),
    ("gpus", 3),  # the largest node has 2
    ("gpu_type", "B200-192GB"),
    ("gpu_type", 7),
    ("command", []),
    ("command", "python train.py"),
    ("command", ["python", 3]),
    ("command", ["python", None]),
    ("command", [""]),
    ("command", None),
    ("env", ["EPOCHS=3"]),
    ("env", {"EPOCHS": 3}),
    ("env", {"1EPOCHS": "3"}),
    ("env", {"MY-VAR": "3"}),
    ("env", {"": "3"}),
    ("env", {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}),
    ("env", {"GPUCP_ATTEMPT": "1"}),
    ("image", "train:1"),
    ("image", "team/train:1"),
    ("image", "registry.local/team/train"),
    ("image", "registry.local/Team/Train:1"),
    ("image", "https://registry.local/team/train:1"),
    ("image", "registry.local/team/train:1 --privileged"),
    ("image", "registry.local/team/train@sha256:short"),
    ("image", ""),
    ("image", 5),
    ("memory_mib", 0),
    ("memory_mib", -1024),
    ("memory_mib", 600 * 1024),  # the largest node has 512 GiB
    ("memory_mib", "16G"),
    ("cpus", 0),
    ("cpus", -2),
    ("cpus", "4"),
    ("cpus", 65),  # the largest node has 64
    ("priority", "urgent"),
    ("priority", None),
    ("max_runtime_s", 0),
    ("max_runtime_s", 10**9),
    ("max_runtime_s", 3600.5),
    ("estimated_duration_s", 0),
    ("estimated_duration_s", 200_000),  # longer than max_runtime_s
    ("preemptible", "yes"),
    ("restartable", 1),
    ("name", 5),
    ("name", "x" * 201),
]


@pytest.mark.parametrize(("field", "value"), BAD_FIELDS, ids=lambda v: repr(v)[:40])
def test_a_bad_field_is_refused_naming_it_and_nothing_is_written(world, field, value):
    response = submit(world, **{field: value})
    assert_refused(response, field)


def test_a_required_field_left_out_is_named(world):
    world.ensure("node")
    body = job_body()
    del body["image"], body["command"]
    response = world.client("member").post("/api/v1/jobs/", body, format="json")
    assert_refused(response, "image")
    assert "command" in response.json()


def test_an_unknown_field_is_named_rather_than_ignored(world):
    response = submit(world, gpu=2)
    assert_refused(response, "gpu")


def test_every_field_at_fault_is_named_at_once(world):
    response = submit(
        world, gpus=-1, image="nope", env={"A": 1}, priority="urgent", memory_mib=600 * 1024
    )
    assert_refused(response, "gpus")
    assert {"gpus", "image", "env", "priority", "memory_mib"} <= set(response.json())


def test_gpus_above_the_tenants_quota_for_the_type_are_refused(world):
    Quota.objects.filter(tenant=world.vision, gpu_type="H100-SXM-80GB").update(
        guaranteed_gpus=1, limit_gpus=1
    )
    response = submit(world, gpus=2)
    assert_refused(response, "gpus")
    assert "quota" in response.json()["gpus"][0]


def test_gpus_above_the_tenants_any_type_quota_are_refused(world):
    world.ensure("users")
    Quota.objects.create(tenant=world.vision, gpu_type="", guaranteed_gpus=0, limit_gpus=1)
    response = submit(world, gpus=2, gpu_type="")
    assert_refused(response, "gpus")


def test_a_tenant_without_a_quota_for_a_type_gets_no_gpus_of_it(world):
    world.ensure("users")
    world.fixture("make_node")("a100-node", gpus=4, model="A100-SXM4-80GB")
    response = submit(world, gpus=1, gpu_type="A100-SXM4-80GB")
    assert_refused(response, "gpus")


def test_an_any_type_job_is_refused_when_no_type_fits_both_quota_and_node(world):
    # vision may use 16 H100 (the node has 2) and no A100 (a node has 4).
    world.ensure("users")
    world.fixture("make_node")("a100-node", gpus=4, model="A100-SXM4-80GB")
    response = submit(world, gpus=3, gpu_type="")
    assert_refused(response, "gpus")


def test_a_cpu_only_job_needs_no_gpu_quota(world):
    response = submit(world, gpus=0, gpu_type="")
    assert response.status_code == 201, response.content


def test_any_type_job_fits_when_one_type_satisfies_both_quota_and_node(world):
    response = submit(world, gpus=2, gpu_type="")
    assert response.status_code == 201, response.content


@pytest.mark.parametrize(
    "image",
    [
        "registry.local/team/train:1",
        "localhost/busybox:latest",
        "docker.io/library/python:3.12",
        "registry.local:5000/team/train:v1.2-rc_3",
        f"docker.io/library/python@{DIGEST}",
        f"docker.io/library/python:3.12@{DIGEST}",
        "ghcr.io/org/sub/deep/image:2024.12.01",
    ],
)
def test_full_image_references_are_accepted(world, image):
    response = submit(world, image=image)
    assert response.status_code == 201, response.content
    assert Job.objects.get().image == image


def test_an_accepted_job_is_pending_with_its_fields_and_one_event(world):
    response = submit(
        world,
        env={"EPOCHS": "3"},
        cpus=4,
        memory_mib=16384,
        priority="high",
        estimated_duration_s=600,
        max_runtime_s=3600,
    )
    assert response.status_code == 201, response.content
    job = Job.objects.get()
    body = response.json()
    assert body["id"] == job.pk and body["state"] == JobState.PENDING
    assert body["tenant"] == "vision" and body["submitted_by"] == "alice"
    assert (job.cpus, job.memory_mib, job.priority, job.env) == (
        4.0,
        16384,
        "high",
        {"EPOCHS": "3"},
    )
    assert [e["kind"] for e in body["events"]] == ["submitted"]


def test_a_job_without_a_name_is_named_after_its_image(world):
    response = submit(world, name="")
    assert response.status_code == 201, response.content
    assert response.json()["name"] == "train"


def test_submitting_into_a_tenant_you_do_not_belong_to_is_not_found(world):
    world.ensure("nlp")
    response = submit(world, tenant="nlp")
    assert_refused(response, None, status=404)


def test_a_foreign_tenant_and_a_missing_one_answer_alike(world):
    world.ensure("nlp")
    foreign = submit(world, tenant="nlp")
    missing = submit(world, tenant="no-such-lab")
    assert foreign.status_code == missing.status_code == 404
    assert_refused(missing, None, status=404)


def test_a_viewer_cannot_submit(world):
    response = submit(world, role="viewer")
    assert_refused(response, None, status=403)


def test_a_member_of_one_tenant_may_leave_the_tenant_out(world):
    body = job_body()
    del body["tenant"]
    world.ensure("node")
    response = world.client("member").post("/api/v1/jobs/", body, format="json")
    assert response.status_code == 201, response.content
    assert response.json()["tenant"] == "vision"


def test_a_member_of_several_tenants_must_say_which(world):
    world.ensure("users")
    Membership.objects.create(user=world.alice, tenant=world.nlp, role="member")
    body = job_body()
    del body["tenant"]
    world.ensure("node")
    response = world.client("member").post("/api/v1/jobs/", body, format="json")
    assert_refused(response, "tenant")


def test_an_inactive_tenant_takes_no_new_jobs(world):
    world.ensure("users")
    world.vision.active = False
    world.vision.save(update_fields=["active"])
    response = submit(world)
    assert_refused(response, None, status=403)


@pytest.mark.parametrize("body", ["train", 3, True], ids=repr)
def test_a_body_that_is_not_an_object_is_a_clear_400(world, body):
    world.ensure("users")
    response = world.client("member").post("/api/v1/jobs/", body, format="json")
    assert_refused(response, "non_field_errors")


def test_a_list_of_things_that_are_not_objects_names_each_item(world):
    # A list is a batch of jobs (test_batch_submit.py): each item must be a job's object.
    world.ensure("users")
    response = world.client("member").post("/api/v1/jobs/", [1, 2], format="json")
    assert_refused(response, "0")
    assert set(response.json()) == {"0", "1"}
    assert "non_field_errors" in response.json()["1"]


def test_the_web_form_and_the_api_refuse_the_same_input_with_the_same_messages(world):
    bad = job_body(gpus=-1, image="train:1", command=["python", 3], env={"A-B": "1"})
    api_errors = submit(world, **bad).json()
    with pytest.raises(ValidationError) as refused:
        validate_submission(world.alice, bad)
    assert refused.value.message_dict == api_errors
