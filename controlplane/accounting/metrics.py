"""What /metrics exposes: cluster state read from the database, and event counters from Redis.

GPU series use dcgm-exporter's names and labels (gpu, UUID, modelName, Hostname) so existing
dashboards work unchanged; DCGM reports total energy in millijoules, and so do we under its
name. Like dcgm-exporter's pod labels, a GPU's series also name what runs on it: job_id,
job_name and tenant while an attempt holds the GPU, empty (which Prometheus reads as absent)
while it is idle. Not `job`: Prometheus gives every scraped series its own `job` label (the
scrape job's name) and would rename ours `exported_job`. Our own series are prefixed gpucp_.

State is read from Postgres at scrape time, so every web process answers the same. Counters and
histograms of events (requests, cycles, job ends, queue waits) cannot be: their rows are pruned
and they must never go down. They are kept in Redis by the code where each event happens
(controlplane.event_metrics) and read here; when Redis cannot answer they are left out, and the
rest of the scrape is answered as usual.

The exposition itself (escaping, the text format or OpenMetrics) is prometheus_client's, from
a registry of its own: the library's default one would add this process's Python and GC
series, which differ from one web process to the next.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from django.db.models import Count, Sum
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    UnknownMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from controlplane import event_metrics
from controlplane.cluster.models import GPU, Node, Pool
from controlplane.jobs.models import FINISHED_JOB_STATES, Allocation, Job, JobAttempt, JobState
from controlplane.scheduling.models import SchedulingCycle
from controlplane.tenancy.models import Tenant

GPU_LABELS = ["gpu", "UUID", "modelName", "Hostname"]
WORKLOAD_LABELS = ["job_id", "job_name", "tenant"]


@dataclass(frozen=True, slots=True)
class GpuSeries:
    name: str
    # dcgm-exporter declares its two counters without a _total suffix, which OpenMetrics
    # requires of a counter (prometheus_client adds one): to keep their names, they are
    # `unknown` ("untyped" in the text format). rate() works on them all the same.
    kind: str  # "gauge" or "unknown"
    help: str
    value: Callable[[GPU], float | None]


GPU_SERIES = [
    GpuSeries("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", lambda g: g.power_draw_w),
    GpuSeries(
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "unknown",
        "Total energy consumption since boot (in mJ); a counter.",
        lambda g: None if g.energy_j is None else g.energy_j * 1000.0,
    ),
    GpuSeries(
        "DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", lambda g: g.utilization_pct
    ),
    GpuSeries(
        "DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", lambda g: g.temperature_c
    ),
    GpuSeries(
        "DCGM_FI_DEV_FB_USED",
        "gauge",
        "Framebuffer memory used (in MiB).",
        lambda g: g.memory_used_mib,
    ),
    GpuSeries(
        "DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", lambda g: g.sm_clock_mhz
    ),
    GpuSeries(
        "DCGM_FI_DEV_POWER_MGMT_LIMIT",
        "gauge",
        "Enforced power limit (in W).",
        lambda g: g.power_cap_w,
    ),
    GpuSeries(
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "unknown",
        "Uncorrected (double-bit) ECC errors since the driver loaded; a counter.",
        lambda g: g.ecc_errors,
    ),
]

# What a user calls each final state.
OUTCOMES: dict[str, str] = {str(state): str(state).lower() for state in FINISHED_JOB_STATES}


def _gpu_family(series: GpuSeries) -> GaugeMetricFamily | UnknownMetricFamily:
    kind = GaugeMetricFamily if series.kind == "gauge" else UnknownMetricFamily
    return kind(series.name, series.help, labels=GPU_LABELS + WORKLOAD_LABELS)


class ClusterCollector(Collector):
    """Reads everything at scrape time; holds nothing between scrapes."""

    def collect(self) -> Iterator[Metric]:
        tenants = {t.pk: t.slug for t in Tenant.objects.order_by("slug")}
        yield from self._gpus()
        yield from self._tenants(tenants)
        yield from self._pools_and_nodes()
        yield from self._scheduling()
        yield from self._events(tenants)

    def _gpus(self) -> Iterator[Metric]:
        gpus = list(GPU.objects.select_related("node").order_by("node__name", "index"))
        on_gpu = {
            gpu_id: [str(job_id), name, slug]
            for gpu_id, job_id, name, slug in Allocation.objects.filter(active=True).values_list(
                "gpu_id", "attempt__job_id", "attempt__job__name", "attempt__job__tenant__slug"
            )
        }
        idle = ["", "", ""]
        for series in GPU_SERIES:
            family = _gpu_family(series)
            for g in gpus:
                value = series.value(g)
                if value is None:  # not reported is not zero
                    continue
                labels = [str(g.index), g.uuid, g.model, g.node.name, *on_gpu.get(g.pk, idle)]
                family.add_metric(labels, value)
            yield family
        # DCGM exports the throttle reasons as one bitmask; ours arrive as names, so one series
        # per reason in force. A GPU that reports none has no series; one that cannot tell, none.
        throttled = GaugeMetricFamily(
            "gpucp_gpu_throttled",
            "1 while the reason holds the GPU's clocks down.",
            labels=["reason", *GPU_LABELS],
        )
        for g in gpus:
            for reason in g.throttle_reasons or ():
                throttled.add_metric([reason, str(g.index), g.uuid, g.model, g.node.name], 1.0)
        yield throttled
        desired = GaugeMetricFamily(
            "gpucp_gpu_desired_power_cap_watts",
            "Power cap the scheduler wants for the GPU.",
            labels=["UUID", "Hostname"],
        )
        for g in gpus:
            if g.desired_power_cap_w is not None:
                desired.add_metric([g.uuid, g.node.name], g.desired_power_cap_w)
        yield desired

    def _tenants(self, tenants: dict[int, str]) -> Iterator[Metric]:
        booked = list(
            JobAttempt.objects.values("job__tenant_id").annotate(
                energy=Sum("energy_j"), gpu_s=Sum("gpu_seconds")
            )
        )
        energy = CounterMetricFamily(
            "gpucp_tenant_energy_joules_total",
            "Energy booked to the tenant's attempts (J).",
            labels=["tenant"],
        )
        gpu_seconds = CounterMetricFamily(
            "gpucp_tenant_gpu_seconds_total",
            "GPU-seconds booked to the tenant's attempts.",
            labels=["tenant"],
        )
        for row in booked:
            slug = tenants[row["job__tenant_id"]]
            energy.add_metric([slug], row["energy"] or 0.0)
            gpu_seconds.add_metric([slug], row["gpu_s"] or 0.0)
        yield energy
        yield gpu_seconds
        jobs_by_state = {
            (row["tenant_id"], row["state"]): row["n"]
            for row in Job.objects.filter(
                state__in=[JobState.PENDING, JobState.RUNNING, JobState.ADMITTED]
            )
            .values("tenant_id", "state")
            .annotate(n=Count("id"))
        }
        pending = GaugeMetricFamily(
            "gpucp_pending_jobs", "Jobs waiting for GPUs, by tenant.", labels=["tenant"]
        )
        running = GaugeMetricFamily(
            "gpucp_running_jobs", "Jobs admitted or running, by tenant.", labels=["tenant"]
        )
        for pk, slug in tenants.items():
            pending.add_metric([slug], jobs_by_state.get((pk, JobState.PENDING), 0))
            running.add_metric(
                [slug],
                jobs_by_state.get((pk, JobState.RUNNING), 0)
                + jobs_by_state.get((pk, JobState.ADMITTED), 0),
            )
        yield pending
        yield running

    def _pools_and_nodes(self) -> Iterator[Metric]:
        budget = GaugeMetricFamily(
            "gpucp_pool_power_budget_watts",
            "Most watts the pool's GPUs may draw together.",
            labels=["pool"],
        )
        draw = GaugeMetricFamily(
            "gpucp_pool_power_draw_watts",
            "Watts the pool's GPUs draw now (latest telemetry).",
            labels=["pool"],
        )
        for p in Pool.objects.annotate(draw_w=Sum("nodes__gpus__power_draw_w")).order_by("name"):
            if p.power_budget_w is not None:
                budget.add_metric([p.name], p.power_budget_w)
            draw.add_metric([p.name], p.draw_w or 0.0)
        yield budget
        yield draw
        ready = GaugeMetricFamily(
            "gpucp_node_ready",
            "1 when the node's agent answers and the node takes new work.",
            labels=["node", "pool"],
        )
        for n in Node.objects.select_related("pool").order_by("name"):
            ready.add_metric([n.name, n.pool.name], 1.0 if n.schedulable else 0.0)
        yield ready

    def _scheduling(self) -> Iterator[Metric]:
        # The latest cycle, from its row (in Postgres, so present without Redis too); the
        # histogram of all cycles is gpucp_scheduling_cycle_duration_seconds.
        last = SchedulingCycle.objects.order_by("-started_at").first()
        duration = GaugeMetricFamily(
            "gpucp_scheduling_last_cycle_duration_seconds",
            "Wall time of the latest scheduling cycle.",
        )
        started = GaugeMetricFamily(
            "gpucp_scheduling_last_cycle_timestamp_seconds",
            "When the latest scheduling cycle started (Unix time): a stalled loop stops moving it.",
        )
        if last is not None:
            duration.add_metric([], last.duration_ms / 1000.0)
            started.add_metric([], last.started_at.timestamp())
        yield duration
        yield started

    def _events(self, tenants: dict[int, str]) -> Iterator[Metric]:
        stored = event_metrics.read()
        if stored is None:
            return  # no Redis, or it did not answer: left out rather than shown as zero

        def tenant_of(tenant_id: str) -> str | None:
            # Counted by id, named at scrape time; an id this database does not know belongs
            # to another deployment sharing the Redis database, and is not ours to show.
            return tenants.get(int(tenant_id)) if tenant_id.isdigit() else None

        # Every tenant's series exist from its first scrape, at zero: rate() then sees the
        # first job end or wait, where a series born at 1 would hide it.
        ends = event_metrics.JOBS_FINISHED
        finished = CounterMetricFamily(ends.name, ends.help, labels=list(ends.labels))
        counts = {
            (slug, outcome): 0.0 for slug in tenants.values() for outcome in OUTCOMES.values()
        }
        for (tenant_id, state), n in stored.counters[ends.name].items():
            slug = tenant_of(tenant_id)
            if slug is not None and state in OUTCOMES:
                counts[(slug, OUTCOMES[state])] += n
        for (slug, outcome), n in sorted(counts.items()):
            finished.add_metric([slug, outcome], n)
        yield finished

        waits = _histogram(event_metrics.QUEUE_WAIT)
        by_tenant = {
            slug: event_metrics.empty_histogram(event_metrics.QUEUE_WAIT)
            for slug in tenants.values()
        }
        for (tenant_id,), value in stored.histograms[event_metrics.QUEUE_WAIT.name].items():
            slug = tenant_of(tenant_id)
            if slug is not None:
                by_tenant[slug] = value
        for slug, value in sorted(by_tenant.items()):
            _observe(waits, [slug], value)
        yield waits

        cycles = _histogram(event_metrics.CYCLE_DURATION)
        cycle_durations = stored.histograms[event_metrics.CYCLE_DURATION.name]
        _observe(
            cycles,
            [],
            cycle_durations.get(()) or event_metrics.empty_histogram(event_metrics.CYCLE_DURATION),
        )
        yield cycles

        http = event_metrics.HTTP_REQUESTS
        requests = CounterMetricFamily(http.name, http.help, labels=list(http.labels))
        for labels, n in sorted(stored.counters[http.name].items()):
            requests.add_metric(list(labels), n)
        yield requests
        latency = _histogram(event_metrics.HTTP_DURATION)
        for labels, value in sorted(stored.histograms[event_metrics.HTTP_DURATION.name].items()):
            _observe(latency, list(labels), value)
        yield latency


def _histogram(family: event_metrics.Family) -> HistogramMetricFamily:
    return HistogramMetricFamily(family.name, family.help, labels=list(family.labels))


def _observe(
    family: HistogramMetricFamily, labels: list[str], value: event_metrics.HistogramValue
) -> None:
    family.add_metric(
        labels,
        [(floatToGoString(bound), float(n)) for bound, n in value.buckets],
        value.sum,
    )


REGISTRY = CollectorRegistry(auto_describe=False)
REGISTRY.register(ClusterCollector())
