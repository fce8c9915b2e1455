"""Tenants, memberships, quotas (with what is in use now), budgets, API tokens."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.db.models import Count
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from controlplane.accounting.budgets import period_bounds, usage_by_tenant
from controlplane.jobs.models import ACTIVE_ATTEMPT_STATES, Allocation, JobAttempt
from controlplane.tenancy import actions, rules
from controlplane.tenancy.models import (
    ApiToken,
    Budget,
    BudgetAction,
    BudgetKind,
    BudgetPeriod,
    Invitation,
    InvitationState,
    Membership,
    Quota,
    Role,
    Tenant,
    TokenRequestRefused,
    TokenScope,
    token_grant,
)

if TYPE_CHECKING:
    from rest_framework.validators import Validator  # a type alias of the stubs only

MAX_QUOTA_GPUS = rules.MAX_QUOTA_GPUS


class TenantSlugField(serializers.SlugRelatedField):
    """A tenant named by slug; fixed once the object exists (move an object by recreating it)."""

    def __init__(self, **kwargs):
        kwargs.setdefault("slug_field", "slug")
        kwargs.setdefault("queryset", Tenant.objects.all())
        super().__init__(**kwargs)


class FixedAfterCreateMixin:
    """Fields named in Meta.fixed_after_create may be given on create and are read-only after."""

    def get_fields(self):
        fields = super().get_fields()
        if self.instance is not None:
            for name in getattr(self.Meta, "fixed_after_create", ()):
                fields[name].read_only = True
        return fields


class TenantSerializer(serializers.ModelSerializer):
    my_role = serializers.SerializerMethodField(
        help_text="Your role in this tenant (null for a cluster admin who is not a member)."
    )
    checkpoint_limit_bytes = serializers.IntegerField(
        required=False,
        allow_null=True,
        min_value=0,
        max_value=rules.MAX_CHECKPOINT_LIMIT_BYTES,
        help_text="The most its jobs' checkpoint directories may hold together; null: no limit",
    )
    max_array_size = serializers.IntegerField(
        required=False,
        min_value=1,
        max_value=settings.MAX_ARRAY_SIZE_CEILING,
        help_text="The most tasks one job array of the tenant may have (cluster admins set it)",
    )
    checkpoint_usage_bytes = serializers.IntegerField(
        read_only=True,
        default=0,
        help_text="What its jobs' checkpoint directories hold, as their nodes last measured",
    )

    class Meta:
        model = Tenant
        fields = [
            "id",
            "slug",
            "name",
            "weight",
            "active",
            "created_at",
            "my_role",
            "checkpoint_limit_bytes",
            "checkpoint_usage_bytes",
            "max_array_size",
        ]
        read_only_fields = ["created_at"]

    @extend_schema_field(serializers.ChoiceField(choices=Role.choices, allow_null=True))
    def get_my_role(self, obj) -> str | None:
        return getattr(obj, "my_role", None)

    def validate_weight(self, value: float) -> float:
        if problem := rules.weight_problem(value):
            raise serializers.ValidationError(problem)
        return value

    def validate_max_array_size(self, value: int) -> int:
        if problem := rules.max_array_size_problem(value):
            raise serializers.ValidationError(problem)
        return value

    def validate_checkpoint_limit_bytes(self, value: int | None) -> int | None:
        if problem := rules.checkpoint_limit_problem(value):
            raise serializers.ValidationError(problem)
        return value

    # Writes go through the actions: audited, and the scheduler hears of a weight at once.

    def create(self, validated_data):
        return actions.create_tenant(actor=self.context["request"].user, **validated_data)

    def update(self, instance, validated_data):
        return actions.update_tenant(instance, actor=self.context["request"].user, **validated_data)


class MembershipSerializer(FixedAfterCreateMixin, serializers.ModelSerializer):
    tenant = TenantSlugField()
    user = serializers.SlugRelatedField(
        slug_field="username", queryset=get_user_model().objects.filter(is_active=True)
    )

    class Meta:
        model = Membership
        fields = ["id", "tenant", "user", "role", "created_at"]
        read_only_fields = ["created_at"]
        fixed_after_create = ["tenant", "user"]
        # The uniqueness error is raised below, naming the field a person would change.
        validators: list[Validator[Any]] = []

    def validate(self, attrs):
        if self.instance is None:
            rules.check_new_membership(attrs["tenant"], attrs["user"])
        return attrs

    def create(self, validated_data):
        return actions.add_member(
            validated_data["tenant"],
            validated_data["user"],
            validated_data.get("role", Role.MEMBER),
            actor=self.context["request"].user,
        )


class QuotaUsageSerializer(serializers.Serializer):
    gpus_in_use = serializers.IntegerField(help_text="GPUs the tenant's jobs hold now")
    gpus_guaranteed = serializers.IntegerField(help_text="of which within the guarantee")
    gpus_borrowed = serializers.IntegerField(help_text="of which borrowed (preemptible)")
    running_jobs = serializers.IntegerField(help_text="jobs admitted or running")


def quota_usage(quotas) -> dict[int, dict]:
    """What each quota's tenant holds now, for any number of quotas in two queries."""
    tenant_ids = {q.tenant_id for q in quotas}
    if not tenant_ids:
        return {}
    # (tenant id, GPU model) -> GPUs held within the guarantee, borrowed, and jobs holding them
    held: defaultdict[tuple[int, str], dict[str, int]] = defaultdict(
        lambda: {"guaranteed": 0, "borrowed": 0, "jobs": 0}
    )
    rows = (
        Allocation.objects.filter(active=True, attempt__job__tenant_id__in=tenant_ids)
        .values("attempt__job__tenant_id", "gpu__model", "attempt__borrowed")
        .annotate(gpus=Count("id"), jobs=Count("attempt__job_id", distinct=True))
    )
    for row in rows:
        entry = held[(row["attempt__job__tenant_id"], row["gpu__model"])]
        entry["borrowed" if row["attempt__borrowed"] else "guaranteed"] += row["gpus"]
        # A job holds one attempt at a time, borrowed or not, so the two groups never share a job.
        entry["jobs"] += row["jobs"]
    running = dict(
        JobAttempt.objects.filter(state__in=ACTIVE_ATTEMPT_STATES, job__tenant_id__in=tenant_ids)
        .values("job__tenant_id")
        .annotate(jobs=Count("job_id", distinct=True))
        .values_list("job__tenant_id", "jobs")
    )
    usage = {}
    for quota in quotas:
        if quota.gpu_type:
            entry = held[(quota.tenant_id, quota.gpu_type)]
            guaranteed, borrowed, jobs = entry["guaranteed"], entry["borrowed"], entry["jobs"]
        else:
            entries = [v for (tenant_id, _), v in held.items() if tenant_id == quota.tenant_id]
            guaranteed = sum(e["guaranteed"] for e in entries)
            borrowed = sum(e["borrowed"] for e in entries)
            jobs = running.get(quota.tenant_id, 0)
        usage[quota.pk] = {
            "gpus_in_use": guaranteed + borrowed,
            "gpus_guaranteed": guaranteed,
            "gpus_borrowed": borrowed,
            "running_jobs": jobs,
        }
    return usage


class QuotaListSerializer(serializers.ListSerializer):
    def to_representation(self, data):
        items = list(data.all() if hasattr(data, "all") else data)
        self.context["quota_usage"] = quota_usage(items)
        return super().to_representation(items)


class QuotaSerializer(FixedAfterCreateMixin, serializers.ModelSerializer):
    tenant = TenantSlugField()
    usage = serializers.SerializerMethodField()

    class Meta:
        model = Quota
        fields = [
            "id",
            "tenant",
            "gpu_type",
            "guaranteed_gpus",
            "limit_gpus",
            "max_running_jobs",
            "usage",
        ]
        fixed_after_create = ["tenant", "gpu_type"]
        list_serializer_class = QuotaListSerializer
        validators: list[Validator[Any]] = []
        extra_kwargs = {
            "gpu_type": {"help_text": "A GPU model, or empty for a cap over all types"},
            "guaranteed_gpus": {"max_value": MAX_QUOTA_GPUS},
            "limit_gpus": {"max_value": MAX_QUOTA_GPUS},
            "max_running_jobs": {"max_value": MAX_QUOTA_GPUS},
        }

    @extend_schema_field(QuotaUsageSerializer)
    def get_usage(self, obj) -> dict:
        cached = self.context.get("quota_usage")
        if cached is None or obj.pk not in cached:
            cached = quota_usage([obj])
        return cached[obj.pk]

    def validate(self, attrs):
        values = {k: v for k, v in attrs.items() if k != "tenant"}
        tenant = attrs["tenant"] if self.instance is None else self.instance.tenant
        rules.check_quota(tenant, values, self.instance)
        return attrs

    def create(self, validated_data):
        values = dict(validated_data)
        tenant = values.pop("tenant")
        return actions.create_quota(tenant, actor=self.context["request"].user, **values)

    def update(self, instance, validated_data):
        return actions.update_quota(instance, actor=self.context["request"].user, **validated_data)


class BudgetUsageSerializer(serializers.Serializer):
    period_start = serializers.DateTimeField()
    period_end = serializers.DateTimeField()
    used = serializers.FloatField(help_text="kWh or GPU-hours spent this period, by kind")
    fraction_used = serializers.FloatField()
    exhausted = serializers.BooleanField(help_text="True once the action applies")


def budget_usage(budgets, now=None) -> dict[int, dict]:
    """This period's use of each budget: one query per distinct period among them (at most 3)."""
    now = now or timezone.now()
    tenant_ids = {b.tenant_id for b in budgets}
    by_period = {}
    usage = {}
    for budget in budgets:
        if budget.period not in by_period:
            start, end = period_bounds(budget.period, now)
            by_period[budget.period] = (start, end, usage_by_tenant(start, end, tenant_ids))
        start, end, spent = by_period[budget.period]
        tenant_usage = spent.get(budget.tenant_id)
        if tenant_usage is None:
            used = 0.0
        elif budget.kind == BudgetKind.ENERGY_KWH:
            used = tenant_usage.energy_kwh
        else:
            used = tenant_usage.gpu_hours
        usage[budget.pk] = {
            "period_start": start,
            "period_end": end,
            "used": used,
            "fraction_used": used / budget.amount,
            "exhausted": used >= budget.amount,
        }
    return usage


class BudgetListSerializer(serializers.ListSerializer):
    def to_representation(self, data):
        items = list(data.all() if hasattr(data, "all") else data)
        self.context["budget_usage"] = budget_usage(items)
        return super().to_representation(items)


class BudgetSerializer(FixedAfterCreateMixin, serializers.ModelSerializer):
    tenant = TenantSlugField()
    usage = serializers.SerializerMethodField()

    class Meta:
        model = Budget
        fields = ["id", "tenant", "kind", "period", "amount", "action", "warn_at_fraction", "usage"]
        fixed_after_create = ["tenant", "kind"]
        list_serializer_class = BudgetListSerializer
        validators: list[Validator[Any]] = []
        extra_kwargs = {
            **{
                name: {
                    "error_messages": {
                        "invalid_choice": f'"{{input}}" is not a {name}; use one of '
                        + ", ".join(choices.values)
                        + "."
                    }
                }
                for name, choices in (
                    ("kind", BudgetKind),
                    ("period", BudgetPeriod),
                    ("action", BudgetAction),
                )
            },
            "amount": {"help_text": "kWh or GPU-hours per period, by kind"},
            "warn_at_fraction": {"help_text": "Warn when this share of the amount is spent"},
        }

    @extend_schema_field(BudgetUsageSerializer)
    def get_usage(self, obj) -> dict:
        cached = self.context.get("budget_usage")
        if cached is None or obj.pk not in cached:
            cached = budget_usage([obj])
        return cached[obj.pk]

    def validate_amount(self, value: float) -> float:
        if problem := rules.amount_problem(value):
            raise serializers.ValidationError(problem)
        return value

    def validate_warn_at_fraction(self, value: float) -> float:
        if problem := rules.warn_at_fraction_problem(value):
            raise serializers.ValidationError(problem)
        return value

    def validate(self, attrs):
        values = {k: v for k, v in attrs.items() if k != "tenant"}
        tenant = attrs["tenant"] if self.instance is None else self.instance.tenant
        rules.check_budget(tenant, values, self.instance)
        return attrs

    def create(self, validated_data):
        values = dict(validated_data)
        tenant = values.pop("tenant")
        return actions.create_budget(tenant, actor=self.context["request"].user, **values)

    def update(self, instance, validated_data):
        return actions.update_budget(instance, actor=self.context["request"].user, **validated_data)


def _token_of(request) -> ApiToken | None:
    """The API token a request came with (None for a session)."""
    auth = getattr(request, "auth", None)
    return auth if isinstance(auth, ApiToken) else None


class ApiTokenSerializer(serializers.ModelSerializer):
    usable = serializers.BooleanField(source="is_usable", read_only=True)
    expires_at = serializers.DateTimeField(
        required=False,
        help_text=(
            "When it stops working. At most API_TOKEN_MAX_LIFETIME_DAYS ahead, and, for a token "
            "made with a token, no later than that token; left out, the latest allowed"
        ),
    )
    scopes = serializers.ListField(
        child=serializers.ChoiceField(choices=TokenScope.choices),
        required=False,
        help_text=(
            "What it may do: read (always), write (change anything its owner may), tokens "
            "(issue and revoke tokens; needs write). Left out: read and write, as far as the "
            "token it is made with holds them. Never more than that token"
        ),
    )
    minted_with: serializers.PrimaryKeyRelatedField[ApiToken] = serializers.PrimaryKeyRelatedField(
        source="parent",
        read_only=True,
        help_text="The token it was made with (null: made while signed in); revoking that "
        "token revokes this one",
    )

    class Meta:
        model = ApiToken
        fields = [
            "id",
            "name",
            "prefix",
            "scopes",
            "created_at",
            "expires_at",
            "last_used_at",
            "revoked_at",
            "usable",
            "minted_with",
        ]
        read_only_fields = ["prefix", "created_at", "last_used_at", "revoked_at"]

    def to_representation(self, instance):
        data = super().to_representation(instance)
        # What a client relies on is when it stops working, which a lowered maximum lifetime can
        # make sooner than the expiry it was issued with.
        data["expires_at"] = serializers.DateTimeField().to_representation(
            instance.effective_expires_at
        )
        return data

    def _refusal(self, **asked) -> list[str] | None:
        """What token_grant says about one field alone, so it is named with the other fields'."""
        try:
            token_grant(parent=_token_of(self.context["request"]), **asked)
        except TokenRequestRefused as exc:
            return exc.errors.get(next(iter(asked)))
        return None

    def validate_expires_at(self, value):
        if errors := self._refusal(expires_at=value):
            raise serializers.ValidationError(errors)
        return value

    def validate_scopes(self, value):
        if errors := self._refusal(scopes=value):
            raise serializers.ValidationError(errors)
        return value

    def validate(self, attrs):
        try:
            expires_at, scopes = token_grant(
                expires_at=attrs.get("expires_at"),
                scopes=attrs.get("scopes"),
                parent=_token_of(self.context["request"]),
            )
        except TokenRequestRefused as exc:
            raise serializers.ValidationError(exc.errors) from None
        return {**attrs, "expires_at": expires_at, "scopes": scopes}

    def create(self, validated_data):
        request = self.context["request"]
        try:
            token, raw = actions.issue_token(
                request.user,
                validated_data["name"],
                expires_at=validated_data["expires_at"],
                scopes=validated_data["scopes"],
                using=_token_of(request),
            )
        except TokenRequestRefused as exc:
            # The token it is made with was revoked since validate().
            raise serializers.ValidationError(exc.errors) from None
        token.raw_token = raw
        return token


class ApiTokenCreatedSerializer(ApiTokenSerializer):
    token = serializers.SerializerMethodField(
        help_text="The secret, shown this once: only its hash is stored"
    )

    class Meta(ApiTokenSerializer.Meta):
        fields = [*ApiTokenSerializer.Meta.fields, "token"]

    @extend_schema_field(OpenApiTypes.STR)
    def get_token(self, obj) -> str:
        return obj.raw_token


class InvitationSerializer(serializers.ModelSerializer):
    tenant = TenantSlugField()
    invited_by: serializers.SlugRelatedField[User] = serializers.SlugRelatedField(
        slug_field="username", read_only=True
    )
    state = serializers.ChoiceField(choices=InvitationState.choices, read_only=True)

    class Meta:
        model = Invitation
        fields = [
            "id",
            "tenant",
            "invitee",
            "role",
            "state",
            "invited_by",
            "created_at",
            "expires_at",
            "accepted_at",
        ]
        read_only_fields = ["created_at", "expires_at", "accepted_at"]
        extra_kwargs = {
            "invitee": {
                "help_text": "The username or e-mail address of the person invited, as they "
                "sign in or as their account records it. Nothing tells whether it exists"
            }
        }

    def validate_invitee(self, value: str) -> str:
        value = value.strip()
        if problem := rules.invitee_problem(value):
            raise serializers.ValidationError(problem)
        return value

    def validate(self, attrs):
        rules.check_new_invitation(attrs["tenant"], attrs["invitee"])
        return attrs

    def create(self, validated_data):
        return actions.invite(
            validated_data["tenant"],
            validated_data["invitee"],
            validated_data.get("role", Role.MEMBER),
            actor=self.context["request"].user,
        )
