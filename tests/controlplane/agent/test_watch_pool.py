"""Watches under gunicorn with the connection pool (DB_POOL_MAX_SIZE), as docker-compose runs it.

Every agent keeps a watch open (a long poll of up to 30 s). Without a pool each gunicorn thread
holding one keeps a PostgreSQL connection of its own for the whole wait, so the agents
connected, not the requests being answered, count against PostgreSQL's max_connections (the
Kueue scenario with real agents stopped at "too many clients" for that reason). With the pool a
watch gives its connection back while it waits. Real gunicorn, PostgreSQL and Redis; the
connections are counted in pg_stat_activity by the server's application_name.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import pytest
import requests
import yaml
from django.conf import settings
from django.db import connection

from controlplane.wakeups import notify_nodes
from tests import ports
from tests.controlplane.test_deploy_checks import compose_web_command
from tests.e2e.conftest import database_url_of_test_db, wait_until

from .conftest import readings

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="watches across processes: Redis"),
]

# This file's ports (no other suite uses 18650-18699).
PORTS = range(18650, 18700)
WATCHES = 8
THREADS = WATCHES + 4
# Long enough never to be what ends a watch during the test, on a loaded machine.
WATCH_TIMEOUT_S = 25.0


def backends(application_name: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            # This database's only: the other xdist worker runs these tests too, under the same
            # application names, on a database of its own.
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
            " AND datname = current_database()",
            [application_name],
        )
        return cursor.fetchone()[0]


def blocked(application_name: str) -> bool:
    """Whether a backend of that application waits on a lock."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
            "AND wait_event_type = 'Lock' AND datname = current_database()",
            [application_name],
        )
        return cursor.fetchone()[0] > 0


class HttpWatch(threading.Thread):
    def __init__(self, url: str, token: str):
        super().__init__(daemon=True)
        self.url, self.token = url, token
        self.answer: tuple[int, dict] | None = None

    def run(self) -> None:
        try:
            response = requests.post(
                f"{self.url}/api/agent/v1/watch",
                json={"timeout_s": WATCH_TIMEOUT_S},
                headers={"Authorization": f"Bearer {self.token}"},
                timeout=WATCH_TIMEOUT_S + 30,
            )
        except requests.ConnectionError:
            return  # the server was killed at the end of the test
        self.answer = (response.status_code, response.json())


@pytest.fixture
def gunicorn(transactional_db, tmp_path):
    started: list[subprocess.Popen] = []
    names: list[str] = []

    def start(pool_max_size: int, application_name: str, **environment: str) -> str:
        names.append(application_name)
        port = ports.free_port(PORTS)
        command = [
            f"--threads={THREADS}" if arg.startswith("--threads=") else arg
            for arg in compose_web_command(port)
        ]
        env = {
            **os.environ,
            "DATABASE_URL": f"{database_url_of_test_db()}?application_name={application_name}",
            "REDIS_URL": settings.REDIS_URL,
            "DB_POOL_MAX_SIZE": str(pool_max_size),
            "AGENT_WATCH_MAX_PER_PROCESS": str(WATCHES + 1),
            "GUNICORN_CMD_ARGS": "--no-control-socket",
            **environment,
        }
        log_path = tmp_path / f"gunicorn-{application_name}.log"
        with open(log_path, "wb") as out:
            web = subprocess.Popen(
                command,
                cwd=settings.BASE_DIR,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        started.append(web)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert web.poll() is None, f"gunicorn exited:\n{log_path.read_text()[-3000:]}"
            try:
                # Without a token the agent API answers 401: the server is up.
                answer = requests.post(f"{url}/api/agent/v1/heartbeat", json={}, timeout=2)
                if answer.status_code == 401:
                    return url
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)

    yield start
    # Killed, not stopped: a graceful stop would wait out the watches still open.
    for web in started:
        os.killpg(web.pid, signal.SIGKILL)
        web.wait(timeout=30)
    # Their backends end once PostgreSQL sees the sockets closed; the test database is dropped
    # after this, and would not be while they are there.
    for name in names:
        wait_until(lambda name=name: backends(name) == 0, 20, f"{name}'s backends ended")


def open_watches(url: str, registered) -> list[HttpWatch]:
    watches = [HttpWatch(url, token) for _, token in registered]
    for watch in watches:
        watch.start()
    return watches


def test_the_compose_web_service_takes_a_pool_size_and_the_worker_does_not():
    compose = yaml.safe_load((settings.BASE_DIR / "docker-compose.yml").read_text())
    services = compose["services"]
    assert services["web"]["environment"]["DB_POOL_MAX_SIZE"] == "${DB_POOL_MAX_SIZE:-0}"
    # The rest of the web service's environment is the shared one, not replaced by the pool's.
    assert services["web"]["environment"]["DATABASE_URL"].startswith("postgres://")
    # A forking Celery worker must not inherit a pool opened in its parent.
    assert "DB_POOL_MAX_SIZE" not in services["worker"]["environment"]


def test_waiting_watches_hold_no_connection_and_a_change_still_wakes_its_watch(
    gunicorn, nodes, agent, make_job, vision, alice, admit
):
    registered = nodes(WATCHES, prefix="pooled")
    url = gunicorn(pool_max_size=2, application_name="gpucp-watch-pool")
    watches = open_watches(url, registered)
    # Every watch has read its node and is waiting (none has an answer: nothing changed).
    time.sleep(2.0)
    assert [w.answer for w in watches] == [None] * WATCHES
    assert backends("gpucp-watch-pool") <= 2

    # The threads left over answer heartbeats while every watch waits: the pool serves them.
    for node, token in registered:
        body = agent.heartbeat_body(readings(node))
        response = requests.post(
            f"{url}/api/agent/v1/heartbeat",
            data=json.dumps(body),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            timeout=30,
        )
        assert response.status_code == 200, response.text
        assert response.json().get("degraded") is None
    assert backends("gpucp-watch-pool") <= 2

    # A change to one node wakes its watch (the check takes a pooled connection again); the
    # others keep waiting.
    first_node, _ = registered[0]
    admit(make_job(vision, alice), first_node, gpu_indexes=(0,))
    notify_nodes([first_node.name])
    wait_until(lambda: watches[0].answer is not None, 20, "the changed node's watch answered")
    assert watches[0].answer == (200, {"changed": True})
    assert [w.answer for w in watches[1:]] == [None] * (WATCHES - 1)
    assert backends("gpucp-watch-pool") <= 2


def test_without_a_pool_every_waiting_watch_holds_a_connection(gunicorn, nodes):
    """Why the pool: the same watches each keep a PostgreSQL backend through their wait."""
    registered = nodes(WATCHES, prefix="unpooled")
    url = gunicorn(pool_max_size=0, application_name="gpucp-watch-nopool")
    watches = open_watches(url, registered)
    wait_until(
        lambda: backends("gpucp-watch-nopool") >= WATCHES, 20, "a connection per waiting watch"
    )
    assert [w.answer for w in watches] == [None] * WATCHES


@pytest.mark.parametrize("pool_timeout_s", [10.0, 0.3], ids=["waited-out", "timed-out"])
def test_a_pool_busy_with_a_slow_request_is_not_taken_for_an_outage(
    gunicorn, nodes, agent, pool_timeout_s
):
    """Every connection of the pool in use is a busy process, not a database out of reach.

    Taken for an outage, the other agents' heartbeats were answered degraded (nothing they
    reported recorded) and the pool was then replaced under the requests using it, which
    failed with 500s: 250 agents registering at once did both (the Kueue scenario, issue 14).
    Now a heartbeat waits its turn for a connection; one that waits longer than the pool's
    timeout keeps its lease and is told the control plane is busy, and the next is answered in
    full.
    """
    import psycopg

    registered = nodes(3, prefix="busy")
    url = gunicorn(
        pool_max_size=1, application_name="gpucp-busy-pool", DB_POOL_TIMEOUT_S=str(pool_timeout_s)
    )
    answers: dict[str, tuple[int, dict]] = {}
    # Read here: a thread of the test that used the ORM would keep a connection of its own.
    bodies = {node.name: json.dumps(agent.heartbeat_body(readings(node))) for node, _ in registered}

    def beat(node, token) -> None:
        response = requests.post(
            f"{url}/api/agent/v1/heartbeat",
            data=bodies[node.name],
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            timeout=60,
        )
        answers[node.name] = (response.status_code, response.json())

    (slow_node, slow_token), *others = registered
    # The first heartbeat waits on the nodes' table, locked here, and keeps the pool's only
    # connection while it waits; the others come meanwhile and find none free for 1.5 s:
    # longer than PooledDatabaseDown.QUICK_WAIT_S, and than one of the two pool timeouts.
    with psycopg.connect(database_url_of_test_db(), autocommit=False) as lock:
        lock.execute("LOCK TABLE cluster_node IN ACCESS EXCLUSIVE MODE")
        slow = threading.Thread(target=beat, args=(slow_node, slow_token))
        slow.start()
        wait_until(lambda: blocked("gpucp-busy-pool"), 20, "the slow heartbeat waits on the lock")
        waiting = [threading.Thread(target=beat, args=pair) for pair in others]
        for thread in waiting:
            thread.start()
        time.sleep(1.5)
    for thread in [slow, *waiting]:
        thread.join(timeout=60)
    assert sorted(answers) == sorted(node.name for node, _ in registered)
    for name, (status, body) in answers.items():
        assert status == 200, (name, body)
        if name == slow_node.name or pool_timeout_s > 1:
            assert body.get("degraded") is None, (name, body)
        else:
            assert body["degraded"] is True and body["lease_s"] > 0, (name, body)
            assert body["detail"].startswith("The control plane is too busy"), body
    # Another round: still answered in full, from the same pool.
    for node, token in registered:
        beat(node, token)
        assert answers[node.name][0] == 200 and answers[node.name][1].get("degraded") is None
