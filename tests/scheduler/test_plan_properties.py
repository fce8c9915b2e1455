"""Properties every plan keeps, over random snapshots and every ordering and switch."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler.model import (
    ANY_GPU_TYPE,
    Config,
    Gpu,
    Node,
    Ordering,
    Pending,
    Plan,
    Quota,
    ReasonCode,
    Running,
    Snapshot,
    Start,
    Tenant,
    VictimOrder,
)
from scheduler.policy import plan
from scheduler.quota import PreemptionBound

NOW = 100_000.0
TYPES = ("H100", "A100")
TENANTS = ("vision", "nlp", "speech", "ops")


# Strategies are built once: building them inside the composite per draw costs more than plan().
INT = {k: st.integers(0, k) for k in (2, 4, 5, 6, 7, 8, 12, 14)}
NODE_COUNT = st.integers(2, 8)
NODE_GPUS = st.sampled_from([1, 2, 4, 8, 8, 8])
JOB_GPUS = st.sampled_from([0, 1, 1, 1, 2, 2, 3, 4, 4, 8, 8, 12, 16])
BOOL = st.booleans()
GPU_TYPE = st.sampled_from(TYPES)
QUOTA_TYPES = st.sets(st.sampled_from((ANY_GPU_TYPE, *TYPES)), min_size=1)
WEIGHT = st.sampled_from([0.5, 1.0, 2.0])
MAX_JOBS = st.sampled_from([None, None, None, None, 1, 3])
BUDGET = st.sampled_from([None] * 8 + ["hold", "no_borrowing", "throttle"])
NODE_CPUS = st.sampled_from([0.0, 0.0, 16.0, 64.0])
NODE_MEM = st.sampled_from([0, 64_000])
USER = st.sampled_from(["u1", "u2"])
NAME = st.sampled_from(["train-1", "train-2", "eval"])
JOB_TYPE = st.sampled_from((ANY_GPU_TYPE,) * 3 + TYPES * 2 + ("B200",))
PRIORITY = st.sampled_from([50, 100, 200])
AGO = st.floats(0, 20_000)
DURATION = st.one_of(st.none(), st.floats(1, 20_000))
SERVICE = st.sampled_from([0.0, 5000.0, 90_000.0])
JOB_CPUS = st.sampled_from([0.0, 0.0, 0.0, 4.0, 32.0])
JOB_MEM = st.sampled_from([0, 8000])
RAN = st.floats(0, 10_000)
END = st.one_of(st.none(), st.floats(NOW - 100, NOW + 20_000))
REMAINING = st.one_of(st.none(), st.floats(0, 20_000))
RUN_CPUS = st.sampled_from([0.0, 8.0])
TENANT_COUNT = st.integers(0, len(TENANTS) - 1)
EXTRA = st.sampled_from([0, 4, 8, 16, 32])
VOLUME_NAMES = ("datasets", "scratch")
NODE_VOLUMES = st.sampled_from(
    [frozenset(VOLUME_NAMES)] * 3 + [frozenset(), frozenset({"datasets"}), frozenset({"scratch"})]
)
JOB_VOLUMES = st.sampled_from([()] * 6 + [("datasets",), ("scratch",), VOLUME_NAMES, ("gone",)])
GRACE = st.sampled_from([0.0, 0.0, 30.0, 60.0])
CHECKPOINTED_AGO = st.one_of(st.none(), st.floats(0, 10_000))
INTERVAL = st.sampled_from([None, None, 60.0, 900.0])
PREEMPTED = st.sampled_from([0, 0, 0, 1, 2, 5])


@st.composite
def snapshots(draw) -> Snapshot:
    nodes = []
    for i in range(draw(NODE_COUNT)):
        n_gpus = draw(NODE_GPUS)
        gpu_type = draw(GPU_TYPE)
        unhealthy = {j for j in range(n_gpus) if draw(INT[8]) == 0}
        draining = draw(INT[5]) == 0
        nodes.append(
            Node(
                name=f"n{i}",
                pool="p",
                gpus=tuple(
                    Gpu(f"n{i}-g{j}", j, gpu_type, 100, 700, 700, healthy=j not in unhealthy)
                    for j in range(n_gpus)
                ),
                schedulable=not draining and draw(INT[7]) > 0,
                draining=draining,
                cpus=draw(NODE_CPUS),
                memory_mib=draw(NODE_MEM),
                volumes=draw(NODE_VOLUMES),
            )
        )
    tenants = []
    for name in TENANTS[: 1 + draw(TENANT_COUNT)]:
        quotas = []
        for gpu_type in sorted(draw(QUOTA_TYPES) | ({ANY_GPU_TYPE} if draw(INT[2]) else set())):
            g = draw(INT[8])
            quotas.append(Quota(gpu_type, g, g + draw(EXTRA)))
        tenants.append(
            Tenant(
                name,
                weight=draw(WEIGHT),
                quotas=tuple(quotas),
                max_running_jobs=draw(MAX_JOBS),
                budget_action=draw(BUDGET),
            )
        )
    names = st.sampled_from([t.name for t in tenants] * 4 + ["stranger"])
    running = []
    job_id = 1
    for node in nodes:
        uuids = [g.uuid for g in node.gpus]
        while uuids and draw(BOOL):
            k = 1 + draw(INT[8]) % len(uuids)
            held, uuids = uuids[:k], uuids[k:]
            running.append(_running(draw, job_id, names, tuple(held), node.gpus[0].gpu_type))
            job_id += 1
    pending = []
    for _ in range(draw(INT[14])):
        pending.append(
            Pending(
                job_id=job_id,
                tenant=draw(names),
                user=draw(USER),
                name=draw(NAME),
                gpus=draw(JOB_GPUS),
                gpu_type=draw(JOB_TYPE),
                priority=draw(PRIORITY),
                preemptible=draw(INT[5]) > 0,
                submitted_at_s=NOW - draw(AGO),
                predicted_duration_s=draw(DURATION),
                estimated_duration_s=draw(DURATION),
                attained_service_s=draw(SERVICE),
                cpus=draw(JOB_CPUS),
                memory_mib=draw(JOB_MEM),
                volumes=draw(JOB_VOLUMES),
                preemptions=draw(PREEMPTED),
            )
        )
        job_id += 1
    return Snapshot(
        now_s=NOW,
        nodes=tuple(nodes),
        running=tuple(running),
        pending=tuple(pending),
        tenants=tuple(tenants),
    )


GUARANTEE = st.sampled_from([0, 4, 8, 12])
OWED = st.sampled_from([8, 16])
GANG = st.sampled_from([2, 4, 8])
PREEMPTING = st.builds(
    Config,
    ordering=st.sampled_from([Ordering.FAIR, Ordering.FIFO, Ordering.SJF]),
    borrowing=st.just(True),
    preemption=st.just(True),
    backfill=st.booleans(),
    min_runtime_s=st.sampled_from([0.0, 60.0, 60.0, 3000.0]),
    victim_order=st.sampled_from(list(VictimOrder)),
    max_preemptions=st.sampled_from([None, None, 1]),
)


@st.composite
def full_clusters(draw) -> Snapshot:
    """Nodes of 8 GPUs, every GPU held, mostly by tenants with small guarantees, and gangs
    waiting of a tenant owed much: the cluster where who gives a node back matters."""
    nodes = tuple(
        Node(f"n{i}", "p", tuple(Gpu(f"n{i}-g{j}", j, "H100", 100, 700, 700) for j in range(8)))
        for i in range(draw(st.integers(2, 5)))
    )
    total = 8 * len(nodes)
    # ops runs little and is owed much; the others run most of the cluster on less.
    tenants = tuple(
        Tenant(
            name, quotas=(Quota(ANY_GPU_TYPE, draw(OWED if name == "ops" else GUARANTEE), total),)
        )
        for name in TENANTS
    )
    names = st.sampled_from(("vision", "nlp", "speech"))
    owed = st.sampled_from(("ops", "ops", "ops", "nlp"))
    running = []
    job_id = 1
    for node in nodes:
        uuids = [g.uuid for g in node.gpus]
        while uuids:
            k = 1 + draw(INT[8]) % len(uuids)
            held, uuids = uuids[:k], uuids[k:]
            running.append(
                Running(
                    attempt_id=job_id,
                    job_id=job_id,
                    tenant=draw(names),
                    user="u1",
                    priority=draw(PRIORITY),
                    preemptible=draw(INT[8]) != 1,
                    started_at_s=NOW - 100 - draw(RAN),
                    gpus=tuple(held),
                    gpu_type="H100",
                    last_checkpoint_s=NOW - draw(RAN) if draw(BOOL) else None,
                )
            )
            job_id += 1
    pending = []
    for _ in range(1 + draw(INT[2])):
        pending.append(
            Pending(
                job_id=job_id,
                tenant=draw(owed),
                user="u1",
                name="train-1",
                gpus=draw(GANG),
                gpu_type=ANY_GPU_TYPE,
                priority=draw(PRIORITY),
                submitted_at_s=NOW - draw(AGO),
                predicted_duration_s=draw(DURATION),
            )
        )
        job_id += 1
    return Snapshot(
        now_s=NOW, nodes=nodes, running=tuple(running), pending=tuple(pending), tenants=tenants
    )


def _running(draw, job_id, names, gpus, gpu_type) -> Running:
    stopping = draw(INT[6]) == 0
    grace_s = draw(GRACE)
    ago_s = draw(CHECKPOINTED_AGO)
    return Running(
        attempt_id=job_id,
        job_id=job_id,
        tenant=draw(names),
        user="u1",
        priority=draw(PRIORITY),
        preemptible=draw(INT[4]) > 0,
        started_at_s=NOW - draw(RAN),
        gpus=gpus,
        gpu_type=gpu_type,
        predicted_end_s=draw(END),
        stopping=stopping,
        remaining_s=draw(REMAINING),
        attained_service_s=draw(SERVICE),
        preemptions=draw(PREEMPTED),
        cpus=draw(RUN_CPUS),
        grace_s=grace_s,
        stop_by_s=NOW + draw(st.floats(-10, grace_s)) if stopping and draw(BOOL) else None,
        last_checkpoint_s=None if ago_s is None else NOW - ago_s,
        checkpoint_interval_s=draw(INTERVAL),
    )


configs = st.builds(
    Config,
    ordering=st.sampled_from(list(Ordering)),
    borrowing=st.booleans(),
    preemption=st.booleans(),
    backfill=st.booleans(),
    min_runtime_s=st.sampled_from([0.0, 60.0, 3000.0]),
    aging_period_s=st.sampled_from([0.0, 600.0, 3600.0]),
    victim_order=st.sampled_from(list(VictimOrder)),
    max_preemptions=st.sampled_from([None, None, 0, 1, 3]),
)

SETTINGS = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


@SETTINGS
@given(snapshots(), configs)
def test_a_plan_never_hands_out_a_gpu_that_is_not_free_usable_and_of_the_right_type(snap, config):
    p = plan(snap, config)
    gpus = {g.uuid: (n, g) for n in snap.nodes for g in n.gpus}
    held = {u for r in snap.running for u in r.gpus}
    jobs = {j.job_id: j for j in snap.pending}
    handed = [u for s in p.starts for u in s.gpu_uuids]
    assert len(handed) == len(set(handed)), "a GPU was given twice"
    assert not set(handed) & held, "a GPU of a running attempt was given out"
    for s in p.starts:
        job = jobs[s.job_id]
        assert len(s.gpu_uuids) == max(job.gpus, 0), "a gang started partially"
        types = set()
        for node_name, uuids in s.placements:
            for u in uuids:
                node, gpu = gpus[u]
                assert node.name == node_name
                assert node.schedulable and gpu.healthy
                types.add(gpu.gpu_type)
        assert len(types) <= 1
        if job.gpu_type and types:
            assert types == {job.gpu_type}
    assert len(handed) <= sum(len(n.gpus) for n in snap.nodes)


@SETTINGS
@given(snapshots(), configs)
def test_a_plan_never_takes_a_tenant_past_its_limit(snap, config):
    p = plan(snap, config)
    jobs = {j.job_id: j for j in snap.pending}
    tenants = {t.name: t for t in snap.tenants}
    gpu_type = {g.uuid: g.gpu_type for n in snap.nodes for g in n.gpus}
    used: Counter = Counter()
    for r in snap.running:
        used[(r.tenant, r.gpu_type)] += len(r.gpus)
        used[(r.tenant, ANY_GPU_TYPE)] += len(r.gpus)
    added: Counter = Counter()
    for s in p.starts:
        job = jobs[s.job_id]
        if not s.gpu_uuids:
            continue
        t = gpu_type[s.gpu_uuids[0]]
        added[(job.tenant, t)] += len(s.gpu_uuids)
        added[(job.tenant, ANY_GPU_TYPE)] += len(s.gpu_uuids)
    for (tenant, key), n in added.items():
        quotas = {q.gpu_type: q for q in tenants[tenant].quotas} if tenant in tenants else {}
        if key != ANY_GPU_TYPE:
            assert key in quotas or ANY_GPU_TYPE in quotas, "a type without quota was used"
        q = quotas.get(key)
        if q is None:
            continue
        may_borrow = config.borrowing and tenants[tenant].budget_action != "no_borrowing"
        cap = q.limit_gpus if may_borrow else q.guaranteed_gpus
        assert used[(tenant, key)] + n <= cap
    for s in p.starts:
        t = tenants.get(jobs[s.job_id].tenant)
        assert t is not None and t.budget_action != "hold"


@SETTINGS
@given(snapshots(), configs)
def test_every_job_left_pending_has_exactly_one_reason_and_a_place_in_the_queue(snap, config):
    p = plan(snap, config)
    started = [s.job_id for s in p.starts]
    assert len(started) == len(set(started))
    decided = [d.job_id for d in p.pending]
    assert sorted(decided) == sorted({j.job_id for j in snap.pending} - set(started))
    assert [d.queue_position for d in p.pending] == list(range(1, len(p.pending) + 1))
    for d in p.pending:
        assert isinstance(d.reason_code, ReasonCode) and d.reason
    assert set(p.predicted_duration_s) == {j.job_id for j in snap.pending}


@SETTINGS
@given(snapshots(), configs)
def test_only_preemptible_attempts_older_than_the_minimum_runtime_are_preempted(snap, config):
    p = plan(snap, config)
    attempts = {r.attempt_id: r for r in snap.running}
    victims = [x.attempt_id for x in p.preemptions]
    assert len(victims) == len(set(victims)), "an attempt was preempted twice"
    bound = PreemptionBound(config.max_preemptions, snap.tenants)
    for x in p.preemptions:
        r = attempts[x.attempt_id]
        assert r.preemptible and not r.stopping
        assert NOW - r.started_at_s >= config.min_runtime_s
        assert x.job_id == r.job_id
        if x.for_job_id is not None:
            # Only draining a node (no job it is stopped for) stops one past the bound (which
            # holds for a job its tenant's guarantee can hold: PreemptionBound).
            assert not bound.reached(r.tenant, r.gpu_type, len(r.gpus), r.preemptions)


def _bounded(snap: Snapshot, config: Config) -> tuple[Plan, dict[int, Pending], PreemptionBound]:
    """The plan, the waiting jobs by id, and the preemption bound as it applies to them."""
    jobs = {j.job_id: j for j in snap.pending}
    return plan(snap, config), jobs, PreemptionBound(config.max_preemptions, snap.tenants)


def _started_type(snap: Snapshot, s: Start) -> str:
    """The GPU type a start was placed on ("" for a job without GPUs)."""
    if not s.gpu_uuids:
        return ""
    return next(g.gpu_type for n in snap.nodes for g in n.gpus if g.uuid == s.gpu_uuids[0])


@SETTINGS
@given(snapshots(), configs)
def test_a_job_at_its_preemption_bound_never_starts_on_borrowed_gpus(snap, config):
    # It would not be preempted to give them back, so their owner would wait for it to end.
    p, jobs, bound = _bounded(snap, config)
    for s in p.starts:
        j = jobs[s.job_id]
        if s.gpu_uuids and bound.reached(j.tenant, _started_type(snap, s), j.gpus, j.preemptions):
            assert not s.borrowed, s


@SETTINGS
@given(snapshots(), configs)
def test_only_a_job_its_guarantee_can_hold_is_told_it_waits_for_the_preemption_bound(snap, config):
    # At the bound a job may start only within its guarantee: told so, a job the guarantee
    # cannot hold would wait for ever. Such a job is never bounded (PreemptionBound).
    p, jobs, bound = _bounded(snap, config)
    for d in p.pending:
        if "so it is not preempted again" in d.reason:
            j = jobs[d.job_id]
            assert bound.holds(j.tenant, j.gpu_type, j.gpus), (j, d.reason)
            assert config.max_preemptions is not None
            assert j.preemptions >= config.max_preemptions


@SETTINGS
@given(snapshots(), configs)
def test_work_that_cannot_be_taken_back_never_grows_past_a_guarantee(snap, config):
    # Not preemptible, or at the preemption bound: GPUs it held beyond its tenant's guarantee
    # could not be given back to their owner. Starts may fill the guarantee with it, never more.
    p, jobs, bound = _bounded(snap, config)

    before: Counter = Counter()
    for r in snap.running:
        if not r.stopping and not bound.takeable(r):
            before[(r.tenant, r.gpu_type)] += len(r.gpus)
            before[(r.tenant, ANY_GPU_TYPE)] += len(r.gpus)
    after = Counter(before)
    for s in p.starts:
        job = jobs[s.job_id]
        t = _started_type(snap, s)
        if s.gpu_uuids and (
            not job.preemptible or bound.reached(job.tenant, t, job.gpus, job.preemptions)
        ):
            after[(job.tenant, t)] += len(s.gpu_uuids)
            after[(job.tenant, ANY_GPU_TYPE)] += len(s.gpu_uuids)
    for t in snap.tenants:
        for q in t.quotas:
            key = (t.name, q.gpu_type)
            if before[key] <= q.guaranteed_gpus:
                assert after[key] <= q.guaranteed_gpus, (key, before[key], after[key])


def _guarantees(snap: Snapshot) -> dict[tuple[str, str], int]:
    return {(t.name, q.gpu_type): q.guaranteed_gpus for t in snap.tenants for q in t.quotas}


def _held(snap: Snapshot) -> Counter:
    """GPUs each tenant holds in attempts not told to stop, by (tenant, type) and ANY."""
    held: Counter = Counter()
    for r in snap.running:
        if not r.stopping:
            held[(r.tenant, r.gpu_type)] += len(r.gpus)
            held[(r.tenant, ANY_GPU_TYPE)] += len(r.gpus)
    return held


@SETTINGS
@given(snapshots(), configs)
def test_a_tenant_within_its_guarantee_never_loses_an_attempt_to_another_tenant(snap, config):
    p = plan(snap, config)
    jobs = {j.job_id: j for j in snap.pending}
    attempts = {r.attempt_id: r for r in snap.running}
    guarantees = _guarantees(snap)
    active = _held(snap)
    for x in p.preemptions:
        victim = attempts[x.attempt_id]
        taker = jobs.get(x.for_job_id)
        if taker is not None and taker.tenant == victim.tenant:
            continue
        over = [
            active[(victim.tenant, key)] > guarantees[(victim.tenant, key)]
            for key in (victim.gpu_type, ANY_GPU_TYPE)
            if (victim.tenant, key) in guarantees
        ]
        assert any(over) or not over, f"attempt {x.attempt_id} was within its guarantee"


RECLAIMED = "uses more than its guarantee"


@settings(SETTINGS, max_examples=600)
@given(st.one_of(snapshots(), full_clusters()), st.one_of(configs, PREEMPTING))
def test_a_node_reclaimed_from_surplus_leaves_every_tenant_its_whole_guarantee(snap, config):
    # preemption.reclaim_node may take any of a tenant's attempts, not only its borrowed ones,
    # so it must stop at what the tenant uses beyond every guarantee covering the type: walked
    # in the plan's order, after each such preemption the victim still holds its guarantees.
    p = plan(snap, config)
    attempts = {r.attempt_id: r for r in snap.running}
    guarantees = _guarantees(snap)
    held = _held(snap)
    for x in p.preemptions:
        victim = attempts[x.attempt_id]
        for key in (victim.gpu_type, ANY_GPU_TYPE):
            held[(victim.tenant, key)] -= len(victim.gpus)
        if RECLAIMED not in x.reason:
            continue
        for key in (victim.gpu_type, ANY_GPU_TYPE):
            if (victim.tenant, key) in guarantees:
                assert held[(victim.tenant, key)] >= guarantees[(victim.tenant, key)], (x, key)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(snapshots(), configs)
def test_the_same_snapshot_always_gives_the_same_plan(snap, config):
    assert plan(snap, config) == plan(snap, config)


@SETTINGS
@given(snapshots(), configs)
def test_backfill_leaves_the_head_of_the_queue_its_gpus_at_its_estimated_start(snap, config):
    p = plan(snap, config)
    if p.preemptions or any(d.reason_code is ReasonCode.WAITING_FOR_PREEMPTION for d in p.pending):
        return  # GPUs set aside for preemptions are outside what this check models
    jobs = {j.job_id: j for j in snap.pending}
    heads = [
        d
        for d in p.pending
        if d.estimated_start_s is not None
        and d.reason_code in (ReasonCode.NO_CAPACITY, ReasonCode.GANG_FRAGMENTED)
    ]
    for d in heads:
        job = jobs[d.job_id]
        assert _can_hold(snap, p, job, d.estimated_start_s, config), f"head {job.job_id} delayed"


def _can_hold(snap: Snapshot, p, job: Pending, at_s: float, config: Config) -> bool:
    """Whether, at at_s, some node (or, for a gang larger than every node, the type) will have
    the head's GPUs free, counting running attempts and this plan's starts by their ends."""
    busy_until: dict[str, float] = {}
    for r in snap.running:
        end_s = r.predicted_end_s
        if end_s is None:
            end_s = r.started_at_s + config.default_duration_s
        end_s = NOW if r.stopping else max(end_s, NOW)
        for u in r.gpus:
            busy_until[u] = end_s
    for s in p.starts:
        for u in s.gpu_uuids:
            busy_until[u] = NOW + p.predicted_duration_s[s.job_id]
    for gpu_type in [job.gpu_type] if job.gpu_type else TYPES:
        per_node = {}
        for node in snap.nodes:
            if not node.schedulable:
                continue
            usable = [g for g in node.gpus if g.healthy and g.gpu_type == gpu_type]
            if usable:
                free_then = sum(1 for g in usable if busy_until.get(g.uuid, NOW) <= at_s)
                per_node[node.name] = (len(usable), free_then)
        biggest = max((cap for cap, _ in per_node.values()), default=0)
        if job.gpus <= biggest:
            if any(free >= job.gpus for _, free in per_node.values()):
                return True
        elif sum(free for _, free in per_node.values()) >= job.gpus:
            return True
    return False


def plan_with_admission(admission, snap, config):
    """The plan made with `admission` as the planner's Admission class (restored after)."""
    import scheduler.admit as admit
    import scheduler.policy as policy

    policy.Admission = admission
    try:
        return plan(snap, config)
    finally:
        policy.Admission = admit.Admission


class _Forgets(dict):
    """A memo that never recalls anything: the plan must then be worked out in full."""

    def get(self, key, default=None):
        return default


class _RecallsNothing(set):
    """A set of failures that never holds the one asked about."""

    def __contains__(self, key):
        return False


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.one_of(snapshots(), full_clusters()), st.one_of(configs, PREEMPTING))
def test_remembering_failed_searches_never_changes_a_plan(snap, config):
    import scheduler.admit as admit

    class Forgetful(admit.Admission):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._reclaim_failed = _RecallsNothing()
            self._hopeless = _Forgets()
            self._claim_memo = _Forgets()
            self.search_failed_at = _Forgets()

    assert plan_with_admission(Forgetful, snap, config) == plan(snap, config)


@SETTINGS
@given(snapshots(), configs)
def test_a_job_with_volumes_starts_only_on_nodes_that_have_them_all(snap, config):
    p = plan(snap, config)
    volumes = {n.name: n.volumes for n in snap.nodes}
    jobs = {j.job_id: j for j in snap.pending}
    for start in p.starts:
        need = set(jobs[start.job_id].volumes)
        for node, _ in start.placements:
            assert need <= volumes[node], f"job {start.job_id} placed on {node} without {need}"
    for d in p.pending:
        if d.reason_code is ReasonCode.MISSING_VOLUME:
            job = jobs[d.job_id]
            assert job.volumes
            assert d.reason.startswith("waiting for a node with volume")


@SETTINGS
@given(snapshots(), configs)
def test_no_job_is_expected_to_start_before_the_gpus_it_waits_for_are_released(snap, config):
    p = plan(snap, config)
    for d in p.pending:
        if d.estimated_start_s is not None:
            assert d.estimated_start_s >= snap.now_s
        if "next checkpoint" in d.reason:
            # Only the lost-work order waits for a checkpoint, and never for one already due.
            assert config.victim_order is VictimOrder.LOST_WORK
            assert d.estimated_start_s is not None and d.estimated_start_s > snap.now_s
        if (
            d.reason_code is ReasonCode.WAITING_FOR_PREEMPTION
            and d.estimated_start_s is not None
            and "next checkpoint" not in d.reason  # it waits for a victim to save one first
        ):
            # Victims of this plan hold their GPUs through their notice; nothing is promised
            # later than the longest notice among the attempts that are or will be stopping.
            stopping = [r for r in snap.running if r.stopping] + [
                r for r in snap.running if r.attempt_id in {x.attempt_id for x in p.preemptions}
            ]
            latest = max(
                (
                    r.stop_by_s
                    if r.stopping and r.stop_by_s is not None
                    else snap.now_s + r.grace_s
                    for r in stopping
                ),
                default=snap.now_s,
            )
            assert d.estimated_start_s <= max(latest, snap.now_s)


SPLITS = st.lists(st.integers(0, 2), min_size=0, max_size=40)


@settings(max_examples=120, deadline=None, derandomize=True)
@given(snapshots(), configs, SPLITS)
def test_a_memo_kept_over_changing_running_attempts_plans_as_a_fresh_one(snap, config, splits):
    # A scheduling loop hands one memo snapshots whose running attempts are mostly the same
    # objects as the last one's, a few come and gone: the indexes it keeps up to date from
    # those differences (running totals, free GPUs, backfill ends, attempts in guarantee order)
    # must give the plan a fresh memo gives.
    from dataclasses import replace

    from scheduler.memo import PlanMemo

    memo = PlanMemo()
    running = snap.running
    # Each attempt is in the first, second or both of two partial snapshots, then all of it.
    first = tuple(r for r, k in zip(running, splits, strict=False) if k != 1)
    second = tuple(r for r, k in zip(running, splits, strict=False) if k != 0)
    for part in (first, second, running, first, running):
        s = replace(snap, running=part)
        assert plan(s, config, memo) == plan(s, config)


@settings(max_examples=120, deadline=None, derandomize=True)
@given(snapshots(), configs)
def test_attained_service_counted_from_a_past_time_plans_as_stated_now(snap, config):
    # The simulator hands LAS the same attempt objects for many cycles, their attained service
    # as of their start (Running.attained_as_of_s); the plan adds the service since, to the
    # value a snapshot stating it now carries.
    from dataclasses import replace

    from scheduler.priority import attained_now

    lazy = tuple(replace(r, attained_as_of_s=r.started_at_s) for r in snap.running)
    stated = tuple(
        replace(r, attained_service_s=attained_now(r, snap.now_s), attained_as_of_s=None)
        for r in lazy
    )
    assert plan(replace(snap, running=lazy), config) == plan(replace(snap, running=stated), config)
