"""The rules a tenant, quota, budget, membership or invitation must pass: the REST API's
serializers, the web UI's forms and the actions all call these, so every path refuses the same
input with the same words.

Input is typed already (a number is a number); each function raises Django's ValidationError
with a dict of field name -> messages, as `controlplane.jobs.validation` does. Nothing here
writes to the database.
"""

from __future__ import annotations

import math

from django.core.exceptions import ValidationError

from controlplane.tenancy.models import (
    INVITEE_RE,
    Budget,
    BudgetKind,
    Invitation,
    Membership,
    Quota,
    Tenant,
)

MAX_TENANT_WEIGHT = 1000.0
MAX_QUOTA_GPUS = 100_000
# An exabyte of checkpoints is a typo, and the column holds no more than 2**63 - 1.
MAX_CHECKPOINT_LIMIT_BYTES = 10**18
# Larger than any cluster spends in a month (100 GWh, 100 million GPU-hours): a typo, not a plan.
MAX_BUDGET_AMOUNT = {BudgetKind.ENERGY_KWH: 1e8, BudgetKind.GPU_HOURS: 1e8}


def default(model, name: str):
    """A field's default for a new object. It lives on the model only: the API leaves it out of
    `required`, the actions let the model fill it in, and the forms show it as the initial value."""
    field = model._meta.get_field(name)
    return field.get_default() if field.has_default() or field.null else None


def _raise(errors: dict[str, list[str]]) -> None:
    if errors:
        raise ValidationError(errors)


def weight_problem(value: float) -> str | None:
    if not (math.isfinite(value) and 0 < value <= MAX_TENANT_WEIGHT):
        return f"Must be more than 0 and at most {MAX_TENANT_WEIGHT:g}."
    return None


def checkpoint_limit_problem(value: int | None) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        return "Must be a whole number of bytes, or null for no limit."
    if not 0 <= value <= MAX_CHECKPOINT_LIMIT_BYTES:
        return f"Must be between 0 and {MAX_CHECKPOINT_LIMIT_BYTES} bytes, or null for no limit."
    return None


def max_array_size_problem(value: int) -> str | None:
    from django.conf import settings

    ceiling = settings.MAX_ARRAY_SIZE_CEILING
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= ceiling:
        return f"Must be a whole number of tasks from 1 to {ceiling} (MAX_ARRAY_SIZE_CEILING)."
    return None


def check_tenant(values: dict, instance: Tenant | None = None) -> None:
    errors: dict[str, list[str]] = {}
    if "max_array_size" in values and (problem := max_array_size_problem(values["max_array_size"])):
        errors["max_array_size"] = [problem]
    if "weight" in values and (problem := weight_problem(values["weight"])):
        errors["weight"] = [problem]
    if "checkpoint_limit_bytes" in values and (
        problem := checkpoint_limit_problem(values["checkpoint_limit_bytes"])
    ):
        errors["checkpoint_limit_bytes"] = [problem]
    slug = values.get("slug")
    if slug is not None:
        taken = Tenant.objects.filter(slug=slug)
        if instance is not None:
            taken = taken.exclude(pk=instance.pk)
        if taken.exists():
            errors["slug"] = ["tenant with this slug already exists."]
    _raise(errors)


def gpus_problem(value: int | None) -> str | None:
    # DRF's own words: the API's fields say the same before this rule is reached.
    if value is not None and value < 0:
        return "Ensure this value is greater than or equal to 0."
    if value is not None and value > MAX_QUOTA_GPUS:
        return f"Ensure this value is less than or equal to {MAX_QUOTA_GPUS}."
    return None


def check_quota(tenant: Tenant, values: dict, instance: Quota | None = None) -> None:
    """`values`: the fields being set; the others are the instance's (or the defaults)."""

    def current(name):
        if name in values:
            return values[name]
        return getattr(instance, name) if instance is not None else default(Quota, name)

    errors: dict[str, list[str]] = {}
    for name in ("guaranteed_gpus", "limit_gpus", "max_running_jobs"):
        if problem := gpus_problem(current(name)):
            errors[name] = [problem]
    if not errors and current("limit_gpus") < current("guaranteed_gpus"):
        errors["limit_gpus"] = [
            f"Must be at least guaranteed_gpus ({current('guaranteed_gpus')}): "
            "a tenant may borrow beyond its guarantee, never less."
        ]
    if instance is None:
        gpu_type = current("gpu_type")
        if Quota.objects.filter(tenant=tenant, gpu_type=gpu_type).exists():
            errors["gpu_type"] = [
                f"{tenant.slug} already has a quota for {gpu_type or 'any type'}; change that one."
            ]
    _raise(errors)


def amount_problem(value: float) -> str | None:
    if not math.isfinite(value) or value <= 0:
        return "Must be a number more than 0."
    return None


def warn_at_fraction_problem(value: float) -> str | None:
    if not (math.isfinite(value) and 0 < value <= 1):
        return "Must be more than 0 and at most 1 (e.g. 0.8)."
    return None


def check_budget(tenant: Tenant, values: dict, instance: Budget | None = None) -> None:
    errors: dict[str, list[str]] = {}
    kind = values.get("kind") or (instance.kind if instance is not None else None)
    amount = values.get("amount", instance.amount if instance is not None else None)
    if amount is not None and (problem := amount_problem(amount)):
        errors["amount"] = [problem]
    if "warn_at_fraction" in values and (
        problem := warn_at_fraction_problem(values["warn_at_fraction"])
    ):
        errors["warn_at_fraction"] = [problem]
    if kind is not None and amount is not None and "amount" not in errors:
        limit = MAX_BUDGET_AMOUNT[BudgetKind(kind)]
        if amount > limit:
            unit = "kWh" if kind == BudgetKind.ENERGY_KWH else "GPU-hours"
            errors["amount"] = [
                f"{amount:g} {unit} per period is beyond any cluster (at most {limit:g})."
            ]
    if instance is None and kind is not None:
        if Budget.objects.filter(tenant=tenant, kind=kind).exists():
            errors["kind"] = [f"{tenant.slug} already has a {kind} budget; change that one."]
    _raise(errors)


def check_new_membership(tenant: Tenant, user) -> None:
    if Membership.objects.filter(tenant=tenant, user=user).exists():
        raise ValidationError({"user": [f"{user.username} is already a member of {tenant.slug}."]})


def invitee_problem(value: str) -> str | None:
    """Of the invitee as typed, stripped of surrounding blanks."""
    if not INVITEE_RE.match(value):
        return "A username or an e-mail address: letters, digits and @ . + - _ only."
    return None


def check_new_invitation(tenant: Tenant, invitee: str) -> None:
    if Invitation.objects.open().filter(tenant=tenant, invitee=invitee).exists():
        raise ValidationError(
            {"invitee": [f"{tenant.slug} already has an open invitation for {invitee}."]}
        )
