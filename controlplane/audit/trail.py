"""`record`: what every action calls to leave its one audit row, in the action's transaction.

Before and after hold only the fields the action is about, as JSON values, so the admin's list
shows what changed at a glance and nothing secret (token hashes) is ever copied here.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping

from controlplane.audit.models import AuditEvent


def _json(value):
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    if isinstance(value, Mapping):
        return {str(k): _json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json(v) for v in value]
    if hasattr(value, "pk"):
        return value.pk
    return value


def snapshot(obj, fields: Iterable[str]) -> dict:
    """The named fields of a model instance as JSON values (a relation as its id)."""
    out = {}
    for name in fields:
        value = getattr(obj, name)
        out[name] = _json(getattr(value, "pk", value)) if hasattr(value, "_meta") else _json(value)
    return out


def actor_label_of(actor) -> str:
    if actor is None:
        return "system"
    return getattr(actor, "username", None) or str(actor)


def record(
    action: str,
    *,
    actor=None,
    actor_label: str = "",
    tenant=None,
    obj=None,
    object_type: str = "",
    object_id: str | int = "",
    object_repr: str = "",
    before: dict | None = None,
    after: dict | None = None,
    message: str = "",
) -> AuditEvent:
    """Write one audit row. `actor` is a user (or None for the system: then say who in
    actor_label); `tenant` a Tenant or its id; `obj` fills the object fields unless given."""
    if obj is not None:
        object_type = object_type or obj._meta.model_name
        object_id = object_id or obj.pk
        object_repr = object_repr or str(obj)
    user = actor if getattr(actor, "is_authenticated", False) else None
    return AuditEvent.objects.create(
        actor=user,
        actor_label=actor_label or actor_label_of(actor),
        tenant_id=getattr(tenant, "pk", tenant),
        action=action,
        object_type=object_type,
        object_id=str(object_id if object_id is not None else ""),
        object_repr=object_repr[:300],
        before=_json(before) if before is not None else None,
        after=_json(after) if after is not None else None,
        message=message,
    )


def changes(before: dict, after: dict) -> tuple[dict, dict]:
    """Only the fields that differ, from both sides."""
    keys = [k for k in after if before.get(k) != after.get(k)]
    return {k: before.get(k) for k in keys}, {k: after[k] for k in keys}


def describe(before: dict, after: dict) -> str:
    """ "limit_gpus 16 → 12, weight 1.0 → 2.0": what a message says changed."""
    return ", ".join(f"{k} {before.get(k)} → {after[k]}" for k in after)
