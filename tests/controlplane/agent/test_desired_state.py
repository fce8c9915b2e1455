"""Every column the heartbeat answer reads moves its node's generation when it changes.

A node's answer is cached per process under its desired-state generation, which PostgreSQL
triggers bump. controlplane.cluster.desired_state declares the columns the answer reads; these
tests hold the declaration, the statements and the triggers together: the statements read
exactly the declared columns, and changing any declared column, one at a time, on a node with
work moves the node's generation and changes what the node is answered, never leaving it a
stale cached answer. A new field in the answer needs a Read in desired_state.py and, should its
column be of a kind CHANGES does not know, a line there.
"""

from __future__ import annotations

import datetime as dt
import json
import re

import pytest
from django.db import connection, models
from django.utils import timezone

from controlplane.cluster import desired_state, heartbeat
from controlplane.cluster.models import GPU, Node, NodeGeneration
from controlplane.jobs import actions
from controlplane.jobs.models import Allocation, AttemptMember, Job, JobAttempt
from controlplane.storage.models import Volume
from controlplane.tenancy.models import Tenant

needs_triggers = pytest.mark.skipif(
    connection.vendor != "postgresql", reason="the generation triggers are PostgreSQL's"
)


def _declared(reads) -> set[tuple[str, str]]:
    return {(r.model._meta.db_table, r.model._meta.get_field(r.column).column) for r in reads}


def _read_by(sql: str) -> tuple[set[tuple[str, str]], set[str]]:
    """The (table, column) pairs a statement reads, and any column named without its table."""
    qualified = re.compile(r"\b(" + "|".join(desired_state.TABLES) + r')\."?(\w+)"?')
    read = {
        (desired_state.TABLES[alias]._meta.db_table, column)
        for alias, column in qualified.findall(sql)
    }
    rest = qualified.sub(" ", sql)
    columns = {
        f.column for model in desired_state.TABLES.values() for f in model._meta.concrete_fields
    }
    bare = {word for word in re.findall(r"\b\w+\b", rest) if word in columns}
    return read, bare


def test_the_statements_read_exactly_the_declared_columns():
    work_read, work_bare = _read_by(desired_state.work_sql())
    caps_read, caps_bare = _read_by(desired_state.caps_sql())
    volumes_read, volumes_bare = _read_by(desired_state.volumes_sql())

    assert work_bare == caps_bare == volumes_bare == set(), "every column is named with its alias"
    assert work_read == _declared(desired_state.WORK_READS)
    assert caps_read == _declared(desired_state.CAPS_READS)
    assert volumes_read == _declared(desired_state.VOLUME_READS)


# --- a node with work, and a change of each column it reads -------------------------------------


@pytest.fixture
def scene(agent, make_node, make_job, vision, alice):
    """node-01 answering one admitted two-GPU job (GPUs 0 and 1, a data volume mounted, a
    checkpoint directory) and a cap on GPU 0, with the rows a foreign key can be pointed at
    instead: another node, job, attempt, tenant, volume and a free GPU. Rows are by model, or
    by alias where two aliases read the same table (the checkpoint volume, a mounted one)."""
    token = agent.register("node-01", gpus=4)
    node = Node.objects.get(name="node-01")
    data = Volume.objects.create(name="datasets", source="/mnt/datasets", all_tenants=True)
    checkpoints = Volume.objects.create(name="ckpt", source="/srv/ckpt", checkpoints=True)
    job = make_job(
        vision,
        alice,
        gpus=2,
        env={"SEED": "1"},
        mounts=[{"volume": "datasets", "path": "/data", "read_only": False}],
        checkpoint_volume=checkpoints,
    )
    gpus = list(node.gpus.order_by("index"))
    attempt = actions.admit_job(job, node=node, gpus=gpus[:2], borrowed=False)
    GPU.objects.filter(pk=gpus[0].pk).update(desired_power_cap_w=500.0)

    elsewhere = make_node("node-02", gpus=1)
    other_attempt = actions.admit_job(
        make_job(vision, alice), node=elsewhere, gpus=list(elsewhere.gpus.all()), borrowed=False
    )
    # The other attempt gives its member up, so that ours can be moved onto it.
    AttemptMember.objects.filter(attempt=other_attempt).delete()
    others = {
        Node: make_node("spare", gpus=0).pk,
        Job: make_job(vision, alice).pk,
        JobAttempt: other_attempt.pk,
        GPU: gpus[3].pk,
        Tenant: Tenant.objects.create(slug="elsewhere", name="Elsewhere").pk,
        Volume: Volume.objects.create(name="other", source="/mnt/other").pk,
    }
    rows = {
        JobAttempt: attempt.pk,
        Job: job.pk,
        Allocation: Allocation.objects.get(attempt=attempt, gpu=gpus[0]).pk,
        AttemptMember: AttemptMember.objects.get(attempt=attempt).pk,
        GPU: gpus[0].pk,
        Tenant: vision.pk,
        "cv": checkpoints.pk,
        "v": data.pk,
    }
    return node, token, rows, others


def _changed(field: models.Field, value, others: dict):
    """Another value of this column: of its kind, and different."""
    if field.is_relation:
        return others[field.related_model]
    if field.choices:
        return next(choice for choice, _ in field.choices if choice != value)
    if isinstance(field, models.BooleanField):
        return not value
    if isinstance(field, models.DateTimeField):
        return timezone.now() if value is None else None
    if isinstance(field, models.JSONField):
        return [*value, "--changed"] if isinstance(value, list) else {**value, "CHANGED": "1"}
    if isinstance(field, models.CharField):
        return f"{value}-changed"
    if isinstance(field, models.IntegerField):
        return value + 100  # past every GPU index of the node: (node, index) is unique
    if isinstance(field, models.FloatField):
        return (value or 0.0) + 1.5
    raise AssertionError(f"no change known for {field!r}: add one to _changed")


def _generation(node: Node) -> int:
    row = NodeGeneration.objects.filter(node_id=node.pk).values_list("generation", flat=True)
    return row.first() or 0


def _served(node: Node) -> dict:
    """What this process answers the node from its cache now, as a steady heartbeat would."""
    read = heartbeat.read_node(Node.objects.get(pk=node.pk).token_hash)
    return json.loads(heartbeat.prepared_answer(read).body)


def _truth(node: Node) -> dict:
    return desired_state.current_desired_state(Node.objects.get(pk=node.pk))


def _changes():
    seen, out = set(), []
    for r in desired_state.READS:
        if not r.in_answer or r.model._meta.get_field(r.column).primary_key:
            continue  # a row keeps its id: rows come and go by insert and delete
        if (r.alias, r.column) not in seen:
            seen.add((r.alias, r.column))
            out.append(r)
    return out


def _row(rows: dict, read):
    return rows.get(read.alias) or rows[read.model]


@needs_triggers
@pytest.mark.parametrize("read", _changes(), ids=lambda r: f"{r.alias}.{r.column}")
def test_changing_a_column_the_answer_reads_moves_the_generation(scene, read):
    node, _, rows, others = scene
    before = _served(node)
    assert before == _truth(node)
    generation = _generation(node)

    field = read.model._meta.get_field(read.column)
    row = read.model.objects.filter(pk=_row(rows, read))
    value = row.values_list(field.attname, flat=True).get()
    row.update(**{field.attname: _changed(field, value, others)})

    assert _generation(node) > generation, f"{read.model.__name__}.{read.column} moved nothing"
    assert _served(node) == _truth(node), "the node would be answered from a stale cache"


@needs_triggers
def test_the_columns_read_for_the_full_path_alone_are_in_no_answer(scene):
    node, _, rows, others = scene
    before = _truth(node)
    for r in desired_state.READS:
        if r.in_answer:
            continue
        field = r.model._meta.get_field(r.column)
        row = r.model.objects.filter(pk=_row(rows, r))
        row.update(**{field.attname: _changed(field, row.values_list(field.attname).get()[0], {})})
    assert _truth(node) == before


@needs_triggers
def test_a_new_heartbeat_interval_reaches_the_cached_answer(scene):
    node, _, _, _ = scene
    assert _served(node)["heartbeat_interval_s"] == node.heartbeat_interval_s
    ((model, column),) = desired_state.NODE_KEYED
    model.objects.filter(pk=node.pk).update(**{column: node.heartbeat_interval_s + 5})
    assert _served(node)["heartbeat_interval_s"] == node.heartbeat_interval_s + 5


def test_the_answer_lists_the_work_and_caps_the_statements_read(scene):
    node, _, rows, _ = scene
    answer = _truth(node)
    (listed,) = answer["attempts"]
    job = Job.objects.get(pk=rows[Job])
    assert listed["attempt_id"] == rows[JobAttempt]
    assert (listed["image"], listed["command"], listed["env"]) == (job.image, job.command, job.env)
    assert listed["gpu_uuids"] == ["GPU-node-01-0", "GPU-node-01-1"]
    assert answer["power_caps_w"] == {"GPU-node-01-0": 500.0}
    JobAttempt.objects.filter(pk=rows[JobAttempt]).update(
        stop_requested_at=timezone.now() - dt.timedelta(seconds=1)
    )
    assert _truth(node)["attempts"] == [], "an attempt told to stop is no longer answered"


# --- the job contract's fields --------------------------------------------------------------------


def test_the_answer_carries_the_notice_mounts_and_checkpoint_directory(scene):
    node, _, rows, _ = scene
    (listed,) = _truth(node)["attempts"]
    assert listed["stop_signal"] == "SIGTERM"
    assert listed["grace_s"] == 30.0
    assert listed["mounts"] == [
        {
            "name": "datasets",
            "kind": "host_path",
            "source": "/mnt/datasets",
            "target": "/data",
            "read_only": False,
        }
    ]
    assert listed["checkpoint"] == {
        "host_path": f"/srv/ckpt/checkpoints/vision/{rows[Job]}",
        "target": "/gpucp/checkpoint",
        "read_only": False,
    }


def test_a_read_only_volume_is_mounted_read_only_whatever_the_job_asked(scene):
    node, _, rows, _ = scene
    Volume.objects.filter(pk=rows["v"]).update(read_only=True, per_tenant_subdir=True)
    (listed,) = _truth(node)["attempts"]
    ((mount),) = listed["mounts"]
    assert mount["read_only"] is True
    assert mount["source"] == "/mnt/datasets/tenants/vision"


def test_an_attempt_admitted_over_the_limit_gets_a_read_only_checkpoint_directory(scene):
    node, _, rows, _ = scene
    JobAttempt.objects.filter(pk=rows[JobAttempt]).update(checkpoint_read_only=True)
    (listed,) = _truth(node)["attempts"]
    assert listed["checkpoint"]["read_only"] is True


def test_a_job_without_a_checkpoint_volume_or_mounts_gets_neither(scene):
    node, _, rows, _ = scene
    Job.objects.filter(pk=rows[Job]).update(checkpoint_volume=None, mounts=[])
    (listed,) = _truth(node)["attempts"]
    assert listed["checkpoint"] is None
    assert listed["mounts"] == []


def test_a_heartbeat_costs_no_extra_statement_for_the_checkpoint_directory(scene):
    """The work, its tenant and checkpoint volume are one statement; only mounts cost one more,
    and only on a node whose work has some."""
    from django.test.utils import CaptureQueriesContext

    node, _, rows, _ = scene
    with CaptureQueriesContext(connection) as with_mounts:
        desired_state.load_work(node.pk)
    Job.objects.filter(pk=rows[Job]).update(mounts=[])
    with CaptureQueriesContext(connection) as without:
        desired_state.load_work(node.pk)
    assert len(without) == 1
    assert len(with_mounts) == 2
