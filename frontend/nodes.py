"""The nodes page: one row per node (state, health in words, GPUs, utilization, power against
cap), filtered, sorted and paginated in the database, with a heat map of the page's GPUs.

The node's own page keeps the per-GPU detail. The filters are a GET form, so a filtered page is a
link; a value the page cannot use is a 400 that says which and why (as on the job list).
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from dataclasses import dataclass

from django import forms
from django.core.paginator import Paginator
from django.db.models import (
    Avg,
    Case,
    Count,
    IntegerField,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    Value,
    When,
)
from django.db.models.functions import Coalesce
from django.shortcuts import render
from django.utils import timezone

from controlplane import queries
from controlplane.cluster.models import GPU, Node, NodeState, Pool
from controlplane.validators import refuse_unstorable_text
from frontend import node_health
from frontend.pages import page, staff_required

NODES_PER_PAGE = 25

STATE_CHOICES = [
    ("", "Any"),
    ("ready", "Ready"),
    ("cordoned", "Cordoned"),
    ("draining", "Draining"),
    ("down", "Down (not answering)"),
    ("deregistered", "Deregistered"),
]
HEALTH_CHOICES = [
    ("", "Any"),
    (node_health.HEALTHY, "Healthy"),
    (node_health.WARNING, "Warnings"),
    (node_health.UNHEALTHY, "Unhealthy"),
]

# Node.status as one sortable number: the states that take work first.
STATUS_RANK = Case(
    When(deregistered_at__isnull=False, then=Value(4)),
    When(ready=False, then=Value(3)),
    When(state=NodeState.READY, then=Value(0)),
    When(state=NodeState.CORDONED, then=Value(1)),
    default=Value(2),
    output_field=IntegerField(),
)


def _per_node(gpus: QuerySet[GPU], aggregate) -> Subquery:
    """One figure of each node's GPUs, as a column of the node query (no join, no GROUP BY)."""
    return Subquery(
        gpus.filter(node=OuterRef("pk")).order_by().values("node").annotate(x=aggregate).values("x")
    )


def _utilization_mean():
    return _per_node(GPU.objects.all(), Avg("utilization_pct"))


def _gpus_free():
    free = GPU.objects.filter(healthy=True).exclude(allocations__active=True)
    return Coalesce(_per_node(free, Count("pk")), 0)


# What a person can sort by: the ORM ordering, ties by name. Utilization and free GPUs are
# computed per node only when asked for.
NODE_SORTS = {
    "name": ("name",),
    "-name": ("-name",),
    "pool": ("pool__name", "name"),
    "-pool": ("-pool__name", "name"),
    "state": ("status_rank", "name"),
    "-state": ("-status_rank", "name"),
    "util": ("utilization_pct_mean", "name"),
    "-util": ("-utilization_pct_mean", "name"),
    "free": ("gpus_free", "name"),
    "-free": ("-gpus_free", "name"),
}
DEFAULT_NODE_SORT = "name"


class NodeFilterForm(forms.Form):
    """The nodes page's query string; pools and GPU models are those the cluster has."""

    q = forms.CharField(
        label="Name contains", required=False, max_length=253, validators=[refuse_unstorable_text]
    )
    pool = forms.ChoiceField(
        required=False, error_messages={"invalid_choice": "No pool is named “%(value)s”."}
    )
    state = forms.ChoiceField(
        required=False,
        choices=STATE_CHOICES,
        error_messages={
            "invalid_choice": "“%(value)s” is not a state: ready, cordoned, draining, down or "
            "deregistered."
        },
    )
    health = forms.ChoiceField(
        required=False,
        choices=HEALTH_CHOICES,
        error_messages={
            "invalid_choice": "“%(value)s” is not a health: healthy, warning or unhealthy."
        },
    )
    model = forms.ChoiceField(
        label="GPU model",
        required=False,
        error_messages={"invalid_choice": "No GPU in the cluster is a “%(value)s”."},
    )
    sort = forms.ChoiceField(
        required=False,
        choices=[(s, s) for s in NODE_SORTS],
        error_messages={"invalid_choice": "The list cannot be sorted by “%(value)s”."},
    )

    def __init__(self, data, *, pools: list[str], models: list[str]):
        super().__init__(data)
        pool_field = self.fields["pool"]
        model_field = self.fields["model"]
        assert isinstance(pool_field, forms.ChoiceField)
        assert isinstance(model_field, forms.ChoiceField)
        pool_field.choices = [("", "Any"), *((p, p) for p in pools)]
        model_field.choices = [("", "Any"), *((m, m) for m in models)]

    def value(self, name: str) -> str:
        """A filter's valid value ("" when absent or in error)."""
        return str(getattr(self, "cleaned_data", {}).get(name) or "")


def filter_nodes(form: NodeFilterForm) -> QuerySet[Node]:
    nodes = Node.objects.select_related("pool")
    if name := form.value("q"):
        nodes = nodes.filter(name__icontains=name)
    if pool := form.value("pool"):
        nodes = nodes.filter(pool__name=pool)
    if model := form.value("model"):
        nodes = nodes.filter(pk__in=GPU.objects.filter(model=model).values("node"))
    state = form.value("state")
    present = Q(deregistered_at__isnull=True)
    if state == "deregistered":
        nodes = nodes.exclude(present)
    elif state == "down":
        nodes = nodes.filter(present, ready=False)
    elif state:
        nodes = nodes.filter(present, ready=True, state=state)
    if health := form.value("health"):
        nodes = nodes.filter(node_health.health_q(health))
    sort = form.value("sort") or DEFAULT_NODE_SORT
    if "status_rank" in NODE_SORTS[sort][0]:
        nodes = nodes.annotate(status_rank=STATUS_RANK)
    if "utilization_pct_mean" in NODE_SORTS[sort][0]:
        nodes = nodes.annotate(utilization_pct_mean=_utilization_mean())
    if "gpus_free" in NODE_SORTS[sort][0]:
        nodes = nodes.annotate(gpus_free=_gpus_free())
    return nodes.order_by(*NODE_SORTS[sort])


# --- what a row shows ---------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeRow:
    node: Node
    gpus: list[queries.GpuRow]
    notes: list[node_health.Note]
    health: str

    @property
    def health_label(self) -> str:
        return node_health.HEALTH_LABELS[self.health]

    @property
    def health_badge(self) -> str:
        return node_health.HEALTH_BADGES[self.health]

    @property
    def gpus_total(self) -> int:
        return len(self.gpus)

    @property
    def gpus_in_use(self) -> int:
        return sum(1 for g in self.gpus if g.attempt is not None)

    @property
    def gpus_free(self) -> int:
        """Healthy and held by no job (on a cordoned or down node, free is not schedulable)."""
        return sum(1 for g in self.gpus if g.attempt is None and g.gpu.healthy)

    @property
    def models(self) -> str:
        counts = Counter(g.gpu.model for g in self.gpus)
        return ", ".join(f"{n} × {m}" for m, n in sorted(counts.items()))

    @property
    def utilization_pct(self) -> float | None:
        """The mean of the GPUs that report it: a GPU without a reading is not idle."""
        known = [g.gpu.utilization_pct for g in self.gpus if g.gpu.utilization_pct is not None]
        return sum(known) / len(known) if known else None

    @property
    def power_draw_w(self) -> float | None:
        known = [g.gpu.power_draw_w for g in self.gpus if g.gpu.power_draw_w is not None]
        return sum(known) if known else None

    @property
    def power_cap_w(self) -> float | None:
        """The caps the agents report in force (not those asked for and not yet applied)."""
        known = [g.gpu.power_cap_w for g in self.gpus if g.gpu.power_cap_w is not None]
        return sum(known) if known else None


def node_rows(nodes: list[Node], now: dt.datetime) -> list[NodeRow]:
    """The rows of these nodes, in their order, in a bounded number of queries however many."""
    loaded = dict(
        (n.pk, (n, gpus))
        for n, gpus in queries.nodes_with_gpus(Node.objects.filter(pk__in=[n.pk for n in nodes]))
    )
    rows = []
    for listed in nodes:
        node, gpus = loaded[listed.pk]
        notes = node_health.node_notes(node, gpus, now)
        rows.append(NodeRow(node, gpus, notes, node_health.health_level(node, notes)))
    return rows


# --- the heat map -------------------------------------------------------------------------------

# Utilization bands of the heat map, each a class of app.css (.heat-0 .. .heat-4).
HEAT_BANDS = ((20, "0–19 %"), (40, "20–39 %"), (60, "40–59 %"), (80, "60–79 %"), (101, "80–100 %"))


@dataclass(frozen=True)
class HeatCell:
    css: str
    text: str  # what the cell shows: its utilization, or a mark
    label: str  # what it says in words (tooltip and screen reader)


def heat_cell(node: Node, row: queries.GpuRow) -> HeatCell:
    gpu = row.gpu
    util = gpu.utilization_pct
    holder = (
        f"{row.job.name} #{row.job.pk} ({row.job.tenant.slug})" if row.job is not None else "free"
    )
    if not gpu.healthy:
        css, text, state = "heat-out", "×", "out of service"
    elif util is None:
        css, text, state = "heat-none", "–", "no reading"
    else:
        band = next(i for i, (upper, _) in enumerate(HEAT_BANDS) if util < upper)
        css, text, state = f"heat-{band}", f"{util:.0f}", f"{util:.0f} % busy"
    if row.job is not None:
        css += " held"
    return HeatCell(css, text, f"{node.name} GPU {gpu.index}: {state}, {holder}")


def heat_map(rows: list[NodeRow]) -> list[tuple[Node, list[HeatCell]]]:
    return [(r.node, [heat_cell(r.node, g) for g in r.gpus]) for r in rows]


# --- the page -----------------------------------------------------------------------------------


@staff_required
def node_list(request):
    now = timezone.now()
    pools = list(Pool.objects.order_by("name").values_list("name", flat=True))
    models = list(GPU.objects.order_by("model").values_list("model", flat=True).distinct())
    form = NodeFilterForm(request.GET, pools=pools, models=models)
    valid = form.is_valid()
    paginator = Paginator(filter_nodes(form) if valid else Node.objects.none(), NODES_PER_PAGE)
    asked = request.GET.get("page", "")
    page_obj = paginator.get_page(asked)
    page_note = ""
    if asked and asked != str(page_obj.number):
        # get_page answers the nearest page there is; say so rather than pretend it was asked.
        page_note = (
            f"There is no page “{asked[:20]}”: this is page {page_obj.number} "
            f"of {paginator.num_pages}."
        )
    rows = node_rows(list(page_obj.object_list), now)
    any_filter = any(form.value(f) for f in ("q", "pool", "state", "health", "model"))
    context = {
        "form": form,
        "filter": {name: form.value(name) for name in form.fields},
        "sort": form.value("sort") or DEFAULT_NODE_SORT,
        "pools": pools,
        "models": models,
        "states": STATE_CHOICES[1:],
        "healths": HEALTH_CHOICES[1:],
        "any_filter": any_filter,
        "filter_errors": form.errors,
        "page_obj": page_obj,
        "page_note": page_note,
        "rows": rows,
        "heat_rows": heat_map(rows),
        "heat_bands": [(f"heat-{i}", label) for i, (_, label) in enumerate(HEAT_BANDS)],
        "total_nodes": Node.objects.count() if any_filter else paginator.count,
        "now": now,
    }
    # A filter that cannot be applied is the request's fault: say which, and show no list that
    # would look like its answer.
    status = 400 if form.errors else 200
    if request.htmx:
        return render(request, "frontend/cluster/nodes_table.html", context, status=status)
    return page(request, "frontend/cluster/nodes.html", context, nav="nodes", status=status)
