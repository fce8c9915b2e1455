"""GPU backends: NVML on real hosts, a modelled GPU everywhere else."""

from __future__ import annotations

import logging

from agents.gpu.base import (
    GpuBackend,
    GpuError,
    GpuInfo,
    GpuInvalidArgument,
    GpuLost,
    GpuNoPermission,
    GpuNotSupported,
    GpuTelemetry,
)

__all__ = [
    "GpuBackend",
    "GpuError",
    "GpuInfo",
    "GpuInvalidArgument",
    "GpuLost",
    "GpuNoPermission",
    "GpuNotSupported",
    "GpuTelemetry",
    "make_backend",
]

log = logging.getLogger(__name__)

# What `auto` falls back to on a host without NVML: one modelled DGX-class node.
AUTO_FALLBACK = "simulated:H100-SXM-80GB:8"


def make_backend(spec: str, *, node_name: str, state_dir: str | None = None) -> GpuBackend:
    """Build the backend named by ``spec``: ``nvml``, ``simulated:<profile>[:count]`` or ``auto``.

    ``auto`` is NVML when ``nvmlInit()`` works and the simulated fallback otherwise, so one
    command line serves real GPU hosts and laptops alike.
    """
    if spec == "nvml":
        from agents.gpu.nvml import NvmlBackend

        return NvmlBackend()
    if spec == "auto":
        from agents.gpu.nvml import NvmlBackend

        try:
            return NvmlBackend()
        except GpuError as exc:
            log.warning("NVML unavailable (%s); using %s", exc, AUTO_FALLBACK)
            spec = AUTO_FALLBACK
    if spec.startswith("simulated"):
        from agents.gpu.simulated import SimulatedBackend

        return SimulatedBackend.from_spec(spec, node_name=node_name, state_dir=state_dir)
    raise ValueError(f"unknown GPU backend {spec!r}: use nvml, simulated:<profile>[:count] or auto")
