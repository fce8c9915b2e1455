"""A node that is down or cordoned for a minute does not make valid submissions a 400.

The bug this guards against: the submit's "largest node" check counted only ready, schedulable
nodes, so while nodes were briefly not ready, valid jobs were refused. The check counts every
registered node; a job waiting for nodes to come back is accepted, and its pending reason says
so. Only a job no registered node could ever hold is still refused.
"""

import pytest
from django.urls import reverse

from controlplane.cluster.models import Node, NodeState
from controlplane.jobs.models import Job, JobState
from controlplane.scheduling.cycle import run_scheduling_cycle
from tests.controlplane.api.helpers import job_body

G = "H100-SXM-80GB"


def submit(world, **overrides):
    world.ensure("users")
    return world.client("member").post("/api/v1/jobs/", job_body(**overrides), format="json")


def take_out(node, *, ready=True, state=NodeState.READY):
    Node.objects.filter(pk=node.pk).update(ready=ready, state=state)


@pytest.mark.parametrize(
    "out",
    [{"ready": False}, {"state": NodeState.CORDONED}, {"state": NodeState.DRAINING}],
    ids=["not-ready", "cordoned", "draining"],
)
def test_a_job_for_a_node_that_is_out_is_accepted_and_says_it_waits_for_it(world, out):
    take_out(world.node, **out)  # the only node: two H100
    response = submit(world, gpus=2)
    assert response.status_code == 201, response.content
    run_scheduling_cycle(trigger="test")
    job = Job.objects.get()
    assert job.state == JobState.PENDING
    assert job.pending_reason_code == "nodes_unavailable"
    assert job.pending_reason == (
        f"waiting for 2 x {G}: every node with {G} GPUs is down, cordoned or draining; "
        "it waits for them to come back"
    )


def test_once_the_node_is_back_the_waiting_job_starts(world):
    take_out(world.node, ready=False)
    assert submit(world, gpus=2).status_code == 201
    run_scheduling_cycle(trigger="test")
    take_out(world.node)
    run_scheduling_cycle(trigger="test")
    job = Job.objects.get()
    assert (job.state, job.pending_reason_code) == (JobState.ADMITTED, "")


def test_a_job_only_a_node_that_is_down_can_hold_is_accepted_beside_smaller_ones_that_are_up(
    world,
):
    world.ensure("node")  # two H100, up
    big = world.fixture("make_node")("gpu-big.example", gpus=4)
    take_out(big, ready=False)
    assert submit(world, gpus=4).status_code == 201
    run_scheduling_cycle(trigger="test")
    job = Job.objects.get()
    assert job.pending_reason_code == "nodes_unavailable"
    assert job.pending_reason == (
        f"waiting for 4 x {G}: only 2 of the cluster's 6 {G} GPUs take work now (4 are on "
        "nodes that are down, cordoned or draining); it waits for them to come back"
    )


def test_a_job_bigger_than_the_whole_cluster_is_still_a_400_naming_gpus(world):
    world.ensure("node")  # two H100, up
    take_out(world.fixture("make_node")("gpu-big.example", gpus=4), ready=False)
    response = submit(world, gpus=7)
    assert response.status_code == 400, response.content
    assert response.json()["gpus"] == [
        f"The cluster has 6 GPUs of type {G} in all: 7 cannot be given."
    ]
    assert Job.objects.count() == 0
    # Larger than any node but not than the cluster: it runs over several nodes.
    assert submit(world, gpus=5).status_code == 201


def test_more_memory_or_cpus_than_any_node_has_is_still_a_400_while_nodes_are_down(world):
    take_out(world.node, ready=False)  # 64 CPUs, 512 GiB
    response = submit(world, memory_mib=600 * 1024, cpus=65)
    assert response.status_code == 400, response.content
    assert {"memory_mib", "cpus"} <= set(response.json())
    assert Job.objects.count() == 0


def test_the_web_form_says_what_takes_work_now_beside_what_the_cluster_holds(client, world):
    take_out(world.node, state=NodeState.CORDONED)
    client.force_login(world.alice)
    html = client.get(reverse("job-submit")).content.decode()
    assert f"Largest node per type: 2 × {G}." in html
    assert f"Largest taking work now: 0 × {G}; a larger job waits for nodes" in html
