"""The docker runtime against a real engine (Podman's Docker API, from scripts/podman-setup.sh)."""

import uuid

import docker
import pytest
import requests

from agents.runtime.base import (
    ATTEMPT_LABEL,
    NODE_LABEL,
    AttemptSpec,
    AttemptState,
    CheckpointSpec,
    MountSpec,
    RendezvousSpec,
    StartError,
)
from agents.runtime.docker import API_VERSION, DockerRuntime, parse_engine_time
from tests.agents.conftest import wait_until

pytestmark = pytest.mark.container

IMAGE = "localhost/busybox:latest"


@pytest.fixture
def node_name():
    # Each test is its own node, so tests sharing one engine never see each other's containers.
    return f"h3-test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def engine(engine_url, node_name):
    client = docker.DockerClient(base_url=engine_url, version=API_VERSION)
    yield client
    for container in client.containers.list(
        all=True, filters={"label": [f"{NODE_LABEL}={node_name}"]}
    ):
        container.remove(force=True)
    client.close()


@pytest.fixture
def runtime(engine, engine_url, node_name, state_dir):
    rt = DockerRuntime(state_dir, node_name=node_name, base_url=engine_url)
    yield rt
    rt.close()


def spec(attempt_id, *command, **kwargs):
    return AttemptSpec(attempt_id=attempt_id, image=IMAGE, command=tuple(command), **kwargs)


def ended(runtime, attempt_id):
    def check():
        for status in runtime.statuses():
            if status.attempt_id == attempt_id and status.state is not AttemptState.RUNNING:
                return status
        return None

    return wait_until(check, timeout_s=60, what=f"attempt {attempt_id} to end")


def test_a_container_runs_with_its_env_gpus_labels_and_limits_and_its_output_is_kept(
    runtime, engine, node_name, containers_of
):
    runtime.start(
        spec(
            21,
            "sh",
            "-c",
            'echo "gpus=$CUDA_VISIBLE_DEVICES nv=$NVIDIA_VISIBLE_DEVICES '
            'attempt=$GPUCP_ATTEMPT_ID epochs=$EPOCHS"; echo oops >&2; exit 3',
            job_id=4,
            env={"EPOCHS": "3"},
            gpu_uuids=("GPU-1", "GPU-2"),
            cpus=0.5,
            memory_mib=64,
        )
    )
    status = ended(runtime, 21)
    assert status.state is AttemptState.EXITED and status.exit_code == 3
    assert status.started_at is not None and status.finished_at >= status.started_at
    assert status.logs_complete
    output = runtime.read_logs(21, 0, 10_000).decode()
    assert "gpus=GPU-1,GPU-2 nv=GPU-1,GPU-2 attempt=21 epochs=3" in output
    assert "oops" in output

    (container,) = containers_of(21)
    assert container.labels[NODE_LABEL] == node_name
    assert container.labels["gpucp.job-id"] == "4"
    host = container.attrs["HostConfig"]
    assert host["NanoCpus"] == 500_000_000
    assert host["Memory"] == 64 * 1024 * 1024


def test_an_engine_that_cannot_inspect_a_container_just_started_has_not_failed_the_start(
    runtime, monkeypatch
):
    # Podman answers an inspect of a container whose process has just ended with a 500 ("read
    # /proc/N/cgroup: no such process"). The start had succeeded: the job must not be reported
    # as one that never started (a failed job, or one run again), and its end and output must
    # be read at the next poll. The engine is real; only its first inspect answers are faulted.
    api = runtime._client.api
    real_inspect, real_start = api.inspect_container, api.start
    faults = {"left": 0}

    def start(container_id, *args, **kwargs):
        real_start(container_id, *args, **kwargs)
        faults["left"] = 2  # the inspects right after the start (create inspects too)

    def inspect(container_id):
        if faults["left"]:
            faults["left"] -= 1
            raise docker.errors.APIError(
                "500 Server Error: read /proc/14754/cgroup: no such process"
            )
        return real_inspect(container_id)

    monkeypatch.setattr(api, "start", start)
    monkeypatch.setattr(api, "inspect_container", inspect)
    started = runtime.start(spec(29, "sh", "-c", "echo ran once; exit 0", job_id=9))

    assert started.state is AttemptState.RUNNING
    status = ended(runtime, 29)
    assert status.state is AttemptState.EXITED and status.exit_code == 0
    assert faults["left"] == 0  # the faults were met, by the start and the first poll
    assert "ran once" in runtime.read_logs(29, 0, 10_000).decode()


def test_stop_sends_sigterm_then_sigkill_after_the_grace_period(runtime):
    # busybox sleep as PID 1 ignores SIGTERM (no handler): only the SIGKILL ends it.
    runtime.start(spec(22, "sleep", "300"))
    runtime.stop(22, grace_s=1.0)
    status = ended(runtime, 22)
    assert status.exit_code == 137


def test_a_container_that_handles_sigterm_ends_with_its_own_code(runtime):
    runtime.start(spec(23, "sh", "-c", "trap 'echo bye; exit 0' TERM; while :; do sleep 0.1; done"))
    wait_until(lambda: runtime.statuses()[0].started_at, what="the container to start")
    runtime.stop(23, grace_s=30)
    status = ended(runtime, 23)
    assert status.exit_code == 0
    assert b"bye" in runtime.read_logs(23, 0, 1000)


ENGINE_ERRORS = {
    # Podman's answer to a start whose process has just ended, or to an exec that failed.
    "a 500": lambda: docker.errors.APIError("500 Server Error: Internal Server Error"),
    # No answer in time: the engine may still carry the request out.
    "a timeout": lambda: requests.ReadTimeout("read timed out"),
}


def fault(api, method, error, *, after: bool, times: int = 1, then=None):
    """The engine's `method` answers `error` for its next `times` calls, once it really did
    the work (after) or without doing it, and calls then() at each. Returns the count of
    faults left."""
    real = getattr(api, method)
    left = {"n": times}

    def faulted(*args, **kwargs):
        if not left["n"]:
            return real(*args, **kwargs)
        left["n"] -= 1
        if after:
            real(*args, **kwargs)
        if then is not None:
            then()
        raise ENGINE_ERRORS[error]()

    setattr(api, method, faulted)
    return left


@pytest.fixture
def containers_of(engine, node_name):
    """This test's containers of an attempt. Attempt ids repeat between tests, and the suite's
    parallel workers share the engine: another test's container of the same attempt id, and
    its removal while the list is inspected, must not count here."""

    def of(attempt_id):
        labels = [f"{NODE_LABEL}={node_name}", f"{ATTEMPT_LABEL}={attempt_id}"]
        return engine.containers.list(all=True, filters={"label": labels})

    return of


@pytest.mark.parametrize("error", sorted(ENGINE_ERRORS))
@pytest.mark.parametrize(
    "method, after, runs",
    [
        ("create_container", False, False),  # refused: nothing made
        ("create_container", True, False),  # made, never started
        ("start", False, False),  # made, start refused
        ("start", True, True),  # started, then the error
    ],
)
def test_a_create_or_start_that_answers_an_error_is_a_failed_start_only_if_nothing_runs(
    runtime, engine, method, after, runs, error, containers_of
):
    # A start reported failed while its container runs would run the job twice once the
    # control plane requeues it; a container left made would be started by the next agent's
    # adopt(). Whatever the engine did before its error, the report matches it.
    left = fault(runtime._client.api, method, error, after=after)
    if runs:
        runtime.start(spec(41, "sh", "-c", "echo ran; exit 0", job_id=7))  # no StartError
        status = ended(runtime, 41)
        assert status.state is AttemptState.EXITED and status.exit_code == 0
        assert runtime.read_logs(41, 0, 10_000).decode().count("ran") == 1
        assert len(containers_of(41)) == 1
    else:
        with pytest.raises(StartError):
            runtime.start(spec(41, "sh", "-c", "echo ran; exit 0", job_id=7))
        assert containers_of(41) == []
        assert runtime.statuses() == []
    assert left["n"] == 0


@pytest.mark.parametrize("runs", [True, False], ids=["it-started", "it-did-not"])
def test_a_start_the_engine_cannot_account_for_is_reported_only_once_it_can(
    runtime, engine, runs, containers_of
):
    # The start answers an error and the engine then cannot be asked (a restart): the attempt
    # is reported neither failed nor ended until the engine says what it made.
    api = runtime._client.api
    away = fault(api, "inspect_container", "a timeout", after=False, times=0)
    fault(api, "start", "a 500", after=runs, then=lambda: away.update(n=3))
    started = runtime.start(spec(42, "sh", "-c", "echo ran; exit 0", job_id=7))
    assert started.state is AttemptState.RUNNING
    while away["n"]:
        assert runtime.statuses() == []  # nothing said while nothing is known
    status = ended(runtime, 42)
    if runs:
        assert status.state is AttemptState.EXITED and status.exit_code == 0
        assert runtime.read_logs(42, 0, 10_000).decode().count("ran") == 1
    else:
        assert status.state is AttemptState.FAILED_TO_START and "500" in status.message
        assert containers_of(42) == []


def test_a_stop_asked_while_the_start_is_unaccounted_for_reaches_the_container(runtime, engine):
    api = runtime._client.api
    away = fault(api, "inspect_container", "a 500", after=False, times=0)
    fault(api, "start", "a timeout", after=True, then=lambda: away.update(n=2))
    runtime.start(spec(43, "sleep", "300"))
    runtime.stop(43, grace_s=0.5)
    while away["n"]:
        runtime.statuses()
    status = ended(runtime, 43)
    assert status.state is AttemptState.EXITED and status.exit_code == 137
    assert status.stop_signal_at is not None and status.killed_after_grace


@pytest.mark.parametrize("error", sorted(ENGINE_ERRORS))
def test_a_stop_signal_the_engine_failed_to_deliver_is_sent_again_within_the_grace(runtime, error):
    # The notice before a preemption: a job that never gets it cannot checkpoint.
    runtime.start(spec(45, "sh", "-c", "trap 'echo bye; exit 0' TERM; while :; do sleep 0.1; done"))
    wait_until(lambda: runtime.statuses()[0].started_at, what="the container to start")
    left = fault(runtime._client.api, "kill", error, after=False, times=2)
    runtime.stop(45, grace_s=30)
    status = ended(runtime, 45)
    assert status.exit_code == 0 and not status.killed_after_grace
    assert b"bye" in runtime.read_logs(45, 0, 1000)
    assert left["n"] == 0


def test_the_fence_finds_and_kills_a_container_without_inspecting_it(
    runtime, engine, engine_url, node_name, state_dir
):
    # The fence lists the node's running containers while the agent removes those that exited:
    # an inspect of one removed since the list answers an error (Podman: a 500, "no such
    # container"), and had the fence needed it, its look would fail whenever that happened.
    from agents.fence import Fence
    from tests.agents.test_leases import write_lease

    runtime.start(spec(46, "sleep", "300"))
    wait_until(lambda: runtime.statuses()[0].started_at, what="the container to start")
    fenced = DockerRuntime(state_dir, node_name=node_name, base_url=engine_url)
    try:
        fault(fenced._client.api, "inspect_container", "a 500", after=False, times=1000)
        write_lease(state_dir, kill_in_s=-0.1)
        assert Fence(state_dir, fenced).check() == {46: "kill"}
    finally:
        fenced.close()
    status = ended(runtime, 46)
    assert status.exit_code == 137


def test_an_adopted_container_whose_start_answers_an_error_but_ran_is_not_a_failed_start(
    engine, engine_url, node_name, state_dir, containers_of
):
    # The agent died between creating a container and starting it; the next agent starts it,
    # and the engine answers that start with a 500 although the process ran.
    first = DockerRuntime(state_dir, node_name=node_name, base_url=engine_url)
    fault(first._client.api, "start", "a timeout", after=False)
    first._client.api.remove_container = lambda *a, **k: None  # the agent dies: nothing removed
    with pytest.raises(StartError):
        first.start(spec(44, "sh", "-c", "echo ran; exit 0", job_id=7))
    first.close()
    assert [c.status for c in containers_of(44)] == ["created"]

    restarted = DockerRuntime(state_dir, node_name=node_name, base_url=engine_url)
    try:
        fault(restarted._client.api, "start", "a 500", after=True)
        assert [s.state for s in restarted.adopt()] in (
            [AttemptState.RUNNING],
            [AttemptState.EXITED],
        )
        status = ended(restarted, 44)
        assert status.state is AttemptState.EXITED and status.exit_code == 0
        assert restarted.read_logs(44, 0, 10_000).decode().count("ran") == 1
    finally:
        restarted.close()


def test_a_kill_at_the_end_of_the_grace_by_the_runtime_it_was_adopted_from_counts_as_one(
    runtime, engine_url, node_name, state_dir
):
    # As the process runtime's (tests/agents/test_job_contract.py): whichever runtime kills it
    # at the end of the grace, its report says it was killed after its grace.
    runtime.start(spec(47, "sleep", "300"))
    wait_until(lambda: runtime.statuses()[0].started_at, what="the container to start")
    runtime.stop(47, grace_s=0.5)
    restarted = DockerRuntime(state_dir, node_name=node_name, base_url=engine_url)
    try:
        late = restarted._escalate_after
        restarted._escalate_after = lambda entry, delay_s: late(entry, delay_s + 30)
        restarted.adopt()
        status = ended(restarted, 47)
        assert status.exit_code == 137 and status.killed_after_grace is True
    finally:
        restarted.close()


def test_a_restarted_runtime_adopts_its_own_containers_by_label_and_no_others(
    runtime, engine, engine_url, node_name, state_dir, tmp_path, containers_of
):
    runtime.start(spec(24, "sh", "-c", "echo one; sleep 300", gpu_uuids=("GPU-z",), job_id=8))
    wait_until(lambda: runtime.read_logs(24, 0, 100), what="the first output")
    neighbour = DockerRuntime(tmp_path / "other", node_name=node_name + "-b", base_url=engine_url)
    neighbour.start(spec(25, "sleep", "300"))
    try:
        restarted = DockerRuntime(state_dir, node_name=node_name, base_url=engine_url)
        adopted = restarted.adopt()
        assert [(s.attempt_id, s.state) for s in adopted] == [(24, AttemptState.RUNNING)]
        assert adopted[0].job_id == 8 and adopted[0].gpu_uuids == ("GPU-z",)
        # The output is the engine's, replayed: the same bytes at the same offsets.
        wait_until(lambda: restarted.read_logs(24, 0, 100) == b"one\n", what="replayed output")
        restarted.stop(24, grace_s=0.5)
        assert ended(restarted, 24).exit_code == 137
        restarted.remove(24)
        assert containers_of(24) == []
    finally:
        neighbour.remove(25)


def test_an_image_that_is_not_here_fails_to_start_in_the_engines_words(runtime):
    with pytest.raises(StartError, match="no-such-image"):
        runtime.start(AttemptSpec(attempt_id=26, image="localhost/no-such-image:1"))


def test_a_command_not_in_the_image_fails_to_start_and_leaves_no_container(
    runtime, engine, containers_of
):
    with pytest.raises(StartError, match="not found"):
        runtime.start(spec(27, "no-such-command"))
    assert containers_of(27) == []


def test_engine_timestamps_with_nanoseconds_become_unix_seconds():
    assert parse_engine_time("1970-01-01T00:00:10.5Z") == 10.5
    assert parse_engine_time("1970-01-01T00:00:10.123456789+00:00") == pytest.approx(10.123456789)
    assert parse_engine_time("1970-01-01T01:00:00+01:00") == 0.0
    assert parse_engine_time("0001-01-01T00:00:00Z") is None
    assert parse_engine_time("") is None


def test_the_agent_runs_a_desired_container_reports_its_exit_and_then_removes_it(
    control_plane, engine, engine_url, node_name, state_dir, containers_of
):
    from agents.client import ControlPlaneClient
    from agents.daemon import Agent, AgentConfig
    from agents.gpu.simulated import SimulatedBackend

    gpu = SimulatedBackend.from_spec("simulated:V100-SXM2-32GB:1", node_name=node_name)
    config = AgentConfig(
        url=control_plane.url,
        state_dir=state_dir,
        node_name=node_name,
        join_token=control_plane.JOIN_TOKEN,
        runtime="docker",
    )
    agent = Agent(
        config,
        client=ControlPlaneClient(
            control_plane.url, state_dir=state_dir, join_token=control_plane.JOIN_TOKEN
        ),
        gpu=gpu,
        runtime=DockerRuntime(state_dir, node_name=node_name, base_url=engine_url),
    )
    agent.recover()
    agent.ensure_registered()
    gpu0 = gpu.inventory()[0].uuid
    control_plane.set_desired(
        [
            {
                "attempt_id": 41,
                "job_id": 4,
                "image": IMAGE,
                "command": ["sh", "-c", 'echo "speed=$GPUCP_SIM_SPEED on $CUDA_VISIBLE_DEVICES"'],
                "env": {},
                "gpu_uuids": [gpu0],
                "cpus": 1.0,
                "memory_mib": 128,
                "max_runtime_s": 600,
            }
        ]
    )
    assert agent.cycle()
    assert registered_runtime(control_plane) == "docker"
    ended(agent.runtime, 41)
    assert agent.cycle()
    report = control_plane.reported(41)[-1]
    assert report["state"] == "exited" and report["exit_code"] == 0
    assert control_plane.logs[41] == f"speed=1.000000 on {gpu0}\n".encode()
    # Its exit was acknowledged: the container is gone, and it is not started again.
    assert containers_of(41) == []
    assert agent.cycle()
    assert containers_of(41) == []


def registered_runtime(control_plane):
    return control_plane.registrations[-1]["runtime"]


# -- the job contract: mounts, checkpoint dir, stop signal and grace ------------------------------


def test_a_host_path_is_bind_mounted_at_its_target_and_named_in_the_environment(runtime, tmp_path):
    data = tmp_path / "datasets"
    data.mkdir()
    (data / "train.txt").write_text("cats and dogs\n")
    runtime.start(
        spec(
            41,
            "sh",
            "-c",
            'echo "at=$GPUCP_MOUNT_DATA_SETS"; cat "$GPUCP_MOUNT_DATA_SETS/train.txt"; '
            'echo written > /data/out.txt; echo "sig=$GPUCP_STOP_SIGNAL grace=$GPUCP_GRACE_S"',
            mounts=(MountSpec("data-sets", "host_path", str(data), "/data"),),
            stop_signal="SIGINT",
            grace_s=12.0,
        )
    )
    assert ended(runtime, 41).exit_code == 0
    output = runtime.read_logs(41, 0, 10_000).decode()
    assert "at=/data\ncats and dogs\n" in output
    assert "sig=SIGINT grace=12" in output
    assert (data / "out.txt").read_text() == "written\n"


def test_a_read_only_mount_cannot_be_written(runtime, tmp_path):
    data = tmp_path / "datasets"
    data.mkdir()
    (data / "train.txt").write_text("keep\n")
    runtime.start(
        spec(
            42,
            "sh",
            "-c",
            "cat /data/train.txt && echo x > /data/train.txt; echo y > /data/new.txt",
            mounts=(MountSpec("datasets", "host_path", str(data), "/data", read_only=True),),
        )
    )
    status = ended(runtime, 42)
    assert status.exit_code != 0
    assert (data / "train.txt").read_text() == "keep\n"
    assert not (data / "new.txt").exists()
    assert "keep" in runtime.read_logs(42, 0, 10_000).decode()  # readable all the same


def test_a_missing_host_path_or_engine_volume_fails_to_start_and_nothing_is_created(
    runtime, engine, tmp_path
):
    missing = tmp_path / "not-here"
    with pytest.raises(StartError, match="not on this node"):
        runtime.start(spec(43, "true", mounts=(MountSpec("d", "host_path", str(missing), "/d"),)))
    assert not missing.exists()
    name = f"gpucp-test-missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(StartError, match="has no volume"):
        runtime.start(spec(44, "true", mounts=(MountSpec("v", "engine_volume", name, "/v"),)))
    with pytest.raises(docker.errors.NotFound):
        engine.volumes.get(name)


def test_an_engine_volume_is_mounted_by_name(runtime, engine):
    name = f"gpucp-test-{uuid.uuid4().hex[:8]}"
    volume = engine.volumes.create(name)
    try:
        assert runtime.has_volume(name)
        runtime.start(
            spec(
                45,
                "sh",
                "-c",
                'echo hi > "$GPUCP_MOUNT_CACHE/f" && cat /cache/f',
                mounts=(MountSpec("cache", "engine_volume", name, "/cache"),),
            )
        )
        assert ended(runtime, 45).exit_code == 0
        assert b"hi" in runtime.read_logs(45, 0, 100)
        runtime.remove(45)
    finally:
        volume.remove(force=True)


def test_the_checkpoint_dir_is_mounted_writable_and_outlives_the_container(runtime, tmp_path):
    host_dir = tmp_path / "ckpt" / "checkpoints" / "vision" / "7"
    checkpoint = CheckpointSpec(str(host_dir))
    runtime.start(
        spec(
            46,
            "sh",
            "-c",
            'echo "dir=$GPUCP_CHECKPOINT_DIR"; echo epoch-3 > "$GPUCP_CHECKPOINT_DIR/state" '
            '&& touch "$GPUCP_CHECKPOINT_DIR/.checkpoint"',
            job_id=7,
            checkpoint=checkpoint,
        )
    )
    assert ended(runtime, 46).exit_code == 0
    assert "dir=/gpucp/checkpoint" in runtime.read_logs(46, 0, 1000).decode()
    runtime.remove(46)
    assert (host_dir / "state").read_text() == "epoch-3\n" and (host_dir / ".checkpoint").exists()
    # The job's next attempt finds it; read-only when the control plane says so.
    runtime.start(
        spec(
            47,
            "sh",
            "-c",
            "cat /gpucp/checkpoint/state; echo x > /gpucp/checkpoint/state",
            job_id=7,
            checkpoint=CheckpointSpec(str(host_dir), read_only=True),
        )
    )
    status = ended(runtime, 47)
    assert b"epoch-3" in runtime.read_logs(47, 0, 1000)
    assert status.exit_code != 0 and (host_dir / "state").read_text() == "epoch-3\n"


def test_a_container_gets_its_own_stop_signal_and_leaves_by_itself(runtime):
    runtime.start(
        spec(48, "sh", "-c", "trap 'echo got-usr1; exit 0' USR1; while :; do sleep 0.1; done")
    )
    wait_until(lambda: runtime.statuses()[0].started_at, what="the container to start")
    runtime.stop(48, grace_s=60, signal="SIGUSR1")
    status = ended(runtime, 48)
    assert status.exit_code == 0 and status.killed_after_grace is False
    assert b"got-usr1" in runtime.read_logs(48, 0, 1000)


def test_a_container_that_ignores_its_signal_is_killed_at_the_end_of_its_grace(runtime):
    # busybox sleep as PID 1 ignores SIGTERM (no handler): only the SIGKILL ends it.
    runtime.start(spec(49, "sleep", "300"))
    wait_until(lambda: runtime.statuses()[0].started_at, what="the container to start")
    runtime.stop(49, grace_s=1.5)
    status = ended(runtime, 49)
    assert status.exit_code == 137 and status.killed_after_grace is True
    assert status.finished_at - status.stop_signal_at >= 1.5


@pytest.mark.parametrize(("nodes", "host_network"), [(2, True), (1, False)])
def test_a_job_over_several_nodes_uses_the_hosts_network_and_a_one_node_job_does_not(
    runtime, engine, nodes, host_network, containers_of
):
    attempt_id = 40 + nodes
    addrs = tuple(f"10.0.0.{i + 1}" for i in range(nodes))
    runtime.start(
        spec(
            attempt_id,
            "sh",
            "-c",
            'echo "nodes=$GPUCP_NUM_NODES master=$PET_MASTER_ADDR:$PET_MASTER_PORT"',
            rendezvous=RendezvousSpec(0, addrs, 29600, 1),
        )
    )
    assert ended(runtime, attempt_id).exit_code == 0
    assert f"nodes={nodes} master=10.0.0.1:29600" in runtime.read_logs(attempt_id, 0, 1000).decode()
    (container,) = containers_of(attempt_id)
    assert (container.attrs["HostConfig"]["NetworkMode"] == "host") is host_network
