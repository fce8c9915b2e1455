"""Demo data for the embedded mode: two tenants, their people, a pool of simulated nodes."""

import secrets
from pathlib import Path

from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.db import transaction

from controlplane.audit import trail
from controlplane.cluster import actions as cluster_actions
from controlplane.cluster.models import Pool
from controlplane.storage import actions as storage_actions
from controlplane.storage.models import Volume
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
def seed_demo(storage_root: Path | None = None) -> dict[str, str]:
    """Create the demo once; return the people created now with their passwords.

    With a storage root (the embedded mode's var/storage, which its simulated nodes share as a
    real cluster shares an NFS mount), the demo also has a read-only `datasets` volume every
    tenant may mount and the volume that holds every job's checkpoint directory.

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
    if storage_root is not None:
        _seed_volumes(storage_root, admin)
    return created


def demo_usernames() -> list[str]:
    """The accounts seed_demo makes: the admin and each demo tenant's admin and researcher."""
    return ["admin"] + [
        f"{slug}-{role}" for slug, *_ in DEMO_TENANTS for role in ("admin", "researcher")
    ]


@transaction.atomic
def reset_demo_passwords() -> dict[str, str]:
    """New passwords for the demo accounts that exist, for someone who lost the first ones.

    Only those accounts: anyone else's password is theirs to change. Each change is audited,
    and a changed password signs out the account's sessions (Django checks the password hash
    stored in the session), so an old password copied elsewhere stops working at once.
    """
    User = get_user_model()
    reset: dict[str, str] = {}
    for user in User.objects.filter(username__in=demo_usernames()).order_by("pk"):
        password = demo_password(user)
        user.set_password(password)
        user.save(update_fields=["password"])
        trail.record(
            "user.password_reset",
            actor_label="manage.py reset_demo_passwords",
            obj=user,
            object_repr=user.username,
            message=f"New demo password for {user.username}",
        )
        reset[user.username] = password
    return reset


def _seed_volumes(root: Path, admin) -> None:
    datasets, checkpoints = root / "datasets", root / "checkpoints"
    for path in (datasets, checkpoints):
        path.mkdir(parents=True, exist_ok=True)
    sample = datasets / "README.txt"
    if not sample.exists():
        sample.write_text("A demo dataset: mount the volume `datasets` and read it here.\n")
    if not Volume.objects.filter(name="datasets").exists():
        storage_actions.create_volume(
            actor=admin,
            name="datasets",
            description="Shared datasets (read-only)",
            source=str(datasets.resolve()),
            all_tenants=True,
            read_only=True,
        )
    if not Volume.objects.filter(checkpoints=True).exists():
        storage_actions.create_volume(
            actor=admin,
            name="checkpoints",
            description="Every job's GPUCP_CHECKPOINT_DIR",
            source=str(checkpoints.resolve()),
            checkpoints=True,
        )


HISTORY_ACTOR = "demo history"


def history_seeded() -> bool:
    from controlplane.audit.models import AuditEvent

    return AuditEvent.objects.filter(
        action="jobs.history_imported", actor_label=HISTORY_ACTOR
    ).exists()


@transaction.atomic
def seed_history(*, days: float | None = None, seed: int = 1, now=None) -> int:
    """Give the demo a generated past (controlplane.demo_history) on the nodes that exist now.

    Once: a second call finds the first one's audit row and writes nothing. Returns the number
    of jobs written (0 when seeded already, or when there is no node or demo tenant to use).
    """
    import datetime as dt

    from django.utils import timezone

    from controlplane import demo_history
    from controlplane.cluster.models import Node
    from controlplane.jobs import actions as job_actions

    if history_seeded():
        return 0
    now = now or timezone.now()
    days = demo_history.DEMO_HISTORY_DAYS if days is None else days
    nodes = list(
        Node.objects.filter(deregistered_at__isnull=True)
        .select_related("pool")
        .prefetch_related("gpus")
        .order_by("name")
    )
    shapes = [
        demo_history.NodeShape(
            name=n.name,
            gpu_type=gpus[0].model,
            gpus=tuple((g.index, g.power_min_w, g.power_max_w) for g in gpus),
        )
        for n in nodes
        if (gpus := sorted(n.gpus.all(), key=lambda g: g.index))
    ]
    User = get_user_model()
    users = {
        user.username.removesuffix("-researcher"): user
        for user in User.objects.filter(
            username__in=[f"{slug}-researcher" for slug, *_ in DEMO_TENANTS]
        )
    }
    tenants = {t.slug: t for t in Tenant.objects.filter(slug__in=users)}
    if not shapes or not tenants:
        return 0
    runs = demo_history.generate(shapes, sorted(tenants), end=now, days=days, seed=seed)
    budgets = {n.pool.power_budget_w for n in nodes}
    # One pool in the demo; with several, the smallest budget keeps every pool's figures honest.
    budget_w = min((b for b in budgets if b), default=None)
    points = demo_history.charge_power(
        runs,
        shapes,
        power_budget_w=budget_w,
        end=now,
        # A day, what the telemetry history keeps by default (import_telemetry drops the rest).
        telemetry_s=min(86400.0, days * 86400.0),
    )
    node_by_name = {n.name: n for n in nodes}
    gpu_by_key = {(n.name, g.index): g for n in nodes for g in n.gpus.all()}
    records = [
        job_actions.FinishedJob(
            tenant=tenants[r.tenant],
            user=users[r.tenant],
            fields={
                "name": r.kind.name,
                "image": "registry.local/demo/train:1",
                "command": list(r.kind.command),
                "gpus": r.kind.gpus,
                "gpu_type": r.kind.gpu_type,
            },
            submitted_at=r.submitted_at,
            node=node_by_name[r.node],
            gpus=[gpu_by_key[(r.node, i)] for i in r.gpu_indexes],
            admitted_at=max(r.submitted_at, r.started_at - dt.timedelta(seconds=1)),
            started_at=r.started_at,
            finished_at=r.finished_at,
            outcome=r.outcome.upper(),
            exit_code=r.exit_code,
            energy_j=r.energy_j,
        )
        for r in runs
    ]
    job_actions.import_finished_jobs(records, actor_label=HISTORY_ACTOR)
    cluster_actions.import_telemetry(
        (
            (
                gpu_by_key[(p.node, p.gpu_index)],
                p.at,
                {
                    "utilization_pct": p.utilization_pct,
                    "power_draw_w": p.power_draw_w,
                    "power_cap_w": p.power_cap_w,
                },
            )
            for p in points
        ),
        actor_label=HISTORY_ACTOR,
    )
    return len(records)
