"""Fixtures for the agent API: join tokens, a registered node, and a client speaking the protocol.

The client is not a fake agent: it sends the JSON of docs/agent-protocol.md through Django's
test client, so every test goes through URL routing, authentication and validation.
"""

from __future__ import annotations

import datetime as dt
import json
import time

import pytest
from django.utils import timezone


def inventory(name: str, gpus: int = 8, model: str = "H100-SXM-80GB", **fields) -> dict:
    body = {
        "name": name,
        "cpus": 64,
        "memory_mib": 512 * 1024,
        "labels": {"rack": "a1"},
        "agent_version": "0.1.0",
        "runtime": "process",
        "gpus": [
            {
                "index": i,
                "uuid": f"GPU-{name}-{i}",
                "model": model,
                "memory_mib": 81559,
                "power_min_w": 200.0,
                "power_max_w": 700.0,
                "power_default_w": 700.0,
            }
            for i in range(gpus)
        ],
    }
    body.update(fields)
    return body


def gpu_reading(uuid: str, **fields) -> dict:
    reading = {
        "uuid": uuid,
        "healthy": True,
        "utilization_pct": 50.0,
        "memory_used_mib": 1000.0,
        "power_draw_w": 300.0,
        "power_cap_w": 700.0,
        "energy_j": 1_000_000.0,
        "temperature_c": 55.0,
        "sm_clock_mhz": 1500.0,
        "throttle_reasons": [],
        "ecc_errors": 0,
    }
    reading.update(fields)
    return reading


class AgentClient:
    """Speaks the agent protocol to the control plane under test."""

    def __init__(self, client, join_token: str):
        self.client = client
        self.join_token = join_token
        self.seq = 0

    def post(self, path: str, body, token: str | None):
        headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
        return self.client.post(
            f"/api/agent/v1/{path}",
            data=body if isinstance(body, str | bytes) else json.dumps(body),
            content_type="application/json",
            **headers,
        )

    def register(self, name: str, gpus: int = 8, **fields) -> str:
        response = self.post("register", inventory(name, gpus, **fields), self.join_token)
        assert response.status_code == 201, response.content
        return response.json()["node_token"]

    def rejoin(self, name: str, gpus: int = 8, **fields) -> str:
        """Register an existing node again, as its admin would: with a join token for its name."""
        response = self.post("register", inventory(name, gpus, **fields), rejoin_token(name))
        assert response.status_code == 201, response.content
        return response.json()["node_token"]

    def heartbeat_body(self, gpus: list[dict], attempts: list[dict] = (), **fields) -> dict:
        self.seq += 1
        body = {"seq": self.seq, "sent_at": time.time(), "gpus": gpus, "attempts": list(attempts)}
        body.update(fields)
        return body

    def heartbeat(self, token: str, gpus: list[dict], attempts: list[dict] = (), **fields):
        response = self.post("heartbeat", self.heartbeat_body(gpus, attempts, **fields), token)
        assert response.status_code == 200, response.content
        return response.json()


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    # People are created for every test; the production hasher's cost buys nothing here.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(autouse=True)
def _telemetry_written_inline(settings):
    # Each heartbeat's readings are on the rows when its answer comes back; the batched path
    # has its own tests (test_telemetry.py) and runs in the end-to-end suite.
    settings.TELEMETRY_FLUSH_INTERVAL_S = 0


@pytest.fixture(autouse=True)
def _forget_answers(settings):
    """Each test starts with no remembered answers (node names repeat across tests); those in
    Redis are cleared for every test (tests/conftest.py)."""
    from controlplane.cluster import heartbeat

    with heartbeat._answered_lock:
        heartbeat._answered.clear()
    heartbeat._store_failed_at = None


def rejoin_token(name: str) -> str:
    """A join token issued for this node's name, in its pool: the one kind that re-registers it."""
    from controlplane.cluster.agent_auth import issue_join_token
    from controlplane.cluster.models import Node

    pool = Node.objects.get(name=name).pool
    expires_at = timezone.now() + dt.timedelta(hours=1)
    return issue_join_token(pool, expires_at=expires_at, node_name=name)[1]


@pytest.fixture
def join_token(pool):
    from controlplane.cluster.agent_auth import issue_join_token

    _, raw = issue_join_token(pool, expires_at=timezone.now() + dt.timedelta(hours=1), max_uses=50)
    return raw


@pytest.fixture
def agent(client, join_token):
    return AgentClient(client, join_token)


@pytest.fixture
def nodes(agent):
    """register(count, prefix): that many registered nodes that have heartbeated once, as
    [(Node, its token)]."""
    from controlplane.cluster.models import Node

    def register(count: int, prefix: str = "hub"):
        made = []
        for i in range(count):
            token = agent.register(f"{prefix}-{i:02d}")
            node = Node.objects.get(name=f"{prefix}-{i:02d}")
            agent.heartbeat(token, readings(node))
            made.append((node, token))
        return made

    return register


@pytest.fixture
def node01(agent):
    """A registered node with 8 GPUs: (Node, its token)."""
    from controlplane.cluster.models import Node

    token = agent.register("node-01")
    return Node.objects.get(name="node-01"), token


def running(attempt, **fields) -> dict:
    """A heartbeat's report of an attempt that runs (started a second ago); fields override."""
    report = {
        "attempt_id": attempt.pk,
        "state": "running",
        "started_at": time.time() - 1,
        "exit_code": None,
        "finished_at": None,
        "energy_j": 10.0,
        "energy_estimated": False,
    }
    report.update(fields)
    return report


def exited(attempt, exit_code, **fields) -> dict:
    """A heartbeat's report of an attempt whose container exited just now."""
    return running(attempt, state="exited", exit_code=exit_code, finished_at=time.time(), **fields)


def readings(node, **fields) -> list[dict]:
    return [gpu_reading(g.uuid, **fields) for g in node.gpus.order_by("index")]


@pytest.fixture
def admit(db):
    """Admit a job onto GPUs the way the scheduler's plan applier does."""
    from controlplane.jobs import actions

    def do(job, node, gpu_indexes=(0,), borrowed=False):
        gpus = list(node.gpus.filter(index__in=gpu_indexes).order_by("index"))
        attempt = actions.admit_job(job, node=node, gpus=gpus, borrowed=borrowed)
        assert attempt is not None
        return attempt

    return do


def hearing_until(now, *, witness: bool = True) -> None:
    """Make the control plane one that has been sweeping and hearing all along, up to `now`.

    Its previous sweep was a second before `now` and it could hear since long before; with
    `witness`, another node (`witness`, no GPUs) was heard at `now`, so the silence of the
    others is theirs, not the control plane's.
    """
    from controlplane.cluster.models import LivenessClock, Node, Pool

    LivenessClock.objects.update_or_create(
        pk=1,
        defaults={
            "last_sweep_at": now - dt.timedelta(seconds=1),
            "hearing_since": now - dt.timedelta(days=30),
            "deaf_reason": "",
        },
    )
    if witness:
        pool = Pool.objects.order_by("pk").first() or Pool.objects.create(name="default")
        Node.objects.update_or_create(
            name="witness", defaults={"pool": pool, "last_heartbeat_at": now, "ready": True}
        )


def sweep_while_hearing(now=None, *, witness: bool = True) -> dict:
    """One liveness sweep at `now` by a control plane that could hear all along (hearing_until)."""
    from controlplane.cluster.tasks import sweep_node_liveness

    now = now or timezone.now()
    hearing_until(now, witness=witness)
    return sweep_node_liveness(now)
