"""Why a job is still pending, in words a researcher understands, and where it stands.

The admission step records, for every job it leaves pending, a `Waiting` with the facts of that
moment (the tenant's usage, the free GPUs, the job the GPUs are reserved for); this step turns
them into PendingDecisions. Sentences are built last, once, so the admission loop stays cheap.

Admission sees only the nodes that take work now. A job it found no node for (NO_MATCHING_GPUS)
is looked at once more here against every node of the snapshot, down, cordoned, draining or
with unhealthy GPUs included: when those could hold it, it is not hopeless but waiting for them
to come back (NODES_UNAVAILABLE), and its reason says so. A job that mounts volumes no node
that could hold it has (MISSING_VOLUME) waits for a node with them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from scheduler.model import Node, Pending, PendingDecision, ReasonCode

RC = ReasonCode


class Waiting:
    """The facts behind one pending decision (class attributes are the defaults)."""

    quota_type = ""  # the type of the quota that binds ("" for the ANY one)
    free = 0
    used = 0
    guaranteed = 0
    limit = 0
    head: int | None = None  # the job the free GPUs are reserved for
    start_s: float | None = None
    count = 0
    # NODES_UNAVAILABLE: GPUs of the type in the cluster, those that take work now, those on
    # nodes that are down, cordoned or draining, and the unhealthy ones on the other nodes (for
    # a job waiting for a node big enough in CPUs or memory: such nodes that take work now but
    # whose GPUs are unhealthy)
    total = 0
    up = 0
    down = 0
    unhealthy = 0

    def __init__(self, job: Pending, code: ReasonCode, gpu_type: str = "", detail: str = ""):
        self.job = job
        self.code = code
        self.gpu_type = gpu_type  # the type the facts are about (for any-type jobs: the best one)
        self.detail = detail


def decisions(
    waiting: list[Waiting],
    now_s: float,
    nodes: Sequence[Node] = (),
    fleet_of: Callable[[Sequence[Node]], Fleet] | None = None,
    sentences: bool = True,
) -> tuple[PendingDecision, ...]:
    """One PendingDecision per waiting job, numbered in the order the cycle considered them.

    `nodes` are all the snapshot's nodes, whether they take work or not: a job no node that
    takes work now could hold, but one of these could, waits for them (NODES_UNAVAILABLE).
    `fleet_of` builds their summary; plan() passes its memo's, which reuses it while the node
    tuple stays the same. `sentences` False leaves every reason empty (codes, positions and
    estimated starts are the same).
    """
    hopeless = [w for w in waiting if w.code is RC.NO_MATCHING_GPUS]
    if hopeless and nodes:
        fleet = (fleet_of or build_fleet)(nodes)
        # A queue of identical jobs behind a node that is down costs one look, not one each.
        seen: dict[tuple[int, str, float, int], _Out | None] = {}
        for w in hopeless:
            job = w.job
            key = (job.gpus, job.gpu_type, job.cpus, job.memory_mib)
            if key not in seen:
                seen[key] = _nodes_out(job, fleet)
            out = seen[key]
            if out is not None:
                w.code, w.gpu_type, w.detail = RC.NODES_UNAVAILABLE, out.gpu_type, out.detail
                w.total, w.up, w.down, w.unhealthy = out.total, out.up, out.down, out.unhealthy
    return tuple(
        PendingDecision(
            job_id=w.job.job_id,
            reason_code=w.code,
            reason=sentence(w, now_s) if sentences else "",
            queue_position=position,
            estimated_start_s=w.start_s,
        )
        for position, w in enumerate(waiting, start=1)
    )


def sentence(w: Waiting, now_s: float) -> str:
    """The reason as a sentence."""
    job = w.job
    tenant = job.tenant
    kind = w.gpu_type or "GPUs"
    if job.gpu_type:
        what = f"{job.gpus} x {job.gpu_type}"
    else:
        what = f"{job.gpus} GPU{'' if job.gpus == 1 else 's'} of any type"
    head = f"waiting for {what}"
    usage = f"tenant {tenant} uses {w.used} of its {w.guaranteed} guaranteed"
    code = w.code
    if code is RC.BUDGET_HOLD:
        return (
            f"held: tenant {tenant} has used up its budget, so none of its jobs start until the "
            "budget renews or is raised"
        )
    if code is RC.MAX_RUNNING_JOBS:
        return f"{head}: tenant {tenant} already runs {w.count} jobs, its maximum"
    if code is RC.QUOTA_LIMIT:
        if w.detail == "unknown_tenant":
            return f"{head}: tenant {tenant} is unknown, so it has no quota"
        if w.detail == "no_quota":
            on = f"{w.gpu_type} GPUs" if w.gpu_type else "GPUs"
            return f"{head}: tenant {tenant} has no quota for {on}"
        # Work that cannot be taken back fills the guarantee first (scheduler.quota.check).
        held = (
            f"tenant {tenant}'s work that cannot be preempted holds {w.used} of its "
            f"{w.guaranteed} guaranteed"
        )
        if w.detail == "not_preemptible":
            return (
                f"{head}: the job cannot be preempted, so it may only use guaranteed GPUs, and "
                f"{held}"
            )
        if w.detail == "preemption_cap":
            return (
                f"{head}: the job was preempted {job.preemptions} "
                f"time{'' if job.preemptions == 1 else 's'}, so it is not preempted again and "
                f"may only use guaranteed GPUs, and {held}"
            )
        return (
            f"{head}: tenant {tenant} uses {w.used} of its limit of {w.limit} "
            f"{w.quota_type or 'GPUs'}"
        )
    if code is RC.MISSING_VOLUME:
        names = sorted(set(job.volumes))
        return f"waiting for a node with volume{'s' if len(names) > 1 else ''} {', '.join(names)}"
    if code is RC.STATIC_PARTITION:
        return f"{head}: {usage}, and without borrowing it may not use more"
    if code is RC.BUDGET_NO_BORROWING:
        return (
            f"{head}: tenant {tenant} has used up its budget, so it may only start work within "
            f"its guarantee, and it uses {w.used} of its {w.guaranteed} guaranteed"
        )
    if code is RC.NODES_UNAVAILABLE:
        out = "down, cordoned or draining"
        if w.detail == "resources":
            needs = _resources(job)
            which = f"with {w.gpu_type} GPUs " if w.gpu_type else ""
            which += f"that has {needs} for it " if needs else ""
            if w.unhealthy:
                out += ", or its GPUs are unhealthy"
            return f"{head}: every node {which}is {out}; it waits for one to come back"
        gpus = f"{w.gpu_type} GPUs"
        if not w.up and not w.unhealthy:
            return f"{head}: every node with {gpus} is {out}; it waits for them to come back"
        missing = []
        if w.down:
            missing.append(f"{w.down} {_are(w.down)} on nodes that are {out}")
        if w.unhealthy:
            missing.append(f"{w.unhealthy} {_are(w.unhealthy)} unhealthy")
        return (
            f"{head}: only {w.up} of the cluster's {w.total} {gpus} take work now "
            f"({' and '.join(missing)}); it waits for them to come back"
        )
    if code is RC.NO_MATCHING_GPUS:
        if w.detail == "no_type":
            return f"{head}: no schedulable node has {kind}"
        if w.detail == "resources":
            cpus = f"{job.cpus:g} CPUs and " if job.cpus else ""
            return (
                f"{head}: no schedulable node with {kind} has {cpus}{job.memory_mib} MiB of "
                "memory for it"
                if job.memory_mib
                else f"{head}: no schedulable node with {kind} has {job.cpus:g} CPUs for it"
            )
        return f"{head}: only {w.count} healthy {kind} exist on schedulable nodes"
    if code is RC.WAITING_FOR_PREEMPTION:
        if w.detail == "own_stopping":
            return (
                f"{head}: tenant {tenant}'s jobs that are stopping still count against its "
                "quota; it can start once they have stopped"
            )
        if w.detail == "checkpoint":
            return (
                f"{head}: GPUs are reclaimed for it once a running job has saved its next "
                f"checkpoint, {_when(w.start_s - now_s) if w.start_s is not None else 'soon'}"
            )
        if w.detail == "victims":
            jobs = "1 running job is" if w.count == 1 else f"{w.count} running jobs are"
            return f"{head}: {jobs} being preempted to free GPUs for it; it starts once stopped"
        return (
            f"{head}: GPUs of jobs that are stopping are set aside for it; it starts once they "
            "are released"
        )
    if code is RC.RESERVED or (w.head is not None and w.head != job.job_id):
        if 0 < w.count < w.free:
            free = f"{w.count} of the {w.free} free {kind} {'is' if w.count == 1 else 'are'}"
        else:
            free = _free_phrase(w.free, kind)
        return (
            f"{head}: {usage}, and {free} reserved for job {w.head}, which is first in line "
            f"for {kind}"
        )
    if code is RC.GANG_FRAGMENTED:
        text = f"{head}: {w.free} {kind} are free, but no node has {job.gpus} of them free together"
    else:
        text = f"{head}: {usage}, and only {w.free} {kind} are free"
    if w.head == job.job_id and w.start_s is not None:
        text += f"; it is first in line for {kind} and should start {_when(w.start_s - now_s)}"
    return text


def _free_phrase(free: int, kind: str) -> str:
    if free == 1:
        return f"the 1 free {kind} is"
    return f"the {free} free {kind} are"


def _when(delay_s: float) -> str:
    if delay_s < 30:
        return "within a minute"
    if delay_s < 5400:
        return f"in about {max(1, round(delay_s / 60))} min"
    if delay_s < 2 * 86400:
        return f"in about {round(delay_s / 3600)} h"
    return f"in about {round(delay_s / 86400)} days"


def _are(count: int) -> str:
    return "is" if count == 1 else "are"


def _resources(job: Pending) -> str:
    cpus = f"{job.cpus:g} CPUs" if job.cpus else ""
    memory = f"{job.memory_mib} MiB of memory" if job.memory_mib else ""
    return " and ".join(part for part in (cpus, memory) if part)


# ----- waiting for nodes to come back ----------------------------------------------------------


@dataclass
class _TypeFacts:
    total: int = 0  # GPUs of the type on every node
    up: int = 0  # healthy ones on nodes that take work now
    down: int = 0  # on nodes that are down, cordoned or draining
    unhealthy: int = 0  # unhealthy ones on nodes that take work now
    most: int = 0  # the most on one node
    nodes: list[Node] = field(default_factory=list)  # every node that has the type


@dataclass
class Fleet:
    """Every node of a snapshot, taking work or not, by GPU type."""

    types: dict[str, _TypeFacts]
    nodes: Sequence[Node]
    track_cpus: bool
    track_mem: bool


def build_fleet(nodes: Sequence[Node]) -> Fleet:
    """What the nodes hold, per GPU type: up, down, unhealthy, and the most on one node."""
    types: dict[str, _TypeFacts] = {}
    for node in nodes:
        on_node: dict[str, int] = {}
        for gpu in node.gpus:
            facts = types.setdefault(gpu.gpu_type, _TypeFacts())
            facts.total += 1
            if not node.schedulable:
                facts.down += 1
            elif gpu.healthy:
                facts.up += 1
            else:
                facts.unhealthy += 1
            on_node[gpu.gpu_type] = on_node.get(gpu.gpu_type, 0) + 1
        for gpu_type, count in on_node.items():
            facts = types[gpu_type]
            facts.nodes.append(node)
            facts.most = max(facts.most, count)
    return Fleet(
        types=dict(sorted(types.items())),
        nodes=nodes,
        track_cpus=any(n.cpus for n in nodes),
        track_mem=any(n.memory_mib for n in nodes),
    )


@dataclass(frozen=True)
class _Out:
    """Why a job waits for nodes: the Waiting facts of NODES_UNAVAILABLE."""

    gpu_type: str
    detail: str  # "gpus": too few GPUs take work now; "resources": no node big enough does
    total: int = 0
    up: int = 0
    down: int = 0
    unhealthy: int = 0


def _nodes_out(job: Pending, fleet: Fleet) -> _Out | None:
    """What the job waits for when nodes that are out now could hold it; None if none could."""

    def roomy(node: Node) -> bool:
        return not (fleet.track_cpus and job.cpus > node.cpus) and not (
            fleet.track_mem and job.memory_mib > node.memory_mib
        )

    if job.gpus <= 0:
        # Admission looked at the free CPUs and memory of the nodes that take work: the job
        # waits for nodes only when every node big enough for it is out.
        if any(roomy(n) and n.schedulable for n in fleet.nodes):
            return None
        return _Out("", "resources") if any(roomy(n) for n in fleet.nodes) else None
    for gpu_type in [job.gpu_type] if job.gpu_type else list(fleet.types):
        facts = fleet.types.get(gpu_type)
        if facts is None or facts.total < job.gpus:
            continue
        if facts.up < job.gpus:
            # A job larger than every node spans nodes, whose size then does not bound it.
            if job.gpus <= facts.most and not any(roomy(n) for n in facts.nodes):
                continue
            return _Out(gpu_type, "gpus", facts.total, facts.up, facts.down, facts.unhealthy)
        big = [n for n in facts.nodes if roomy(n)]
        if big and not any(_takes(n, gpu_type) for n in big):
            # Big enough nodes that take work but whose GPUs of the type are all unhealthy.
            return _Out(gpu_type, "resources", unhealthy=sum(1 for n in big if n.schedulable))
    return None


def _takes(node: Node, gpu_type: str) -> bool:
    """Whether the node takes work now on a GPU of this type."""
    return node.schedulable and any(g.healthy and g.gpu_type == gpu_type for g in node.gpus)
