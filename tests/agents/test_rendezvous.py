"""Where a job's nodes meet (the answer's `rendezvous`), as the agent hands it to the job.

The variables are read by the job itself (process runtime, a real process): the multi-node
contract of docs/job-contract.md, torchrun's PET_ flags among them.
"""

import socket

import pytest

from agents.runtime.base import AttemptSpec, AttemptState, RendezvousSpec
from agents.runtime.process import ProcessRuntime
from tests.agents.conftest import wait_until
from tests.agents.test_daemon import attempt, make_agent

NAMES = (
    "GPUCP_NUM_NODES",
    "GPUCP_NODE_RANK",
    "GPUCP_GPUS_PER_NODE",
    "GPUCP_NODE_ADDRS",
    "GPUCP_MASTER_ADDR",
    "GPUCP_MASTER_PORT",
    "PET_NNODES",
    "PET_NODE_RANK",
    "PET_NPROC_PER_NODE",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
    "MASTER_ADDR",
    "WORLD_SIZE",
)
PRINT_ENV = "; ".join(f'echo "{n}=${{{n}-unset}}"' for n in NAMES)


def _env_of(state_dir, attempt_id, rendezvous, env=None) -> dict[str, str]:
    runtime = ProcessRuntime(state_dir)
    runtime.start(
        AttemptSpec(
            attempt_id=attempt_id,
            command=("sh", "-c", PRINT_ENV),
            env=env or {},
            rendezvous=rendezvous,
        )
    )

    def done():
        return next(
            (
                s
                for s in runtime.statuses()
                if s.attempt_id == attempt_id and s.state is not AttemptState.RUNNING
            ),
            None,
        )

    assert wait_until(done, what="the job to end").exit_code == 0
    text = runtime.read_logs(attempt_id, 0, 100_000).decode()
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def test_a_member_of_a_two_node_job_knows_its_rank_and_its_peers(state_dir):
    rendezvous = RendezvousSpec(1, ("10.0.0.7", "10.0.0.8"), 29517, 4)

    env = _env_of(state_dir, 31, rendezvous)

    assert env == {
        "GPUCP_NUM_NODES": "2",
        "GPUCP_NODE_RANK": "1",
        "GPUCP_GPUS_PER_NODE": "4",
        "GPUCP_NODE_ADDRS": "10.0.0.7,10.0.0.8",
        "GPUCP_MASTER_ADDR": "10.0.0.7",
        "GPUCP_MASTER_PORT": "29517",
        "PET_NNODES": "2",
        "PET_NODE_RANK": "1",
        "PET_NPROC_PER_NODE": "4",
        "PET_MASTER_ADDR": "10.0.0.7",
        "PET_MASTER_PORT": "29517",
        # torchrun sets these for its workers; the platform leaves them alone.
        "MASTER_ADDR": "unset",
        "WORLD_SIZE": "unset",
    }


def test_a_one_node_job_gets_the_same_names_with_one_node_and_a_torchrun_flag_it_set_wins(
    state_dir,
):
    rendezvous = RendezvousSpec(0, ("10.0.0.7",), 29500, 0)

    env = _env_of(state_dir, 32, rendezvous, env={"PET_NPROC_PER_NODE": "3"})

    assert env["GPUCP_NUM_NODES"] == env["PET_NNODES"] == "1"
    assert env["GPUCP_NODE_RANK"] == "0"
    assert env["GPUCP_MASTER_ADDR"] == "10.0.0.7"
    assert env["PET_NPROC_PER_NODE"] == "3"


@pytest.mark.parametrize(
    "raw",
    [
        "10.0.0.7",
        {"node_rank": 0, "node_addrs": [], "master_port": 29500, "gpus_per_node": 1},
        {"node_rank": 2, "node_addrs": ["a", "b"], "master_port": 29500, "gpus_per_node": 1},
        {"node_rank": 0, "node_addrs": ["a"], "master_port": 70000, "gpus_per_node": 1},
        {"node_rank": True, "node_addrs": ["a"], "master_port": 29500, "gpus_per_node": 1},
        {"node_rank": 0, "node_addrs": [7], "master_port": 29500, "gpus_per_node": 1},
    ],
)
def test_a_rendezvous_the_agent_cannot_read_refuses_the_start(raw):
    spec = AttemptSpec.from_wire({"attempt_id": 5, "rendezvous": raw})
    assert spec.rendezvous is None
    assert "rendezvous" in spec.refused


def test_rank_zero_does_not_start_when_its_master_port_is_taken(control_plane, state_dir):
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        agent = make_agent(control_plane, state_dir)
        rendezvous = {
            "node_rank": 0,
            "node_addrs": ["10.0.0.7", "10.0.0.8"],
            "master_port": port,
            "gpus_per_node": 1,
        }
        control_plane.set_desired([attempt(6, "true", rendezvous=rendezvous)])
        agent.cycle()
        agent.cycle()

    (report,) = control_plane.reported(6)
    assert report["state"] == "failed_to_start"
    assert report["stop_cause"] == "port_busy"
    assert str(port) in report["message"]


def test_the_agent_tells_where_its_jobs_are_reached(control_plane, state_dir):
    agent = make_agent(
        control_plane, state_dir, advertise_address="10.9.8.7", job_port_range=(31000, 31099)
    )
    agent.ensure_registered()
    agent.cycle()
    agent.cycle()

    (registration,) = control_plane.registrations
    assert registration["advertise_address"] == "10.9.8.7"
    assert registration["job_port_range"] == [31000, 31099]
    # Told once more in the first heartbeat (a restarted agent may have moved), then no more.
    first, second = control_plane.heartbeats[:2]
    assert first["advertise_address"] == "10.9.8.7"
    assert "advertise_address" not in second
