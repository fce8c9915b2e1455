"""Request rates of the user API: guessing bearer tokens gets 429, each person and each anonymous
address has a rate, the counts are shared through the cache (Redis) by every web process, and
the agent API is never throttled."""

import datetime as dt
import json
import secrets
import socket
import threading
import time

import pytest
from django.conf import settings as django_settings
from django.core.cache import caches
from django.utils import timezone
from rest_framework.test import APIClient

from controlplane.cluster.agent_auth import issue_join_token
from controlplane.tenancy.models import ApiToken
from controlplane.tenancy.throttling import WindowCounter
from tests.controlplane.agent.conftest import inventory


def rates(settings, **overrides):
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_RATES": {**settings.API_THROTTLE_RATES, **overrides},
    }


def bearer(raw: str, ip: str = "203.0.113.7") -> APIClient:
    client = APIClient(REMOTE_ADDR=ip)
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def guess() -> str:
    return "gcp_" + secrets.token_urlsafe(32)


@pytest.fixture
def one_window():
    """Counts are per fixed window (a minute here): start where a test's requests all fit in one."""
    if 60 - time.time() % 60 < 10:
        time.sleep(60 - time.time() % 60 + 0.01)


# --- guessing bearer tokens ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "make_guess",
    [guess, lambda: "gcpn_" + secrets.token_urlsafe(32), lambda: "not-a-token-at-all"],
    ids=["user-token-shape", "node-token-shape", "garbage"],
)
def test_sixty_invalid_bearer_tokens_from_one_address_end_in_429_with_retry_after(
    one_window, db, make_guess
):
    limit = int(django_settings.API_THROTTLE_RATES["bearer_failure"].split("/")[0])
    assert limit < 60
    answers = [bearer(make_guess()).get("/api/v1/jobs/") for _ in range(60)]
    codes = [r.status_code for r in answers]
    assert codes[:limit] == [401] * limit
    assert codes[limit:] == [429] * (60 - limit)
    retry_after = int(answers[-1]["Retry-After"])
    assert 1 <= retry_after <= 60
    assert "Too many invalid tokens" in answers[-1].json()["detail"]


def test_once_blocked_even_a_valid_token_from_that_address_gets_429(one_window, world):
    _, raw = ApiToken.issue(world.alice, "ci")
    for _ in range(61):
        bearer(guess()).get("/api/v1/jobs/")
    # Answering a right guess normally would tell the guesser it was right.
    assert bearer(raw).get("/api/v1/jobs/").status_code == 429
    # Another address is not blocked by this one's guessing.
    assert bearer(raw, ip="198.51.100.20").get("/api/v1/jobs/").status_code == 200


def test_valid_tokens_do_not_count_as_failures(world):
    _, raw = ApiToken.issue(world.alice, "ci")
    for _ in range(100):
        assert bearer(raw).get("/api/v1/tenants/").status_code == 200


def test_the_block_ends_with_its_window(world, settings):
    rates(settings, bearer_failure="5/second")
    _, raw = ApiToken.issue(world.alice, "ci")
    # Start at the beginning of a second, so all six land in one window.
    time.sleep(1 - time.time() % 1)
    codes = [bearer(guess()).get("/api/v1/jobs/").status_code for _ in range(6)]
    assert codes == [401] * 5 + [429]
    time.sleep(1 - time.time() % 1 + 0.01)
    assert bearer(raw).get("/api/v1/jobs/").status_code == 200


def test_behind_a_trusted_proxy_the_forwarded_address_is_what_counts(one_window, world, settings):
    settings.NUM_PROXIES = 1
    _, raw = ApiToken.issue(world.alice, "ci")
    proxy = "10.0.0.2"
    for _ in range(61):
        client = bearer(guess(), ip=proxy)
        client.get("/api/v1/jobs/", HTTP_X_FORWARDED_FOR="203.0.113.66")
    blocked = bearer(raw, ip=proxy).get("/api/v1/jobs/", HTTP_X_FORWARDED_FOR="203.0.113.66")
    assert blocked.status_code == 429
    # Everyone else behind the same proxy is not: the proxy's address is not the client's.
    other = bearer(raw, ip=proxy).get("/api/v1/jobs/", HTTP_X_FORWARDED_FOR="198.51.100.9")
    assert other.status_code == 200
    # A client cannot pick its address by writing X-Forwarded-For itself: the proxy appends.
    spoofed = bearer(raw, ip=proxy).get(
        "/api/v1/jobs/", HTTP_X_FORWARDED_FOR="198.51.100.9, 203.0.113.66"
    )
    assert spoofed.status_code == 429


# --- per person and per anonymous address --------------------------------------------------------


def test_a_person_past_their_rate_gets_429_with_retry_after_and_others_do_not(
    one_window, world, settings
):
    rates(settings, user="5/minute")
    _, raw = ApiToken.issue(world.alice, "ci")
    session = world.client("member")  # alice too: tokens and sessions count together
    codes = [bearer(raw).get("/api/v1/tenants/").status_code for _ in range(3)]
    codes += [session.get("/api/v1/tenants/").status_code for _ in range(3)]
    assert codes == [200] * 5 + [429]
    refused = session.get("/api/v1/tenants/")
    assert refused.status_code == 429 and 1 <= int(refused["Retry-After"]) <= 60
    assert world.client("other_tenant").get("/api/v1/tenants/").status_code == 200


def test_anonymous_requests_have_a_rate_per_address(one_window, db, settings):
    rates(settings, anon="3/minute")
    first = APIClient(REMOTE_ADDR="203.0.113.8")
    codes = [first.get("/api/schema/").status_code for _ in range(4)]
    assert codes == [200, 200, 200, 429]
    assert APIClient(REMOTE_ADDR="203.0.113.9").get("/api/schema/").status_code == 200


def test_the_rates_are_counted_in_the_shared_cache(one_window, world):
    """Every web process builds its cache from the same settings: with Redis, a count made by one
    is seen by a fresh connection, as another gunicorn worker would open it."""
    if not django_settings.REDIS_URL:
        pytest.skip("REDIS_URL not set: the embedded mode counts in local memory")
    assert django_settings.CACHES["default"]["BACKEND"].endswith("RedisCache")
    for _ in range(7):
        bearer(guess(), ip="203.0.113.77").get("/api/v1/jobs/")
    other_worker = caches.create_connection("default")
    key = WindowCounter("bearer_failure")._key(
        "203.0.113.77", 60, time.time()
    )  # the same window, read through another connection
    assert other_worker.get(key) == 7


class SilentRedis:
    """A Redis address that accepts connections and never answers (a hung server): a client
    waits its socket timeout, then fails. Counts the connections it was asked for."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.listener.close()
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def hung_cache(settings, monkeypatch):
    from controlplane.tenancy import throttling

    monkeypatch.setattr(throttling, "_cache_down_until", 0.0)  # put back after the test
    server = SilentRedis()
    settings.CACHES = {
        "default": {
            **django_settings.CACHES["default"],
            "BACKEND": "django.core.cache.backends.redis.RedisCache",
            "LOCATION": f"redis://127.0.0.1:{server.port}/0",
            "OPTIONS": {"socket_timeout": 0.5, "socket_connect_timeout": 0.5},
        }
    }
    yield server
    server.close()


def test_an_unreachable_cache_lets_requests_through_and_is_not_asked_again_at_once(
    world, hung_cache
):
    _, raw = ApiToken.issue(world.alice, "ci")
    assert bearer(raw).get("/api/v1/tenants/").status_code == 200
    asked = len(hung_cache.accepted)
    assert asked >= 1
    # Until CACHE_RETRY_AFTER_S have passed, requests do not wait on the cache again: neither a
    # person's nor a guesser's, whose failures would be counted there.
    assert bearer(raw).get("/api/v1/tenants/").status_code == 200
    assert bearer(guess()).get("/api/v1/tenants/").status_code == 401
    assert len(hung_cache.accepted) == asked


# --- the agent API is not throttled ---------------------------------------------------------------


@pytest.fixture
def tight_rates(settings):
    rates(settings, user="2/minute", anon="2/minute", bearer_failure="2/minute")
    settings.TELEMETRY_FLUSH_INTERVAL_S = 0


def agent_post(client, path: str, body, token: str | None):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    return client.post(
        f"/api/agent/v1/{path}",
        data=json.dumps(body),
        content_type="application/json",
        REMOTE_ADDR="203.0.113.50",
        **headers,
    )


def test_invalid_node_and_join_tokens_on_the_agent_api_are_never_throttled(db, client, tight_rates):
    for _ in range(40):
        body = {"seq": 1, "sent_at": time.time(), "gpus": [], "attempts": []}
        assert agent_post(client, "heartbeat", body, "gcpn_" + "x" * 43).status_code == 401
        assert agent_post(client, "register", inventory("n1"), "gcpj_" + "x" * 43).status_code == (
            401
        )


def test_a_node_heartbeats_far_past_every_user_api_rate(client, pool, tight_rates):
    _, join = issue_join_token(pool, expires_at=timezone.now() + dt.timedelta(hours=1))
    registered = agent_post(client, "register", inventory("node-fast", gpus=1), join)
    assert registered.status_code == 201, registered.content
    token = registered.json()["node_token"]
    for seq in range(1, 31):
        body = {"seq": seq, "sent_at": time.time(), "gpus": [], "attempts": []}
        response = agent_post(client, "heartbeat", body, token)
        assert response.status_code == 200, (seq, response.content)
