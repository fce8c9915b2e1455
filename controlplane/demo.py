"""Demo data for the embedded mode: two tenants, their people, a pool of simulated nodes."""

import secrets

from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.db import transaction

from controlplane.cluster.models import Pool
from controlplane.tenancy.models import Membership, Quota, Tenant

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
    """Create the demo once; return the people created now with their passwords."""
    User = get_user_model()
    created: dict[str, str] = {}
    Pool.objects.get_or_create(name="default", defaults={"power_budget_w": 6000.0})
    if not User.objects.filter(username="admin").exists():
        admin = User(username="admin", email="admin@example.org")
        password = demo_password(admin)
        User.objects.create_superuser("admin", "admin@example.org", password)
        created["admin"] = password
    for slug, name, g_h100, l_h100, g_a100, l_a100 in DEMO_TENANTS:
        tenant, _ = Tenant.objects.get_or_create(slug=slug, defaults={"name": name})
        Quota.objects.get_or_create(
            tenant=tenant,
            gpu_type="H100-SXM-80GB",
            defaults={"guaranteed_gpus": g_h100, "limit_gpus": l_h100},
        )
        Quota.objects.get_or_create(
            tenant=tenant,
            gpu_type="A100-SXM4-80GB",
            defaults={"guaranteed_gpus": g_a100, "limit_gpus": l_a100},
        )
        for username, role in ((f"{slug}-admin", "admin"), (f"{slug}-researcher", "member")):
            if User.objects.filter(username=username).exists():
                continue
            email = f"{username}@example.org"
            password = demo_password(User(username=username, email=email))
            user = User.objects.create_user(username, email, password)
            Membership.objects.create(user=user, tenant=tenant, role=role)
            created[username] = password
    return created
