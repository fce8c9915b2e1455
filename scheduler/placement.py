"""Placement: which GPUs a job gets, all of them or none.

The free GPUs of every type are indexed by how many a node has free (one sorted list of node
ordinals per count), so best fit is a walk from the smallest sufficient count upwards and costs
the same on 20 nodes as on 2,000. A job stays on one node whenever some schedulable node has
enough healthy GPUs of its type to hold it (NVLink beats the network); it spans nodes only when
it is larger than every node, and then it takes whole nodes first and best-fits the remainder.
GPUs that stopping attempts are about to free are indexed the same way (nodes by free plus
soon-free GPUs), so a job waiting for them finds its node without a walk over all of them.

The static part of the index (which GPU is where) is cached on the identity of the snapshot's
nodes tuple: the simulator passes the same tuple to thousands of cycles, and frozen nodes cannot
change under a cached copy.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from operator import attrgetter

from scheduler.model import Node, Pending, Running

# fits(node ordinal, GPUs on that node) -> whether the node has room for that share of the job
Fits = Callable[[int, int], bool]


# Entries of Topology.held_nodes before it starts afresh (a long-lived memo must not grow forever).
_HELD_NODES_MAX = 200_000


class Topology:
    """Where every GPU is, and which ones could ever be handed out (healthy, schedulable)."""

    __slots__ = (
        "nodes",
        "names",
        "gpu_node",
        "usable",
        "by_type",
        "node_cpus",
        "node_mem",
        "schedulable",
        "draining",
        "caps",
        "volumes",
        "held_nodes",
    )

    def __init__(self, nodes: tuple[Node, ...]):
        ordered = sorted(nodes, key=attrgetter("name"))
        self.nodes = nodes
        # (type, GPU uuids) -> node ordinal -> usable GPUs of the type there: what an attempt
        # holds where depends on its GPUs and these nodes alone, so it outlives a cycle (a
        # caller's memo keeps the topology while the nodes stay the same; see ClusterIndex).
        self.held_nodes: dict[tuple[str, tuple[str, ...]], dict[int, int]] = {}
        self.names: list[str] = [n.name for n in ordered]
        self.gpu_node: dict[str, int] = {}
        # uuid -> (type, node ordinal) for GPUs a job may be given
        self.usable: dict[str, tuple[str, int]] = {}
        # type -> node ordinal -> usable uuids in GPU index order
        self.by_type: dict[str, dict[int, tuple[str, ...]]] = {}
        self.node_cpus: list[float] = [n.cpus for n in ordered]
        self.node_mem: list[int] = [n.memory_mib for n in ordered]
        self.schedulable: list[int] = [i for i, n in enumerate(ordered) if n.schedulable]
        self.draining: list[bool] = [n.draining for n in ordered]
        self.volumes: list[frozenset[str]] = [n.volumes for n in ordered]
        gpu_node, usable, by_type = self.gpu_node, self.usable, self.by_type
        for i, node in enumerate(ordered):
            gpus = sorted(node.gpus, key=_GPU_ORDER)
            uuids = [g.uuid for g in gpus]
            gpu_node.update(zip(uuids, repeat(i)))
            if not node.schedulable or not gpus:
                continue
            kinds = {g.gpu_type for g in gpus}
            if len(kinds) == 1 and all(g.healthy for g in gpus):
                gpu_type = gpus[0].gpu_type
                by_type.setdefault(gpu_type, {})[i] = tuple(uuids)
                usable.update(zip(uuids, repeat((gpu_type, i))))
                continue
            for g in gpus:
                if g.healthy:
                    usable[g.uuid] = (g.gpu_type, i)
                    per_node = by_type.setdefault(g.gpu_type, {})
                    per_node[i] = per_node.get(i, ()) + (g.uuid,)
        # type -> (GPUs per node, their nodes in order, the most on one node, the total): what
        # every cycle's TypeIndex starts from, worked out once per topology.
        self.caps: dict[str, tuple[dict[int, int], list[int], int, int]] = {}
        for gpu_type, per_node in by_type.items():
            node_cap = {i: len(uuids) for i, uuids in per_node.items()}
            self.caps[gpu_type] = (
                node_cap,
                sorted(per_node),
                max(node_cap.values(), default=0),
                sum(node_cap.values()),
            )


_GPU_ORDER = attrgetter("index", "uuid")


class TypeIndex:
    """Free GPUs of one type on schedulable nodes, and GPUs of that type that free up soon."""

    __slots__ = (
        "gpu_type",
        "free",
        "buckets",
        "total_free",
        "node_cap",
        "max_node_cap",
        "total_cap",
        "soon",
        "soon_total",
        "soon_buckets",
        "version",
        "changed",
    )

    def __init__(
        self,
        gpu_type: str,
        node_cap: dict[int, int],
        max_node_cap: int | None = None,
        total_cap: int | None = None,
    ):
        self.gpu_type = gpu_type
        # Healthy GPUs of this type per schedulable node, busy or not (shared: read only).
        self.node_cap = node_cap
        if max_node_cap is None:
            max_node_cap = max(node_cap.values(), default=0)
        self.max_node_cap = max_node_cap
        self.total_cap = sum(node_cap.values()) if total_cap is None else total_cap
        self.free: dict[int, list[str]] = {}
        self.buckets: list[list[int]] = [[] for _ in range(self.max_node_cap + 1)]
        self.total_free = 0
        # GPUs held by attempts that were told to stop (or are preempted now), not yet claimed.
        self.soon: dict[int, int] = {}
        self.soon_total = 0
        # Nodes with soon-free GPUs by what they could give (free + soon-free), each list sorted:
        # a job waiting for stopping attempts then finds its best node without walking them all.
        self.soon_buckets: list[list[int]] = [[] for _ in range(self.max_node_cap + 1)]
        self.version = 0  # bumped on every change, so a failed search can be remembered
        self.changed: list[int] = []  # nodes whose free or soon-free count changed (see preemption)

    def free_on(self, node: int) -> int:
        """Free GPUs of this type on a node."""
        free = self.free.get(node)
        return len(free) if free else 0

    def take(self, node: int, count: int) -> tuple[str, ...]:
        """Hand out `count` free GPUs of a node, lowest GPU index first."""
        self.version += 1
        self.changed.append(node)
        free = self.free[node]
        k = len(free)
        taken = tuple(free[:count])
        # A new list, not one cut in place: the lists may be shared with the memo's FreeGPUs.
        self.free[node] = free[count:]
        bucket = self.buckets[k]
        del bucket[bisect_left(bucket, node)]
        if k > count:
            insort(self.buckets[k - count], node)
        self.total_free -= count
        soon = self.soon.get(node)
        if soon:
            self._move_soon(node, k + soon, k - count + soon)
        return taken

    def add_soon(self, node: int, count: int) -> None:
        """Count GPUs of a node as freeing up soon."""
        self.version += 1
        self.changed.append(node)
        before = self.soon.get(node, 0)
        self.soon[node] = before + count
        self.soon_total += count
        have = self.free_on(node) + before
        self._move_soon(node, have if before else None, have + count)

    def claim_soon(self, node: int, count: int) -> None:
        """Set soon-free GPUs of a node aside for a waiting job."""
        self.version += 1
        self.changed.append(node)
        left = self.soon[node] - count
        if left:
            self.soon[node] = left
        else:
            del self.soon[node]
        self.soon_total -= count
        free = self.free_on(node)
        self._move_soon(node, free + left + count, free + left if left else None)

    def _move_soon(self, node: int, old: int | None, new: int | None) -> None:
        """Move a node between soon_buckets (None: it has no soon-free GPUs)."""
        buckets = self.soon_buckets
        if old is not None:
            bucket = buckets[old]
            del bucket[bisect_left(bucket, node)]
        if new is not None:
            if new >= len(buckets):
                # More GPUs than the node's healthy count (only from inconsistent input).
                buckets.extend([] for _ in range(new + 1 - len(buckets)))
            insort(buckets[new], node)

    def soon_best_fit(self, n: int, skip: set[int], fits: Fits | None) -> int | None:
        """The node with soon-free GPUs that can give n with the fewest to spare (then by name).

        Counts free and soon-free GPUs together; nodes in `skip` are left out.
        """
        buckets = self.soon_buckets
        node_cap = self.node_cap
        for k in range(n, len(buckets)):
            for node in buckets[k]:
                if node in skip or node_cap.get(node, 0) < n:
                    continue
                if fits is None or fits(node, n):
                    return node
        return None


class ClusterIndex:
    """The free capacity of one cycle: mutated as the cycle starts jobs and claims GPUs."""

    __slots__ = ("topo", "types", "cpus_free", "mem_free", "track_cpus", "track_mem")

    def __init__(
        self,
        nodes: tuple[Node, ...],
        running: tuple[Running, ...],
        topo: Topology | None = None,
        held: set[str] | None = None,
        base: FreeGPUs | None = None,
    ):
        # The topology of `nodes` (static: which GPU is where), built here unless the caller's
        # memo (scheduler.memo) already has it; `held`: the GPUs the running attempts hold,
        # when the caller's memo has them summed already (read only here); `base`: the free
        # GPUs of `running` kept in the caller's memo (copied here, never changed).
        topo = self.topo = topo if topo is not None else Topology(nodes)
        if base is not None and base.topo is topo:
            self._from_base(running, base)
            return
        if held is None:
            held = set()
            for r in running:
                held.update(r.gpus)
        self.track_cpus = any(topo.node_cpus)
        self.track_mem = any(topo.node_mem)
        # None when no node states any: nothing is booked then. Memory left becomes fractional
        # once a gang's share is booked, hence float.
        self.cpus_free: list[float] | None = list(topo.node_cpus) if self.track_cpus else None
        self.mem_free: list[float] | None = list(topo.node_mem) if self.track_mem else None
        if self.track_cpus or self.track_mem:
            self._charge_all(running)
        self.types: dict[str, TypeIndex] = {}
        for gpu_type in sorted(topo.by_type):
            per_node = topo.by_type[gpu_type]
            node_cap, order, max_cap, total_cap = topo.caps[gpu_type]
            ti = TypeIndex(gpu_type, node_cap, max_cap, total_cap)
            buckets = ti.buckets
            free_by_node = ti.free
            total = 0
            for i in order:
                uuids = per_node[i]
                free = (
                    list(uuids) if held.isdisjoint(uuids) else [u for u in uuids if u not in held]
                )
                if free:
                    free_by_node[i] = free
                    buckets[len(free)].append(i)
                    total += len(free)
            ti.total_free = total
            self.types[gpu_type] = ti
        for r in running:
            if r.stopping:
                self.add_soon(r)

    def _from_base(self, running: tuple[Running, ...], base: FreeGPUs) -> None:
        """The same index as the walk over every node, copied from what the memo keeps."""
        topo = self.topo
        self.track_cpus = any(topo.node_cpus)
        self.track_mem = any(topo.node_mem)
        self.cpus_free = list(topo.node_cpus) if self.track_cpus else None
        self.mem_free = list(topo.node_mem) if self.track_mem else None
        if self.track_cpus or self.track_mem:
            self._charge_all(running)
        self.types = {}
        for gpu_type in sorted(topo.by_type):
            node_cap, _, max_cap, total_cap = topo.caps[gpu_type]
            ti = TypeIndex(gpu_type, node_cap, max_cap, total_cap)
            free, buckets, total = base.types[gpu_type]
            ti.free = dict(free)  # the lists are shared: TypeIndex.take replaces, never cuts
            ti.buckets = [b.copy() for b in buckets]
            ti.total_free = total
            self.types[gpu_type] = ti
        if base.stopping:
            for r in running:
                if r.stopping:
                    self.add_soon(r)

    def _charge_all(self, running: tuple[Running, ...]) -> None:
        """Book what running attempts hold of their nodes' CPUs and memory.

        An attempt on one node (nearly all of them) is booked here directly, with the same
        arithmetic as _charge_running, which takes the gangs: a call per attempt cost more than
        the booking on the simulator's many small plans.
        """
        gpu_node = self.topo.gpu_node
        cpus_free, mem_free = self.cpus_free, self.mem_free
        node_cpus, node_mem = self.topo.node_cpus, self.topo.node_mem
        for r in running:
            cpus = r.cpus if cpus_free is not None else 0.0
            mem = r.memory_mib if mem_free is not None else 0
            if not (cpus or mem):
                continue
            nodes = list(map(gpu_node.get, r.gpus))
            if not nodes:
                continue
            first = nodes[0]
            total = len(nodes)
            if nodes.count(first) != total:
                self._charge_running(r, gpu_node)
                continue
            if first is None:
                continue
            if cpus and cpus_free is not None and node_cpus[first]:
                cpus_free[first] -= cpus * total / total
            if mem and mem_free is not None and node_mem[first]:
                mem_free[first] -= mem * total / total

    def _charge_running(self, r: Running, gpu_node: dict[str, int]) -> None:
        nodes = list(map(gpu_node.get, r.gpus))
        if not nodes:
            return
        first = nodes[0]
        if nodes.count(first) == len(nodes):
            share = {first: len(nodes)}
        else:
            share = {}
            for i in nodes:
                share[i] = share.get(i, 0) + 1
        total = len(nodes)
        cpus_free, mem_free = self.cpus_free, self.mem_free
        node_cpus, node_mem = self.topo.node_cpus, self.topo.node_mem
        for i, count in share.items():
            if i is None:
                continue
            if cpus_free is not None and r.cpus and node_cpus[i]:
                cpus_free[i] -= r.cpus * count / total
            if mem_free is not None and r.memory_mib and node_mem[i]:
                mem_free[i] -= r.memory_mib * count / total

    def add_soon(self, r: Running) -> None:
        """Count an attempt's GPUs as soon free: it was told to stop, or is preempted now."""
        ti = self.types.get(r.gpu_type)
        if ti is None:
            return
        usable = self.topo.usable
        for u in r.gpus:
            where = usable.get(u)
            if where is not None and where[0] == r.gpu_type:
                ti.add_soon(where[1], 1)

    def nodes_of(self, r: Running) -> dict[int, int]:
        """How many usable GPUs of its type an attempt holds on each node (shared: read only)."""
        return nodes_of(self.topo, r)

    def fits_for(self, job: Pending) -> Fits | None:
        """A check of a node for a share of the job, or None when any node would do.

        A node fits when it has every volume the job mounts, and room in its CPUs and memory
        where those are tracked.
        """
        fits = self._fits_resources(job)
        if not job.volumes:
            return fits
        need = frozenset(job.volumes)
        volumes = self.topo.volumes
        if fits is None:
            return lambda node, count: need <= volumes[node]
        room = fits
        return lambda node, count: need <= volumes[node] and room(node, count)

    def _fits_resources(self, job: Pending) -> Fits | None:
        need_cpus = job.cpus if self.cpus_free is not None else 0.0
        need_mem = job.memory_mib if self.mem_free is not None else 0
        if not need_cpus and not need_mem:
            return None
        n = max(job.gpus, 1)
        # An untracked resource has a need of 0 here, so its empty stand-in is never read.
        cpus_free: Sequence[float] = self.cpus_free if self.cpus_free is not None else ()
        mem_free: Sequence[float] = self.mem_free if self.mem_free is not None else ()
        node_cpus, node_mem = self.topo.node_cpus, self.topo.node_mem

        def fits(node: int, count: int) -> bool:
            part = count / n
            if need_cpus and node_cpus[node] and cpus_free[node] + 1e-9 < need_cpus * part:
                return False
            if need_mem and node_mem[node] and mem_free[node] + 1e-9 < need_mem * part:
                return False
            return True

        return fits

    def charge(self, job: Pending, placements: list[tuple[int, int]]) -> None:
        """Book a started job's CPUs and memory on the nodes it landed on."""
        n = max(job.gpus, 1)
        for node, count in placements:
            part = count / n if job.gpus else 1.0
            if self.cpus_free is not None and self.topo.node_cpus[node]:
                self.cpus_free[node] -= job.cpus * part
            if self.mem_free is not None and self.topo.node_mem[node]:
                self.mem_free[node] -= job.memory_mib * part

    def max_node_resources(self, gpu_type: str) -> tuple[float, int]:
        """The most CPUs and memory any node holding this type has in total (0: untracked)."""
        ti = self.types[gpu_type]
        cpus = max((self.topo.node_cpus[i] for i in ti.node_cap), default=0.0)
        mem = max((self.topo.node_mem[i] for i in ti.node_cap), default=0)
        return cpus, mem


def single_node(
    ti: TypeIndex, n: int, fits: Fits | None, slack: dict[int, int] | None = None
) -> int | None:
    """Best fit: the node with the fewest free GPUs that still holds all n (then by name).

    `slack` caps what a job may take on nodes a reservation protects (see scheduler.backfill).
    """
    buckets = ti.buckets
    best: tuple[int, int] | None = None
    for k in range(n, ti.max_node_cap + 1):
        for node in buckets[k]:
            if slack is not None and node in slack:
                continue
            if fits is None or fits(node, n):
                best = (k, node)
                break
        if best is not None:
            break
    if slack:
        for node, room in slack.items():
            k = ti.free_on(node)
            if min(k, room) >= n and (fits is None or fits(node, n)):
                if best is None or (k, node) < best:
                    best = (k, node)
    return None if best is None else best[1]


def multi_node(
    ti: TypeIndex, n: int, fits: Fits | None, slack: dict[int, int] | None = None
) -> list[tuple[int, int]] | None:
    """A gang larger than any node: whole nodes first, the remainder best-fit; None if short."""

    def room(node: int, k: int) -> int:
        if slack is not None and node in slack:
            k = min(k, slack[node])
        if k and fits is not None and not fits(node, k):
            return 0
        return k

    chosen: list[tuple[int, int]] = []
    got = 0
    buckets = ti.buckets
    for k in range(ti.max_node_cap, 0, -1):
        for node in buckets[k]:
            r = room(node, k)
            if r:
                chosen.append((node, r))
                got += r
                if got >= n:
                    break
        if got >= n:
            break
    if got < n:
        return None
    # The last node only gives the remainder: give it to the node that fits it most tightly.
    last_node, last_room = chosen.pop()
    rest = n - (got - last_room)
    used = {node for node, _ in chosen}
    best = (last_room, last_node)
    for k in range(rest, ti.max_node_cap + 1):
        if best[0] <= k:
            break  # no node in this bucket or a later one fits the remainder more tightly
        for node in buckets[k]:
            if node in used:
                continue
            r = room(node, k)
            if r >= rest:
                if (r, node) < best:
                    best = (r, node)
                break
    chosen.append((best[1], rest))
    return chosen


def find(
    ti: TypeIndex,
    n: int,
    fits: Fits | None,
    slack: dict[int, int] | None = None,
) -> list[tuple[int, int]] | None:
    """Where n GPUs of this type go now, as (node ordinal, count) pairs, or None."""
    if n > ti.total_free:
        return None
    if n <= ti.max_node_cap:
        node = single_node(ti, n, fits, slack)
        return None if node is None else [(node, n)]
    return multi_node(ti, n, fits, slack)


def commit(
    index: ClusterIndex, ti: TypeIndex, job: Pending, where: list[tuple[int, int]]
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Hand the GPUs out; returns Start.placements in node-name order."""
    names = index.topo.names
    out = [(names[node], ti.take(node, count)) for node, count in sorted(where)]
    index.charge(job, where)
    return tuple(out)


def nodes_of(topo: Topology, r: Running) -> dict[int, int]:
    """How many usable GPUs of its type an attempt holds on each node (shared: read only)."""
    key = (r.gpu_type, r.gpus)
    held = topo.held_nodes
    out = held.get(key)
    if out is not None:
        return out
    usable = topo.usable
    out = {}
    gpu_type = r.gpu_type
    for u in r.gpus:
        where = usable.get(u)
        if where is not None and where[0] == gpu_type:
            node = where[1]
            out[node] = out.get(node, 0) + 1
    if len(held) >= _HELD_NODES_MAX:
        held.clear()
    held[key] = out
    return out


class FreeGPUs:
    """The free GPUs of every type per node, as ClusterIndex finds them for a running tuple,
    kept in the caller's memo (scheduler.memo) and updated with the attempts that came and went:
    only the nodes they hold GPUs on are looked at again. ClusterIndex copies it each cycle.
    """

    __slots__ = ("topo", "types", "stopping", "epoch")

    def __init__(self, topo: Topology, held: set[str], running: Iterable[Running]):
        self.topo = topo
        self.epoch = -1  # the RunningTotals update it is in step with (see PlanMemo.free_gpus)
        # type -> (node -> free uuids in GPU order, nodes by free count (sorted), free in all)
        self.types: dict[str, tuple[dict[int, list[str]], list[list[int]], int]] = {}
        for gpu_type in sorted(topo.by_type):
            per_node = topo.by_type[gpu_type]
            _, order, max_cap, _ = topo.caps[gpu_type]
            free_by_node: dict[int, list[str]] = {}
            buckets: list[list[int]] = [[] for _ in range(max_cap + 1)]
            total = 0
            for i in order:
                uuids = per_node[i]
                free = (
                    list(uuids) if held.isdisjoint(uuids) else [u for u in uuids if u not in held]
                )
                if free:
                    free_by_node[i] = free
                    buckets[len(free)].append(i)
                    total += len(free)
            self.types[gpu_type] = (free_by_node, buckets, total)
        self.stopping = sum(1 for r in running if r.stopping)  # attempts told to stop

    def update(self, held: set[str], added: list[Running], removed: list[Running]) -> None:
        """Look again at the nodes the attempts that came and went hold GPUs on."""
        usable = self.topo.usable
        touched: set[tuple[str, int]] = set()
        for group, sign in ((added, 1), (removed, -1)):
            for r in group:
                if r.stopping:
                    self.stopping += sign
                for u in r.gpus:
                    where = usable.get(u)
                    if where is not None:
                        touched.add(where)
        by_type = self.topo.by_type
        for gpu_type, i in touched:
            free_by_node, buckets, total = self.types[gpu_type]
            before = free_by_node.get(i)
            k = len(before) if before else 0
            free = [u for u in by_type[gpu_type][i] if u not in held]
            if k:
                del buckets[k][bisect_left(buckets[k], i)]
            if free:
                free_by_node[i] = free
                insort(buckets[len(free)], i)
            elif before is not None:
                del free_by_node[i]
            self.types[gpu_type] = (free_by_node, buckets, total + len(free) - k)
