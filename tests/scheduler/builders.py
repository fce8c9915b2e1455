"""Fluent builders for scheduler snapshots, so a test reads like the situation it sets up.

    snap = (
        cluster()
        .node("n1", gpus=8, type="H100")
        .tenant("vision", guaranteed=8, limit=16)
        .running(1, "vision", gpus=8, node="n1")
        .pending(2, "nlp", gpus=4)
    )
    plan = snap.plan(preemption=False)

Times default to a clock at NOW; running attempts started an hour earlier (old enough to be
preempted under the default minimum runtime), pending jobs were submitted a minute earlier.
GPU uuids are "<node>-gpu<index>", and a running attempt takes the lowest free ones of its node.
"""

from __future__ import annotations

from dataclasses import replace

from scheduler.model import (
    ANY_GPU_TYPE,
    Config,
    Gpu,
    HistoryRecord,
    Node,
    Pending,
    PendingDecision,
    Plan,
    Quota,
    Running,
    Snapshot,
    Tenant,
)
from scheduler.policy import plan as make_plan

NOW = 100_000.0
DEFAULT_TYPE = "H100"


def cluster(now_s: float = NOW) -> ClusterBuilder:
    """An empty cluster at a given time."""
    return ClusterBuilder(now_s)


class ClusterBuilder:
    def __init__(self, now_s: float):
        self.now_s = now_s
        self._nodes: dict[str, dict] = {}
        self._tenants: dict[str, dict] = {}
        self._running: list[Running] = []
        self._pending: list[Pending] = []
        self._history: list[HistoryRecord] = []
        self._taken: dict[str, set[int]] = {}

    # ----- nodes -------------------------------------------------------------------------------

    def node(
        self,
        name: str,
        gpus: int = 8,
        type: str = DEFAULT_TYPE,  # noqa: A002 - reads as the domain word in a test
        *,
        pool: str = "default",
        schedulable: bool = True,
        draining: bool = False,
        cpus: float = 0.0,
        memory_mib: int = 0,
        unhealthy: tuple[int, ...] = (),
        volumes: tuple[str, ...] = (),
    ) -> ClusterBuilder:
        self._nodes[name] = dict(
            volumes=frozenset(volumes),
            gpus=gpus,
            type=type,
            pool=pool,
            schedulable=schedulable and not draining,
            draining=draining,
            cpus=cpus,
            memory_mib=memory_mib,
            unhealthy=set(unhealthy),
        )
        self._taken.setdefault(name, set())
        return self

    def nodes(self, count: int, prefix: str = "n", **kw) -> ClusterBuilder:
        for i in range(1, count + 1):
            self.node(f"{prefix}{i}", **kw)
        return self

    # ----- tenants -----------------------------------------------------------------------------

    def tenant(
        self,
        name: str,
        guaranteed: int = 0,
        limit: int | None = None,
        *,
        type: str = ANY_GPU_TYPE,  # noqa: A002
        weight: float = 1.0,
        max_running_jobs: int | None = None,
        budget_action: str | None = None,
    ) -> ClusterBuilder:
        t = self._tenants.setdefault(name, dict(quotas={}, weight=weight))
        t["weight"] = weight
        t["max_running_jobs"] = max_running_jobs
        t["budget_action"] = budget_action
        t["quotas"][type] = (guaranteed, guaranteed if limit is None else limit)
        return self

    def quota(self, tenant: str, type: str, guaranteed: int, limit: int) -> ClusterBuilder:  # noqa: A002
        """An extra quota row (for instance per GPU type beside the ANY one)."""
        self._tenants[tenant]["quotas"][type] = (guaranteed, limit)
        return self

    # ----- work --------------------------------------------------------------------------------

    def running(
        self,
        job_id: int,
        tenant: str,
        gpus: int = 1,
        node: str | tuple[str, ...] = "n1",
        *,
        attempt_id: int | None = None,
        started_at_s: float | None = None,
        ran_s: float | None = None,
        priority: int = 100,
        preemptible: bool = True,
        predicted_end_s: float | None = None,
        ends_in_s: float | None = None,
        stopping: bool = False,
        user: str | None = None,
        remaining_s: float | None = None,
        attained_service_s: float = 0.0,
        cpus: float = 0.0,
        memory_mib: int = 0,
        grace_s: float = 0.0,
        stop_by_s: float | None = None,
        checkpointed_ago_s: float | None = None,
        checkpoint_interval_s: float | None = None,
        preemptions: int = 0,
    ) -> ClusterBuilder:
        """An attempt holding `gpus` GPUs on a node (or spread evenly over several nodes)."""
        if started_at_s is None:
            started_at_s = self.now_s - (3600.0 if ran_s is None else ran_s)
        if ends_in_s is not None:
            predicted_end_s = self.now_s + ends_in_s
        names = (node,) if isinstance(node, str) else node
        uuids: list[str] = []
        per_node = [
            gpus // len(names) + (1 if i < gpus % len(names) else 0) for i in range(len(names))
        ]
        for name, count in zip(names, per_node, strict=True):
            uuids.extend(self._take(name, count))
        self._running.append(
            Running(
                attempt_id=job_id if attempt_id is None else attempt_id,
                job_id=job_id,
                tenant=tenant,
                user=user or f"{tenant}-user",
                priority=priority,
                preemptible=preemptible,
                started_at_s=started_at_s,
                gpus=tuple(uuids),
                gpu_type=self._nodes[names[0]]["type"],
                predicted_end_s=predicted_end_s,
                stopping=stopping,
                submitted_at_s=started_at_s - 60.0,
                remaining_s=remaining_s,
                attained_service_s=attained_service_s,
                cpus=cpus,
                memory_mib=memory_mib,
                grace_s=grace_s,
                stop_by_s=stop_by_s,
                last_checkpoint_s=(
                    None if checkpointed_ago_s is None else self.now_s - checkpointed_ago_s
                ),
                checkpoint_interval_s=checkpoint_interval_s,
                preemptions=preemptions,
            )
        )
        return self

    def pending(
        self,
        job_id: int,
        tenant: str,
        gpus: int = 1,
        type: str = ANY_GPU_TYPE,  # noqa: A002
        *,
        name: str = "train",
        user: str | None = None,
        priority: int = 100,
        preemptible: bool = True,
        submitted_at_s: float | None = None,
        waited_s: float | None = None,
        predicted_s: float | None = None,
        estimated_s: float | None = None,
        max_runtime_s: float | None = None,
        attained_service_s: float = 0.0,
        cpus: float = 0.0,
        memory_mib: int = 0,
        volumes: tuple[str, ...] = (),
        group: int | None = None,
        preemptions: int = 0,
    ) -> ClusterBuilder:
        if submitted_at_s is None:
            submitted_at_s = self.now_s - (60.0 if waited_s is None else waited_s)
        self._pending.append(
            Pending(
                job_id=job_id,
                tenant=tenant,
                user=user or f"{tenant}-user",
                name=name,
                gpus=gpus,
                gpu_type=type,
                priority=priority,
                preemptible=preemptible,
                submitted_at_s=submitted_at_s,
                predicted_duration_s=predicted_s,
                estimated_duration_s=estimated_s,
                max_runtime_s=max_runtime_s,
                attained_service_s=attained_service_s,
                cpus=cpus,
                memory_mib=memory_mib,
                volumes=volumes,
                group=group,
                preemptions=preemptions,
            )
        )
        return self

    def history(
        self,
        tenant: str,
        name: str,
        gpus: int,
        duration_s: float,
        *,
        user: str | None = None,
        group: int | None = None,
    ) -> ClusterBuilder:
        self._history.append(
            HistoryRecord(tenant, user or f"{tenant}-user", name, gpus, duration_s, group)
        )
        return self

    def at(self, now_s: float) -> ClusterBuilder:
        self.now_s = now_s
        return self

    # ----- results -----------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        nodes = []
        for name, spec in self._nodes.items():
            gpus = tuple(
                Gpu(
                    uuid=f"{name}-gpu{i}",
                    index=i,
                    gpu_type=spec["type"],
                    power_min_w=200.0,
                    power_max_w=700.0,
                    power_default_w=700.0,
                    healthy=i not in spec["unhealthy"],
                )
                for i in range(spec["gpus"])
            )
            nodes.append(
                Node(
                    name=name,
                    pool=spec["pool"],
                    gpus=gpus,
                    schedulable=spec["schedulable"],
                    draining=spec["draining"],
                    cpus=spec["cpus"],
                    memory_mib=spec["memory_mib"],
                    volumes=spec["volumes"],
                )
            )
        tenants = tuple(
            Tenant(
                name=name,
                weight=spec["weight"],
                quotas=tuple(
                    Quota(gpu_type=t, guaranteed_gpus=g, limit_gpus=limit)
                    for t, (g, limit) in sorted(spec["quotas"].items())
                ),
                max_running_jobs=spec.get("max_running_jobs"),
                budget_action=spec.get("budget_action"),
            )
            for name, spec in self._tenants.items()
        )
        return Snapshot(
            now_s=self.now_s,
            nodes=tuple(nodes),
            running=tuple(self._running),
            pending=tuple(self._pending),
            tenants=tenants,
            history=tuple(self._history),
        )

    def plan(self, **config) -> Plan:
        return make_plan(self.snapshot(), Config(**config))

    def _take(self, node: str, count: int) -> list[str]:
        spec = self._nodes[node]
        taken = self._taken[node]
        free = [i for i in range(spec["gpus"]) if i not in taken]
        if len(free) < count:
            raise ValueError(f"node {node} has only {len(free)} GPUs left for an attempt")
        chosen = free[:count]
        taken.update(chosen)
        return [f"{node}-gpu{i}" for i in chosen]


# ----- reading plans ---------------------------------------------------------------------------


def started(plan: Plan) -> set[int]:
    return {s.job_id for s in plan.starts}


def preempted(plan: Plan) -> set[int]:
    """Job ids of the attempts the plan preempts."""
    return {p.job_id for p in plan.preemptions}


def decision(plan: Plan, job_id: int) -> PendingDecision:
    found = [d for d in plan.pending if d.job_id == job_id]
    assert len(found) == 1, f"job {job_id} has {len(found)} pending decisions"
    return found[0]


def start_of(plan: Plan, job_id: int):
    found = [s for s in plan.starts if s.job_id == job_id]
    assert len(found) == 1, f"job {job_id} started {len(found)} times"
    return found[0]


def with_stopping(snapshot: Snapshot, attempt_ids: set[int]) -> Snapshot:
    """The next cycle's snapshot: the given attempts were told to stop and still hold GPUs."""
    running = tuple(
        replace(r, stopping=True) if r.attempt_id in attempt_ids else r for r in snapshot.running
    )
    return replace(snapshot, running=running)


def without(snapshot: Snapshot, attempt_ids: set[int]) -> Snapshot:
    """The snapshot after the given attempts have stopped and released their GPUs."""
    return replace(
        snapshot, running=tuple(r for r in snapshot.running if r.attempt_id not in attempt_ids)
    )
