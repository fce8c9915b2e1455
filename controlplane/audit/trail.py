"""`record`: what every action calls to leave its one audit row, in the action's transaction.

Before and after hold only the fields the action is about, as JSON values, so the admin's list
shows what changed at a glance and nothing secret (token hashes) is ever copied here.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class Kind:
    """One kind of configuration row (a pool, a tenant, a quota, a budget) that actions create,
    change and delete, each with one audit row: the three share one shape, so they are written
    once here and an app's action keeps only its rule and whether the scheduler must hear of it.
    """

    name: str  # "quota": the rows say quota.create, quota.update, quota.delete
    fields: tuple[str, ...]  # what before and after carry
    settable: tuple[str, ...]  # what an update may change; the rest is fixed once made
    title: Callable[[Any], str]  # "Quota for H100-SXM-80GB": how messages name the row
    shown: Callable[[Any], str] = str  # the row's object_repr
    tenant_of: Callable[[Any], Any] = lambda obj: None  # whose trail the row belongs to
    # A change with a name of its own (a pool's power budget alone, which operators filter
    # the trail by): (action, message) for (obj, before, after), or None for "<kind>.update".
    named_change: Callable[[Any, dict, dict], tuple[str, str] | None] = lambda obj, b, a: None


def created(kind: Kind, obj: Any, *, actor: Any) -> AuditEvent:
    return record(
        f"{kind.name}.create",
        actor=actor,
        tenant=kind.tenant_of(obj),
        obj=obj,
        object_repr=kind.shown(obj),
        after=snapshot(obj, kind.fields),
        message=f"{kind.title(obj)} created.",
    )


def save_changes(kind: Kind, obj: Any, values: Mapping[str, Any], *, actor: Any) -> dict[str, Any]:
    """Set `values` on `obj` and save and record what changed; {} when nothing did (no row)."""
    for name in values:
        if name not in kind.settable:
            raise TypeError(f"{type(obj).__name__} has no settable field {name!r}")
    before = snapshot(obj, kind.fields)
    for name, value in values.items():
        setattr(obj, name, value)
    before, after = changes(before, snapshot(obj, kind.fields))
    if after:
        obj.save(update_fields=list(after))
        action, message = kind.named_change(obj, before, after) or (
            f"{kind.name}.update",
            f"{kind.title(obj)} changed: {describe(before, after)}.",
        )
        record(
            action,
            actor=actor,
            tenant=kind.tenant_of(obj),
            obj=obj,
            object_repr=kind.shown(obj),
            before=before,
            after=after,
            message=message,
        )
    return after


def deleted(kind: Kind, obj: Any, *, actor: Any) -> AuditEvent:
    """Delete `obj` (a ProtectedError leaves everything as it was) and record it."""
    before = snapshot(obj, kind.fields)
    pk, shown, title = obj.pk, kind.shown(obj), kind.title(obj)
    tenant = kind.tenant_of(obj)
    obj.delete()
    return record(
        f"{kind.name}.delete",
        actor=actor,
        # A deleted tenant's own row keeps no tenant (there is none to point at); the rows of
        # what it owned keep theirs until the tenant goes, then become null too.
        tenant=None if tenant is obj else tenant,
        object_type=kind.name,
        object_id=pk,
        object_repr=shown,
        before=before,
        message=f"{title} deleted.",
    )


def prune(now: dt.datetime, retention_days: float) -> int:
    """Delete the rows older than the admin's retention (AUDIT_RETENTION_DAYS); 0 keeps all.

    The one deletion the trail allows: nothing else ever changes a row.
    """
    if retention_days <= 0:
        return 0
    deleted, _ = AuditEvent.objects.filter(at__lt=now - dt.timedelta(days=retention_days)).delete()
    return deleted
