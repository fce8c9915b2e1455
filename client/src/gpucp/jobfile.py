"""Job files: YAML (comments allowed) whose keys are the fields of POST /api/v1/jobs/, and the
`--set key=value` overrides of the command line.

    # train.yaml
    name: resnet-sweep
    image: registry.example.org/vision/train:2.3
    command: [python, train.py, --lr, "3e-4"]
    gpus: 2
    env: {WANDB_MODE: offline}
    # array: 0-9          # makes it an array of 10 tasks
    # max_parallel: 4
    # depends_on: [{job: 41}]

A value given with --set is read as YAML (`gpus=4` is a number, `command=[python, x.py]` a
list); a command given as one string is split as a shell would; `env.NAME=value` sets one
variable (always text).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import yaml


class JobFileError(ValueError):
    """The job file or an override cannot be used; the message names it."""


def load(path: str) -> dict[str, Any]:
    source = "standard input" if path == "-" else path
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise JobFileError(f"cannot read {source}: {exc.strerror or exc}") from None
    try:
        spec = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" line {where.line + 1}" if where is not None else ""
        raise JobFileError(f"{source}{line} is not valid YAML: {exc}") from None
    if spec is None:
        spec = {}
    if not isinstance(spec, dict):
        raise JobFileError(f"{source} must be a mapping of job fields (name: value, ...)")
    return normalized(spec)


def apply_sets(spec: dict[str, Any], assignments: list[str]) -> dict[str, Any]:
    result = dict(spec)
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        key = key.strip()
        if not sep or not key:
            raise JobFileError(f"--set {assignment!r}: write it as key=value")
        if key.startswith("env."):
            name = key.removeprefix("env.")
            result["env"] = {**(result.get("env") or {}), name: raw}
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        result[key] = value
    return normalized(result)


def normalized(spec: dict[str, Any]) -> dict[str, Any]:
    spec = {str(k): v for k, v in spec.items()}
    if isinstance(spec.get("command"), str):
        spec["command"] = shlex.split(spec["command"])
    if isinstance(spec.get("env"), dict):
        # YAML reads `DEBUG: 1` as a number; an environment holds text.
        spec["env"] = {str(k): _env_text(v) for k, v in spec["env"].items()}
    return spec


def _env_text(value: Any) -> Any:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return value  # text, or something the API names as wrong
