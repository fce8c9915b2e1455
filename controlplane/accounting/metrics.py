"""Prometheus text exposition of cluster state.

GPU series use dcgm-exporter's names and labels (gpu, UUID, modelName, Hostname) so existing
dashboards work unchanged; DCGM reports total energy in millijoules, and so do we under its
name. Our own series are prefixed gpucp_. Values are read from Postgres at scrape time, so every
web process answers the same and there is no in-process registry to keep consistent.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db.models import Count, Sum

from controlplane.cluster.models import GPU, Node, Pool
from controlplane.jobs.models import Job, JobAttempt, JobState
from controlplane.scheduling.models import SchedulingCycle
from controlplane.tenancy.models import Tenant


def _escape(value) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


class Exposition:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(
        self, name: str, kind: str, help_text: str, samples: Iterable[tuple[dict, float | None]]
    ) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            if value is None:  # not reported is not zero
                continue
            self.lines.append(f"{name}{_labels(labels)} {float(value):.6g}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


GPU_SERIES = [
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", lambda g: g.power_draw_w),
    (
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "counter",
        "Total energy consumption since boot (in mJ).",
        lambda g: None if g.energy_j is None else g.energy_j * 1000.0,
    ),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", lambda g: g.utilization_pct),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", lambda g: g.temperature_c),
    (
        "DCGM_FI_DEV_FB_USED",
        "gauge",
        "Framebuffer memory used (in MiB).",
        lambda g: g.memory_used_mib,
    ),
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", lambda g: g.sm_clock_mhz),
    (
        "DCGM_FI_DEV_POWER_MGMT_LIMIT",
        "gauge",
        "Enforced power limit (in W).",
        lambda g: g.power_cap_w,
    ),
    (
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "counter",
        "Uncorrected (double-bit) ECC errors since the driver loaded.",
        lambda g: g.ecc_errors,
    ),
]


def render_metrics() -> str:
    out = Exposition()
    gpus = list(GPU.objects.select_related("node").order_by("node__name", "index"))
    for name, kind, help_text, get in GPU_SERIES:
        out.family(
            name,
            kind,
            help_text,
            (
                (
                    {"gpu": g.index, "UUID": g.uuid, "modelName": g.model, "Hostname": g.node.name},
                    get(g),
                )
                for g in gpus
            ),
        )
    # DCGM exports the throttle reasons as one bitmask; ours arrive as names, so one series per
    # reason in force. A GPU that reports none has no series; one that cannot tell, none either.
    out.family(
        "gpucp_gpu_throttled",
        "gauge",
        "1 while the reason holds the GPU's clocks down.",
        (
            (
                {
                    "reason": reason,
                    "gpu": g.index,
                    "UUID": g.uuid,
                    "modelName": g.model,
                    "Hostname": g.node.name,
                },
                1.0,
            )
            for g in gpus
            for reason in g.throttle_reasons or ()
        ),
    )
    out.family(
        "gpucp_gpu_desired_power_cap_watts",
        "gauge",
        "Power cap the scheduler wants for the GPU.",
        (({"UUID": g.uuid, "Hostname": g.node.name}, g.desired_power_cap_w) for g in gpus),
    )

    tenants = {t.pk: t.slug for t in Tenant.objects.all()}
    booked = JobAttempt.objects.values("job__tenant_id").annotate(
        energy=Sum("energy_j"), gpu_s=Sum("gpu_seconds")
    )
    out.family(
        "gpucp_tenant_energy_joules_total",
        "counter",
        "Energy booked to the tenant's attempts (J).",
        (({"tenant": tenants[r["job__tenant_id"]]}, r["energy"] or 0.0) for r in booked),
    )
    out.family(
        "gpucp_tenant_gpu_seconds_total",
        "counter",
        "GPU-seconds booked to the tenant's attempts.",
        (({"tenant": tenants[r["job__tenant_id"]]}, r["gpu_s"] or 0.0) for r in booked),
    )
    jobs_by_state = {}
    for row in (
        Job.objects.filter(state__in=[JobState.PENDING, JobState.RUNNING, JobState.ADMITTED])
        .values("tenant_id", "state")
        .annotate(n=Count("id"))
    ):
        jobs_by_state[(row["tenant_id"], row["state"])] = row["n"]
    out.family(
        "gpucp_pending_jobs",
        "gauge",
        "Jobs waiting for GPUs, by tenant.",
        (
            ({"tenant": slug}, jobs_by_state.get((pk, JobState.PENDING), 0))
            for pk, slug in tenants.items()
        ),
    )
    out.family(
        "gpucp_running_jobs",
        "gauge",
        "Jobs admitted or running, by tenant.",
        (
            (
                {"tenant": slug},
                jobs_by_state.get((pk, JobState.RUNNING), 0)
                + jobs_by_state.get((pk, JobState.ADMITTED), 0),
            )
            for pk, slug in tenants.items()
        ),
    )

    pools = list(Pool.objects.annotate(draw_w=Sum("nodes__gpus__power_draw_w")))
    out.family(
        "gpucp_pool_power_budget_watts",
        "gauge",
        "Most watts the pool's GPUs may draw together.",
        (({"pool": p.name}, p.power_budget_w) for p in pools),
    )
    out.family(
        "gpucp_pool_power_draw_watts",
        "gauge",
        "Watts the pool's GPUs draw now (latest telemetry).",
        (({"pool": p.name}, p.draw_w or 0.0) for p in pools),
    )
    out.family(
        "gpucp_node_ready",
        "gauge",
        "1 when the node's agent answers and the node takes new work.",
        (
            ({"node": n.name, "pool": n.pool.name}, 1.0 if n.schedulable else 0.0)
            for n in Node.objects.select_related("pool")
        ),
    )
    last = SchedulingCycle.objects.order_by("-started_at").first()
    out.family(
        "gpucp_scheduling_cycle_duration_seconds",
        "gauge",
        "Wall time of the latest scheduling cycle.",
        [({}, last.duration_ms / 1000.0)] if last else [],
    )
    return out.text()
