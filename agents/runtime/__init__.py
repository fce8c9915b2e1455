"""Runtimes: where attempts run (containers on a Docker-compatible engine, or plain processes)."""

from __future__ import annotations

import os

from agents.runtime.base import (
    AttemptSpec,
    AttemptState,
    AttemptStatus,
    Runtime,
    StartError,
)

__all__ = [
    "AttemptSpec",
    "AttemptState",
    "AttemptStatus",
    "Runtime",
    "StartError",
    "make_runtime",
]


def make_runtime(
    kind: str,
    *,
    state_dir: str | os.PathLike[str],
    node_name: str,
    docker_url: str | None = None,
    gpu_device_requests: bool = False,
    job_path_prepend: tuple[str, ...] = (),
    supervisor: str | None = None,
    supervisor_dir: str | None = None,
) -> Runtime:
    """Build the runtime named ``kind`` ("docker" or "process").

    job_path_prepend (folders put first on each job's PATH) is for the process runtime only: a
    container's PATH comes from its image, and silently ignoring the setting would mislead.
    So are supervisor (agents/runtime/supervisor.py: auto, compiled or bash) and supervisor_dir
    (where the compiled one is built; default <state_dir>/bin).
    """
    if kind == "process":
        from agents.runtime.process import ProcessRuntime

        return ProcessRuntime(
            state_dir,
            job_path_prepend=job_path_prepend,
            supervisor=supervisor,
            supervisor_dir=supervisor_dir,
        )
    if job_path_prepend:
        raise ValueError("a job PATH prepend applies to the process runtime only")
    if supervisor not in (None, "auto"):
        raise ValueError("a job supervisor applies to the process runtime only")
    if kind == "docker":
        from agents.runtime.docker import DockerRuntime

        return DockerRuntime(
            state_dir,
            node_name=node_name,
            base_url=docker_url,
            gpu_device_requests=gpu_device_requests,
        )
    raise ValueError(f"unknown runtime {kind!r}: use docker or process")
