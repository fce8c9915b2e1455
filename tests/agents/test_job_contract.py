"""The job contract on the node: stop signal and grace, mounts, checkpoint dirs, volumes.

Process-runtime tests use real processes and real signals; the agent is driven against the
tiny in-test control plane (conftest), one cycle at a time.
"""

import json
import math
import os
import time
from pathlib import Path

import pytest

from agents import lease as leases
from agents.fence import Fence
from agents.runtime.base import AttemptSpec, AttemptState, CheckpointSpec, MountSpec, StartError
from agents.runtime.process import ProcessRuntime
from agents.volumes import (
    checkpoint_dir_inside,
    delete_checkpoint_dir,
    dir_bytes,
    scan_checkpoint_lines,
)
from tests.agents.conftest import kept_records, wait_until
from tests.agents.test_daemon import attempt, make_agent

# A job that says when it is ready, then ignores SIGTERM (its sleeps die of it; the loop goes on).
IGNORES_TERM = "trap 'echo got-term' TERM; echo ready; while :; do sleep 0.05; done"
# A job that leaves, with 0, on SIGUSR1 only.
EXITS_ON_USR1 = "trap 'echo got-usr1; exit 0' USR1; echo ready; while :; do sleep 0.05; done"


def spec(attempt_id, *command, **kwargs):
    return AttemptSpec(attempt_id=attempt_id, command=tuple(command), **kwargs)


def ended(runtime, attempt_id):
    def check():
        for status in runtime.statuses():
            if status.attempt_id == attempt_id and status.state is not AttemptState.RUNNING:
                return status
        return None

    return wait_until(check, timeout_s=30, what=f"attempt {attempt_id} to end")


def output(runtime, attempt_id):
    return runtime.read_logs(attempt_id, 0, 100_000).decode()


def ready(runtime, attempt_id):
    wait_until(lambda: "ready" in output(runtime, attempt_id), what="the job to be ready")


# -- the wire -----------------------------------------------------------------------------------


def test_an_entry_without_the_new_keys_means_sigterm_the_agents_grace_no_mounts_no_checkpoint():
    parsed = AttemptSpec.from_wire({"attempt_id": 1, "command": ["true"]})
    assert parsed.stop_signal == "SIGTERM"
    assert parsed.grace_s is None
    assert parsed.mounts == () and parsed.checkpoint is None and parsed.refused == ""


def test_the_stop_signal_grace_mounts_and_checkpoint_are_read_from_the_wire():
    parsed = AttemptSpec.from_wire(
        {
            "attempt_id": 1,
            "stop_signal": "SIGUSR1",
            "grace_s": 2.5,
            "mounts": [
                {
                    "name": "data-sets.v2",
                    "kind": "host_path",
                    "source": "/mnt/datasets/tenants/vision",
                    "target": "/data",
                    "read_only": True,
                },
                {"name": "cache", "kind": "engine_volume", "source": "cache-vol", "target": "/c"},
            ],
            "checkpoint": {"host_path": "/srv/ckpt/checkpoints/vision/7", "read_only": False},
            "some_future_key": 1,
        }
    )
    assert parsed.stop_signal == "SIGUSR1" and parsed.grace_s == 2.5
    assert parsed.mounts == (
        MountSpec("data-sets.v2", "host_path", "/mnt/datasets/tenants/vision", "/data", True),
        MountSpec("cache", "engine_volume", "cache-vol", "/c", False),
    )
    assert parsed.mounts[0].env_name == "GPUCP_MOUNT_DATA_SETS_V2"
    assert parsed.checkpoint == CheckpointSpec(
        "/srv/ckpt/checkpoints/vision/7", "/gpucp/checkpoint"
    )


@pytest.mark.parametrize("value", ["SIGKILL", "SIGSTOP", "SIGNOPE", 9, "", ["SIGTERM"]])
def test_a_stop_signal_the_agent_does_not_allow_is_sigterm(value):
    assert AttemptSpec.from_wire({"attempt_id": 1, "stop_signal": value}).stop_signal == "SIGTERM"


@pytest.mark.parametrize("value", [-1, math.nan, math.inf, "soon", True, 1e9, [5]])
def test_a_grace_that_is_not_a_sane_number_of_seconds_is_the_agents_own(value):
    assert AttemptSpec.from_wire({"attempt_id": 1, "grace_s": value}).grace_s is None


@pytest.mark.parametrize(
    ("mounts", "checkpoint", "field"),
    [
        ("/data", None, "mounts must be a list"),
        ([{"name": "d", "kind": "nfs", "source": "/x", "target": "/d"}], None, "mounts[0].kind"),
        ([{"name": "d", "kind": "host_path", "source": "/x"}], None, "mounts[0].target"),
        (
            [{"name": "d", "kind": "host_path", "source": "/x", "target": "/d", "read_only": "no"}],
            None,
            "mounts[0].read_only",
        ),
        (None, {"target": "/gpucp/checkpoint"}, "checkpoint.host_path"),
        (None, "/srv/ckpt", "checkpoint must be an object"),
    ],
)
def test_volumes_the_agent_cannot_read_make_the_attempt_fail_to_start_saying_which(
    state_dir, mounts, checkpoint, field
):
    parsed = AttemptSpec.from_wire(
        {"attempt_id": 1, "command": ["true"], "mounts": mounts, "checkpoint": checkpoint}
    )
    assert field in parsed.refused
    with pytest.raises(StartError, match="cannot read its volumes") as raised:
        ProcessRuntime(state_dir).start(parsed)
    assert field in str(raised.value)


@pytest.mark.parametrize(
    "target",
    [
        "data",
        "/data/../etc",
        "/",
        "//",
        "/proc",
        "/sys/fs",
        "/dev",
        "/etc",
        "/etc/ssl",
        "/usr/local/x",
        "/bin",
        "/sbin",
        "/lib",
        "/lib64",
        "/boot",
        "/run",
        "/var/run",
        "/var/run/docker.sock",
        "/./etc",
    ],
)
def test_a_mount_over_a_system_path_or_outside_the_root_is_refused(state_dir, tmp_path, target):
    mount = MountSpec("data", "host_path", str(tmp_path), target)
    with pytest.raises(StartError, match="mount 'data': target"):
        ProcessRuntime(state_dir).start(spec(1, "true", mounts=(mount,)))
    assert not (state_dir / "process" / "1").exists()


@pytest.mark.parametrize("source", ["relative/dir", "/mnt/data/../../etc"])
def test_a_host_source_that_is_relative_or_climbs_is_refused(state_dir, source):
    mount = MountSpec("data", "host_path", source, "/data")
    with pytest.raises(StartError, match="mount 'data': host path"):
        ProcessRuntime(state_dir).start(spec(1, "true", mounts=(mount,)))


def test_a_checkpoint_dir_that_climbs_is_refused_and_nothing_is_created(state_dir, tmp_path):
    checkpoint = CheckpointSpec(str(tmp_path / "v" / "checkpoints" / ".." / ".." / "escape"))
    with pytest.raises(StartError, match="checkpoint dir"):
        ProcessRuntime(state_dir).start(spec(1, "true", checkpoint=checkpoint))
    assert not (tmp_path / "escape").exists() and not (tmp_path / "v").exists()


# -- stopping with the job's own signal and grace (process runtime) ------------------------------


def test_a_job_that_ignores_its_signal_is_killed_at_the_end_of_its_grace_and_not_before(
    state_dir,
):
    runtime = ProcessRuntime(state_dir)
    runtime.start(spec(11, "sh", "-c", IGNORES_TERM))
    ready(runtime, 11)
    runtime.stop(11, grace_s=1.5, signal="SIGTERM")
    status = ended(runtime, 11)
    assert status.exit_code == 137  # SIGKILL
    assert status.killed_after_grace is True
    # It got the notice, and all of its grace: the kill came no earlier than the grace's end.
    assert "got-term" in output(runtime, 11)
    assert status.finished_at - status.stop_signal_at >= 1.5


def test_a_job_asked_for_sigusr1_gets_sigusr1_and_leaves_by_itself(state_dir):
    runtime = ProcessRuntime(state_dir)
    runtime.start(spec(12, "sh", "-c", EXITS_ON_USR1))
    ready(runtime, 12)
    before = time.time()
    runtime.stop(12, grace_s=60, signal="SIGUSR1")
    status = ended(runtime, 12)
    assert status.exit_code == 0
    assert "got-usr1" in output(runtime, 12)
    assert status.killed_after_grace is False
    assert status.stop_signal_at >= before


@pytest.mark.parametrize("name", ["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT"])
def test_every_allowed_stop_signal_reaches_the_job_which_may_handle_it(state_dir, name):
    # A shell ignores SIGINT and SIGQUIT in what it runs in the background without job control:
    # the supervisor must not pass such an ignore on.
    runtime = ProcessRuntime(state_dir)
    runtime.start(
        spec(18, "sh", "-c", f"trap 'exit 7' {name[3:]}; echo ready; while :; do sleep 0.05; done")
    )
    ready(runtime, 18)
    runtime.stop(18, grace_s=60, signal=name)
    status = ended(runtime, 18)
    assert status.exit_code == 7 and status.killed_after_grace is False


def test_a_restarted_runtime_still_kills_at_the_end_of_the_grace_its_predecessor_began(
    state_dir,
):
    runtime = ProcessRuntime(state_dir)
    runtime.start(spec(13, "sh", "-c", IGNORES_TERM))
    ready(runtime, 13)
    runtime.stop(13, grace_s=1.0)
    restarted = ProcessRuntime(state_dir)  # the agent died within the grace
    restarted.adopt()
    restarted.stop(13, grace_s=600)  # a second stop neither resends nor lengthens the grace
    status = ended(restarted, 13)
    assert status.exit_code == 137 and status.killed_after_grace is True
    assert output(restarted, 13).count("got-term") == 1


def test_a_kill_at_the_end_of_the_grace_by_the_runtime_it_was_adopted_from_counts_as_one(state_dir):
    # Whichever of the two kills it at the end of the grace (the one adopted from had not quite
    # died), the report says it was killed after its grace: the stop is read from disk.
    runtime = ProcessRuntime(state_dir)
    runtime.start(spec(14, "sh", "-c", IGNORES_TERM))
    ready(runtime, 14)
    runtime.stop(14, grace_s=0.5)
    restarted = ProcessRuntime(state_dir)
    late = restarted._escalate_after
    restarted._escalate_after = lambda proc, delay_s: late(proc, delay_s + 30)
    restarted.adopt()
    status = ended(restarted, 14)
    assert status.exit_code == 137 and status.killed_after_grace is True


def test_the_job_knows_its_notice_mounts_and_checkpoint_dir_by_environment(state_dir, tmp_path):
    data = tmp_path / "datasets"
    data.mkdir()
    checkpoint_dir = tmp_path / "ckpt" / "checkpoints" / "vision" / "7"
    runtime = ProcessRuntime(state_dir)
    runtime.start(
        spec(
            14,
            "sh",
            "-c",
            'echo "sig=$GPUCP_STOP_SIGNAL grace=$GPUCP_GRACE_S data=$GPUCP_MOUNT_DATA_SETS '
            'ckpt=$GPUCP_CHECKPOINT_DIR"',
            stop_signal="SIGUSR2",
            grace_s=45.0,
            mounts=(MountSpec("data-sets", "host_path", str(data), "/data", read_only=True),),
            checkpoint=CheckpointSpec(str(checkpoint_dir)),
        )
    )
    assert ended(runtime, 14).exit_code == 0
    # The process runtime cannot remap paths: the job gets the host's.
    assert f"sig=SIGUSR2 grace=45 data={data} ckpt={checkpoint_dir}" in output(runtime, 14)
    assert checkpoint_dir.is_dir()


def test_without_a_checkpoint_volume_the_job_has_no_checkpoint_dir_variable(state_dir):
    runtime = ProcessRuntime(state_dir)
    runtime.start(spec(15, "sh", "-c", 'echo "ckpt=${GPUCP_CHECKPOINT_DIR-unset}"'))
    ended(runtime, 15)
    assert "ckpt=unset" in output(runtime, 15)


def test_the_process_runtime_refuses_engine_volumes_and_missing_host_paths(state_dir, tmp_path):
    runtime = ProcessRuntime(state_dir)
    with pytest.raises(StartError, match="cannot mount engine volumes"):
        runtime.start(spec(16, "true", mounts=(MountSpec("c", "engine_volume", "vol", "/c"),)))
    with pytest.raises(StartError, match="is not on this node"):
        runtime.start(
            spec(17, "true", mounts=(MountSpec("d", "host_path", str(tmp_path / "no"), "/d"),))
        )
    assert not (tmp_path / "no").exists()


# -- through the agent -------------------------------------------------------------------------


def report_of(cp, attempt_id, predicate=lambda r: True):
    reports = [r for r in cp.reported(attempt_id) if predicate(r)]
    return reports[-1] if reports else None


def test_an_unwanted_attempt_is_stopped_with_its_own_signal_and_says_it_left_by_itself(
    control_plane, state_dir
):
    agent = make_agent(control_plane, state_dir)
    control_plane.set_desired(
        [attempt(21, "sh", "-c", EXITS_ON_USR1, stop_signal="SIGUSR1", grace_s=60)]
    )
    agent.cycle()
    ready(agent.runtime, 21)
    control_plane.set_desired([])  # preempted: no longer in the answer, its signal is kept
    agent.cycle()
    wait_until(
        lambda: agent.cycle() and report_of(control_plane, 21, lambda r: r["state"] == "exited"),
        what="the exit to be reported",
    )
    report = report_of(control_plane, 21, lambda r: r["state"] == "exited")
    assert report["exit_code"] == 0 and report["stop_cause"] == "unwanted"
    assert report["killed_after_grace"] is False
    assert report["stop_signal_at"] <= report["finished_at"]


def test_an_attempt_past_its_max_runtime_gets_its_grace_then_the_kill_and_the_report_says_so(
    control_plane, state_dir
):
    agent = make_agent(control_plane, state_dir)
    control_plane.set_desired(
        [attempt(22, "sh", "-c", IGNORES_TERM, max_runtime_s=0.0, grace_s=0.5)]
    )
    agent.cycle()
    wait_until(
        lambda: agent.cycle() and report_of(control_plane, 22, lambda r: r["state"] == "exited"),
        what="the exit to be reported",
    )
    report = report_of(control_plane, 22, lambda r: r["state"] == "exited")
    assert report["exit_code"] == 137 and report["killed_after_grace"] is True
    assert report["finished_at"] - report["stop_signal_at"] >= 0.5


def test_the_lease_gives_each_attempt_its_own_grace_and_signal_and_the_fence_sends_it(
    control_plane, state_dir
):
    control_plane.lease_s = 600.0
    agent = make_agent(control_plane, state_dir)
    control_plane.set_desired(
        [attempt(23, "sh", "-c", EXITS_ON_USR1, stop_signal="SIGUSR1", grace_s=42)]
    )
    agent.cycle()
    ready(agent.runtime, 23)
    # Named at once, before any renewal: the fence must not wait for the next heartbeat.
    lease = leases.read_lease(state_dir)
    assert lease.grace_of(23) == 42 and lease.signal_of(23) == "SIGUSR1"
    assert lease.term_at(23) == lease.kill_at - 42
    fence = Fence(state_dir, ProcessRuntime(state_dir))
    assert fence.check(now=lease.term_at(23) - 1) == {}
    assert fence.check(now=lease.term_at(23)) == {23: "term"}
    note = leases.fenced(state_dir, 23)
    assert note["signal"] == "SIGUSR1"
    wait_until(
        lambda: agent.cycle() and report_of(control_plane, 23, lambda r: r["state"] == "exited"),
        what="the exit to be reported",
    )
    report = report_of(control_plane, 23, lambda r: r["state"] == "exited")
    assert b"got-usr1" in control_plane.logs[23]
    assert report["exit_code"] == 0 and report["stop_cause"] == "fenced"
    assert report["stop_signal_at"] == note["at_unix"]
    assert report["killed_after_grace"] is False


def test_a_lease_file_of_an_older_agent_stops_every_attempt_with_sigterm(state_dir):
    lease = leases.Lease.renewed(leases.boottime(), 60.0, 10.0, {5: 20.0})
    written = json.loads(json.dumps(vars(lease)))
    del written["signals"]  # what an agent before per-attempt signals wrote
    (state_dir / leases.LEASE_FILE).write_text(json.dumps(written))
    read = leases.read_lease(state_dir)
    assert read.signal_of(5) == "SIGTERM" and read.grace_of(5) == 20.0


def test_an_attempt_waits_while_the_lease_is_shorter_than_its_own_grace(control_plane, state_dir):
    control_plane.lease_s = 30.0  # kill_at about 28.5 s away
    agent = make_agent(control_plane, state_dir)
    agent.cycle()  # the first lease
    control_plane.set_desired(
        [
            attempt(24, "sleep", "30", grace_s=3000),
            attempt(25, "sleep", "30", grace_s=5),
        ]
    )
    agent.cycle()
    running = {s.attempt_id for s in agent.runtime.statuses()}
    assert running == {25}
    assert "lease" in agent._deferred[24]


def test_a_checkpoint_marker_is_reported_with_its_time_and_the_dirs_size(
    control_plane, state_dir, tmp_path
):
    checkpoint_dir = tmp_path / "ckpt" / "checkpoints" / "vision" / "126"
    agent = make_agent(control_plane, state_dir)
    control_plane.set_desired(
        [
            attempt(
                26,
                "sh",
                "-c",
                'head -c 1000 /dev/zero > "$GPUCP_CHECKPOINT_DIR/weights"; '
                'touch "$GPUCP_CHECKPOINT_DIR/.checkpoint"; echo ready; sleep 60',
                checkpoint={"host_path": str(checkpoint_dir), "target": "/gpucp/checkpoint"},
            )
        ]
    )
    agent.cycle()
    ready(agent.runtime, 26)
    agent.cycle()  # hands the dir to the storage worker
    agent.storage.step()
    agent.cycle()
    report = report_of(control_plane, 26)
    marker = checkpoint_dir / ".checkpoint"
    assert report["last_checkpoint_at"] == marker.stat().st_mtime
    assert report["checkpoint_bytes"] == 1000
    assert kept_records(state_dir)[26]["checkpoint_bytes"] == 1000


def test_a_checkpoint_line_in_the_output_is_reported_when_the_agent_ships_it(
    control_plane, state_dir, tmp_path
):
    agent = make_agent(control_plane, state_dir)
    control_plane.set_desired(
        [
            attempt(
                27,
                "sh",
                "-c",
                "echo step 1; echo 'gpucp:checkpoint step 1'; echo ready; sleep 60",
                checkpoint={"host_path": str(tmp_path / "c" / "checkpoints" / "t" / "127")},
            )
        ]
    )
    agent.cycle()
    ready(agent.runtime, 27)
    before = time.time()
    agent.cycle()  # ships the output, and sees the line
    agent.cycle()
    report = report_of(control_plane, 27)
    assert report["last_checkpoint_at"] >= before


def test_output_without_a_checkpoint_line_reports_no_checkpoint(control_plane, state_dir, tmp_path):
    agent = make_agent(control_plane, state_dir)
    control_plane.set_desired(
        [
            attempt(
                28,
                "sh",
                "-c",
                "echo ' gpucp:checkpoint'; echo 'x gpucp:checkpoint'; echo gpucp:check; "
                "echo ready; sleep 60",
                checkpoint={"host_path": str(tmp_path / "c" / "checkpoints" / "t" / "128")},
            )
        ]
    )
    agent.cycle()
    ready(agent.runtime, 28)
    agent.cycle()
    agent.storage.step()
    agent.cycle()
    assert report_of(control_plane, 28)["last_checkpoint_at"] is None


def test_the_checkpoint_dir_outlives_an_attempt_for_the_jobs_next_one(
    control_plane, state_dir, tmp_path
):
    checkpoint = {"host_path": str(tmp_path / "c" / "checkpoints" / "t" / "9")}
    agent = make_agent(control_plane, state_dir)
    first = attempt(
        31,
        "sh",
        "-c",
        'echo epoch-3 > "$GPUCP_CHECKPOINT_DIR/state"; touch "$GPUCP_CHECKPOINT_DIR/.checkpoint"',
        job_id=9,
        checkpoint=checkpoint,
    )
    control_plane.set_desired([first])
    agent.cycle()
    wait_until(
        lambda: agent.cycle() and agent.storage.step() is None and 31 not in agent._meta,
        what="the first attempt to be reported and forgotten",
    )
    assert report_of(control_plane, 31, lambda r: r["state"] == "exited")["checkpoint_bytes"] == 8
    marker = tmp_path / "c" / "checkpoints" / "t" / "9" / ".checkpoint"
    # File times lag the clock by a tick; the next attempt starts well after this one's marker.
    wait_until(lambda: time.time() > marker.stat().st_mtime + 0.5, what="the marker to age")
    second = attempt(
        32,
        "sh",
        "-c",
        'echo "resumed from $(cat "$GPUCP_CHECKPOINT_DIR/state")"; echo ready; sleep 60',
        job_id=9,
        checkpoint=checkpoint,
    )
    control_plane.set_desired([second])
    agent.cycle()
    ready(agent.runtime, 32)
    assert "resumed from epoch-3" in agent.runtime.read_logs(32, 0, 1000).decode()
    agent.cycle()
    agent.storage.step()
    agent.cycle()
    # The first attempt's marker is older than this attempt: not this attempt's checkpoint.
    assert report_of(control_plane, 32)["last_checkpoint_at"] is None


# -- the checkpoint-line scan ------------------------------------------------------------------


@pytest.mark.parametrize("cut", range(1, 30))
def test_a_checkpoint_line_cut_between_two_chunks_is_found_once(cut):
    data = b"loss 0.1\ngpucp:checkpoint epoch 3\nmore\n"
    found_first, head = scan_checkpoint_lines("", data[:cut])
    found_second, _ = scan_checkpoint_lines(head, data[cut:])
    assert [found_first, found_second].count(True) == 1


@pytest.mark.parametrize(
    ("head", "data", "found"),
    [
        ("", b"gpucp:checkpoint", True),
        ("", b"x\ngpucp:checkpoint\n", True),
        ("", b"xgpucp:checkpoint\n", False),
        (None, b"gpucp:checkpoint\n", False),  # the middle of a line the scan did not see begin
        (None, b"\ngpucp:checkpoint\n", True),
        ("", b"gpucp:check\npoint\n", False),
        ("gpucp:check", b"point", True),
        ("", b"\xff\xfe\ngpucp:checkpoint", True),
    ],
)
def test_only_lines_that_start_with_the_marker_count(head, data, found):
    assert scan_checkpoint_lines(head, data)[0] is found


# -- volumes and checkpoint deletions ----------------------------------------------------------


@pytest.fixture
def volume(tmp_path):
    """A checkpoint volume's source with two jobs' dirs, and a precious folder outside it."""
    source = tmp_path / "ckpt"
    for job in ("7", "8"):
        (source / "checkpoints" / "vision" / job).mkdir(parents=True)
        (source / "checkpoints" / "vision" / job / "weights").write_text("w")
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "keep").write_text("k")
    return source, precious


def test_a_jobs_checkpoint_dir_inside_the_volume_is_deleted(volume):
    source, _ = volume
    path = source / "checkpoints" / "vision" / "7"
    assert delete_checkpoint_dir(str(path), str(source), 7)
    assert not path.exists() and (source / "checkpoints" / "vision" / "8" / "weights").exists()
    assert delete_checkpoint_dir(str(path), str(source), 7)  # already gone: done


@pytest.mark.parametrize(
    "host_path",
    [
        "{precious}",
        "{source}/checkpoints/vision/../../../precious",
        "{source}/checkpoints/vision",
        "{source}/checkpoints",
        "{source}",
        "{source}/checkpoints/vision/8",  # another job's
        "checkpoints/vision/7",
    ],
)
def test_a_deletion_outside_the_jobs_own_dir_in_the_volume_is_refused(volume, host_path):
    source, precious = volume
    path = host_path.format(source=source, precious=precious)
    assert not delete_checkpoint_dir(path, str(source), 7)
    assert (precious / "keep").exists()
    assert (source / "checkpoints" / "vision" / "7" / "weights").exists()
    assert (source / "checkpoints" / "vision" / "8" / "weights").exists()


def test_a_symlink_in_the_volume_is_never_followed_out_of_it(volume):
    source, precious = volume
    # The job's dir is a link out of the volume, and so is a tenant's dir.
    (source / "checkpoints" / "vision" / "7" / "weights").unlink()
    (source / "checkpoints" / "vision" / "7").rmdir()
    (source / "checkpoints" / "vision" / "7").symlink_to(precious)
    (source / "checkpoints" / "evil").symlink_to(precious.parent)
    assert not delete_checkpoint_dir(str(source / "checkpoints" / "vision" / "7"), str(source), 7)
    assert checkpoint_dir_inside(str(source / "checkpoints/evil/precious"), str(source), 7) is None
    assert not delete_checkpoint_dir(str(source / "checkpoints/evil/ckpt"), str(source), 7)
    assert (precious / "keep").exists() and (source / "checkpoints" / "vision" / "8").exists()


def test_a_symlink_inside_a_checkpoint_dir_is_removed_not_followed(volume):
    source, precious = volume
    job_dir = source / "checkpoints" / "vision" / "7"
    (job_dir / "link").symlink_to(precious)
    assert dir_bytes(str(job_dir)) == 1  # its own file only, not what the link points at
    assert delete_checkpoint_dir(str(job_dir), str(source), 7)
    assert (precious / "keep").exists()


def test_the_agent_reports_its_volumes_and_deletes_due_checkpoint_dirs_in_its_volume_only(
    control_plane, state_dir, volume, tmp_path
):
    source, precious = volume
    datasets = tmp_path / "datasets"
    datasets.mkdir()
    control_plane.volumes = [
        {"name": "ckpt", "kind": "host_path", "source": str(source), "checkpoints": True},
        {"name": "datasets", "kind": "host_path", "source": str(datasets), "checkpoints": False},
        {
            "name": "elsewhere",
            "kind": "host_path",
            "source": str(tmp_path / "no"),
            "checkpoints": False,
        },
        {"name": "cache", "kind": "engine_volume", "source": "cache", "checkpoints": False},
    ]
    control_plane.checkpoint_deletions = [
        {"job_id": 7, "host_path": str(source / "checkpoints" / "vision" / "7")},
        {"job_id": 99, "host_path": str(precious)},
    ]
    agent = make_agent(control_plane, state_dir)
    agent.storage.step_volumes()
    (report,) = control_plane.volume_reports
    # The process runtime has no engine volumes; a missing folder is not a volume here.
    assert report == {"present": ["ckpt", "datasets"], "deleted_checkpoints": [7]}
    assert not (source / "checkpoints" / "vision" / "7").exists()
    assert (precious / "keep").exists()
    agent.storage.step_volumes()  # nothing changed, nothing deleted: nothing to say
    assert len(control_plane.volume_reports) == 1
    datasets.rmdir()
    agent.storage.step_volumes()
    assert control_plane.volume_reports[-1]["present"] == ["ckpt"]


@pytest.fixture
def open_dir():
    """A directory anyone may enter (pytest's tmp_path is its owner's alone)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="gpucp-volume-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_checkpoint_volume_the_agent_cannot_write_is_not_present(open_dir):
    """Checked as an unprivileged user: root writes anywhere, so as root (CI) the check runs in a
    child that has dropped to nobody, the way an agent runs without root."""
    from agents.volumes import volume_present

    writable, read_only = open_dir / "rw", open_dir / "ro"
    for path, mode in ((writable, 0o777), (read_only, 0o555)):
        path.mkdir()
        path.chmod(mode)

    def present(source) -> bool:
        volume = {"name": "ckpt", "kind": "host_path", "source": str(source), "checkpoints": True}
        if os.geteuid() != 0:
            return volume_present(volume, runtime=None)  # type: ignore[arg-type]
        pid = os.fork()
        if pid == 0:  # the child: drop to nobody, answer through the exit status
            try:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                os._exit(0 if volume_present(volume, runtime=None) else 1)  # type: ignore[arg-type]
            except BaseException:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) in (0, 1), "the unprivileged check could not run"
        return os.WEXITSTATUS(status) == 0

    assert present(writable)
    assert not present(read_only)
    # A plain volume needs no writing: only the checkpoint volume is held to it.
    assert volume_present({"kind": "host_path", "source": str(read_only)}, runtime=None)  # type: ignore[arg-type]


def test_a_control_plane_without_volumes_is_left_alone(control_plane, state_dir):
    agent = make_agent(control_plane, state_dir)
    agent.storage.step_volumes()  # control_plane.volumes is None: 404
    assert agent.storage.feature_absent
    assert control_plane.volume_reports == []


def test_the_storage_worker_never_blocks_the_heartbeat(control_plane, state_dir, monkeypatch):
    """A hung file system stalls the storage thread, never the loop's cycle."""
    import threading

    from agents import volumes

    stuck = threading.Event()
    release = threading.Event()

    def hung_stat(path):
        stuck.set()
        release.wait(30)
        return None

    monkeypatch.setattr(volumes, "marker_mtime", hung_stat)
    agent = make_agent(control_plane, state_dir)
    agent.storage.track(1, "/nfs/hung/checkpoints/t/1", None, False)
    worker = threading.Thread(target=agent.storage.step, daemon=True)
    worker.start()
    assert stuck.wait(10)
    try:
        assert agent.cycle()  # answered while the storage pass hangs
    finally:
        release.set()
        worker.join(10)


def test_a_job_the_fence_had_to_kill_is_reported_killed_after_its_grace(control_plane, state_dir):
    control_plane.lease_s = 600.0
    agent = make_agent(control_plane, state_dir)
    control_plane.set_desired([attempt(29, "sh", "-c", IGNORES_TERM, grace_s=30)])
    agent.cycle()
    ready(agent.runtime, 29)
    lease = leases.read_lease(state_dir)
    fence = Fence(state_dir, ProcessRuntime(state_dir))
    assert fence.check(now=lease.term_at(29)) == {29: "term"}
    wait_until(lambda: "got-term" in output(agent.runtime, 29), what="the notice")
    assert fence.check(now=lease.kill_at) == {29: "kill"}
    wait_until(
        lambda: agent.cycle() and report_of(control_plane, 29, lambda r: r["state"] == "exited"),
        what="the exit to be reported",
    )
    report = report_of(control_plane, 29, lambda r: r["state"] == "exited")
    assert report["exit_code"] == 137 and report["stop_cause"] == "fenced"
    assert report["killed_after_grace"] is True


def test_an_agent_stopping_its_jobs_on_the_way_out_gives_each_its_own_signal_and_grace(
    control_plane, state_dir
):
    from tests.agents.test_daemon import run_in_thread

    agent = make_agent(control_plane, state_dir, stop_jobs_on_exit=True)
    control_plane.set_desired(
        [
            attempt(51, "sh", "-c", EXITS_ON_USR1, stop_signal="SIGUSR1", grace_s=60),
            attempt(52, "sh", "-c", IGNORES_TERM, grace_s=0.5),
        ]
    )
    thread = run_in_thread(agent)
    wait_until(lambda: "ready" in output(agent.runtime, 51), what="the first job")
    wait_until(lambda: "ready" in output(agent.runtime, 52), what="the second job")
    agent.stop()
    thread.join(timeout=30)
    assert not thread.is_alive()
    statuses = {s.attempt_id: s for s in ProcessRuntime(state_dir).adopt()}
    assert statuses[51].exit_code == 0 and statuses[51].killed_after_grace is False
    assert statuses[52].exit_code == 137 and statuses[52].killed_after_grace is True


def test_an_attempt_with_unreadable_or_unsafe_mounts_is_reported_failed_to_start(
    control_plane, state_dir, tmp_path
):
    agent = make_agent(control_plane, state_dir)
    control_plane.set_desired(
        [
            attempt(53, "true", mounts=[{"name": "d", "kind": "host_path", "source": "/x"}]),
            attempt(
                54,
                "true",
                mounts=[
                    {"name": "d", "kind": "host_path", "source": str(tmp_path), "target": "/etc"}
                ],
            ),
        ]
    )
    agent.cycle()
    agent.cycle()
    unreadable = report_of(control_plane, 53)
    unsafe = report_of(control_plane, 54)
    assert unreadable["state"] == "failed_to_start" and "mounts[0].target" in unreadable["message"]
    assert unsafe["state"] == "failed_to_start" and "'/etc' is a system path" in unsafe["message"]
