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
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypedDict

from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import CharField, Count, Max

from controlplane.cluster.models import GPU, Node, NodeState
from controlplane.jobs.models import Job, PriorityClass
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
}


@dataclass(frozen=True)
class ClusterShape:
    """What the cluster's registered nodes can hold, read once per submission.

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

    @classmethod
    def load(cls) -> ClusterShape:
        largest: dict[str, int] = defaultdict(int)
        largest_now: dict[str, int] = defaultdict(int)
        rows = GPU.objects.values("model", "node_id", "node__ready", "node__state").annotate(
            count=Count("id")
        )
        for row in rows:
            model = row["model"]
            largest[model] = max(largest[model], row["count"])
            if row["node__ready"] and row["node__state"] == NodeState.READY:
                largest_now[model] = max(largest_now[model], row["count"])
        sizes = Node.objects.aggregate(memory_mib=Max("memory_mib"), cpus=Max("cpus"))
        return cls(
            gpu_models=frozenset(largest),
            largest_gpus_per_node=dict(largest),
            max_node_memory_mib=sizes["memory_mib"] or 0,
            max_node_cpus=sizes["cpus"] or 0,
            largest_gpus_per_node_now=dict(largest_now),
        )


@dataclass(frozen=True)
class Submission:
    tenant: Tenant
    fields: dict = field(default_factory=dict)


def resolve_submit_tenant(user, slug, roles: dict[int, str] | None = None) -> Tenant:
    """The tenant a job goes to. A user in exactly one tenant may leave it out."""
    from controlplane.permissions import is_cluster_admin, tenant_for_write, tenant_roles

    roles = tenant_roles(user) if roles is None else roles
    if slug in (None, ""):
        if len(roles) == 1:
            tenant = Tenant.objects.get(pk=next(iter(roles)))
            slug = tenant.slug
        elif roles:
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
    tenant = tenant_for_write(user, slug, Role.MEMBER, roles)
    if not tenant.active:
        raise PermissionDenied(f"Tenant {tenant.slug} is inactive: it takes no new jobs.")
    return tenant


def validate_submission(user, data: Mapping, roles: dict[int, str] | None = None) -> Submission:
    """Everything a submit checks, in the order that leaks the least: tenant, then fields."""
    tenant = resolve_submit_tenant(user, data.get("tenant"), roles)
    return Submission(tenant=tenant, fields=clean_submission(data, tenant))


def clean_submission(data: Mapping, tenant: Tenant, cluster: ClusterShape | None = None) -> dict:
    """The job's fields, cleaned, or a ValidationError naming every field at fault."""
    errors: dict[str, list[str]] = {}
    unknown = sorted(set(data) - set(DEFAULTS) - {"tenant"})
    for key in unknown:
        errors[str(key)] = ["Unknown field."]

    cleaned: dict = {}
    for name, default in DEFAULTS.items():
        value = data.get(name, default)
        if value is None and default is None and name != "estimated_duration_s":
            errors[name] = ["This field is required."]
            continue
        try:
            cleaned[name] = FIELD_CLEANERS[name](value)
        except ValidationError as exc:
            errors[name] = exc.messages
    cluster = cluster or ClusterShape.load()
    for name, messages in _check_against_cluster(cleaned, tenant, cluster).items():
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
    quotas = list(tenant.quotas.all())
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
    largest = max(cluster.largest_gpus_per_node.get(m, 0) for m in within_quota)
    if gpus > largest:
        of_type = f" of type {gpu_type}" if gpu_type else " of one type"
        return f"No node has {gpus} GPUs{of_type}: the largest has {largest}."
    return ""


def _name_from_image(image: str) -> str:
    """registry.local/team/train:1 -> train"""
    match = IMAGE_REFERENCE.fullmatch(image)
    if match is None:  # clean_image let it through: never
        raise ValueError(f"{image!r} is not an image reference")
    path = match["path"]
    return path.rsplit("/", 1)[-1][:MAX_NAME_CHARS]
