"""A submit's mounts, stop signal, grace and checkpoint interval: every bad input is a 400
naming the field (the item's, for a mount), nothing is written, and what is accepted is what
the job, its API answer and its node's answer then say."""

import json

import pytest

from controlplane.jobs.models import Job
from tests.controlplane.api.helpers import job_body

URL = "/api/v1/jobs/"


def post(client, **overrides):
    # Escaped as JSON escapes them, so that a lone surrogate reaches the server as "\ud800".
    body = json.dumps(job_body(**overrides))
    return client.post(URL, body, content_type="application/json")


def refused(response, field):
    """The 400 names the field; text that cannot be stored (NUL, a lone surrogate) is refused
    by the API's parser before validation, under the top-level field, naming the item."""
    assert response.status_code == 400, response.content
    errors = response.json()
    assert not Job.objects.exists()
    if field in errors:
        return errors[field]
    top = field.split("[")[0].split(".")[0]
    assert top in errors and any(field in message for message in errors[top]), errors
    return errors[top]


def mount(volume="datasets", path="/data", **more):
    return {"volume": volume, "path": path, **more}


BAD = [
    ("mounts", "datasets:/data"),
    ("mounts", {"volume": "datasets", "path": "/data"}),
    ("mounts", [mount()] * 33),
    ("mounts[0]", ["datasets", "/data"]),
    ("mounts[0].volume", [mount(volume=None)]),
    ("mounts[0].volume", [mount(volume=7)]),
    ("mounts[0].volume", [mount(volume="")]),
    ("mounts[0].volume", [mount(volume="no-such-volume")]),
    ("mounts[0].volume", [mount(volume="data\x00sets")]),
    ("mounts[0].volume", [mount(volume="data\ud800")]),
    ("mounts[0].volume", [mount(volume="ckpt")]),
    ("mounts[0].path", [mount(path="data")]),
    ("mounts[0].path", [mount(path="")]),
    ("mounts[0].path", [mount(path=None)]),
    ("mounts[0].path", [mount(path=5)]),
    ("mounts[0].path", [mount(path="/data/../etc")]),
    ("mounts[0].path", [mount(path="/")]),
    ("mounts[0].path", [mount(path="//")]),
    ("mounts[0].path", [mount(path="/proc")]),
    ("mounts[0].path", [mount(path="/etc/ssl")]),
    ("mounts[0].path", [mount(path="/usr/")]),
    ("mounts[0].path", [mount(path="/lib64")]),
    ("mounts[0].path", [mount(path="/var/run/docker.sock")]),
    ("mounts[0].path", [mount(path="/var")]),  # would cover /var/run
    ("mounts[0].path", [mount(path="/gpucp")]),
    ("mounts[0].path", [mount(path="/gpucp/checkpoint")]),
    ("mounts[0].path", [mount(path="/data:ro")]),
    ("mounts[0].path", [mount(path="/da,ta")]),
    ("mounts[0].path", [mount(path="/da\x00ta")]),
    ("mounts[0].path", [mount(path="/data\udfff")]),
    ("mounts[0].path", [mount(path="/" + "d" * 2000)]),
    ("mounts[0].read_only", [mount(read_only="yes")]),
    ("mounts[0].read_only", [mount(volume="models", read_only=False)]),
    ("mounts[0].colour", [mount(colour="blue")]),
    ("mounts[1].path", [mount(), mount(volume="models", path="/data")]),
    ("mounts[1].path", [mount(), mount(volume="models", path="/data/models")]),
    ("mounts[1].path", [mount(path="/data/sets"), mount(volume="models", path="/data")]),
    ("mounts[1].path", [mount(path="/data/"), mount(volume="models", path="//data")]),
    ("stop_signal", "SIGKILL"),
    ("stop_signal", "sigterm"),
    ("stop_signal", 15),
    ("stop_signal", None),
    ("preemption_grace_s", -1),
    ("preemption_grace_s", 61),
    ("preemption_grace_s", 10**30),
    ("preemption_grace_s", 1.5),
    ("preemption_grace_s", "30"),
    ("preemption_grace_s", True),
    ("checkpoint_interval_s", 0),
    ("checkpoint_interval_s", 30 * 86400 + 1),
    ("checkpoint_interval_s", "600"),
    ("checkpoint_interval_s", float("nan")),
]


@pytest.mark.parametrize(("field", "value"), BAD, ids=[f"{f}={v!r}"[:60] for f, v in BAD])
def test_a_bad_value_is_refused_naming_the_field(member, volumes, field, value):
    name = field.split("[")[0].split(".")[0]
    if isinstance(value, float) and value != value:
        # JSON has no NaN; a client that sends one anyway sends the token.
        raw = json.dumps(job_body())[:-1] + ', "checkpoint_interval_s": NaN}'
        response = member.post(URL, raw, content_type="application/json")
        assert response.status_code == 400, response.content
        assert not Job.objects.exists()
        return
    refused(post(member, **{name: value}), field)


def test_another_tenants_volume_is_refused_as_if_it_did_not_exist(member, volumes):
    theirs = refused(post(member, mounts=[mount(volume="nlp-private")]), "mounts[0].volume")
    unknown = refused(post(member, mounts=[mount(volume="no-such")]), "mounts[0].volume")
    assert theirs == [m.replace("no-such", "nlp-private") for m in unknown]


def test_a_volume_given_to_the_tenant_is_accepted(member, volumes):
    response = post(member, mounts=[mount(volume="vision-only", path="/scratch")])
    assert response.status_code == 201, response.content


def test_accepted_mounts_are_stored_normalised_and_a_read_only_volume_stays_read_only(
    member, volumes
):
    response = post(
        member,
        mounts=[mount(path="/data//sets/./"), mount(volume="models", path="/models")],
        stop_signal="SIGUSR1",
        preemption_grace_s=45,
        checkpoint_interval_s=600,
    )
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["mounts"] == [
        {"volume": "datasets", "path": "/data/sets", "read_only": False},
        {"volume": "models", "path": "/models", "read_only": True},
    ]
    assert (body["stop_signal"], body["preemption_grace_s"], body["checkpoint_interval_s"]) == (
        "SIGUSR1",
        45,
        600,
    )
    assert body["checkpoint_dir"] == "/gpucp/checkpoint"
    assert body["checkpoint_bytes"] == 0
    job = Job.objects.get()
    assert job.checkpoint_volume == volumes["ckpt"]
    assert member.get(f"{URL}{job.pk}/").json() == body


def test_left_out_the_job_gets_the_clusters_notice_and_no_checkpoint_dir_without_a_volume(
    member, settings
):
    settings.PREEMPTION_GRACE_DEFAULT_S = 12.0
    response = post(member)
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["stop_signal"], body["preemption_grace_s"]) == ("SIGTERM", 12)
    assert body["mounts"] == []
    assert body["checkpoint_dir"] is None
    assert Job.objects.get().checkpoint_volume is None


def test_the_grace_limit_is_the_settings_maximum(member, settings):
    settings.PREEMPTION_GRACE_MAX_S = 20.0
    refused(post(member, preemption_grace_s=21), "preemption_grace_s")
    assert post(member, preemption_grace_s=20).status_code == 201


def test_a_batch_refuses_the_item_naming_its_mount(member, volumes):
    response = member.post(
        URL, [job_body(), job_body(mounts=[mount(volume="nlp-private")])], format="json"
    )
    assert response.status_code == 400, response.content
    assert set(response.json()) == {"1"}
    assert set(response.json()["1"]) == {"mounts[0].volume"}
    assert not Job.objects.exists()


def test_a_volume_made_since_the_catalog_was_read_is_found_before_refusing(member, volumes):
    from controlplane.jobs import validation
    from controlplane.storage.models import Volume

    assert post(member).status_code == 201
    stale = validation._recent_volumes
    Volume.objects.create(name="fresh", source="/mnt/fresh", all_tenants=True)
    validation._recent_volumes = stale  # as another web process, which saw no signal
    assert post(member, mounts=[mount(volume="fresh")]).status_code == 201
