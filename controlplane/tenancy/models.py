"""Tenants, who belongs to them, what they may use, and the tokens people automate with."""

import hashlib
import secrets

from django.conf import settings
from django.db import models
from django.db.models import F, Q
from django.utils import timezone


class Tenant(models.Model):
    slug = models.SlugField(max_length=63, unique=True)
    name = models.CharField(max_length=200)
    # Weighted fair share: a tenant with weight 2 is entitled to twice the borrowed capacity of a
    # tenant with weight 1 when both want more than their guarantee.
    weight = models.FloatField(default=1.0)
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["slug"]
        constraints = [
            models.CheckConstraint(condition=Q(weight__gt=0), name="tenant_weight_positive")
        ]

    def __str__(self) -> str:
        return self.slug


class Role(models.TextChoices):
    VIEWER = "viewer", "Viewer"
    MEMBER = "member", "Member"
    ADMIN = "admin", "Tenant admin"


# A role can do everything the roles before it can.
ROLE_RANK = {Role.VIEWER: 0, Role.MEMBER: 1, Role.ADMIN: 2}


class Membership(models.Model):
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["tenant__slug", "user__username"]
        constraints = [models.UniqueConstraint(fields=["user", "tenant"], name="membership_unique")]

    def __str__(self) -> str:
        return f"{self.user} in {self.tenant} as {self.role}"


class Quota(models.Model):
    """How many GPUs of one type a tenant is guaranteed, and how far it may borrow.

    An empty gpu_type means "any type": it caps the tenant's GPUs summed over all types.
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="quotas")
    gpu_type = models.CharField(max_length=64, blank=True, default="")
    guaranteed_gpus = models.PositiveIntegerField(default=0)
    limit_gpus = models.PositiveIntegerField(default=0)
    max_running_jobs = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["tenant__slug", "gpu_type"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "gpu_type"], name="quota_unique_per_type"),
            models.CheckConstraint(
                condition=Q(limit_gpus__gte=F("guaranteed_gpus")), name="quota_limit_gte_guaranteed"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tenant}: {self.gpu_type or 'any'} {self.guaranteed_gpus}/{self.limit_gpus}"


class BudgetKind(models.TextChoices):
    ENERGY_KWH = "energy_kwh", "Energy (kWh)"
    GPU_HOURS = "gpu_hours", "GPU-hours"


class BudgetPeriod(models.TextChoices):
    DAY = "day", "Day"
    WEEK = "week", "Week"
    MONTH = "month", "Month"


class BudgetAction(models.TextChoices):
    THROTTLE = "throttle", "Throttle to the most efficient power cap"
    NO_BORROWING = "no_borrowing", "Admit only guaranteed work"
    HOLD = "hold", "Start no new jobs"


class Budget(models.Model):
    """A tenant's energy or GPU-hour allowance per period, and what happens when it runs out."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="budgets")
    kind = models.CharField(max_length=16, choices=BudgetKind.choices)
    period = models.CharField(max_length=8, choices=BudgetPeriod.choices)
    amount = models.FloatField()
    action = models.CharField(
        max_length=16, choices=BudgetAction.choices, default=BudgetAction.THROTTLE
    )
    warn_at_fraction = models.FloatField(default=0.8)

    class Meta:
        ordering = ["tenant__slug", "kind"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "kind"], name="budget_unique_per_kind"),
            models.CheckConstraint(condition=Q(amount__gt=0), name="budget_amount_positive"),
        ]

    def __str__(self) -> str:
        return f"{self.tenant}: {self.amount} {self.kind}/{self.period}"


def hash_token(raw: str) -> str:
    """Tokens are stored as SHA-256: they are long random strings, so a slow hash buys nothing."""
    return hashlib.sha256(raw.encode()).hexdigest()


def new_raw_token(prefix: str) -> str:
    return f"{prefix}_{secrets.token_urlsafe(32)}"


class ApiToken(models.Model):
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    name = models.CharField(max_length=100)
    # The first characters of the raw token, kept so a person can tell tokens apart in a list.
    prefix = models.CharField(max_length=16)
    token_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.name})"

    @property
    def is_usable(self) -> bool:
        now = timezone.now()
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > now)

    @classmethod
    def issue(cls, user, name: str, expires_at=None) -> tuple["ApiToken", str]:
        """Create a token and return it with the raw secret, which is never stored."""
        raw = new_raw_token("gcp")
        token = cls.objects.create(
            user=user, name=name, prefix=raw[:12], token_hash=hash_token(raw), expires_at=expires_at
        )
        return token, raw


class TenantEvent(models.Model):
    """Facts about a tenant as a whole, such as a budget warning."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="events")
    at = models.DateTimeField(default=timezone.now)
    kind = models.CharField(max_length=32)
    message = models.TextField()
    data = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-at", "-id"]
