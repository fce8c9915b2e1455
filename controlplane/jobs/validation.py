"""The rules a job submission must pass, shared by the REST API and the web form.

Input is what JSON gives: ints, floats, strings, booleans, a list for `command`, a dict for `env`.
A web form parses its text inputs into those types first (e.g. `shlex.split` for the command,
`KEY=value` lines for env) and then calls the same function, so both paths refuse the same
things with the same messages:

    submission = validate_submission(user, data)
    job = actions.submit_job(tenant=submission.tenant, user=user, **submission.fields)

Errors are Django's exceptions, which the REST API maps to HTTP and a form can show as is:
- `Http404`: the tenant does not exist or the user is not a member (the same answer for both);
- `PermissionDenied`: a viewer, or a tenant that takes no new jobs;
- `ValidationError` with a dict of field name -> messages (every field at fault, not just one).
Nothing here writes to the database.
"""

from __future__ import annotations

import math
import re
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypedDict

from django.conf import settings
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.db.models import CharField, Count, Max, prefetch_related_objects
from django.db.models.signals import m2m_changed, post_delete, post_save

from controlplane.cluster.models import GPU, Node, NodeState
from controlplane.jobs import dependencies
from controlplane.jobs.models import Job, PriorityClass
from controlplane.storage.models import Volume
from controlplane.tenancy import reads as tenancy_reads
from controlplane.tenancy.models import Role, Tenant
from controlplane.validators import text_problem


def _column_chars(name: str) -> int:
    """The max_length of Job's text column `name`: a longer value is refused, not cut."""
    column = Job._meta.get_field(name)
    if not isinstance(column, CharField) or column.max_length is None:
        raise TypeError(f"Job.{name} is no text column with a max_length")
    return column.max_length


MAX_RUNTIME_S = 30 * 86400
MAX_NAME_CHARS = _column_chars("name")
MAX_IMAGE_CHARS = _column_chars("image")
MAX_COMMAND_ITEMS = 4096
MAX_ENV_VARS = 512
MAX_ARGV_BYTES = 128 * 1024  # Linux allows more, but a command this long is a mistake.
# The columns' own limit (PostgreSQL integer): past it a number is a typo, and a database error.
MAX_GPUS = MAX_MEMORY_MIB = 2**31 - 1
# The agent sets these to the job's own GPUs; a job that chose its own would see other jobs' GPUs.
RESERVED_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"})
RESERVED_ENV_PREFIX = "GPUCP_"

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# An image reference as the distribution spec writes it, with the registry host required and a
# tag or digest required: an image never silently means ":latest" of whatever docker.io serves.
_HOST_LABEL = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)"
_REGISTRY = rf"(?P<registry>{_HOST_LABEL}(?:\.{_HOST_LABEL})*(?::[0-9]+)?)"
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
# ASCII only, as registries take them (Python's \w would also take any letter of any script).
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
IMAGE_REFERENCE = re.compile(
    rf"{_REGISTRY}/(?P<path>{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*)"
    rf"(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?"
)

# The same rule as one pattern without named groups, for the OpenAPI schema (clients and
# fuzzers read it): a registry host (with a dot or a port, or localhost), and a tag or digest.
IMAGE_PATTERN = (
    rf"^(?:{_HOST_LABEL}(?:\.{_HOST_LABEL})+(?::[0-9]+)?|{_HOST_LABEL}:[0-9]+|localhost)"
    rf"/{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
    rf"(?::{_TAG}(?:@{_DIGEST})?|@{_DIGEST})$"
)

IMAGE_HELP = (
    "Give a full image reference: registry/name:tag or registry/name@sha256:digest, "
    "e.g. registry.local/team/train:1 or docker.io/library/python:3.12."
)


class SubmissionDefaults(TypedDict):
    """DEFAULTS, field by field: what a form or serializer may show as its own default."""

    name: str
    image: str | None
    command: list[str] | None
    env: dict[str, str]
    gpus: int
    gpu_type: str
    cpus: float
    memory_mib: int
    priority: str
    preemptible: bool
    restartable: bool
    max_runtime_s: int
    estimated_duration_s: int | None
    mounts: list[dict]
    stop_signal: str
    preemption_grace_s: int | None
    checkpoint_interval_s: int | None


# Every field a submission may carry, with its default when left out (None: required).
DEFAULTS: SubmissionDefaults = {
    "name": "",  # empty: named after the image
    "image": None,
    "command": None,
    "env": {},
    "gpus": 1,
    "gpu_type": "",
    "cpus": 1.0,
    "memory_mib": 4096,
    "priority": PriorityClass.NORMAL.value,
    "preemptible": True,
    "restartable": True,
    "max_runtime_s": 86400,
    "estimated_duration_s": None,
    "mounts": [],
    "stop_signal": "SIGTERM",
    "preemption_grace_s": None,  # None: the admin's PREEMPTION_GRACE_DEFAULT_S, read when used
    "checkpoint_interval_s": None,
}
# Fields that may be left out, or null, without being required.
OPTIONAL = frozenset({"estimated_duration_s", "preemption_grace_s", "checkpoint_interval_s"})

# The signals a job may ask to be warned with before it is stopped (then SIGKILL after grace).
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")
MAX_CHECKPOINT_INTERVAL_S = 30 * 86400
MAX_MOUNTS = 32
MAX_MOUNT_PATH_CHARS = 1024
# Where the job's checkpoint directory is mounted: a mount of its own there would hide it.
CHECKPOINT_ROOT = "/gpucp"
# What a mount may not cover, nor be under: the container's own system, which a volume laid
# over it would replace (a job could then shadow /etc/passwd or the dynamic loader's libraries
# with files of its choosing, or lose /proc). "/" itself only exactly: everything is under it.
SYSTEM_PATHS = (
    "/proc",
    "/sys",
    "/dev",
    "/etc",
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib64",
    "/boot",
    "/run",
    "/var/run",
    CHECKPOINT_ROOT,
)
# One part of a mount path: what docker's --mount and podman's -v take without quoting, and
# what the web form's "volume:/path:ro" lines can hold (no ':' or ',').
_PATH_PART = re.compile(r"[A-Za-z0-9._@+-]+")


@dataclass(frozen=True)
class ClusterShape:
    """What the cluster's registered nodes can hold (a submit checks against recent()).

    Every registered node counts, ready or not, cordoned or not: a node that is down now may be
    back in a minute, so a job that waits for it is valid, and its pending reason (the
    scheduler's) says what it waits for. Only what no registered node could ever hold is refused.
    """

    gpu_models: frozenset[str]
    # model -> the most GPUs of that model on one registered node
    largest_gpus_per_node: dict[str, int]
    max_node_memory_mib: int
    max_node_cpus: int
    # model -> the most GPUs of that model on one node that takes work now (ready, and neither
    # cordoned nor draining): what the web form's hints say about now, never a reason to refuse
    largest_gpus_per_node_now: dict[str, int] = field(default_factory=dict)
    # model -> every GPU of that model on a registered node: a job larger than one node runs
    # over several (docs/job-contract.md), so only more than all of them is refused
    total_gpus: dict[str, int] = field(default_factory=dict)

    @classmethod
    def recent(cls) -> ClusterShape:
        """The shape as this process read it at most CLUSTER_SHAPE_CACHE_S ago.

        Only for accepting: a submit it refuses is checked again against reload() (see
        clean_submission), so a node registered on another web process a moment ago is never
        the reason for a 400.
        """
        entry = _recent_shape
        if entry is None or time.monotonic() - entry[0] > CLUSTER_SHAPE_CACHE_S:
            return cls.reload()
        return entry[1]

    @classmethod
    def reload(cls) -> ClusterShape:
        """load(), and keep it as the recent shape."""
        global _recent_shape
        shape = cls.load()
        _recent_shape = (time.monotonic(), shape)
        return shape

    @classmethod
    def load(cls) -> ClusterShape:
        largest: dict[str, int] = defaultdict(int)
        largest_now: dict[str, int] = defaultdict(int)
        total: dict[str, int] = defaultdict(int)
        rows = GPU.objects.values("model", "node_id", "node__ready", "node__state").annotate(
            count=Count("id")
        )
        for row in rows:
            model = row["model"]
            largest[model] = max(largest[model], row["count"])
            total[model] += row["count"]
            if row["node__ready"] and row["node__state"] == NodeState.READY:
                largest_now[model] = max(largest_now[model], row["count"])
        sizes = Node.objects.aggregate(memory_mib=Max("memory_mib"), cpus=Max("cpus"))
        return cls(
            gpu_models=frozenset(largest),
            largest_gpus_per_node=dict(largest),
            max_node_memory_mib=sizes["memory_mib"] or 0,
            max_node_cpus=sizes["cpus"] or 0,
            largest_gpus_per_node_now=dict(largest_now),
            total_gpus=dict(total),
        )


# How long a web process validates submits against the cluster shape it read last, instead of
# two queries per submit. A refusal is never made on it (clean_submission reads the shape again
# first), so the one effect of its age is that a job no registered node can hold any more (a
# node removed or shrunk on another process within this time) is accepted: it waits PENDING
# with the scheduler's reason, exactly as a job submitted a moment before the removal does.
CLUSTER_SHAPE_CACHE_S = 5.0
# (monotonic time read, shape), replaced whole: the threads of a process share it.
_recent_shape: tuple[float, ClusterShape] | None = None


def _forget_recent_shape(**_kwargs) -> None:
    # This process's own writes are seen by its next submit (the web UI's node pages, tests);
    # other processes' after CLUSTER_SHAPE_CACHE_S. Writes that send no signal (bulk_create,
    # update()) are covered by the age limit and by the fresh read before any refusal.
    global _recent_shape
    _recent_shape = None


for _model in (Node, GPU):
    post_save.connect(_forget_recent_shape, sender=_model, dispatch_uid=f"shape-{_model.__name__}")
    post_delete.connect(
        _forget_recent_shape, sender=_model, dispatch_uid=f"shape-del-{_model.__name__}"
    )


@dataclass(frozen=True, slots=True)
class VolumeInfo:
    pk: int
    name: str
    read_only: bool
    checkpoints: bool
    all_tenants: bool
    tenant_ids: frozenset[int]

    def usable_by(self, tenant: Tenant) -> bool:
        return self.all_tenants or tenant.pk in self.tenant_ids


@dataclass(frozen=True)
class VolumeCatalog:
    """Every volume, as a submit checks mounts against it (there are few: an admin's list).

    Cached per process like ClusterShape, for the same reason (a submit costs no extra query),
    and with the same rule: a mount it refuses is checked again against a fresh read. What the
    age can let through: a volume deleted, or taken from the tenant, on another web process
    within VOLUME_CATALOG_CACHE_S; the job then names a volume no node reports (it waits, with
    the scheduler's reason) or one its tenant lost a moment before, as a job submitted a moment
    earlier would. A checkpoint volume defined on another process within that time is missed by
    jobs submitted meanwhile (they get no checkpoint directory, as jobs before it).
    """

    by_name: dict[str, VolumeInfo]
    checkpoint: VolumeInfo | None

    @classmethod
    def recent(cls) -> VolumeCatalog:
        entry = _recent_volumes
        if (
            entry is None
            or time.monotonic() - entry[0] > VOLUME_CATALOG_CACHE_S
            or not _visible_here(entry[2])
        ):
            return cls.reload()
        return entry[1]

    @classmethod
    def reload(cls) -> VolumeCatalog:
        """load(), kept as the recent catalog. Read inside a transaction, it may hold that
        transaction's own uncommitted volumes: it is then kept for that transaction alone
        until it commits (a rolled-back volume must not name a checkpoint volume to others)."""
        global _recent_volumes
        catalog = cls.load()
        connection = transaction.get_connection()
        block = connection.atomic_blocks[0] if connection.in_atomic_block else None
        entry = (time.monotonic(), catalog, block)
        _recent_volumes = entry
        if block is not None:
            transaction.on_commit(lambda: _committed(entry))
        return catalog

    @classmethod
    def load(cls) -> VolumeCatalog:
        tenants: dict[int, set[int]] = defaultdict(set)
        for volume_id, tenant_id in Volume.tenants.through.objects.values_list(
            "volume_id", "tenant_id"
        ):
            tenants[volume_id].add(tenant_id)
        volumes = [
            VolumeInfo(
                pk=row["pk"],
                name=row["name"],
                read_only=row["read_only"],
                checkpoints=row["checkpoints"],
                all_tenants=row["all_tenants"],
                tenant_ids=frozenset(tenants.get(row["pk"], ())),
            )
            for row in Volume.objects.values(
                "pk", "name", "read_only", "checkpoints", "all_tenants"
            )
        ]
        return cls(
            by_name={v.name: v for v in volumes},
            checkpoint=next((v for v in volumes if v.checkpoints), None),
        )


VOLUME_CATALOG_CACHE_S = 5.0
# (monotonic time read, catalog, the outermost atomic block it was read in or None).
_recent_volumes: tuple[float, VolumeCatalog, object] | None = None


def _visible_here(block) -> bool:
    """Whether a catalog read in `block` (None: committed data) may serve this thread now."""
    if block is None:
        return True
    connection = transaction.get_connection()
    return connection.in_atomic_block and connection.atomic_blocks[0] is block


def _committed(entry: tuple[float, VolumeCatalog, object]) -> None:
    global _recent_volumes
    if _recent_volumes is entry:
        _recent_volumes = (entry[0], entry[1], None)


def _forget_recent_volumes(**_kwargs) -> None:
    global _recent_volumes
    _recent_volumes = None


post_save.connect(_forget_recent_volumes, sender=Volume, dispatch_uid="volumes-save")
post_delete.connect(_forget_recent_volumes, sender=Volume, dispatch_uid="volumes-delete")
m2m_changed.connect(
    _forget_recent_volumes, sender=Volume.tenants.through, dispatch_uid="volumes-tenants"
)


def _check_volumes(cleaned: dict, tenant: Tenant, catalog: VolumeCatalog) -> tuple[dict, dict]:
    """(problems, resolved fields): each mount's volume must be one the tenant may use, and a
    read-only volume is mounted read-only. Resolved: the mounts with read_only decided, and the
    checkpoint volume the job's directory will live on.

    A volume the tenant may not use is refused with the same words as one that does not exist,
    so a submit cannot tell whether another tenant's volume is there.
    """
    problems: dict[str, list[str]] = {}
    checkpoint = catalog.checkpoint
    resolved: dict = {"checkpoint_volume_id": checkpoint.pk if checkpoint else None}
    mounts = cleaned.get("mounts")
    if mounts is None:
        return problems, resolved
    out = []
    for i, mount in enumerate(mounts):
        volume = catalog.by_name.get(mount["volume"])
        if volume is None or not volume.usable_by(tenant):
            problems[f"mounts[{i}].volume"] = [
                f"No volume named {mount['volume']!r} that tenant {tenant.slug} may use."
            ]
            continue
        if volume.checkpoints:
            problems[f"mounts[{i}].volume"] = [
                f"{volume.name} holds every job's checkpoint directory; a job gets its own at "
                f"{CHECKPOINT_ROOT}/checkpoint and cannot mount the whole volume."
            ]
            continue
        read_only = mount["read_only"]
        if volume.read_only and read_only is False:
            problems[f"mounts[{i}].read_only"] = [
                f"Volume {volume.name} is read-only: it cannot be mounted read-write."
            ]
            continue
        out.append(
            {
                "volume": volume.name,
                "path": mount["path"],
                "read_only": volume.read_only if read_only is None else read_only,
            }
        )
    resolved["mounts"] = out
    return problems, resolved


@dataclass(frozen=True)
class Submission:
    tenant: Tenant
    fields: dict = field(default_factory=dict)


def resolve_submit_tenant(
    user, slug, roles: dict[int, str] | None = None, tenants: Mapping[int, Tenant] | None = None
) -> Tenant:
    """The tenant a job goes to. A user in exactly one tenant may leave it out.

    `tenants`: the tenants of `roles`, when the caller read them with the roles (a user's
    tenant is found there without another query; only a cluster admin's other tenants are not).
    """
    from controlplane.permissions import (
        is_cluster_admin,
        require_role,
        tenant_for_write,
        tenant_roles,
    )

    roles = tenant_roles(user) if roles is None else roles
    tenants = tenants or {}
    if slug in (None, ""):
        if len(roles) == 1:
            # The user's one tenant, by its id: looking it up again by slug finds the same row.
            only = next(iter(roles))
            tenant = tenants.get(only) or Tenant.objects.get(pk=only)
            require_role(user, tenant, Role.MEMBER, roles)
            return _taking_jobs(tenant)
        if roles:
            slugs = ", ".join(
                Tenant.objects.filter(pk__in=roles).order_by("slug").values_list("slug", flat=True)
            )
            raise ValidationError(
                {"tenant": [f"You belong to several tenants ({slugs}); say which."]}
            )
        elif is_cluster_admin(user):
            raise ValidationError({"tenant": ["Say which tenant the job belongs to."]})
        else:
            raise PermissionDenied("You belong to no tenant; ask a tenant admin to add you.")
    known = next((t for t in tenants.values() if t.slug == slug), None)
    if known is not None:
        # What tenant_for_write would find: a tenant the user belongs to is visible to them.
        require_role(user, known, Role.MEMBER, roles)
        return _taking_jobs(known)
    return _taking_jobs(tenant_for_write(user, slug, Role.MEMBER, roles))


def _taking_jobs(tenant: Tenant) -> Tenant:
    if not tenant.active:
        raise PermissionDenied(f"Tenant {tenant.slug} is inactive: it takes no new jobs.")
    return tenant


def validate_submission(user, data: Mapping, roles: dict[int, str] | None = None) -> Submission:
    """Everything a submit checks, in the order that leaks the least: tenant, then fields."""
    tenant = resolve_submit_tenant(user, data.get("tenant"), roles)
    return Submission(tenant=tenant, fields=clean_submission(data, tenant))


def clean_submission(data: Mapping, tenant: Tenant, cluster: ClusterShape | None = None) -> dict:
    """The job's fields, cleaned, or a ValidationError naming every field at fault.

    Without `cluster`, checked against the shape this process read recently; what that refuses
    is checked again against a fresh read, so only a fresh shape ever refuses.
    """
    cleaned, errors = _clean_fields(data)
    _clean_dependencies(data, tenant, cleaned, errors)
    problems = _check_against_cluster(cleaned, tenant, cluster or ClusterShape.recent())
    if problems and cluster is None:
        problems = _check_against_cluster(cleaned, tenant, ClusterShape.reload())
    problems.update(_volumes_checked(cleaned, tenant, VolumeCatalog.recent(), fresh_retry=True))
    return _finished(cleaned, errors, problems)


def _volumes_checked(
    cleaned: dict, tenant: Tenant, catalog: VolumeCatalog, *, fresh_retry: bool
) -> dict:
    """_check_volumes, its resolved fields written into `cleaned`; a refusal on a recent
    catalog is checked again on a fresh one when `fresh_retry`."""
    problems, resolved = _check_volumes(cleaned, tenant, catalog)
    if problems and fresh_retry:
        problems, resolved = _check_volumes(cleaned, tenant, VolumeCatalog.reload())
    if problems:
        # Only field problems remain to report; mounts stay as given for _finished's errors.
        resolved.pop("mounts", None)
    cleaned.update(resolved)
    return problems


class InvalidItems(Exception):
    """Items of a list of submissions that are refused: index -> field name -> messages."""

    def __init__(self, errors: dict[int, dict[str, list[str]]]):
        super().__init__(f"{len(errors)} items refused")
        self.errors = errors


def clean_submissions(items: Sequence[tuple[Mapping, Tenant]]) -> list[dict]:
    """clean_submission for each (data, tenant), all against one shape, each tenant's quotas
    read once; raises InvalidItems naming every item at fault, and every field of each."""
    prefetch_related_objects(list({id(t): t for _, t in items}.values()), "quotas")
    shape = ClusterShape.recent()
    results = [(*_clean_fields(data), tenant) for data, tenant in items]
    for (cleaned, errors, tenant), (data, _) in zip(results, items, strict=True):
        _clean_dependencies(data, tenant, cleaned, errors)
    problems = [_check_against_cluster(cleaned, t, shape) for cleaned, _, t in results]
    if any(problems):
        # Refused on the recent shape: only a fresh one may refuse (clean_submission).
        shape = ClusterShape.reload()
        problems = [
            _check_against_cluster(cleaned, t, shape) if p else p
            for (cleaned, _, t), p in zip(results, problems, strict=True)
        ]
    catalog = VolumeCatalog.recent()
    volume_problems = [_volumes_checked(c, t, catalog, fresh_retry=False) for c, _, t in results]
    if any(volume_problems):
        catalog = VolumeCatalog.reload()
        volume_problems = [
            _volumes_checked(c, t, catalog, fresh_retry=False) if vp else vp
            for (c, _, t), vp in zip(results, volume_problems, strict=True)
        ]
    for found, vp in zip(problems, volume_problems, strict=True):
        found.update(vp)
    jobs, refused = [], {}
    for i, ((cleaned, errors, _), found) in enumerate(zip(results, problems, strict=True)):
        try:
            jobs.append(_finished(cleaned, errors, found))
        except ValidationError as exc:
            refused[i] = exc.message_dict
    if refused:
        raise InvalidItems(refused)
    return jobs


def _clean_dependencies(
    data: Mapping, tenant: Tenant, cleaned: dict, errors: dict[str, list[str]]
) -> None:
    """`depends_on` (controlplane.jobs.dependencies): the jobs and arrays of the tenant this
    job waits for. Cleaned into a list of DependencySpec, possibly empty."""
    try:
        cleaned["depends_on"] = dependencies.parse(data.get("depends_on"), tenant=tenant)
    except ValidationError as exc:
        errors.update(exc.message_dict)


def _clean_fields(data: Mapping) -> tuple[dict, dict[str, list[str]]]:
    errors: dict[str, list[str]] = {}
    unknown = sorted(set(data) - set(DEFAULTS) - {"tenant", "depends_on"})
    for key in unknown:
        errors[str(key)] = ["Unknown field."]

    cleaned: dict = {}
    for name, default in DEFAULTS.items():
        value = data.get(name, default)
        if value is None and default is None and name not in OPTIONAL:
            errors[name] = ["This field is required."]
            continue
        try:
            cleaned[name] = FIELD_CLEANERS[name](value)
        except ValidationError as exc:
            errors[name] = exc.messages
        except FieldErrors as exc:
            errors.update(exc.errors)
    return cleaned, errors


def _finished(cleaned: dict, errors: dict[str, list[str]], problems: dict) -> dict:
    for name, messages in problems.items():
        errors.setdefault(name, messages)
    if errors:
        raise ValidationError(errors)
    if not cleaned["name"]:
        cleaned["name"] = _name_from_image(cleaned["image"])
    return cleaned


# Field by field. Each takes the raw value and returns it cleaned, or raises ValidationError.


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def clean_name(value) -> str:
    if not isinstance(value, str):
        raise ValidationError("Must be a string.")
    if len(value) > MAX_NAME_CHARS:
        raise ValidationError(f"At most {MAX_NAME_CHARS} characters.")
    if any(ord(c) < 32 for c in value):
        raise ValidationError("Must not contain control characters.")
    _refuse_unstorable(value)
    return value.strip()


def _refuse_unstorable(value: str, what: str = "It") -> None:
    problem = text_problem(value)
    if problem is not None:
        raise ValidationError(f"{what} {problem}.")


def clean_image(value) -> str:
    if not isinstance(value, str) or not value:
        raise ValidationError(IMAGE_HELP)
    if len(value) > MAX_IMAGE_CHARS:
        raise ValidationError(f"At most {MAX_IMAGE_CHARS} characters.")
    match = IMAGE_REFERENCE.fullmatch(value)
    if match is None:
        raise ValidationError(f"{value!r} is not an image reference. {IMAGE_HELP}")
    registry = match["registry"]
    if not ("." in registry or ":" in registry or registry == "localhost"):
        raise ValidationError(f"{value!r} names no registry host. {IMAGE_HELP}")
    if not match["tag"] and not match["digest"]:
        raise ValidationError(f"{value!r} has no tag or digest. {IMAGE_HELP}")
    return value


def clean_command(value) -> list[str]:
    if not isinstance(value, list):
        raise ValidationError('Must be a list of strings, e.g. ["python", "train.py"].')
    if not value:
        raise ValidationError("Must not be empty: give the program to run and its arguments.")
    if len(value) > MAX_COMMAND_ITEMS:
        raise ValidationError(f"At most {MAX_COMMAND_ITEMS} items.")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise ValidationError(f"Item {i} is {type(item).__name__}, not a string.")
        _refuse_unstorable(item, f"Item {i}")
    if not value[0].strip():
        raise ValidationError("The first item, the program to run, must not be blank.")
    if sum(len(item.encode()) + 1 for item in value) > MAX_ARGV_BYTES:
        raise ValidationError(f"The command is longer than {MAX_ARGV_BYTES} bytes.")
    return value


def clean_env(value) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ValidationError(
            'Must be a map of variable names to string values, e.g. {"EPOCHS": "3"}.'
        )
    if len(value) > MAX_ENV_VARS:
        raise ValidationError(f"At most {MAX_ENV_VARS} variables.")
    problems = []
    size_bytes = 0
    for key, item in value.items():
        if not isinstance(key, str) or not ENV_NAME.fullmatch(key):
            problems.append(
                f"{key!r} is not a variable name (letters, digits and _, not starting with a digit)."
            )
        elif key in RESERVED_ENV or key.startswith(RESERVED_ENV_PREFIX):
            problems.append(f"{key} is set by the control plane and cannot be chosen by a job.")
        if not isinstance(item, str):
            problems.append(f"The value of {key!r} is {type(item).__name__}, not a string.")
        elif text_problem(item) is not None:
            problems.append(f"The value of {key!r} {text_problem(item)}.")
        else:
            size_bytes += len(str(key).encode()) + len(item.encode()) + 2
    if size_bytes > MAX_ARGV_BYTES:
        problems.append(f"The environment is larger than {MAX_ARGV_BYTES} bytes.")
    if problems:
        raise ValidationError(problems)
    return value


def clean_gpus(value) -> int:
    if not _is_int(value):
        raise ValidationError("Must be a whole number.")
    if value < 0:
        raise ValidationError("Must be 0 or more.")
    if value > MAX_GPUS:
        raise ValidationError(f"Must be at most {MAX_GPUS}.")
    return value


def clean_gpu_type(value) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValidationError("Must be a string: a GPU model such as H100-SXM-80GB, or empty.")
    _refuse_unstorable(value)
    return value.strip()


def clean_cpus(value) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ValidationError("Must be a number.")
    if value <= 0:
        raise ValidationError("Must be more than 0.")
    return float(value)


def clean_memory_mib(value) -> int:
    if not _is_int(value):
        raise ValidationError("Must be a whole number of MiB.")
    if value <= 0:
        raise ValidationError("Must be more than 0 MiB.")
    if value > MAX_MEMORY_MIB:
        raise ValidationError(f"Must be at most {MAX_MEMORY_MIB} MiB.")
    return value


def clean_priority(value) -> str:
    if value not in PriorityClass.values:
        choices = ", ".join(PriorityClass.values)
        raise ValidationError(f"{value!r} is not a priority class; use one of {choices}.")
    return value


def clean_bool(value) -> bool:
    if not isinstance(value, bool):
        raise ValidationError("Must be true or false.")
    return value


def clean_max_runtime_s(value) -> int:
    if not _is_int(value):
        raise ValidationError("Must be a whole number of seconds.")
    if not 1 <= value <= MAX_RUNTIME_S:
        raise ValidationError(f"Must be between 1 and {MAX_RUNTIME_S} seconds (30 days).")
    return value


def clean_estimated_duration_s(value) -> int | None:
    if value is None:
        return None
    if not _is_int(value):
        raise ValidationError("Must be a whole number of seconds.")
    if not 1 <= value <= MAX_RUNTIME_S:
        raise ValidationError(f"Must be between 1 and {MAX_RUNTIME_S} seconds (30 days).")
    return value


def clean_stop_signal(value) -> str:
    if value not in STOP_SIGNALS:
        raise ValidationError(f"Must be one of {', '.join(STOP_SIGNALS)}.")
    return value


def grace_max_s() -> int:
    """The longest notice a job may ask for, whole seconds (settings.PREEMPTION_GRACE_MAX_S)."""
    return int(settings.PREEMPTION_GRACE_MAX_S)


def clean_preemption_grace_s(value) -> int:
    if value is None:
        return min(int(settings.PREEMPTION_GRACE_DEFAULT_S), grace_max_s())
    if not _is_int(value):
        raise ValidationError("Must be a whole number of seconds.")
    if not 0 <= value <= grace_max_s():
        raise ValidationError(f"Must be between 0 and {grace_max_s()} seconds.")
    return value


def clean_checkpoint_interval_s(value) -> int | None:
    if value is None:
        return None
    if not _is_int(value):
        raise ValidationError("Must be a whole number of seconds.")
    if not 1 <= value <= MAX_CHECKPOINT_INTERVAL_S:
        raise ValidationError(
            f"Must be between 1 and {MAX_CHECKPOINT_INTERVAL_S} seconds (30 days)."
        )
    return value


class FieldErrors(Exception):
    """Errors of a list's items, by their own field names (e.g. mounts[0].path)."""

    def __init__(self, errors: dict[str, list[str]]):
        super().__init__(errors)
        self.errors = errors


def _covers(outer: str, inner: str) -> bool:
    """Whether a mount at `outer` is `inner` or lies over it."""
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def clean_mount_path(value) -> str:
    """An absolute container path, normalised (no '//', no '.', no trailing '/'), outside the
    container's system directories and the checkpoint mount."""
    if not isinstance(value, str) or not value:
        raise ValidationError("Must be an absolute path, e.g. /data.")
    _refuse_unstorable(value)
    if len(value) > MAX_MOUNT_PATH_CHARS:
        raise ValidationError(f"At most {MAX_MOUNT_PATH_CHARS} characters.")
    if not value.startswith("/"):
        raise ValidationError("Must be an absolute path, starting with /.")
    parts = [p for p in value.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ValidationError("Must not contain '..'.")
    bad = next((p for p in parts if not _PATH_PART.fullmatch(p)), None)
    if bad is not None:
        raise ValidationError(
            f"{bad!r}: each part of the path may hold letters, digits and . _ @ + - only."
        )
    path = "/" + "/".join(parts)
    if path == "/":
        raise ValidationError("Cannot mount over the container's root directory.")
    for system in SYSTEM_PATHS:
        if _covers(system, path) or _covers(path, system):
            what = (
                "the job's checkpoint directory" if system == CHECKPOINT_ROOT else "a system path"
            )
            raise ValidationError(f"{path} is or covers {system}, {what}: choose another path.")
    return path


def clean_mounts(value) -> list[dict]:
    """The mounts' shape: [{"volume", "path", "read_only"?}]. Whether the tenant may use each
    volume is checked against the volumes (_check_volumes); read_only stays None when left
    out (the volume's own setting decides)."""
    if not isinstance(value, list):
        raise ValidationError('Must be a list of {"volume": name, "path": "/data"} objects.')
    if len(value) > MAX_MOUNTS:
        raise ValidationError(f"At most {MAX_MOUNTS} mounts.")
    errors: dict[str, list[str]] = {}
    mounts: list[dict] = []
    for i, item in enumerate(value):
        at = f"mounts[{i}]"
        if not isinstance(item, dict):
            errors[at] = ['Must be an object: {"volume": name, "path": "/data"}.']
            continue
        for key in sorted(set(item) - {"volume", "path", "read_only"}, key=str):
            errors[f"{at}.{key}"] = ["Unknown field."]
        volume = item.get("volume")
        if not isinstance(volume, str) or not volume:
            errors[f"{at}.volume"] = ["Must be a volume's name."]
        elif (problem := text_problem(volume)) is not None:
            errors[f"{at}.volume"] = [f"It {problem}."]
        try:
            path = clean_mount_path(item.get("path"))
        except ValidationError as exc:
            errors[f"{at}.path"] = exc.messages
            path = None
        read_only = item.get("read_only")
        if read_only is not None and not isinstance(read_only, bool):
            errors[f"{at}.read_only"] = ["Must be true or false."]
        mounts.append({"volume": volume, "path": path, "read_only": read_only})
    for i, mount in enumerate(mounts):
        if mount["path"] is None:
            continue
        for j, other in enumerate(mounts[:i]):
            if other["path"] is not None and (
                _covers(other["path"], mount["path"]) or _covers(mount["path"], other["path"])
            ):
                errors.setdefault(f"mounts[{i}].path", []).append(
                    f"{mount['path']} is or lies over/under {other['path']} of mounts[{j}]: "
                    "mounts may not share or nest paths."
                )
                break
    if errors:
        raise FieldErrors(errors)
    return mounts


FIELD_CLEANERS = {
    "name": clean_name,
    "image": clean_image,
    "command": clean_command,
    "env": clean_env,
    "gpus": clean_gpus,
    "gpu_type": clean_gpu_type,
    "cpus": clean_cpus,
    "memory_mib": clean_memory_mib,
    "priority": clean_priority,
    "preemptible": clean_bool,
    "restartable": clean_bool,
    "max_runtime_s": clean_max_runtime_s,
    "estimated_duration_s": clean_estimated_duration_s,
    "mounts": clean_mounts,
    "stop_signal": clean_stop_signal,
    "preemption_grace_s": clean_preemption_grace_s,
    "checkpoint_interval_s": clean_checkpoint_interval_s,
}


# Against the tenant's quota and the cluster's hardware.


def tenant_gpu_limit(tenant: Tenant, gpu_type: str, quotas=None) -> int:
    """How many GPUs of `gpu_type` the tenant may hold at once: the tighter of its quota for the
    type and its any-type quota. With neither, none: a tenant uses only what it was given."""
    quotas = list(tenant.quotas.all()) if quotas is None else quotas
    limits = [q.limit_gpus for q in quotas if q.gpu_type in (gpu_type, "")]
    return min(limits) if limits else 0


def _check_against_cluster(cleaned: dict, tenant: Tenant, cluster: ClusterShape) -> dict:
    """Checks across fields and against the hardware; a check whose inputs were already refused
    is skipped, so each field is named once, for its first problem."""
    errors: dict[str, list[str]] = {}
    gpus, gpu_type = cleaned.get("gpus"), cleaned.get("gpu_type")
    if gpu_type and gpu_type not in cluster.gpu_models:
        known = ", ".join(sorted(cluster.gpu_models)) or "none yet"
        errors["gpu_type"] = [f"No GPU of type {gpu_type!r} in the cluster (types: {known})."]
    elif gpus and gpu_type is not None:
        problem = _gpu_count_problem(gpus, gpu_type, tenant, cluster)
        if problem:
            errors["gpus"] = [problem]
    memory_mib = cleaned.get("memory_mib")
    if memory_mib and cluster.max_node_memory_mib and memory_mib > cluster.max_node_memory_mib:
        errors["memory_mib"] = [
            f"No node has {memory_mib} MiB: the largest has {cluster.max_node_memory_mib} MiB."
        ]
    cpus = cleaned.get("cpus")
    if cpus and cluster.max_node_cpus and cpus > cluster.max_node_cpus:
        errors["cpus"] = [f"No node has {cpus:g} CPUs: the largest has {cluster.max_node_cpus}."]
    estimate, runtime = cleaned.get("estimated_duration_s"), cleaned.get("max_runtime_s")
    if estimate is not None and runtime is not None and estimate > runtime:
        errors["estimated_duration_s"] = [
            f"Longer than max_runtime_s ({runtime} s): the job would be stopped first."
        ]
    return errors


def _gpu_count_problem(gpus: int, gpu_type: str, tenant: Tenant, cluster: ClusterShape) -> str:
    quotas = tenancy_reads.quotas_of(tenant)
    candidates = [gpu_type] if gpu_type else sorted(cluster.gpu_models)
    if not candidates:
        return f"The cluster has no GPUs yet; {gpus} cannot be given."
    within_quota = [m for m in candidates if gpus <= tenant_gpu_limit(tenant, m, quotas)]
    if not within_quota:
        best = max(tenant_gpu_limit(tenant, m, quotas) for m in candidates)
        of_type = f" of type {gpu_type}" if gpu_type else ""
        return (
            f"Tenant {tenant.slug} may use at most {best} GPUs{of_type} at once "
            f"(its quota limit); asked for {gpus}."
        )
    # More GPUs than one node has run over several nodes; only more than the cluster has of one
    # type cannot be given.
    most = max(cluster.total_gpus.get(m, 0) for m in within_quota)
    if gpus > most:
        of_type = f" of type {gpu_type}" if gpu_type else " of one type"
        return f"The cluster has {most} GPUs{of_type} in all: {gpus} cannot be given."
    return ""


def _name_from_image(image: str) -> str:
    """registry.local/team/train:1 -> train"""
    match = IMAGE_REFERENCE.fullmatch(image)
    if match is None:  # clean_image let it through: never
        raise ValueError(f"{image!r} is not an image reference")
    path = match["path"]
    return path.rsplit("/", 1)[-1][:MAX_NAME_CHARS]
