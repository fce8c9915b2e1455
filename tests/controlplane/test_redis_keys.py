"""Two deployments on one Redis database: each reads and clears only its own keys.

Node ids, node names and usernames repeat between deployments (a staging copy beside
production), so whatever the product keeps in Redis under those alone would be read by the
other: a lease renewal granted there would keep a lost node here alive, a pruning marker there
would stop the pruning here, and metrics would add up.
"""

import datetime as dt
import os
import subprocess
import sys

import pytest
from django.db import connection
from django.utils import timezone

from controlplane import event_metrics
from controlplane.cluster import lease, telemetry
from controlplane.redis_client import get_redis

pytestmark = pytest.mark.django_db

OURS = "gpucp:deployment-ours"
THEIRS = "gpucp:deployment-theirs"


@pytest.fixture
def as_deployment(settings):
    if not settings.REDIS_URL:
        pytest.fail("REDIS_URL must point at a real Redis for these tests")

    def be(prefix: str) -> None:
        settings.REDIS_KEY_PREFIX = prefix

    yield be
    conn = get_redis()
    for prefix in (OURS, THEIRS):
        keys = list(conn.scan_iter(f"{prefix}:*"))
        if keys:
            conn.delete(*keys)


def test_a_lease_renewed_during_an_outage_counts_only_in_its_own_deployment(as_deployment):
    as_deployment(THEIRS)
    at = timezone.now().replace(microsecond=0)
    lease.record_degraded_renewal(7, at)
    as_deployment(OURS)
    assert lease.degraded_renewals([7]) == {}
    assert lease.degraded_renewals(None) == {}
    lease.record_degraded_renewal(7, at - dt.timedelta(seconds=30))
    as_deployment(THEIRS)
    assert lease.degraded_renewals([7]) == {7: at}


def test_a_node_token_trusted_in_one_deployment_is_unknown_to_the_other(as_deployment, settings):
    settings.TELEMETRY_FLUSH_INTERVAL_S = 0  # shared at once, not with the next batch
    digest = "ab" * 32
    as_deployment(THEIRS)
    lease.remember_checked_token(digest, 3, "node-01", 5.0)
    with lease._trusted_lock:
        lease._trusted.clear()  # another web process: Redis alone is asked
    assert lease.trusted_node(digest) is not None
    as_deployment(OURS)
    assert lease.trusted_node(digest) is None


def test_one_deployments_pruning_does_not_hold_back_the_others(as_deployment):
    as_deployment(THEIRS)
    telemetry.prune_history(timezone.now())
    assert telemetry._prune_is_due() is False  # theirs pruned just now
    as_deployment(OURS)
    assert telemetry._prune_is_due() is True
    assert telemetry._prune_is_due() is False


def test_metrics_are_counted_per_deployment(as_deployment, monkeypatch):
    monkeypatch.setattr(event_metrics, "_resting_until", {})
    as_deployment(THEIRS)
    event_metrics.record_jobs_finished([(1, "SUCCEEDED")] * 3)
    as_deployment(OURS)
    event_metrics.record_jobs_finished([(1, "SUCCEEDED")])
    stored = event_metrics.read()
    assert stored is not None
    assert stored.counters[event_metrics.JOBS_FINISHED.name] == {("1", "SUCCEEDED"): 1.0}


def _prefixes(**env: str) -> list[str]:
    code = (
        "import django; django.setup(); from django.conf import settings;"
        "from controlplane.redis_client import deployment_key;"
        "print(deployment_key('k')); print(settings.CACHES['default']['KEY_PREFIX'])"
    )
    environ = {k: v for k, v in os.environ.items() if k != "REDIS_KEY_PREFIX"}
    environ.update(DJANGO_SETTINGS_MODULE="controlplane.settings", **env)
    out = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True
    )
    return out.stdout.split()


def test_by_default_a_deployment_is_named_by_its_database_and_an_operator_may_name_it():
    host = connection.settings_dict["HOST"] or "127.0.0.1"
    redis_url = "redis://127.0.0.1:6379/3"
    alpha = _prefixes(DATABASE_URL=f"postgres://u@{host}/alpha", REDIS_URL=redis_url)
    beta = _prefixes(DATABASE_URL=f"postgres://u@{host}/beta", REDIS_URL=redis_url)
    assert alpha == ["gpucp:alpha:k", "gpucp:alpha"]  # the rate counts too
    assert beta == ["gpucp:beta:k", "gpucp:beta"]
    named = _prefixes(
        DATABASE_URL=f"postgres://u@{host}/alpha", REDIS_URL=redis_url, REDIS_KEY_PREFIX="lab-a"
    )
    assert named == ["lab-a:k", "lab-a"]
