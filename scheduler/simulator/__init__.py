"""Trace replay through the production policy: loaders, the event engine, metrics, reports.

``replay(jobs, nodes, tenants, config)`` is the entry point over plain data (the what-if
command builds on it); ``python -m scheduler.simulator`` compares policy presets on a trace.
"""

from scheduler import native as _native

# Before the modules below are imported: they are taken from the compiled build where it is
# used (scheduler.native).
_native.attach(__name__, __path__)

from scheduler.simulator.checkpoints import CheckpointIntervals
from scheduler.simulator.engine import (
    JobOutcome,
    PlanError,
    RestartCost,
    Result,
    SimOptions,
    replay,
)
from scheduler.simulator.loaders import TraceError, load_alibaba, load_philly, load_trace
from scheduler.simulator.metrics import Summary, summarize
from scheduler.simulator.policies import PRESETS, Oracle, Preset, Sharing, cluster_for, preset
from scheduler.simulator.trace import Trace, TraceJob, TraceNode, TraceTenant, synthetic_trace

__all__ = [
    "PRESETS",
    "CheckpointIntervals",
    "JobOutcome",
    "Oracle",
    "PlanError",
    "Preset",
    "RestartCost",
    "Result",
    "Sharing",
    "SimOptions",
    "Summary",
    "Trace",
    "TraceError",
    "TraceJob",
    "TraceNode",
    "TraceTenant",
    "cluster_for",
    "load_alibaba",
    "load_philly",
    "load_trace",
    "preset",
    "replay",
    "summarize",
    "synthetic_trace",
]
