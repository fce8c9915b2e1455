"""Demo data for the embedded mode: two tenants, their people, a pool of simulated nodes."""

import secrets

from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.db import transaction

from controlplane.cluster import actions as cluster_actions
from controlplane.cluster.models import Pool
from controlplane.tenancy import actions as tenancy_actions
from controlplane.tenancy.models import Quota, Tenant

DEMO_TENANTS = [
    # slug, name, guaranteed H100, limit H100, guaranteed A100, limit A100
    ("vision", "Vision lab", 4, 12, 4, 8),
    ("nlp", "NLP lab", 4, 12, 4, 8),
]


def demo_password(user) -> str:
    """A random password that passes AUTH_PASSWORD_VALIDATORS (checked, not assumed)."""
    while True:
        # 20 URL-safe characters: about 120 bits, well past the 12-character minimum.
        password = secrets.token_urlsafe(15)
        try:
            validate_password(password, user)
        except ValidationError:  # e.g. all digits, by a very long chance: draw again
            continue
        return password


@transaction.atomic
def seed_demo() -> dict[str, str]:
    """Create the demo once; return the people created now with their passwords.

    The demo is written through the same actions an admin's clicks go through, so its pools,
    tenants, quotas and memberships start the audit trail like any other, by "admin".
    """
    User = get_user_model()
    created: dict[str, str] = {}
    admin = User.objects.filter(username="admin").first()
    if admin is None:
        password = demo_password(User(username="admin", email="admin@example.org"))
        admin = User.objects.create_superuser("admin", "admin@example.org", password)
        created["admin"] = password
    if not Pool.objects.filter(name="default").exists():
        cluster_actions.create_pool(actor=admin, name="default", power_budget_w=6000.0)
    for slug, name, g_h100, l_h100, g_a100, l_a100 in DEMO_TENANTS:
        tenant = Tenant.objects.filter(slug=slug).first()
        if tenant is None:
            tenant = tenancy_actions.create_tenant(actor=admin, slug=slug, name=name)
        for gpu_type, guaranteed, limit in (
            ("H100-SXM-80GB", g_h100, l_h100),
            ("A100-SXM4-80GB", g_a100, l_a100),
        ):
            if not Quota.objects.filter(tenant=tenant, gpu_type=gpu_type).exists():
                tenancy_actions.create_quota(
                    tenant,
                    actor=admin,
                    gpu_type=gpu_type,
                    guaranteed_gpus=guaranteed,
                    limit_gpus=limit,
                )
        for username, role in ((f"{slug}-admin", "admin"), (f"{slug}-researcher", "member")):
            if User.objects.filter(username=username).exists():
                continue
            email = f"{username}@example.org"
            password = demo_password(User(username=username, email=email))
            user = User.objects.create_user(username, email, password)
            tenancy_actions.add_member(tenant, user, role, actor=admin)
            created[username] = password
    return created
