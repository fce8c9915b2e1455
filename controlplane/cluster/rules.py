"""The rules a pool or a node action must pass: the REST API's serializers, the web UI's forms
and the actions call these, so every path refuses the same input with the same words.

Errors are Django's ValidationError with a dict of field name -> messages (as in
`controlplane.jobs.validation`). Nothing here writes to the database.
"""

from __future__ import annotations

import datetime as dt
import math

from django.core.exceptions import ValidationError

from controlplane.cluster.models import NODE_NAME_RE, NodeState, Pool

# A budget above this is a typo (a large datacenter hall draws tens of megawatts).
MAX_POOL_POWER_BUDGET_W = 1e8

MAX_JOIN_TOKEN_LIFETIME = dt.timedelta(days=30)
DEFAULT_JOIN_TOKEN_LIFETIME = dt.timedelta(days=1)
MAX_JOIN_TOKEN_USES = 10_000

# The verbs an admin applies to a node (API actions, page buttons, admin actions) and the admin
# state each sets.
NODE_ACTION_STATES = {
    "cordon": NodeState.CORDONED,
    "drain": NodeState.DRAINING,
    "uncordon": NodeState.READY,
}


def power_budget_problem(value: float | None) -> str | None:
    if value is None:
        return None
    if not math.isfinite(value) or value <= 0:
        return "Must be more than 0 W, or null for no budget."
    if value > MAX_POOL_POWER_BUDGET_W:
        return f"{value:g} W is beyond any facility (at most {MAX_POOL_POWER_BUDGET_W:g} W)."
    return None


def check_pool(values: dict, instance: Pool | None = None) -> None:
    errors: dict[str, list[str]] = {}
    if "power_budget_w" in values and (problem := power_budget_problem(values["power_budget_w"])):
        errors["power_budget_w"] = [problem]
    name = values.get("name")
    if name is not None:
        taken = Pool.objects.filter(name=name)
        if instance is not None:
            taken = taken.exclude(pk=instance.pk)
        if taken.exists():
            errors["name"] = ["pool with this name already exists."]
    if errors:
        raise ValidationError(errors)


def check_node_state(state: str) -> None:
    if state not in NodeState.values:
        raise ValidationError(
            {"state": [f"{state!r} is not one of {', '.join(NodeState.values)}."]}
        )


def join_token_node_name_problem(value: str) -> str | None:
    if value and not NODE_NAME_RE.match(value):
        return "Letters, digits, '.', '_' and '-' only, not at either end."
    return None


def join_token_expiry_problem(value: dt.datetime, now: dt.datetime) -> str | None:
    if value <= now:
        return "Must be in the future."
    if value > now + MAX_JOIN_TOKEN_LIFETIME:
        return "At most 30 days ahead: join tokens are short-lived."
    return None
