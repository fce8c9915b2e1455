"""Shared fixtures: two tenants, a person in each role, a small cluster.

`alice` (member of vision) and `bob` (member of nlp) must never see each other's data.
"""

import threading
import uuid

import pytest
from django.db.backends.signals import connection_created
from hypothesis import settings

# No time limit per example in any property test: these machines are shared, and a slow
# example under load is not a failure (Hypothesis's default deadline of 200 ms made one, with
# CI and another suite running side by side). Tests that set their own settings inherit this.
settings.register_profile("gpucp", deadline=None)
settings.load_profile("gpucp")


def _never_the_deadlock_victim(sender, connection, **kwargs):
    # Transactional tests end with a flush (TRUNCATE of every table) while the suites' real
    # control-plane processes (gunicorn's telemetry batches, Celery's cycles and sweeps) may
    # still be reading and writing. Should the two deadlock, PostgreSQL aborts whichever waited
    # deadlock_timeout first: let that be the product's transaction, which retries or redoes it
    # next cycle, never the test harness's flush. Tests that provoke a deadlock on purpose set
    # their own timeouts. Only the main thread's connection (the one that flushes): live-server
    # and embedded-loop threads are the product and keep the server's default.
    if connection.vendor == "postgresql" and threading.current_thread() is threading.main_thread():
        with connection.cursor() as cursor:
            cursor.execute("SET deadlock_timeout = '60s'")


connection_created.connect(_never_the_deadlock_victim)


# Suites that start whole deployments run on one xdist worker each, one test after another:
# the e2e suite shares one production stack per session, and two chaos runs at once would
# each count the other's load as faults. They go first, so the other worker fills in around
# them with the small tests (xdist's loadgroup hands out the largest groups first).
ONE_WORKER_SUITES = ("e2e", "chaos")


def _one_worker_suite(item) -> str | None:
    """The suite of ONE_WORKER_SUITES the test is in (tests/<suite>/...), or None."""
    suite = item.path.relative_to(item.config.rootpath).parts[1:2]
    return suite[0] if suite and suite[0] in ONE_WORKER_SUITES else None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if suite := _one_worker_suite(item):
            item.add_marker(pytest.mark.xdist_group(suite))


@pytest.fixture
def make_user(db, django_user_model):
    def make(username: str, *, staff: bool = False, password: str = "pw-for-tests-1"):
        return django_user_model.objects.create_user(
            username=username, password=password, is_staff=staff, is_superuser=staff
        )

    return make


@pytest.fixture
def vision(db):
    from controlplane.tenancy.models import Quota, Tenant

    tenant = Tenant.objects.create(slug="vision", name="Vision lab", weight=1.0)
    Quota.objects.create(tenant=tenant, gpu_type="H100-SXM-80GB", guaranteed_gpus=8, limit_gpus=16)
    return tenant


@pytest.fixture
def nlp(db):
    from controlplane.tenancy.models import Quota, Tenant

    tenant = Tenant.objects.create(slug="nlp", name="NLP lab", weight=1.0)
    Quota.objects.create(tenant=tenant, gpu_type="H100-SXM-80GB", guaranteed_gpus=8, limit_gpus=16)
    return tenant


def _member(make_user, tenant, username, role):
    from controlplane.tenancy.models import Membership

    user = make_user(username)
    Membership.objects.create(user=user, tenant=tenant, role=role)
    return user


@pytest.fixture
def alice(make_user, vision):
    return _member(make_user, vision, "alice", "member")


@pytest.fixture
def bob(make_user, nlp):
    return _member(make_user, nlp, "bob", "member")


@pytest.fixture
def vision_viewer(make_user, vision):
    return _member(make_user, vision, "victor", "viewer")


@pytest.fixture
def vision_admin(make_user, vision):
    return _member(make_user, vision, "vera", "admin")


@pytest.fixture
def cluster_admin(make_user):
    return make_user("root-admin", staff=True)


@pytest.fixture
def pool(db):
    from controlplane.cluster.models import Pool

    return Pool.objects.create(name="default")


@pytest.fixture
def make_node(pool):
    from controlplane.cluster.models import GPU, Node

    def make(name: str, gpus: int = 8, model: str = "H100-SXM-80GB", **fields):
        node = Node.objects.create(name=name, pool=pool, cpus=64, memory_mib=512 * 1024, **fields)
        for i in range(gpus):
            GPU.objects.create(
                node=node,
                index=i,
                uuid=f"GPU-{name}-{i}",
                model=model,
                memory_mib=81559,
                power_min_w=200.0,
                power_max_w=700.0,
                power_default_w=700.0,
            )
        return node

    return make


@pytest.fixture
def make_job(db):
    from controlplane.jobs import actions

    def make(tenant, user, **fields):
        defaults = {
            "name": "train",
            "image": "registry.local/team/train:1",
            "command": ["python", "train.py"],
            "gpus": 1,
        }
        defaults.update(fields)
        return actions.submit_job(tenant=tenant, user=user, **defaults)

    return make


@pytest.fixture(autouse=True)
def _own_request_rate_counts(settings):
    # The user API's rate counts (controlplane/tenancy/throttling.py) live in the cache, Redis in
    # the suite, and would outlast a test: every test counts under a key prefix of its own.
    default = settings.CACHES["default"]
    settings.CACHES = {**settings.CACHES, "default": {**default, "KEY_PREFIX": uuid.uuid4().hex}}


@pytest.fixture(autouse=True)
def _no_redis_keys_of_an_earlier_test(request, settings):
    # What the product keeps in Redis under its prefix (lease renewals granted during an
    # outage, what each node was last told, trusted node tokens, metrics) is keyed by node ids
    # and names that every test makes again, and outlives the test's rows. Not in the suites
    # whose one deployment lives as long as the session: their servers share these keys
    # between tests, as production's processes do.
    if not settings.REDIS_URL or _one_worker_suite(request.node):
        return
    from controlplane.redis_client import deployment_key, get_redis

    conn = get_redis()
    keys = list(conn.scan_iter(deployment_key("*"), count=1000))
    if keys:
        conn.delete(*keys)


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    # PBKDF2's deliberate slowness buys nothing in tests and costs seconds per created user.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(autouse=True)
def _no_history_from_an_earlier_test():
    # The scheduler keeps its duration history between cycles and reads only what ended since
    # (controlplane/scheduling/loader.py); rows of a rolled-back test must not outlive it.
    from controlplane.scheduling import loader

    loader.forget_history()
    yield
