"""A job over several nodes (a gang) through the heartbeat endpoint: each node reports its own
member, and no GPU ever holds two jobs.

Two nodes of two GPUs each run one four-GPU job. What is asserted is what a user and the
scheduler see: the job's state and reason, what each node is told to run, and which GPUs are
held (a second job cannot be admitted onto a GPU still held).
"""

from __future__ import annotations

import datetime as dt
import time

import pytest
from django.utils import timezone

from controlplane.cluster.models import Node
from controlplane.jobs import actions
from controlplane.jobs.models import (
    Allocation,
    AttemptMember,
    AttemptState,
    Job,
    JobAttempt,
    JobEvent,
    JobState,
)

from .conftest import exited, readings, running, sweep_while_hearing


@pytest.fixture
def gang(agent, make_job, vision, alice):
    """A four-GPU job over node-a (rank 0, 10.0.0.1) and node-b (rank 1, 10.0.0.2), admitted;
    returns a namespace of what the tests use."""

    class Gang:
        pass

    g = Gang()
    g.agent = agent
    g.token_a = agent.register(
        "node-a", gpus=2, advertise_address="10.0.0.1", job_port_range=[31000, 31009]
    )
    g.token_b = agent.register(
        "node-b", gpus=2, advertise_address="10.0.0.2", job_port_range=[32000, 32009]
    )
    g.a, g.b = Node.objects.get(name="node-a"), Node.objects.get(name="node-b")
    g.job = make_job(vision, alice, name="gang", gpus=4, restartable=True)
    gpus = [*g.a.gpus.order_by("index"), *g.b.gpus.order_by("index")]
    g.attempt = actions.admit_job(g.job, node=g.a, gpus=gpus, borrowed=False)
    g.make_job = lambda **kw: make_job(vision, alice, **kw)
    return g


def _beat(g, node, attempts=()):
    token = g.token_a if node == g.a else g.token_b
    return g.agent.heartbeat(token, readings(node), list(attempts))


def _both_running(g):
    _beat(g, g.a, [running(g.attempt)])
    _beat(g, g.b, [running(g.attempt)])


def _held(node) -> set[str]:
    return set(
        Allocation.objects.filter(active=True, gpu__node=node).values_list("gpu__uuid", flat=True)
    )


def _second_job_admitted_on(g, node) -> bool:
    """Whether another job can be admitted onto `node`'s GPUs now (the scheduler's own path)."""
    other = g.make_job(name="second", gpus=2)
    results = actions.admit_jobs(
        [actions.Admission(other, node, list(node.gpus.order_by("index")), False)]
    )
    return isinstance(results[other.pk], JobAttempt)


def test_each_member_is_told_its_rank_and_where_the_others_are(gang):
    a = _beat(gang, gang.a)["attempts"]
    b = _beat(gang, gang.b)["attempts"]

    common = {"num_nodes": 2, "node_addrs": ["10.0.0.1", "10.0.0.2"], "master_addr": "10.0.0.1"}
    assert a[0]["rendezvous"] == {
        **common,
        "node_rank": 0,
        "master_port": 31000,
        "gpus_per_node": 2,
    }
    assert b[0]["rendezvous"] == {
        **common,
        "node_rank": 1,
        "master_port": 31000,
        "gpus_per_node": 2,
    }


def test_rank_zero_is_the_node_with_most_of_the_gpus_and_ports_are_not_shared(
    agent, make_job, vision, alice
):
    agent.register("small", gpus=1, advertise_address="10.0.1.1")
    agent.register("big", gpus=4, advertise_address="10.0.1.2", job_port_range=[30000, 30001])
    small, big = Node.objects.get(name="small"), Node.objects.get(name="big")
    first = actions.admit_job(
        make_job(vision, alice, gpus=3),
        node=small,  # placed on the small one: rank 0 still goes where most GPUs are
        gpus=[*small.gpus.all(), *big.gpus.order_by("index")[:2]],
        borrowed=False,
    )
    second = actions.admit_job(
        make_job(vision, alice, gpus=2),
        node=big,
        gpus=list(big.gpus.order_by("index")[2:4]),
        borrowed=False,
    )
    ranks = dict(first.members.values_list("node__name", "rank"))
    assert ranks == {"big": 0, "small": 1}
    assert first.node_addrs == ["10.0.1.2", "10.0.1.1"]
    assert {first.master_port, second.master_port} == {30000, 30001}


def test_nodes_on_one_host_never_give_two_jobs_one_master_port(agent, make_job, vision, alice):
    """Simulated nodes, or several agents on one host, share its ports: a port given to a job of
    one of them is taken for the others too, in one cycle's batch and across cycles. Nodes on
    other hosts may use the same port."""
    for name in ("sim-0", "sim-1", "sim-2"):
        agent.register(name, gpus=2, advertise_address="127.0.0.1", job_port_range=[29500, 29999])
    agent.register("other-host", gpus=2, advertise_address="10.0.2.1")
    nodes = {n.name: n for n in Node.objects.filter(name__startswith=("sim-"))}
    other = Node.objects.get(name="other-host")

    def admit(batch):
        results = actions.admit_jobs(
            [
                actions.Admission(make_job(vision, alice, gpus=1), node, [gpu], False)
                for node, gpu in batch
            ]
        )
        return [r.master_port for r in results.values()]

    first = admit([(node, node.gpus.order_by("index")[0]) for node in nodes.values()])
    later = admit([(node, node.gpus.order_by("index")[1]) for node in nodes.values()])
    ports = first + later
    assert len(set(ports)) == len(ports) == 6
    assert admit([(other, other.gpus.order_by("index")[0])]) == [29500]


def test_the_job_runs_only_once_every_member_runs(gang):
    _beat(gang, gang.a, [running(gang.attempt)])
    gang.job.refresh_from_db()
    gang.attempt.refresh_from_db()
    assert gang.job.state == JobState.ADMITTED
    assert gang.attempt.state == AttemptState.ADMITTED

    _beat(gang, gang.b, [running(gang.attempt)])
    gang.job.refresh_from_db()
    gang.attempt.refresh_from_db()
    assert gang.job.state == JobState.RUNNING
    assert gang.attempt.state == AttemptState.RUNNING
    assert set(gang.attempt.members.values_list("state", flat=True)) == {AttemptState.RUNNING}


# Every way a member can end but exiting 0, with what becomes of a restartable job and of one
# that is not: (how node-b's member ends, as node-b's report or its silence, outcome).
REQUEUE, FAIL = "requeue", "fail"
ENDINGS = {
    "exit 3": ([{"state": "exited", "exit_code": 3}], FAIL),
    "exit 1": ([{"state": "exited", "exit_code": 1}], FAIL),
    "killed, 137": ([{"state": "exited", "exit_code": 137}], REQUEUE),
    "killed, -9": ([{"state": "exited", "exit_code": -9}], REQUEUE),
    "fenced": ([{"state": "exited", "exit_code": -15, "stop_cause": "fenced"}], REQUEUE),
    "port busy": ([{"state": "failed_to_start", "stop_cause": "port_busy"}], REQUEUE),
    "failed to start": ([{"state": "failed_to_start", "message": "no such image"}], FAIL),
    "vanished": ([], REQUEUE),  # its agent no longer reports it: lost
}


@pytest.mark.parametrize("restartable", [True, False], ids=["restartable", "not-restartable"])
@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_a_member_that_fails_stops_the_others_whose_gpus_stay_held_until_they_are_gone(
    gang, ending, restartable
):
    Job.objects.filter(pk=gang.job.pk).update(restartable=restartable)
    report, outcome = ENDINGS[ending]
    started = "failed_to_start" not in str(report)
    if started:
        _both_running(gang)
    else:
        _beat(gang, gang.a, [running(gang.attempt)])
    # node-b's member ends (or its agent stops reporting it), a moment after it started.
    time.sleep(0.01)
    answer_b = _beat(
        gang, gang.b, [{**running(gang.attempt, finished_at=time.time()), **r} for r in report]
    )

    assert answer_b["attempts"] == []
    gang.attempt.refresh_from_db()
    assert gang.attempt.stop_requested_at is not None, "the other members must be stopped"
    # node-a is told to stop: its answer no longer lists the attempt.
    assert _beat(gang, gang.a, [running(gang.attempt)])["attempts"] == []
    # node-b's GPUs are free; node-a's stay held until node-a says its process is gone.
    assert _held(gang.b) == set()
    assert _held(gang.a) == {"GPU-node-a-0", "GPU-node-a-1"}
    assert not _second_job_admitted_on(gang, gang.a)
    gang.job.refresh_from_db()
    assert gang.job.state in (JobState.ADMITTED, JobState.RUNNING)

    _beat(gang, gang.a, [exited(gang.attempt, -15)])

    assert _held(gang.a) == set()
    gang.job.refresh_from_db()
    requeued = outcome == REQUEUE and (restartable or ending == "port busy")
    assert gang.job.state == (JobState.PENDING if requeued else JobState.FAILED)
    failure = JobEvent.objects.filter(job=gang.job, kind="member_failed").get()
    assert "Rank 1 on node-b" in failure.message
    if not requeued:
        assert "Rank 1 on node-b" in gang.job.state_reason
    members = dict(gang.attempt.members.values_list("rank", "state"))
    assert members[0] == AttemptState.STOPPED
    assert members[1] in (AttemptState.FAILED, AttemptState.LOST)


def test_a_member_that_exits_0_leaves_the_others_running_and_the_job_succeeds_with_all(gang):
    _both_running(gang)
    _beat(gang, gang.b, [exited(gang.attempt, 0)])

    gang.attempt.refresh_from_db()
    gang.job.refresh_from_db()
    assert gang.attempt.stop_requested_at is None
    assert gang.job.state == JobState.RUNNING
    assert [a["attempt_id"] for a in _beat(gang, gang.a, [running(gang.attempt)])["attempts"]] == [
        gang.attempt.pk
    ]
    assert _held(gang.b) == set() and len(_held(gang.a)) == 2

    _beat(gang, gang.a, [exited(gang.attempt, 0)])
    gang.job.refresh_from_db()
    assert gang.job.state == JobState.SUCCEEDED
    assert gang.job.exit_code == 0
    assert _held(gang.a) == set()


def test_a_cancelled_gang_frees_each_nodes_gpus_when_that_node_says_so(gang):
    _both_running(gang)
    actions.cancel_job(gang.job)

    assert _beat(gang, gang.b, [exited(gang.attempt, -15)])["attempts"] == []
    assert _held(gang.b) == set() and len(_held(gang.a)) == 2
    _beat(gang, gang.a, [exited(gang.attempt, -15)])
    assert _held(gang.a) == set()
    gang.job.refresh_from_db()
    gang.attempt.refresh_from_db()
    assert gang.job.state == JobState.CANCELLED
    assert gang.attempt.state == AttemptState.STOPPED


@pytest.fixture
def lease(settings):
    settings.NODE_LEASE_S = 120.0
    settings.NODE_LEASE_MARGIN_S = 10.0
    settings.LIVENESS_SWEEP_GAP_S = 30.0
    settings.LIVENESS_DEAF_AFTER_S = 30.0
    return 130.0


def test_a_lost_node_loses_its_member_alone_and_the_others_are_stopped(gang, lease):
    _both_running(gang)
    now = timezone.now()
    Node.objects.filter(pk=gang.b.pk).update(last_heartbeat_at=now - dt.timedelta(seconds=200))
    result = sweep_while_hearing(now)  # past its lease and margin: lost

    assert result["lost_attempts"] == [gang.attempt.pk]
    gang.attempt.refresh_from_db()
    assert gang.attempt.state == AttemptState.RUNNING  # node-a's member still runs
    assert gang.attempt.stop_requested_at is not None
    assert _held(gang.b) == set() and len(_held(gang.a)) == 2
    member_b = AttemptMember.objects.get(attempt=gang.attempt, node=gang.b)
    assert member_b.state == AttemptState.LOST

    _beat(gang, gang.a, [exited(gang.attempt, -15)])
    gang.job.refresh_from_db()
    assert gang.job.state == JobState.PENDING  # restartable: requeued
    assert _held(gang.a) == set()


def test_a_one_node_attempt_has_one_member_that_moves_with_it(
    agent, node01, make_job, vision, alice, admit
):
    node, token = node01
    job = make_job(vision, alice, gpus=2)
    attempt = admit(job, node, gpu_indexes=(0, 1))
    (member,) = attempt.members.all()
    assert (member.rank, member.gpus, member.state) == (0, 2, AttemptState.ADMITTED)

    agent.heartbeat(token, readings(node), [running(attempt)])
    member.refresh_from_db()
    assert member.state == AttemptState.RUNNING and member.started_at is not None

    agent.heartbeat(token, readings(node), [exited(attempt, 3)])
    member.refresh_from_db()
    job.refresh_from_db()
    assert (member.state, member.exit_code) == (AttemptState.FAILED, 3)
    assert job.state == JobState.FAILED
    assert job.state_reason == "Exited with code 3"


def test_a_gang_whose_master_could_not_start_never_runs_and_is_requeued_though_not_restartable(
    gang,
):
    Job.objects.filter(pk=gang.job.pk).update(restartable=False)
    _beat(
        gang,
        gang.a,
        [
            {
                **running(gang.attempt),
                "state": "failed_to_start",
                "stop_cause": "port_busy",
                "message": "its master port is taken",
            }
        ],
    )
    # The other member started meanwhile: the job still never ran as a whole.
    _beat(gang, gang.b, [running(gang.attempt)])
    gang.job.refresh_from_db()
    assert gang.job.state == JobState.ADMITTED

    _beat(gang, gang.b, [exited(gang.attempt, -15)])
    gang.job.refresh_from_db()
    assert gang.job.state == JobState.PENDING
    assert _held(gang.a) == _held(gang.b) == set()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("advertise_address", "10.0.0.1; rm -rf /"),
        ("advertise_address", ""),
        ("advertise_address", 7),
        ("job_port_range", [30000]),
        ("job_port_range", [30010, 30000]),
        ("job_port_range", [0, 10]),
        ("job_port_range", [1, 70000]),
        ("job_port_range", [True, 10]),
    ],
)
def test_a_registration_with_an_unusable_address_or_port_range_is_a_400_naming_it(
    agent, field, value
):
    from .conftest import inventory

    response = agent.post("register", inventory("node-x", **{field: value}), agent.join_token)
    assert response.status_code == 400
    assert field in response.json()
    assert not Node.objects.filter(name="node-x").exists()


def test_a_heartbeat_carries_a_new_address_and_a_bad_one_is_left_out_with_a_warning(agent):
    token = agent.register("node-x", gpus=1, advertise_address="10.0.0.1")
    node = Node.objects.get(name="node-x")
    agent.heartbeat(token, readings(node), advertise_address="10.0.0.9", job_port_range=[1, 2])
    node.refresh_from_db()
    assert (node.advertise_address, node.job_port_min, node.job_port_max) == ("10.0.0.9", 1, 2)

    answer = agent.heartbeat(token, readings(node), advertise_address="not an address")
    node.refresh_from_db()
    assert node.advertise_address == "10.0.0.9"
    assert "advertise_address" in answer["warnings"]
