"""A small world for the REST API tests: two tenants, one person per role, one node, tokens.

The role names used across these tests:
  anonymous      nobody signed in
  other_tenant   bob, a member of nlp (must never see vision's objects)
  viewer         victor, viewer in vision
  member         alice, member in vision
  tenant_admin   vera, tenant admin of vision
  cluster_admin  root-admin, Django staff
"""

from datetime import timedelta
from functools import cached_property

import pytest
from django.utils import timezone
from rest_framework.test import APIClient


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    # Every test creates several users; the default hasher would spend seconds on each.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


class World:
    """Objects are made when a test first asks for them, so each test pays only for its own."""

    def __init__(self, request):
        self._request = request

    def fixture(self, name):
        return self._request.getfixturevalue(name)

    def ensure(self, *names):
        for name in names:
            getattr(self, name)

    @cached_property
    def vision(self):
        return self.fixture("vision")

    @cached_property
    def nlp(self):
        return self.fixture("nlp")

    @cached_property
    def users(self) -> dict:
        return {
            "other_tenant": self.fixture("bob"),
            "viewer": self.fixture("vision_viewer"),
            "member": self.fixture("alice"),
            "tenant_admin": self.fixture("vision_admin"),
            "cluster_admin": self.fixture("cluster_admin"),
        }

    @property
    def alice(self):
        return self.users["member"]

    @property
    def bob(self):
        return self.users["other_tenant"]

    @cached_property
    def node(self):
        return self.fixture("make_node")("gpu-a.example", gpus=2)

    @property
    def pool(self):
        self.ensure("node")
        return self.fixture("pool")

    @cached_property
    def spare_pool(self):
        from controlplane.cluster.models import Pool

        return Pool.objects.create(name="spare", power_budget_w=5000.0)

    @cached_property
    def vision_job(self):
        self.ensure("node")
        return self.fixture("make_job")(self.vision, self.alice)

    @cached_property
    def nlp_job(self):
        self.ensure("node")
        return self.fixture("make_job")(self.nlp, self.bob)

    @cached_property
    def vision_array(self):
        return self._array(self.vision, self.alice)

    @cached_property
    def nlp_array(self):
        return self._array(self.nlp, self.bob)

    def _array(self, tenant, user):
        from controlplane.jobs import arrays

        self.ensure("node")
        fields = {
            "name": "sweep",
            "image": "registry.local/team/sweep:1",
            "command": ["python", "sweep.py", "{{array_index}}"],
            "env": {},
            "gpus": 1,
        }
        return arrays.submit_array(
            tenant=tenant, user=user, fields=fields, spec="2", indexes=[0, 1], max_parallel=1
        ).array

    @cached_property
    def vision_quota(self):
        self.ensure("users")
        return self.vision.quotas.get(gpu_type="H100-SXM-80GB")

    @cached_property
    def vision_budget(self):
        from controlplane.tenancy.models import Budget

        self.ensure("users")
        return Budget.objects.create(
            tenant=self.vision, kind="energy_kwh", period="month", amount=500.0, action="throttle"
        )

    @cached_property
    def carol_membership(self):
        from controlplane.tenancy.models import Membership

        self.ensure("users")
        carol = self.fixture("make_user")("carol")
        return Membership.objects.create(user=carol, tenant=self.vision, role="member")

    @cached_property
    def vision_invitation(self):
        from controlplane.tenancy import actions

        self.ensure("users")
        return actions.invite(self.vision, "newcomer", "viewer", actor=self.users["tenant_admin"])

    @cached_property
    def join_token(self):
        from controlplane.cluster.models import JoinToken
        from controlplane.tenancy.models import hash_token

        return JoinToken.objects.create(
            token_hash=hash_token("gcpj_matrix"),
            prefix="gcpj_matrix",
            pool=self.pool,
            expires_at=timezone.now() + timedelta(hours=1),
        )

    @cached_property
    def vision_volume(self):
        """A volume only vision may mount."""
        from controlplane.storage import actions

        self.ensure("users")
        return actions.create_volume(
            actor=self.users["cluster_admin"],
            name="vision-data",
            source="/mnt/vision-data",
            tenants=[self.vision],
        )

    @cached_property
    def alice_token(self):
        from controlplane.tenancy.models import ApiToken

        token, _ = ApiToken.issue(self.alice, "laptop")
        return token

    def client(self, role: str) -> APIClient:
        client = APIClient()
        if role != "anonymous":
            client.force_authenticate(self.users[role])
        return client


@pytest.fixture
def world(request, db) -> World:
    return World(request)


@pytest.fixture
def as_role(world):
    return world.client
