"""The job contract with real processes: volumes, a checkpoint directory that survives a
preemption, the notice before a stop, and victims chosen by the work they would lose.

The container tests run the docker runtime against Podman; the others use the process runtime,
whose stop signal and grace are the same code path in the agent.
"""

from __future__ import annotations

import re
import time

import pytest
import requests

from .conftest import IMAGE, job_processes, wait_until

H100 = "H100-SXM-80GB"


class Person:
    """Someone with an API token, talking to the REST API as a client would."""

    def __init__(self, api: str, token: str):
        self.api = api
        self.headers = {"Authorization": f"Bearer {token}"}

    def post(self, path: str, body) -> requests.Response:
        return requests.post(f"{self.api}{path}", json=body, headers=self.headers, timeout=30)

    def get(self, path: str, **params) -> requests.Response:
        return requests.get(f"{self.api}{path}", params=params, headers=self.headers, timeout=30)

    def submit(self, command: list[str], **fields) -> int:
        body = {"image": IMAGE, "command": command, "gpus": 1, **fields}
        response = self.post("/jobs/", body)
        assert response.status_code == 201, response.text
        return response.json()["id"]


@pytest.fixture
def admin(cluster, django_user_model) -> Person:
    from controlplane.tenancy.models import ApiToken

    root = django_user_model.objects.create_user("root", password="pw-for-tests-1", is_staff=True)
    root.is_superuser = True
    root.save()
    _, token = ApiToken.issue(root, "e2e-admin")
    return Person(cluster.api, token)


@pytest.fixture
def speech(cluster, django_user_model) -> Person:
    """A second tenant, guaranteed one GPU: what it asks for within that is never borrowed."""
    from controlplane.tenancy.models import ApiToken, Membership, Quota, Tenant

    tenant = Tenant.objects.create(slug="speech", name="Speech lab")
    Quota.objects.create(tenant=tenant, gpu_type=H100, guaranteed_gpus=1, limit_gpus=1)
    bob = django_user_model.objects.create_user("bob", password="pw-for-tests-1")
    Membership.objects.create(user=bob, tenant=tenant, role="member")
    _, token = ApiToken.issue(bob, "e2e")
    return Person(cluster.api, token)


@pytest.fixture
def vision(cluster) -> Person:
    return Person(cluster.api, cluster.user_token)


def make_volume(admin: Person, **fields) -> dict:
    response = admin.post("/volumes/", fields)
    assert response.status_code == 201, response.text
    return response.json()


def docker_agent(cluster, name: str, engine_url: str):
    return cluster.start_agent(name, runtime="docker", extra_env={"GPUCP_DOCKER_URL": engine_url})


def remove_containers(engine, cluster) -> None:
    from agents.runtime.base import NODE_LABEL

    for agent in cluster.agents:
        for c in engine.containers.list(all=True, filters={"label": f"{NODE_LABEL}={agent.name}"}):
            c.remove(force=True)


def event_messages(job: dict) -> list[str]:
    return [e["message"] for e in job["events"]]


def attempt_log(cluster, job_id: int, number: int) -> str:
    return cluster.logs(job_id, attempt=number)["text"]


# A training loop in busybox sh: one step every 0.2 s, a checkpoint every 5 steps, and on the
# stop signal a last checkpoint before it leaves. It says where it resumed from.
TRAIN = r"""
d="$GPUCP_CHECKPOINT_DIR"; step=0
if [ -f "$d/step" ]; then step=$(cat "$d/step"); echo "resumed from step $step"; fi
trap 'echo $step > "$d/step"; touch "$d/.checkpoint"; echo "saved step $step on notice"; exit 0' TERM
while true; do
  step=$((step + 1))
  if [ $((step % 5)) -eq 0 ]; then echo $step > "$d/step"; touch "$d/.checkpoint"; fi
  sleep 0.2
done
"""


@pytest.mark.slow
@pytest.mark.container
def test_a_preempted_job_saves_on_notice_and_resumes_from_its_checkpoint_on_another_node(
    cluster,
    admin,
    vision,
    speech,
    engine,
    engine_url,
    tmp_path,
):
    from controlplane.tenancy.models import Quota

    # vision has no guarantee on H100s: all it runs there is borrowed, and may be taken back.
    Quota.objects.filter(tenant__slug="vision").update(guaranteed_gpus=0, limit_gpus=4)
    store = tmp_path / "ckpt"
    store.mkdir()
    make_volume(admin, name="ckpt", kind="host_path", source=str(store), checkpoints=True)
    try:
        docker_agent(cluster, "e2e-ck-1", engine_url)
        docker_agent(cluster, "e2e-ck-2", engine_url)

        trainer = vision.submit(
            ["sh", "-c", TRAIN], name="trainer", preemption_grace_s=8, restartable=True
        )
        wait_until(
            lambda: (lambda j: j["attempts"] and j["attempts"][0]["last_checkpoint_at"])(
                cluster.job(trainer)
            ),
            120,
            "the trainer's first checkpoint to be reported",
        )
        # Younger than the trainer, and it never checkpoints: preempting it would lose all it
        # did, so the trainer (whose last checkpoint is seconds old) is the one to go.
        sleeper = vision.submit(["sleep", "600"], name="sleeper", restartable=True)
        cluster.wait_for_state(sleeper, "RUNNING", timeout_s=120)
        time.sleep(4)  # both past the minimum runtime (3 s here)

        owner = speech.submit(["sh", "-c", "echo mine; sleep 600"], name="owner")
        job = cluster.wait_for_job(
            trainer,
            lambda j: len(j["attempts"]) >= 1 and j["attempts"][0]["state"] == "STOPPED",
            "the trainer to be preempted and leave",
            timeout_s=120,
        )
        assert cluster.job(sleeper)["state"] == "RUNNING"  # the one with more to lose stays
        first = job["attempts"][0]
        assert first["killed_after_grace"] is False and first["stop_signal_at"]
        saved = re.search(r"saved step (\d+) on notice", attempt_log(cluster, trainer, 1))
        assert saved, attempt_log(cluster, trainer, 1)
        assert any(re.search(r"left [\d.]+ s after SIGTERM", m) for m in event_messages(job)), (
            event_messages(job)
        )
        wait_until(
            lambda: speech.get(f"/jobs/{owner}/").json()["state"] == "RUNNING",
            120,
            "the owner's job to run on the GPU it took back",
        )

        # The trainer waits (both nodes are taken) until a third node joins, then resumes there.
        assert cluster.job(trainer)["state"] in ("PENDING", "PREEMPTED")
        docker_agent(cluster, "e2e-ck-3", engine_url)
        job = cluster.wait_for_job(
            trainer,
            lambda j: len(j["attempts"]) == 2 and j["attempts"][1]["state"] == "RUNNING",
            "the trainer to run again",
            timeout_s=120,
        )
        assert job["attempts"][1]["node"] == "e2e-ck-3"
        resumed = wait_until(
            lambda: re.search(r"resumed from step (\d+)", attempt_log(cluster, trainer, 2)),
            60,
            "the second attempt to say where it resumed",
        )
        assert int(resumed.group(1)) == int(saved.group(1)) > 0
        for job_id in (trainer, sleeper):
            cluster.cancel(job_id)
        speech.post(f"/jobs/{owner}/cancel/", {})
    finally:
        remove_containers(engine, cluster)


@pytest.mark.slow
@pytest.mark.container
def test_mounts_are_read_only_where_asked_and_tenants_see_only_their_own_directory(
    cluster,
    admin,
    vision,
    speech,
    engine,
    engine_url,
    tmp_path,
):
    data = tmp_path / "datasets"
    data.mkdir()
    (data / "train.txt").write_text("the data\n")
    shared = tmp_path / "shared"
    for tenant, secret in (("vision", "vision's notes"), ("speech", "speech's notes")):
        (shared / "tenants" / tenant).mkdir(parents=True)
        (shared / "tenants" / tenant / "notes.txt").write_text(secret + "\n")
    make_volume(admin, name="datasets", source=str(data), all_tenants=True, read_only=True)
    make_volume(admin, name="shared", source=str(shared), all_tenants=True, per_tenant_subdir=True)
    make_volume(admin, name="speech-only", source=str(shared), tenants=["speech"])
    try:
        docker_agent(cluster, "e2e-mounts", engine_url)
        job_id = vision.submit(
            [
                "sh",
                "-c",
                "cat /data/train.txt; echo x > /data/new.txt && echo wrote-data || echo refused;"
                ' ls -a /shared; cat /shared/notes.txt; echo "mount=$GPUCP_MOUNT_SHARED";'
                " echo more >> /shared/notes.txt && echo wrote-shared",
            ],
            mounts=[
                {"volume": "datasets", "path": "/data", "read_only": True},
                {"volume": "shared", "path": "/shared"},
            ],
        )
        job = cluster.wait_for_state(job_id, "SUCCEEDED", "FAILED", timeout_s=180)
        text = wait_until(
            lambda: (lambda t: t if "wrote-shared" in t else None)(cluster.logs(job_id)["text"]),
            60,
            "the job's output",
        )
        assert job["state"] == "SUCCEEDED", text
        assert "the data" in text and "refused" in text and "wrote-data" not in text
        assert not (data / "new.txt").exists()
        assert "vision's notes" in text and "speech's notes" not in text
        assert "mount=/shared" in text
        assert (shared / "tenants" / "vision" / "notes.txt").read_text().endswith("more\n")
        assert (shared / "tenants" / "speech" / "notes.txt").read_text() == "speech's notes\n"

        # Another tenant's volume cannot be asked for, nor a read-only one written.
        refused = vision.post(
            "/jobs/",
            {
                "image": IMAGE,
                "command": ["true"],
                "mounts": [{"volume": "speech-only", "path": "/s"}],
            },
        )
        assert refused.status_code == 400 and "mounts[0].volume" in refused.json(), refused.text
        refused = vision.post(
            "/jobs/",
            {
                "image": IMAGE,
                "command": ["true"],
                "mounts": [{"volume": "datasets", "path": "/data", "read_only": False}],
            },
        )
        assert refused.status_code == 400 and "mounts[0].read_only" in refused.json(), refused.text
    finally:
        remove_containers(engine, cluster)


@pytest.mark.slow
def test_a_job_asking_for_a_volume_no_node_has_waits_and_says_so(cluster, admin, vision):
    make_volume(admin, name="lustre", source="/nonexistent/lustre", all_tenants=True)
    cluster.start_agent("e2e-novol")
    job_id = vision.submit(["true"], mounts=[{"volume": "lustre", "path": "/lustre"}])
    job = cluster.wait_for_job(
        job_id, lambda j: j["pending_reason"], "a pending reason", timeout_s=60
    )
    assert job["state"] == "PENDING"
    assert "waiting for a node with volume lustre" in job["pending_reason"]
    cluster.cancel(job_id)


@pytest.mark.slow
def test_a_job_that_ignores_its_signal_is_killed_at_the_end_of_its_grace_and_not_before(
    cluster, vision, tmp_path
):
    cluster.start_agent("e2e-grace")
    stubborn = vision.submit(
        ["sh", "-c", "trap 'echo got TERM' TERM; while true; do sleep 0.1; done"],
        preemption_grace_s=6,
    )
    job = cluster.wait_for_state(stubborn, "RUNNING", timeout_s=60)
    attempt = job["attempts"][0]["id"]
    wait_until(lambda: job_processes(attempt), 30, "the job's processes")
    # Waits for the only GPU, which the stubborn job holds until it is gone.
    follower = vision.submit(["true"])

    cluster.cancel(stubborn)
    cancelled_at = time.monotonic()
    wait_until(
        lambda: "got TERM" in cluster.logs(stubborn)["text"], 30, "the job to get its signal"
    )
    while time.monotonic() - cancelled_at < 4:
        # Inside the grace: still alive, and its GPU not given to the follower.
        assert job_processes(attempt), "killed before the end of its grace"
        assert cluster.job(follower)["state"] == "PENDING"
        time.sleep(0.5)
    job = cluster.wait_for_state(stubborn, "CANCELLED", timeout_s=60)
    wait_until(lambda: not job_processes(attempt), 30, "the job's processes to be gone")
    assert time.monotonic() - cancelled_at >= 5.5
    ended = cluster.wait_for_job(
        stubborn,
        lambda j: j["attempts"][0]["killed_after_grace"] is not None,
        "how the stop went to be reported",
    )
    assert ended["attempts"][0]["killed_after_grace"] is True
    assert any("killed" in m and "6 s grace" in m for m in event_messages(ended)), event_messages(
        ended
    )
    assert cluster.wait_for_state(follower, "SUCCEEDED", timeout_s=60)["state"] == "SUCCEEDED"


@pytest.mark.slow
def test_a_job_asking_for_sigusr1_gets_it_and_knows_its_notice(cluster, vision):
    cluster.start_agent("e2e-usr1")
    job_id = vision.submit(
        [
            "sh",
            "-c",
            'echo "notice=$GPUCP_STOP_SIGNAL/$GPUCP_GRACE_S"; '
            "trap 'echo got USR1; exit 0' USR1; while true; do sleep 0.1; done",
        ],
        stop_signal="SIGUSR1",
        preemption_grace_s=5,
    )
    cluster.wait_for_state(job_id, "RUNNING", timeout_s=60)
    wait_until(lambda: "notice=" in cluster.logs(job_id)["text"], 30, "the job's first line")
    cluster.cancel(job_id)
    cluster.wait_for_state(job_id, "CANCELLED", timeout_s=60)
    text = wait_until(
        lambda: (lambda t: t if "got USR1" in t else None)(cluster.logs(job_id)["text"]),
        30,
        "the job's answer to its signal",
    )
    assert "notice=SIGUSR1/5" in text
    ended = cluster.wait_for_job(
        job_id,
        lambda j: j["attempts"][0]["killed_after_grace"] is not None,
        "how the stop went to be reported",
    )
    assert ended["attempts"][0]["killed_after_grace"] is False
