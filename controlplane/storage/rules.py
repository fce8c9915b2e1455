"""The rules a volume must pass: the REST API's serializer, the web UI's form, the Django admin
and the actions call these, so every path refuses the same input with the same words.

Errors are Django's ValidationError with a dict of field name -> messages. Nothing here writes.
"""

from __future__ import annotations

import posixpath
import re

from django.core.exceptions import ValidationError

from controlplane.storage.models import Volume, VolumeKind
from controlplane.validators import text_problem

# Lower-case letters, digits and inner hyphens: a volume's name becomes GPUCP_MOUNT_<NAME> (upper
# case, "-" -> "_"), so two names that differ only in case or in "-" versus "_" would collide.
VOLUME_NAME_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
# What Docker and Podman accept as a named volume's name.
ENGINE_VOLUME_NAME_RE = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.-]{1,254}")
# Characters a host path may hold. No ":" or ",": container engines split bind specs on them;
# no whitespace or control characters: they hide in logs and break shell-quoted tooling.
HOST_PATH_CHARS_RE = re.compile(r"/[A-Za-z0-9._@+=~/-]*")
MAX_SOURCE_LENGTH = 1024

# The host's own directories: mounting one (or anything under it) into a job hands the job the
# node (its devices, its configuration, the container engine's socket and state).
SYSTEM_TREES = (
    "/bin",
    "/boot",
    "/dev",
    "/etc",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/proc",
    "/root",
    "/run",
    "/sbin",
    "/snap",
    "/sys",
    "/usr",
    "/var/lib/containerd",
    "/var/lib/docker",
    "/var/lib/kubelet",
    "/var/run",
)
# Directories whose contents are fine but which are too broad to hand over whole.
SYSTEM_ROOTS = ("/", "/home", "/media", "/mnt", "/opt", "/srv", "/tmp", "/var", "/var/lib")

MAX_RETENTION_S = 10 * 365 * 86400


def name_problem(value: str) -> str | None:
    if (problem := text_problem(value)) is not None:
        return problem[0].upper() + problem[1:] + "."
    if not VOLUME_NAME_RE.fullmatch(value):
        return (
            "Lower-case letters, digits and hyphens, at most 63 characters, starting and "
            "ending with a letter or digit."
        )
    return None


def host_path_problem(value: str) -> str | None:
    """Why this cannot be a host_path volume's source; None when it can."""
    if (problem := text_problem(value)) is not None:
        return problem[0].upper() + problem[1:] + "."
    if len(value) > MAX_SOURCE_LENGTH:
        return f"At most {MAX_SOURCE_LENGTH} characters."
    if not value.startswith("/"):
        return "Must be an absolute path (starting with /)."
    if ".." in value.split("/"):
        return "Must not contain '..': give the directory itself."
    if not HOST_PATH_CHARS_RE.fullmatch(value):
        return "Letters, digits and . _ @ + = ~ - / only (no spaces, ':' or ',')."
    if posixpath.normpath(value) != value:
        return f"Give the path in its plain form: {posixpath.normpath(value)}."
    if value in SYSTEM_ROOTS:
        return f"{value} is too broad to mount into jobs; give a directory under it."
    for tree in SYSTEM_TREES:
        if value == tree or value.startswith(tree + "/"):
            return f"{tree} belongs to the host's system; jobs may not mount it or anything in it."
    return None


def engine_volume_problem(value: str) -> str | None:
    if (problem := text_problem(value)) is not None:
        return problem[0].upper() + problem[1:] + "."
    if not ENGINE_VOLUME_NAME_RE.fullmatch(value):
        return (
            "A container engine volume name: 2 to 255 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit."
        )
    return None


def retention_problem(value: int) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return "Must be a whole number of seconds."
    if not 0 <= value <= MAX_RETENTION_S:
        return f"Must be between 0 and {MAX_RETENTION_S} seconds (10 years)."
    return None


def check_volume(values: dict, instance: Volume | None = None) -> None:
    """`values`: the fields being set; the others are taken from `instance` (or the defaults).
    Raises ValidationError naming each field at fault."""
    errors: dict[str, list[str]] = {}

    def current(name: str):
        if name in values:
            return values[name]
        if instance is not None:
            return getattr(instance, name)
        return {f.name: f for f in Volume._meta.concrete_fields}[name].get_default()

    if instance is not None and "name" in values and values["name"] != instance.name:
        # Jobs name the volumes they mount; a rename would strand every queued one.
        errors["name"] = ["A volume's name is fixed once it is created."]
    elif "name" in values:
        name = values["name"]
        if not isinstance(name, str):
            errors["name"] = ["Must be text."]
        elif problem := name_problem(name):
            errors["name"] = [problem]
        elif (
            Volume.objects.filter(name=name)
            .exclude(pk__in=[instance.pk] if instance is not None else [])
            .exists()
        ):
            errors["name"] = ["A volume with this name already exists."]
    if "description" in values:
        description = values["description"]
        if (problem := text_problem(description)) is not None:
            errors["description"] = [problem[0].upper() + problem[1:] + "."]
        elif len(description) > 200:
            errors["description"] = ["At most 200 characters."]
    kind = current("kind")
    if kind not in VolumeKind.values:
        errors["kind"] = [f"Must be one of {', '.join(VolumeKind.values)}."]
    source = current("source")
    if "source" in values or "kind" in values:
        if not source:
            errors["source"] = ["This field is required."]
        elif kind == VolumeKind.HOST_PATH and (problem := host_path_problem(source)):
            errors["source"] = [problem]
        elif kind == VolumeKind.ENGINE_VOLUME and (problem := engine_volume_problem(source)):
            errors["source"] = [problem]
    if current("per_tenant_subdir") and kind == VolumeKind.ENGINE_VOLUME:
        errors.setdefault("per_tenant_subdir", []).append(
            "Only a host_path volume can give each tenant its own directory."
        )
    if current("checkpoints"):
        if kind != VolumeKind.HOST_PATH or current("read_only"):
            errors.setdefault("checkpoints", []).append(
                "The checkpoint volume must be a writable host_path volume."
            )
        taken = Volume.objects.filter(checkpoints=True)
        if instance is not None:
            taken = taken.exclude(pk=instance.pk)
        if (other := taken.first()) is not None:
            errors.setdefault("checkpoints", []).append(
                f"{other.name} is already the checkpoint volume; there is only one."
            )
    if "checkpoint_retention_s" in values and (
        problem := retention_problem(values["checkpoint_retention_s"])
    ):
        errors["checkpoint_retention_s"] = [problem]
    if errors:
        raise ValidationError(errors)
