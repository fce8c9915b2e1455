"""A job over two nodes through the real processes: two agents whose nodes advertise different
addresses (127.0.0.2 and 127.0.0.3, both on loopback), the process runtime, and a plain
`torchrun` that runs an all-reduce over gloo on the CPU with no flag at all: everything it needs
comes from the job contract's environment (docs/job-contract.md).

torch comes from a virtualenv of this test's own (var/e2e-torch-2.13.0, made once with
`pip install torch==2.13.0`), never the project's.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO, free_port, processes_with_env, wait_until

pytestmark = pytest.mark.slow

TORCH = "torch==2.13.0"
VENV = REPO / "var" / "e2e-torch-2.13.0"

# Every rank prints what it was told and the sum of (rank + 1) over all ranks, then holds on
# for HOLD_S seconds (so that a test can kill one member while both run).
SCRIPT = """
import os, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
print(
    f"rank {rank} of {world} on node {os.environ['GPUCP_NODE_RANK']}"
    f"/{os.environ['GPUCP_NUM_NODES']} master {os.environ['GPUCP_MASTER_ADDR']}"
    f":{os.environ['GPUCP_MASTER_PORT']} addrs {os.environ['GPUCP_NODE_ADDRS']}"
    f" sum {total.item():g}",
    flush=True,
)
time.sleep(float(os.environ.get("HOLD_S", "0")))
dist.destroy_process_group()
"""


def torchrun() -> Path:
    """The test's own torch, installed once (the wheel is on disk: no download)."""
    VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(VENV.parent / "e2e-torch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another session may be making it right now
        done = VENV / "installed"
        if not done.exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
            subprocess.run(
                [str(VENV / "bin" / "python"), "-m", "pip", "install", "-q", TORCH],
                check=True,
                timeout=900,
            )
            done.write_text(TORCH)
    return VENV / "bin" / "torchrun"


@pytest.fixture
def two_nodes(cluster, tmp_path):
    """Agents node-a (127.0.0.2) and node-b (127.0.0.3), one GPU each, and the script; a job
    asking for two GPUs can only run over both."""
    launcher = torchrun()
    port = free_port()
    for name, address in (("node-a", "127.0.0.2"), ("node-b", "127.0.0.3")):
        cluster.start_agent(
            name,
            extra_env={
                "GPUCP_ADVERTISE_ADDRESS": address,
                "GPUCP_JOB_PORT_RANGE": f"{port}-{port}",
            },
        )
    script = tmp_path / "allreduce.py"
    script.write_text(SCRIPT)
    return cluster, [str(launcher), str(script)], port


def _output(cluster, job_id: int, rank: int, needle: str) -> str:
    return wait_until(
        lambda: (lambda t: t if needle in t else None)(
            cluster.logs(job_id, attempt=1, rank=rank)["text"]
        ),
        60,
        f"rank {rank}'s output to say {needle!r}",
    )


def _gpus_never_shared() -> None:
    """No GPU was ever held by two attempts at once: its allocations' spans do not overlap."""
    from controlplane.jobs.models import Allocation

    spans: dict[int, list] = {}
    for gpu_id, start, end in Allocation.objects.values_list("gpu_id", "created_at", "released_at"):
        spans.setdefault(gpu_id, []).append((start, end))
    for gpu_id, held in spans.items():
        held.sort()
        for (_, end), (next_start, _) in zip(held, held[1:], strict=False):
            assert end is not None and end <= next_start, f"GPU {gpu_id} held twice: {held}"


def test_torchrun_all_reduces_over_two_nodes_and_a_killed_member_stops_the_other(two_nodes):
    cluster, command, port = two_nodes
    env = {"GLOO_SOCKET_IFNAME": "lo"}

    # 1. Both ranks meet at rank 0's address and sum 1 + 2.
    job_id = cluster.submit(command, gpus=2, env=env, restartable=False)
    job = cluster.wait_for_state(job_id, "SUCCEEDED", "FAILED", timeout_s=120)
    assert job["state"] == "SUCCEEDED", job["state_reason"]
    (attempt,) = job["attempts"]
    assert attempt["master_port"] == port
    members = [(m["rank"], m["node"], m["address"], m["state"]) for m in attempt["members"]]
    # Tied at one GPU each: rank 0 is the attempt's own node.
    assert sorted(m[2] for m in members) == ["127.0.0.2", "127.0.0.3"]
    assert {m[3] for m in members} == {"SUCCEEDED"}
    master = next(m[2] for m in members if m[0] == 0)
    addrs = ",".join(m[2] for m in sorted(members))
    for rank in (0, 1):
        text = _output(cluster, job_id, rank, "sum 3")
        assert f"rank {rank} of 2 on node {rank}/2 master {master}:{port} addrs {addrs}" in text

    # 2. One member is killed: the other is stopped, and the job is requeued (a kill is not
    # the job's own failure) with the rank, node and reason named.
    job_id = cluster.submit(command, gpus=2, env={**env, "HOLD_S": "300"}, restartable=True)
    cluster.wait_for_state(job_id, "RUNNING")  # both members run
    for rank in (0, 1):
        _output(cluster, job_id, rank, "sum 3")
    attempt_id = cluster.job(job_id)["attempts"][0]["id"]
    member_1 = set(processes_with_env(f"GPUCP_ATTEMPT_ID={attempt_id}")) & set(
        processes_with_env("GPUCP_NODE_RANK=1")
    )
    cmdlines = {p: Path(f"/proc/{p}/cmdline").read_bytes() for p in member_1}
    # torchrun itself (not its supervisor, which names it too, nor its workers).
    launchers = [p for p, c in cmdlines.items() if b"torchrun" in c and b"supervise" not in c]
    assert launchers, "rank 1's torchrun is not running"
    os.killpg(os.getpgid(launchers[0]), signal.SIGKILL)

    job = cluster.wait_for_job(
        job_id,
        lambda j: j["attempts"][0]["state"] not in ("ADMITTED", "RUNNING"),
        "its first attempt to end",
        timeout_s=60,
    )
    first = job["attempts"][0]
    states = {m["rank"]: (m["state"], m["exit_code"]) for m in first["members"]}
    story = [(e["kind"], e["message"]) for e in job["events"]]
    # The killed member failed: 137 when the kill ends torchrun itself; a busy CI run once saw
    # 1 instead, as torchrun does when it outlives a killed worker and reports it. The issue
    # allows either outcome below; what must hold is that the other member is stopped and the
    # job goes on by the rule its member's code calls for.
    state, code = states[1]
    assert state == "FAILED" and code not in (0, None), (states, story)
    assert states[0][0] == "STOPPED", (states, story)  # its stop signal: it had not failed
    kinds = [e["kind"] for e in job["events"]]
    failed = next(e for e in job["events"] if e["kind"] == "member_failed")
    assert "Rank 1 on" in failed["message"] and str(code) in failed["message"]
    # Killed by a signal: not the job's own doing, requeued (it is restartable). Exit 1 to 127:
    # the job's own failure, as for a one-node job: it fails, naming the member.
    if code > 128:
        assert "requeued" in kinds, story
    else:
        job = cluster.wait_for_state(job_id, "FAILED", timeout_s=60)
        assert "Rank 1 on" in job["state_reason"], job["state_reason"]

    if cluster.job(job_id)["state"] not in ("FAILED", "SUCCEEDED", "CANCELLED"):
        cluster.cancel(job_id)
    cluster.wait_for_job(
        job_id,
        lambda j: all(a["state"] not in ("ADMITTED", "RUNNING") for a in j["attempts"]),
        "every attempt to end after the cancel",
        timeout_s=60,
    )
    _gpus_never_shared()
