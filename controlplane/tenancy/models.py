"""Tenants, who belongs to them, what they may use, and the tokens people automate with."""

from __future__ import annotations

import hashlib
import re
import secrets
from datetime import datetime, timedelta

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
    # The most its jobs' checkpoint directories may hold together; past it, new attempts get
    # theirs read-only (never deleted). Null: no limit.
    checkpoint_limit_bytes = models.PositiveBigIntegerField(null=True, blank=True)
    # The most tasks one job array of this tenant may have (set by a cluster admin, at most
    # settings.MAX_ARRAY_SIZE_CEILING): a sweep is one request and one transaction.
    max_array_size = models.PositiveIntegerField(default=1000)
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


class TokenScope(models.TextChoices):
    # Every token reads; the other scopes are what it may do besides.
    READ = "read", "Read (GET) everything its owner may see"
    WRITE = "write", "Change everything its owner may change"
    TOKENS = "tokens", "Issue and revoke its owner's API tokens"


# Without a choice, a token reads and writes but cannot mint tokens: minting is what lets a leaked
# token outlive its own revocation, so it has to be asked for.
DEFAULT_TOKEN_SCOPES = (TokenScope.READ, TokenScope.WRITE)


def default_token_scopes() -> list[str]:
    return [str(s) for s in DEFAULT_TOKEN_SCOPES]


def api_token_max_lifetime() -> timedelta:
    """How long any API token may live (API_TOKEN_MAX_LIFETIME_DAYS); read per call so a lower
    setting takes effect for tokens issued before it, too."""
    return timedelta(days=settings.API_TOKEN_MAX_LIFETIME_DAYS)


class TokenRequestRefused(Exception):
    """A token asked for more than its issuer may give; `errors` name the fields at fault."""

    def __init__(self, errors: dict[str, list[str]]):
        self.errors = errors
        super().__init__("; ".join(f"{k}: {' '.join(v)}" for k, v in errors.items()))


def normalize_scopes(scopes) -> list[str]:
    """The scopes in their canonical order, read always included."""
    wanted = set(scopes) | {TokenScope.READ}
    return [str(s) for s in TokenScope if s in wanted]


def token_grant(
    *, expires_at=None, scopes=None, parent: ApiToken | None = None, now=None
) -> tuple[datetime, list[str]]:
    """The expiry and scopes a new token gets, or TokenRequestRefused.

    The rules every way of issuing a token shares (API, web UI, shell): no token lives longer than
    API_TOKEN_MAX_LIFETIME_DAYS, and one minted with a token (`parent`) expires no later than
    its parent and holds no scope the parent lacks. Left out, the expiry is the latest allowed and
    the scopes are the defaults the parent holds.
    """
    now = now or timezone.now()
    latest = now + api_token_max_lifetime()
    errors: dict[str, list[str]] = {}
    if parent is not None and parent.effective_expires_at < latest:
        latest = parent.effective_expires_at
    if expires_at is None:
        expires_at = latest
    elif expires_at <= now:
        errors["expires_at"] = ["Must be in the future."]
    elif expires_at > latest:
        if parent is not None and latest == parent.effective_expires_at:
            why = (
                f"At most {latest.isoformat()}, when the token you are using expires: "
                "a token cannot mint one that outlives it."
            )
        else:
            days = settings.API_TOKEN_MAX_LIFETIME_DAYS
            why = f"At most {days} days ahead (API_TOKEN_MAX_LIFETIME_DAYS)."
        errors["expires_at"] = [why]
    held = set(parent.scopes) if parent is not None else set(TokenScope.values)
    if scopes is None:
        granted = normalize_scopes(s for s in DEFAULT_TOKEN_SCOPES if s in held)
    else:
        granted = normalize_scopes(scopes)
        beyond = [s for s in granted if s not in held]
        if beyond:
            errors["scopes"] = [
                f"The token you are using lacks {', '.join(beyond)}; "
                "a token cannot mint one with more scopes than its own."
            ]
        elif TokenScope.TOKENS in granted and TokenScope.WRITE not in granted:
            errors["scopes"] = ["tokens needs write too: issuing a token is a write."]
    if errors:
        raise TokenRequestRefused(errors)
    return expires_at, granted


def usable_token_q(now=None) -> Q:
    """API tokens that work now: ApiToken.is_usable as a query."""
    now = now or timezone.now()
    return (
        Q(revoked_at__isnull=True)
        & (Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        & Q(created_at__gt=now - api_token_max_lifetime())
    )


class ApiTokenQuerySet(models.QuerySet):
    def usable(self, now=None):
        return self.filter(usable_token_q(now))


class ApiToken(models.Model):
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    name = models.CharField(max_length=100)
    # The first characters of the raw token, kept so a person can tell tokens apart in a list.
    prefix = models.CharField(max_length=16)
    token_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(default=timezone.now)
    # Null only on tokens from before the maximum lifetime; effective_expires_at caps those too.
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    # The token this one was minted with (null: made with a session or by ops). Revoking a token
    # revokes everything minted from it, transitively.
    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.CASCADE, related_name="children"
    )
    scopes = models.JSONField(default=default_token_scopes)

    objects = ApiTokenQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.name})"

    @property
    def effective_expires_at(self) -> datetime:
        """When it stops working: its own expiry or the maximum lifetime, whichever is first."""
        cap = self.created_at + api_token_max_lifetime()
        return cap if self.expires_at is None or self.expires_at > cap else self.expires_at

    @property
    def is_usable(self) -> bool:
        return self.revoked_at is None and self.effective_expires_at > timezone.now()

    def allows(self, scope: str) -> bool:
        return scope in self.scopes

    @classmethod
    def issue(
        cls, user, name: str, expires_at=None, *, scopes=None, parent: ApiToken | None = None
    ) -> tuple[ApiToken, str]:
        """Create a token and return it with the raw secret, which is never stored.

        Raises TokenRequestRefused for an expiry or scopes beyond what token_grant allows.
        """
        expires_at, scopes = token_grant(expires_at=expires_at, scopes=scopes, parent=parent)
        raw = new_raw_token("gcp")
        token = cls.objects.create(
            user=user,
            name=name,
            prefix=raw[:12],
            token_hash=hash_token(raw),
            expires_at=expires_at,
            scopes=scopes,
            parent=parent,
        )
        return token, raw


INVITEE_RE = re.compile(r"^[\w.@+-]+\Z")


def invitation_ttl() -> timedelta:
    return timedelta(days=settings.INVITATION_TTL_DAYS)


def addressed_to_q(user) -> Q:
    """Invitations this person may accept: by username, or by their e-mail address."""
    match = Q(invitee=user.username)
    if user.email:
        match |= Q(invitee__iexact=user.email)
    return match


class InvitationQuerySet(models.QuerySet):
    def addressed_to(self, user):
        return self.filter(addressed_to_q(user))

    def open(self, now=None):
        now = now or timezone.now()
        return self.filter(accepted_at__isnull=True, revoked_at__isnull=True, expires_at__gt=now)


class InvitationState(models.TextChoices):
    OPEN = "open", "Open"
    ACCEPTED = "accepted", "Accepted"
    WITHDRAWN = "withdrawn", "Withdrawn or declined"
    EXPIRED = "expired", "Expired"


class Invitation(models.Model):
    """A tenant admin's offer of a role in their tenant to a person named by username or e-mail.

    It names a person as typed and is created without looking anyone up, so it says nothing about
    who has an account; it becomes a membership only when that person accepts it.
    """

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="invitations")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    invitee = models.CharField(max_length=254, help_text="A username or an e-mail address")
    invited_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="invitations_sent",
    )
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    accepted_at = models.DateTimeField(null=True, blank=True)
    accepted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="invitations_accepted",
    )
    # Withdrawn by an admin of the tenant, or declined by the invitee.
    revoked_at = models.DateTimeField(null=True, blank=True)

    objects = InvitationQuerySet.as_manager()
    addressed_to_q = staticmethod(addressed_to_q)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["invitee"], name="invitation_invitee")]

    def __str__(self) -> str:
        return f"{self.invitee} to {self.tenant} as {self.role}"

    @property
    def state(self) -> str:
        if self.accepted_at is not None:
            return InvitationState.ACCEPTED
        if self.revoked_at is not None:
            return InvitationState.WITHDRAWN
        if self.expires_at <= timezone.now():
            return InvitationState.EXPIRED
        return InvitationState.OPEN

    def is_addressed_to(self, user) -> bool:
        if self.invitee == user.username:
            return True
        return bool(user.email) and self.invitee.lower() == user.email.lower()
