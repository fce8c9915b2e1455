"""A registration whose answer was lost: the agent sends it again with the same registration key
and gets a node token for the node the first made, not a refusal for the join token the first
spent. Anything else that is not that very retry is refused as before."""

import datetime as dt
import threading

import pytest
from django.db import connection, transaction
from django.utils import timezone

from controlplane.cluster import actions
from controlplane.cluster.agent_api import parse_registration
from controlplane.cluster.agent_auth import AgentAuthError, issue_join_token
from controlplane.cluster.models import GPU, JoinToken, Node
from controlplane.tenancy.models import hash_token

from .conftest import inventory, readings

KEY = "k" * 43
OTHER_KEY = "o" * 43


@pytest.fixture
def one_use(pool):
    """A join token with one use, as an admin hands one to a new host."""
    token, raw = issue_join_token(pool, expires_at=timezone.now() + dt.timedelta(hours=1))
    return token, raw


_tries = iter(range(1, 10**6))


def _register(agent, raw, name="node-01", key=KEY, try_number=None, **fields):
    """One try, numbered after every earlier one unless try_number says otherwise."""
    body = inventory(name, gpus=2, **fields)
    if key is not None:
        body["registration_key"] = key
        body["registration_try"] = try_number if try_number is not None else next(_tries)
    return agent.post("register", body, raw)


def test_a_retry_of_a_registration_whose_answer_was_lost_gets_a_node_token(agent, one_use):
    token, raw = one_use
    lost = _register(agent, raw)  # the control plane did it; the agent never read the answer
    assert lost.status_code == 201

    again = _register(agent, raw)
    assert again.status_code == 201, again.content
    new_token = again.json()["node_token"]
    assert new_token != lost.json()["node_token"]
    node = Node.objects.get()
    assert node.token_hash == hash_token(new_token)  # the first token, never read, is void
    assert (
        agent.post(
            "heartbeat", agent.heartbeat_body(readings(node)), lost.json()["node_token"]
        ).status_code
        == 401
    )
    agent.heartbeat(new_token, readings(node))
    token.refresh_from_db()
    assert token.uses == 1  # the retry spent nothing
    assert list(node.gpus.values_list("uuid", flat=True)) == ["GPU-node-01-0", "GPU-node-01-1"]


def test_a_multi_use_token_retried_gets_the_same_node_not_a_name_conflict(agent, join_token):
    assert _register(agent, join_token).status_code == 201
    again = _register(agent, join_token)
    assert again.status_code == 201, again.content
    assert Node.objects.count() == 1
    assert JoinToken.objects.get().uses == 1


@pytest.mark.parametrize(
    "change, status",
    [
        ({"key": OTHER_KEY}, 401),  # another agent holding the join token
        ({"key": None}, 401),  # an agent of before registration keys
        ({"name": "node-02"}, 401),  # another node: the one use is spent
    ],
)
def test_what_is_not_the_same_registration_is_refused_as_before(agent, one_use, change, status):
    _, raw = one_use
    assert _register(agent, raw).status_code == 201
    assert _register(agent, raw, **change).status_code == status
    assert Node.objects.count() == 1


def test_no_retry_once_the_first_node_token_was_used(agent, one_use):
    """A heartbeat with the first token means its answer did arrive: a second holder of the
    join token and the key gets nothing."""
    _, raw = one_use
    first = _register(agent, raw).json()["node_token"]
    agent.heartbeat(first, readings(Node.objects.get()))
    assert _register(agent, raw).status_code == 401
    assert Node.objects.get().token_hash == hash_token(first)


@pytest.mark.parametrize("how", ["revoked", "expired", "too_late", "deregistered"])
def test_no_retry_with_a_join_token_no_longer_good_or_after_the_window(agent, one_use, how):
    token, raw = one_use
    first = _register(agent, raw).json()["node_token"]
    node = Node.objects.get()
    if how == "revoked":
        JoinToken.objects.filter(pk=token.pk).update(revoked_at=timezone.now())
    elif how == "expired":
        JoinToken.objects.filter(pk=token.pk).update(expires_at=timezone.now())
    elif how == "too_late":
        earlier = timezone.now() - dt.timedelta(seconds=actions.REGISTRATION_RETRY_S + 1)
        Node.objects.filter(pk=node.pk).update(registered_at=earlier, last_heartbeat_at=earlier)
    else:
        Node.objects.filter(pk=node.pk).update(deregistered_at=timezone.now())
    assert _register(agent, raw).status_code == 401
    assert Node.objects.get().token_hash == hash_token(first)


@pytest.mark.parametrize(
    "field, value",
    [
        ("registration_key", "short"),
        ("registration_key", "x" * 129),
        ("registration_key", "has space" + "x" * 30),
        ("registration_key", "é" * 40),
        ("registration_key", 12345),
        ("registration_try", 0),
        ("registration_try", 2**31),
        ("registration_try", "2"),
        ("registration_try", 1.5),
    ],
)
def test_a_registration_key_or_try_that_is_not_one_is_refused_naming_it(
    agent, one_use, field, value
):
    token, raw = one_use
    body = {**inventory("node-01", gpus=2), "registration_key": KEY, "registration_try": 1}
    body[field] = value
    response = agent.post("register", body, raw)
    assert response.status_code == 400
    assert field in response.json()
    token.refresh_from_db()
    assert token.uses == 0 and not Node.objects.exists()


def test_an_earlier_try_answered_after_a_later_one_takes_no_node_token(agent, one_use):
    """Try 2 was still in flight when the agent gave up on it; try 3 got the node token. Try 2
    reaching the control plane now must not make that token stop working."""
    _, raw = one_use
    assert _register(agent, raw, try_number=1).status_code == 201
    third = _register(agent, raw, try_number=3)
    assert third.status_code == 201
    assert _register(agent, raw, try_number=2).status_code == 401
    assert _register(agent, raw, try_number=3).status_code == 401  # a try is answered once
    node = Node.objects.get()
    assert node.token_hash == hash_token(third.json()["node_token"])
    agent.heartbeat(third.json()["node_token"], readings(node))


@pytest.mark.django_db(transaction=True)
def test_a_retry_that_arrives_while_the_first_try_is_still_being_written_waits_for_it(pool):
    """The agent gave up on a slow first try and sent the second while the control plane was
    still writing the first: the second waits for the first to commit, then gets the node."""
    _, raw = issue_join_token(pool, expires_at=timezone.now() + dt.timedelta(hours=1))
    body = {**inventory("node-01", gpus=2), "registration_key": KEY}
    first_written = threading.Event()
    let_it_commit = threading.Event()
    outcomes = {}

    def first_try():
        try:
            with transaction.atomic():
                outcomes["first"] = actions.register_node(raw, {**body, "registration_try": 1})
                first_written.set()
                let_it_commit.wait(timeout=30)
        finally:
            connection.close()

    def second_try():
        try:
            outcomes["second"] = actions.register_node(raw, {**body, "registration_try": 2})
        except Exception as exc:  # noqa: BLE001 - what it raised is the outcome
            outcomes["second"] = exc
        finally:
            connection.close()

    body = parse_registration(body)
    first = threading.Thread(target=first_try)
    first.start()
    assert first_written.wait(timeout=30)
    second = threading.Thread(target=second_try)
    second.start()
    second.join(timeout=1.0)
    assert second.is_alive()  # waiting for the first try's transaction
    let_it_commit.set()
    first.join(timeout=30)
    second.join(timeout=30)
    node, token = outcomes["second"]
    assert node.name == "node-01" and Node.objects.count() == 1
    assert Node.objects.get().token_hash == hash_token(token)
    assert JoinToken.objects.get().uses == 1


def _held_registrations(monkeypatch, held_name: str):
    """(inside, let_go): the registration of `held_name` stops just before it issues the node
    token, its node and GPUs written, until let_go is set; `inside` is set when it got there."""
    inside, let_go = threading.Event(), threading.Event()
    issue = actions.rotate_node_token

    def rotate(node):
        if node.name == held_name:
            inside.set()
            let_go.wait(timeout=60)
        return issue(node)

    monkeypatch.setattr(actions, "rotate_node_token", rotate)
    return inside, let_go


def _in_thread(outcomes: dict, name: str, raw: str, key: str) -> threading.Thread:
    body = parse_registration({**inventory(name, gpus=2), "registration_key": key})

    def run():
        try:
            outcomes[name] = actions.register_node(raw, {**body, "registration_try": 1})
        except Exception as exc:  # noqa: BLE001 - what it raised is the outcome
            outcomes[name] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.django_db(transaction=True)
def test_nodes_joining_with_one_join_token_do_not_wait_for_each_others_registration(
    pool, monkeypatch
):
    """A pool's agents restarted together register at once: another node's registration with
    the same join token completes while one is still being written (they used to queue on the
    token, each waiting for every registration before it)."""
    _, raw = issue_join_token(pool, expires_at=timezone.now() + dt.timedelta(hours=1), max_uses=5)
    inside, let_go = _held_registrations(monkeypatch, "node-01")
    outcomes: dict = {}
    first = _in_thread(outcomes, "node-01", raw, KEY)
    try:
        assert inside.wait(timeout=30)
        second = _in_thread(outcomes, "node-02", raw, OTHER_KEY)
        second.join(timeout=30)
        finished_meanwhile = not second.is_alive()
    finally:
        let_go.set()
        first.join(timeout=30)
    second.join(timeout=30)

    assert finished_meanwhile
    assert {name: type(o).__name__ for name, o in outcomes.items()} == {
        "node-01": "tuple",
        "node-02": "tuple",
    }
    assert sorted(Node.objects.values_list("name", flat=True)) == ["node-01", "node-02"]
    assert JoinToken.objects.get().uses == 2


@pytest.mark.django_db(transaction=True)
def test_a_registration_whose_join_token_was_used_up_while_it_was_written_is_refused_whole(
    pool, monkeypatch
):
    """The last use of a token, taken by another node while this registration was being
    written: this one is refused and leaves nothing behind (no node, no GPU, no use spent)."""
    _, raw = issue_join_token(pool, expires_at=timezone.now() + dt.timedelta(hours=1))
    inside, let_go = _held_registrations(monkeypatch, "node-01")
    outcomes: dict = {}
    first = _in_thread(outcomes, "node-01", raw, KEY)
    try:
        assert inside.wait(timeout=30)
        _in_thread(outcomes, "node-02", raw, OTHER_KEY).join(timeout=30)
    finally:
        let_go.set()
        first.join(timeout=30)

    assert isinstance(outcomes["node-02"], tuple)
    assert isinstance(outcomes["node-01"], AgentAuthError)
    assert list(Node.objects.values_list("name", flat=True)) == ["node-02"]
    assert GPU.objects.filter(node__name="node-01").count() == 0
    assert JoinToken.objects.get().uses == 1
