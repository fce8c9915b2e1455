"""The submit form: the API's rules, each error shown at the field at fault, nothing half-made."""

import re
from html import unescape as html_unescape

import pytest
from django.urls import reverse

pytestmark = pytest.mark.django_db

VALID = {
    "tenant": "vision",
    "name": "resnet",
    "image": "registry.local/team/train:1",
    "command": "python train.py --epochs 3",
    "env": "EPOCHS=3\nLR=0.1",
    "gpus": "2",
    "gpu_type": "H100-SXM-80GB",
    "cpus": "4",
    "memory_mib": "16384",
    "priority": "high",
    "preemptible": "on",
    "max_runtime_s": "7200",
    "estimated_duration_s": "600",
}


@pytest.fixture
def submit(client, alice, node):
    client.force_login(alice)

    def post(**changes):
        data = {**VALID, **changes}
        data = {k: v for k, v in data.items() if v is not None}
        return client.post(reverse("job-submit"), data)

    return post


def error_at(response, field: str) -> str:
    """The error text rendered next to the field (inside its own .field block), or ""."""
    html = response.content.decode()
    match = re.search(rf'<ul class="errorlist" id="id_{field}_errors">(.*?)</ul>', html, re.S)
    return html_unescape(re.sub(r"<[^>]+>", " ", match.group(1))) if match else ""


BAD_INPUT = [
    ("image", {"image": "train:1"}, "not an image reference"),
    ("image", {"image": "registry.local/team/train"}, "no tag or digest"),
    ("image", {"image": ""}, "Give a full image reference"),
    ("command", {"command": ""}, "Must not be empty"),
    ("command", {"command": "python 'train.py"}, "close every quote"),
    ("command", {"command": '["python", 3]'}, "not a string"),
    ("env", {"env": "EPOCHS"}, 'has no "="'),
    ("env", {"env": "1BAD=x"}, "not a variable name"),
    ("env", {"env": "CUDA_VISIBLE_DEVICES=0"}, "set by the control plane"),
    ("gpus", {"gpus": "-1"}, "0 or more"),
    ("gpus", {"gpus": "1.5"}, "whole number"),
    ("gpus", {"gpus": "17"}, "at most 16 GPUs"),
    ("gpus", {"gpus": "8"}, "8 cannot be given"),
    ("gpu_type", {"gpu_type": "TPU-v5"}, "No GPU of type"),
    ("cpus", {"cpus": "0"}, "more than 0"),
    ("cpus", {"cpus": "500"}, "No node has 500 CPUs"),
    ("memory_mib", {"memory_mib": "999999999"}, "No node has 999999999 MiB"),
    ("memory_mib", {"memory_mib": "lots"}, "whole number of MiB"),
    ("priority", {"priority": "urgent"}, "not a priority class"),
    ("max_runtime_s", {"max_runtime_s": "99999999"}, "between 1 and"),
    ("estimated_duration_s", {"estimated_duration_s": "9000"}, "Longer than max_runtime_s"),
    ("name", {"name": "x" * 201}, "At most 200 characters"),
    ("tenant", {"tenant": "nlp"}, "Choose one of your tenants"),
]


@pytest.mark.parametrize(
    "field,changes,message", BAD_INPUT, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD_INPUT)]
)
def test_each_bad_input_is_named_at_its_field_and_nothing_is_created(
    submit, nlp, field, changes, message
):
    from controlplane.jobs.models import Job, JobEvent

    response = submit(**changes)
    assert response.status_code == 400
    assert message in error_at(response, field), response.context["form"].errors
    # Only the field at fault carries an error.
    assert set(response.context["form"].errors) == {field}
    assert Job.objects.count() == 0
    assert JobEvent.objects.count() == 0


def test_the_form_says_what_the_api_says_for_the_same_input(submit, client, alice):
    """One rule, two doors: the API's 400 and the form's message are the same words."""
    response = submit(gpus="17")
    form_message = error_at(response, "gpus").strip()
    api = client.post(
        "/api/v1/jobs/",
        {
            "tenant": "vision",
            "image": "registry.local/team/train:1",
            "command": ["x"],
            "gpus": 17,
            "gpu_type": "H100-SXM-80GB",
        },
        content_type="application/json",
    )
    assert api.status_code == 400
    assert api.json()["gpus"] == [form_message]


def test_a_valid_submit_creates_a_pending_job_with_every_field(submit, alice, vision):
    from controlplane.jobs.models import Job

    response = submit()
    job = Job.objects.get()
    assert response.status_code == 302
    assert response["Location"] == reverse("job-detail", args=[job.pk])
    assert job.state == "PENDING"
    assert job.tenant == vision and job.submitted_by == alice
    assert job.command == ["python", "train.py", "--epochs", "3"]
    assert job.env == {"EPOCHS": "3", "LR": "0.1"}
    assert (job.gpus, job.gpu_type, job.cpus, job.memory_mib) == (2, "H100-SXM-80GB", 4.0, 16384)
    assert (job.priority, job.preemptible, job.restartable) == ("high", True, False)
    assert (job.max_runtime_s, job.estimated_duration_s) == (7200, 600)
    assert job.events.get().kind == "submitted"


def test_the_submitted_message_does_not_contradict_the_status_below_it(submit, client, alice):
    """The message is shown on the job's page however late it is opened, and stays there
    while the status changes: it must not say a state."""
    from controlplane.jobs import actions
    from controlplane.jobs.models import Job

    response = submit()
    job = Job.objects.get()
    actions.cancel_job(job, actor=alice)
    page = client.get(response["Location"]).content.decode()
    message = page.split('<ul class="messages"', 1)[1].split("</ul>", 1)[0]
    assert f"(#{job.pk}) submitted." in message and "PENDING" not in message
    assert "CANCELLED" in page


def test_an_empty_name_is_taken_from_the_image(submit):
    from controlplane.jobs.models import Job

    submit(name="")
    assert Job.objects.get().name == "train"


def test_the_form_opens_with_sensible_defaults_and_the_tenants_limits(client, alice, node):
    client.force_login(alice)
    response = client.get(reverse("job-submit"))
    assert response.status_code == 200
    html = response.content.decode()
    assert 'name="gpus" value="1"' in html
    assert 'name="memory_mib" value="4096"' in html
    assert 'name="max_runtime_s" value="86400"' in html
    assert " checked" in re.search(r'<input[^>]*name="preemptible"[^>]*>', html).group(0)
    assert " checked" in re.search(r'<input[^>]*name="restartable"[^>]*>', html).group(0)
    assert "Quota of vision: H100-SXM-80GB: limit 16 (guaranteed 8, 0 in use now)." in html
    assert "Largest node per type: 4 × H100-SXM-80GB." in html
    assert "The largest node has 64 CPUs." in html


def test_the_limits_are_tied_to_their_inputs_for_screen_readers(client, alice, node):
    client.force_login(alice)
    html = client.get(reverse("job-submit")).content.decode()
    gpus_input = re.search(r'<input[^>]*name="gpus"[^>]*>', html).group(0)
    assert 'aria-describedby="id_gpus_limit' in gpus_input
    assert 'id="id_gpus_limit"' in html
    for field in ("tenant", "name", "image", "command", "env", "gpus", "gpu_type", "cpus"):
        assert f'for="id_{field}"' in html, field


def test_the_curl_view_is_the_same_request_with_a_bearer_token(client, alice, node):
    client.force_login(alice)
    response = client.post(reverse("job-submit-preview"), VALID)
    text = response.content.decode()
    assert "POST http://testserver/api/v1/jobs/" in text
    assert "Authorization: Bearer $GPUCP_TOKEN" in text
    assert "&quot;command&quot;: [&quot;python&quot;, &quot;train.py&quot;" in text
    assert "&quot;tenant&quot;: &quot;vision&quot;" in text


def test_the_curl_view_submits_the_job_it_shows(client, alice, node):
    """What the curl block says, sent to the API with a token, is accepted as it stands."""
    import json
    import shlex
    from html import unescape

    from controlplane.jobs.models import Job
    from controlplane.tenancy.models import ApiToken

    client.force_login(alice)
    html = client.post(reverse("job-submit-preview"), VALID).content.decode()
    curl = re.search(r'<pre class="code" id="curl-text">(.*?)</pre>', html, re.S).group(1)
    words = shlex.split(unescape(curl).replace("\\\n", " "))
    body = json.loads(words[words.index("-d") + 1])
    _, raw = ApiToken.issue(alice, "cli")
    client.logout()
    response = client.post(
        "/api/v1/jobs/", body, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {raw}"
    )
    assert response.status_code == 201, response.content
    assert Job.objects.get().command == ["python", "train.py", "--epochs", "3"]


def test_show_as_curl_without_javascript_creates_nothing(submit):
    from controlplane.jobs.models import Job

    response = submit(_action="preview")
    assert response.status_code == 200
    assert "curl -sS -X POST" in response.content.decode()
    assert Job.objects.count() == 0


def test_submit_a_copy_prefills_the_form_from_a_visible_job(client, alice, running_job):
    client.force_login(alice)
    html = client.get(reverse("job-submit") + f"?copy={running_job.pk}").content.decode()
    assert 'value="resnet"' in html
    assert 'value="python train.py"' in html


def test_a_copy_of_another_tenants_job_prefills_nothing(client, bob, running_job, nlp):
    client.force_login(bob)
    html = client.get(reverse("job-submit") + f"?copy={running_job.pk}").content.decode()
    assert "resnet" not in html


def test_choosing_another_tenant_shows_that_tenants_limits_and_keeps_the_input(
    client, alice, nlp, node
):
    from controlplane.tenancy.models import Membership, Quota

    Membership.objects.create(user=alice, tenant=nlp, role="member")
    Quota.objects.filter(tenant=nlp).update(guaranteed_gpus=1, limit_gpus=3)
    client.force_login(alice)
    response = client.get(
        reverse("job-submit"),
        {"fragment": "limits", "tenant": "nlp", "image": "registry.local/x/y:1", "gpus": "2"},
        HTTP_HX_REQUEST="true",
    )
    html = response.content.decode()
    assert html.lstrip().startswith('<form method="post" action="/jobs/new/" id="submit-form"')
    assert "Quota of nlp: H100-SXM-80GB: limit 3 (guaranteed 1, 0 in use now)." in html
    assert 'value="registry.local/x/y:1"' in html
    assert '<option value="nlp" selected>' in html
    # Unticked boxes are not sent by a browser: the round trip keeps them unticked.
    assert " checked" not in re.search(r'<input[^>]*name="preemptible"[^>]*>', html).group(0)


# --- the job contract: volumes, stop signal, grace, checkpoint interval ---------------------------


@pytest.fixture
def volumes(vision, nlp):
    from controlplane.storage.models import Volume

    Volume.objects.create(name="datasets", source="/mnt/datasets", all_tenants=True)
    Volume.objects.create(name="models", source="/mnt/models", all_tenants=True, read_only=True)
    Volume.objects.create(name="nlp-only", source="/mnt/nlp").tenants.add(nlp)
    Volume.objects.create(name="ckpt", source="/srv/ckpt", checkpoints=True)


def test_the_form_submits_volumes_and_how_the_job_is_stopped(submit, volumes):
    from controlplane.jobs.models import Job

    response = submit(
        mounts="datasets:/data\n\n# the weights\nmodels:/models:ro",
        stop_signal="SIGUSR1",
        preemption_grace_s="45",
        checkpoint_interval_s="900",
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    job = Job.objects.get()
    assert job.mounts == [
        {"volume": "datasets", "path": "/data", "read_only": False},
        {"volume": "models", "path": "/models", "read_only": True},
    ]
    assert (job.stop_signal, job.preemption_grace_s, job.checkpoint_interval_s) == (
        "SIGUSR1",
        45,
        900,
    )
    assert job.checkpoint_volume.name == "ckpt"


CONTRACT_BAD_INPUT = [
    ("mounts", {"mounts": "datasets"}, 'Line 1 ("datasets"): write volume:/path'),
    ("mounts", {"mounts": "datasets:/data:rx"}, "write volume:/path"),
    ("mounts", {"mounts": "datasets:/data\n\nnlp-only:/nlp"}, "Line 3: No volume named 'nlp-only'"),
    ("mounts", {"mounts": "datasets:/etc"}, "Line 1: /etc is or covers /etc"),
    ("mounts", {"mounts": "models:/models:rw"}, "Line 1: Volume models is read-only"),
    ("mounts", {"mounts": "datasets:/a\ndatasets:/a/b"}, "Line 2: /a/b is or lies over/under"),
    ("stop_signal", {"stop_signal": "SIGKILL"}, "Must be one of SIGTERM"),
    ("preemption_grace_s", {"preemption_grace_s": "600"}, "between 0 and 60"),
    ("preemption_grace_s", {"preemption_grace_s": "soon"}, "whole number of seconds"),
    ("checkpoint_interval_s", {"checkpoint_interval_s": "0"}, "between 1 and"),
]


@pytest.mark.parametrize(("field", "changes", "words"), CONTRACT_BAD_INPUT)
def test_a_bad_contract_field_is_shown_at_its_field(submit, volumes, field, changes, words):
    from controlplane.jobs.models import Job

    response = submit(**changes)
    assert response.status_code == 400
    assert words in error_at(response, field), error_at(response, field)
    assert not Job.objects.exists()


def test_a_copied_job_keeps_its_volumes_and_notice(client, alice, node, volumes, make_job, vision):
    job = make_job(
        vision,
        alice,
        mounts=[{"volume": "models", "path": "/models", "read_only": True}],
        stop_signal="SIGINT",
        preemption_grace_s=5,
    )
    client.force_login(alice)
    html = client.get(reverse("job-submit") + f"?copy={job.pk}").content.decode()
    assert "models:/models:ro" in html
    assert '<option value="SIGINT" selected>' in html


@pytest.mark.parametrize(
    "runtimes,says_any_name_works",
    [(["process", "process"], True), (["process", "docker"], False), (["docker"], False)],
)
def test_the_image_hint_says_whether_the_nodes_pull_images(
    client, alice, make_node, runtimes, says_any_name_works
):
    for i, runtime in enumerate(runtimes):
        make_node(f"node-{i}", gpus=1, runtime=runtime)
    client.force_login(alice)
    page = html_unescape(client.get(reverse("job-submit")).content.decode())
    assert ("any name works, e.g. localhost/busybox:latest" in page) is says_any_name_works
    assert ("e.g. registry.local/team/train:1" in page) is not says_any_name_works
