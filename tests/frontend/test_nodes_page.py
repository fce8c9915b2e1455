"""The nodes page: a row per node with its health in words, filters that narrow the rows, pages
that keep the filters, and a heat map of the GPUs' utilization. Health words are checked against
every code the agents can report, read from the agents' own source."""

from __future__ import annotations

import ast
import datetime as dt
import html
import re
from pathlib import Path

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from agents.gpu.nvml import THROTTLE_REASONS, decode_throttle_reasons
from frontend import node_health
from tests.frontend.test_researcher_pages import text_of

pytestmark = pytest.mark.django_db

AGENTS = Path(__file__).resolve().parents[2] / "agents"


@pytest.fixture
def admin(client, cluster_admin):
    client.force_login(cluster_admin)
    return client


def rows(response) -> list[str]:
    """The names of the nodes listed, in order."""
    return re.findall(
        r'<tr id="node-\d+">\s*<th scope="row"[^>]*><a [^>]+>([^<]+)</a>', page(response)
    )


def page(response) -> str:
    return response.content.decode()


def row_text(response, name: str) -> str:
    match = re.search(
        rf'<tr id="node-\d+">\s*<th scope="row"[^>]*><a [^>]+>{re.escape(name)}</a>(.*?)</tr>',
        page(response),
        re.S,
    )
    assert match, f"no row for {name}"
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", match.group(1))).split())


def heat_labels(response) -> list[str]:
    return [
        html.unescape(label)
        for label in re.findall(r'<li class="heat-cell [^"]*" title="([^"]+)"', page(response))
    ]


# --- one row per node -------------------------------------------------------------------------


def test_the_list_has_a_row_per_node_and_no_row_per_gpu(admin, make_node):
    make_node("gpu-node-01", gpus=8)
    make_node("gpu-node-02", gpus=8)
    response = admin.get(reverse("node-list"))
    assert response.status_code == 200
    assert rows(response) == ["gpu-node-01", "gpu-node-02"]
    assert "gpu-table" not in page(response)  # the per-GPU table is on the node's own page


def test_a_row_shows_gpus_free_and_in_use_their_model_utilization_and_power(admin, running_job):
    # running_job holds GPUs 0 and 1 of gpu-node-01 (4 GPUs) at 93 %, 480 W of a 600 W cap.
    response = admin.get(reverse("node-list"))
    row = row_text(response, "gpu-node-01")
    assert "2 free · 2 in use · 4" in row
    assert "4 × H100-SXM-80GB" in row
    # The mean of the GPUs that report utilization: the two idle ones report nothing yet; the
    # power is the sum of what the GPUs report, each figure named for the power-figure check.
    assert " 93 960 / 1,200 " in f" {row} "
    assert '<data class="watts" value="960.0" data-of="node:gpu-node-01:draw">960</data>' in (
        page(response)
    )
    assert "default ready healthy" in row


def test_the_node_link_leads_to_the_page_with_each_gpu(admin, running_job):
    html_ = page(admin.get(reverse("node-list")))
    assert f'href="{reverse("node-detail", args=["gpu-node-01"])}"' in html_
    detail = admin.get(reverse("node-detail", args=["gpu-node-01"]))
    assert 'class="gpu-table"' in page(detail)


# --- filters and pages ------------------------------------------------------------------------


def test_the_cordoned_filter_shows_only_cordoned_nodes(admin, make_node):
    from controlplane.cluster.models import Node

    make_node("a-ready")
    make_node("b-cordoned")
    make_node("c-draining")
    make_node("d-down-and-cordoned")
    Node.objects.filter(name="b-cordoned").update(state="cordoned")
    Node.objects.filter(name="c-draining").update(state="draining")
    Node.objects.filter(name="d-down-and-cordoned").update(state="cordoned", ready=False)

    assert rows(admin.get(reverse("node-list"), {"state": "cordoned"})) == ["b-cordoned"]
    assert rows(admin.get(reverse("node-list"), {"state": "down"})) == ["d-down-and-cordoned"]
    assert rows(admin.get(reverse("node-list"), {"state": "ready"})) == ["a-ready"]


def test_the_pool_filter_shows_only_that_pools_nodes(admin, make_node):
    from controlplane.cluster.models import Node, Pool

    make_node("train-1")
    make_node("serve-1")
    Node.objects.filter(name="serve-1").update(pool=Pool.objects.create(name="inference"))
    response = admin.get(reverse("node-list"), {"pool": "inference"})
    assert rows(response) == ["serve-1"]
    assert "1 node of 2 matches" in text_of(response)


def test_the_name_search_finds_nodes_by_part_of_their_name(admin, make_node):
    make_node("rack1-gpu-01")
    make_node("rack2-gpu-01")
    make_node("rack1-gpu-02")
    assert rows(admin.get(reverse("node-list"), {"q": "RACK1"})) == ["rack1-gpu-01", "rack1-gpu-02"]


def test_the_gpu_model_filter_shows_nodes_with_that_model(admin, make_node):
    make_node("h100-node", model="H100-SXM-80GB")
    make_node("a100-node", model="A100-SXM4-40GB")
    response = admin.get(reverse("node-list"), {"model": "A100-SXM4-40GB"})
    assert rows(response) == ["a100-node"]


def test_the_second_page_has_the_rest_and_every_link_keeps_the_filter(admin, make_node):
    from controlplane.cluster.models import Node

    for i in range(30):
        make_node(f"node-{i:02d}", gpus=1)
    make_node("ready-one", gpus=1)
    Node.objects.filter(name__startswith="node-").update(state="cordoned")

    first = admin.get(reverse("node-list"), {"state": "cordoned"})
    assert rows(first) == [f"node-{i:02d}" for i in range(25)]
    assert "Page 1 of 2" in text_of(first)
    next_link = re.search(r'href="([^"]+)" rel="next"', page(first)).group(1)
    assert html.unescape(next_link) == "?page=2&state=cordoned"
    # The live refresh asks for the same page of the same filter.
    assert 'hx-get="/cluster/nodes/?page=1&amp;state=cordoned"' in page(first)

    second = admin.get(reverse("node-list") + html.unescape(next_link))
    assert rows(second) == [f"node-{i:02d}" for i in range(25, 30)]
    previous = re.search(r'href="([^"]+)" rel="prev"', page(second)).group(1)
    assert html.unescape(previous) == "?page=1&state=cordoned"
    # A sort link keeps the filter and goes back to the first page.
    sort = re.search(r'<a href="([^"]+)">Util \(%\)', page(second)).group(1)
    assert html.unescape(sort) == "?sort=util&state=cordoned"


@pytest.mark.parametrize("asked", ["99", "abc", "0", "-1", "²"])
def test_a_page_that_does_not_exist_says_which_page_is_shown(admin, make_node, asked):
    make_node("only-node", gpus=1)
    response = admin.get(reverse("node-list"), {"page": asked})
    assert response.status_code == 200
    assert f"There is no page “{asked}”: this is page 1 of 1." in text_of(response)
    assert rows(response) == ["only-node"]


@pytest.mark.parametrize(
    ("query", "field", "says"),
    [
        ({"state": "sleeping"}, "state", "“sleeping” is not a state"),
        ({"health": "meh"}, "health", "“meh” is not a health"),
        ({"pool": "nowhere"}, "pool", "No pool is named “nowhere”."),
        ({"model": "TPU-v9"}, "model", "No GPU in the cluster is a “TPU-v9”."),
        ({"sort": "password"}, "sort", "cannot be sorted by “password”"),
        ({"q": "x" * 254}, "q", "at most 253 characters"),
    ],
)
def test_a_filter_it_cannot_use_is_a_400_that_says_why(admin, make_node, query, field, says):
    make_node("gpu-node-01")
    response = admin.get(reverse("node-list"), query)
    assert response.status_code == 400
    text = text_of(response)
    assert "These filters cannot be applied" in text
    assert re.search(rf"{field}\s*:[^:]*{re.escape(says)}", text), text
    assert rows(response) == []  # no list that would look like the filter's answer


def test_sorting_by_utilization_puts_the_busiest_node_first(admin, make_node):
    from controlplane.cluster.models import GPU

    for name, util in (("idle", 0.0), ("busy", 95.0), ("half", 50.0)):
        make_node(name, gpus=2)
        GPU.objects.filter(node__name=name).update(utilization_pct=util)
    assert rows(admin.get(reverse("node-list"), {"sort": "-util"})) == ["busy", "half", "idle"]
    assert rows(admin.get(reverse("node-list"), {"sort": "util"})) == ["idle", "half", "busy"]


def test_sorting_by_state_lists_the_nodes_that_take_work_first(admin, make_node):
    from controlplane.cluster.models import Node

    make_node("a-down", gpus=1)
    make_node("b-cordoned", gpus=1)
    make_node("c-ready", gpus=1)
    Node.objects.filter(name="a-down").update(ready=False)
    Node.objects.filter(name="b-cordoned").update(state="cordoned")
    assert rows(admin.get(reverse("node-list"), {"sort": "state"})) == [
        "c-ready",
        "b-cordoned",
        "a-down",
    ]


def test_sorting_by_free_gpus_counts_neither_held_nor_broken_ones(admin, running_job, make_node):
    from controlplane.cluster.models import GPU

    make_node("all-free", gpus=4)  # 4 free; gpu-node-01 has 2 free (running_job holds 2)
    make_node("one-broken", gpus=4)
    GPU.objects.filter(node__name="one-broken", index__in=[0, 1, 2]).update(healthy=False)
    ordered = rows(admin.get(reverse("node-list"), {"sort": "-free"}))
    assert ordered == ["all-free", "gpu-node-01", "one-broken"]


def test_the_list_reads_as_many_queries_for_twenty_nodes_as_for_two(admin, make_node, vision):
    from controlplane.cluster.models import GPU

    def count() -> int:
        with CaptureQueriesContext(connection) as seen:
            assert admin.get(reverse("node-list"), {"sort": "-util"}).status_code == 200
        return len(seen)

    for i in range(2):
        make_node(f"n{i:02d}", gpus=8)
    few = count()
    for i in range(2, 20):
        make_node(f"n{i:02d}", gpus=8)
    GPU.objects.update(throttle_reasons=["gpu_idle"], utilization_pct=5.0)
    assert count() == few


# --- health in words --------------------------------------------------------------------------


def test_a_node_with_an_out_of_service_gpu_says_so_in_words(admin, make_node):
    from controlplane.cluster.models import GPU

    make_node("gpu-node-01", gpus=4)
    GPU.objects.filter(index=2).update(healthy=False)
    response = admin.get(reverse("node-list"))
    row = row_text(response, "gpu-node-01")
    assert "unhealthy" in row
    assert "GPU 2 is out of service: the agent reports it lost or failed" in row
    assert "3 free · 0 in use · 4" in row


def test_a_down_node_says_how_long_it_has_been_silent(admin, make_node):
    from controlplane.cluster.models import Node

    make_node("silent", gpus=1)
    Node.objects.filter(name="silent").update(
        ready=False, last_heartbeat_at=timezone.now() - dt.timedelta(minutes=3, seconds=5)
    )
    row = row_text(admin.get(reverse("node-list")), "silent")
    assert re.search(r"Down: no heartbeat for 3m 0[5-9]s\.", row), row


def test_a_gpu_idle_while_its_job_runs_is_a_warning_and_an_idle_free_one_is_not(admin, running_job):
    from controlplane.cluster.models import GPU

    # GPU 0 is held by the running job; GPU 3 is free. Both say NVML's gpu_idle.
    GPU.objects.filter(index__in=[0, 3]).update(throttle_reasons=["gpu_idle"])
    row = row_text(admin.get(reverse("node-list")), "gpu-node-01")
    assert "warning GPU 0 is idle while a running job holds it." in row
    assert "GPU 3" not in row
    assert "gpu_idle" not in row


def test_ecc_errors_and_agent_conditions_read_as_sentences(admin, make_node):
    from controlplane.cluster.models import GPU, Node

    node = make_node("gpu-node-01", gpus=4)
    GPU.objects.filter(index__in=[1, 3]).update(ecc_errors=2)
    Node.objects.filter(pk=node.pk).update(
        conditions=[
            {
                "type": "PowerCapFailed",
                "gpu_uuid": "GPU-gpu-node-01-1",
                "message": "NVML: no permission",
                "since": timezone.now().timestamp() - 120,
            }
        ]
    )
    row = row_text(admin.get(reverse("node-list")), "gpu-node-01")
    assert "A power cap could not be set on GPU 1: NVML: no permission (for 2m 0" in row
    assert "GPUs 1, 3 have uncorrected memory (ECC) errors: 4 since their drivers loaded." in row
    detail = text_of(admin.get(reverse("node-detail", args=["gpu-node-01"])))
    assert "A power cap could not be set on GPU 1" in detail


def _throttle_codes() -> list[str]:
    """Every reason name the agents can report: NVML's known bits and a bit newer than them."""
    known = [name for _, name in THROTTLE_REASONS]
    return [*known, *decode_throttle_reasons(1 << 20)]


def _condition_kinds() -> list[str]:
    """The `type` of every condition the agents build: dict literals with a type and a message."""
    kinds = set()
    for source in AGENTS.rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if not isinstance(node, ast.Dict):
                continue
            keys = {
                k.value: v
                for k, v in zip(node.keys, node.values, strict=True)
                if k is not None and isinstance(k, ast.Constant)
            }
            kind = keys.get("type")
            if "message" in keys and isinstance(kind, ast.Constant) and isinstance(kind.value, str):
                kinds.add(kind.value)
    return sorted(kinds)


def test_the_codes_are_read_from_the_agents():
    assert {"gpu_idle", "hw_thermal_slowdown", "unknown_0x100000"} <= set(_throttle_codes())
    assert {"GpuTelemetryFailed", "PowerCapFailed"} <= set(_condition_kinds())


@pytest.mark.parametrize("code", _throttle_codes())
def test_every_clock_event_reason_the_agents_report_has_words(code):
    words = node_health.throttle_words(code)
    for phrase in (words.one, words.many):
        # Not the raw name (the words for a name this version does not know quote it).
        assert f"“{code}”" not in phrase, f"{code} has no words: add it to THROTTLE_WORDS"
        assert "_" not in phrase and len(phrase.split()) >= 2


@pytest.mark.parametrize("kind", _condition_kinds())
def test_every_condition_the_agents_report_has_words(kind):
    assert kind in node_health.CONDITION_WORDS, f"{kind} has no words: add it to CONDITION_WORDS"
    text = node_health.condition_text(kind, "the message", "GPU 1")
    assert kind not in text and text.endswith(": the message")


def test_a_code_this_version_has_no_words_for_still_reads_as_words():
    assert node_health.condition_text("GpuFellOffTheBus", "", "GPU 4") == (
        "The agent reports: gpu fell off the bus (GPU 4)"
    )
    assert node_health.throttle_words("quantum_flux").one == "reports “quantum_flux”"


def _setups():
    """(what is wrong, how to make it so, the health the node then has)."""
    from controlplane.cluster.models import GPU, Node

    def reason(code):
        return lambda node: GPU.objects.filter(node=node, index=1).update(throttle_reasons=[code])

    level_of = {
        node_health.BAD: "unhealthy",
        node_health.WARN: "warning",
        node_health.INFO: "healthy",
    }
    cases = [
        ("nothing", lambda node: None, "healthy"),
        ("down", lambda node: Node.objects.filter(pk=node.pk).update(ready=False), "unhealthy"),
        (
            "gone",
            lambda node: Node.objects.filter(pk=node.pk).update(deregistered_at=timezone.now()),
            "gone",
        ),
        (
            "failed GPU",
            lambda node: GPU.objects.filter(node=node, index=0).update(healthy=False),
            "unhealthy",
        ),
        (
            "ECC",
            lambda node: GPU.objects.filter(node=node, index=0).update(ecc_errors=1),
            "unhealthy",
        ),
        (
            "condition",
            lambda node: Node.objects.filter(pk=node.pk).update(
                conditions=[{"type": "GpuTelemetryFailed", "gpu_uuid": None, "message": "x"}]
            ),
            "unhealthy",
        ),
        ("zero ECC", lambda node: GPU.objects.filter(node=node).update(ecc_errors=0), "healthy"),
        ("unknown name", reason("quantum_flux"), "healthy"),
    ]
    for code in _throttle_codes():
        cases.append((code, reason(code), level_of[node_health.throttle_words(code).level]))
    return cases


@pytest.mark.parametrize(("what", "setup", "expected"), _setups(), ids=[c[0] for c in _setups()])
def test_the_health_filter_and_the_rows_badge_agree(admin, make_node, what, setup, expected):
    node = make_node("subject", gpus=2)
    make_node("bystander", gpus=2)
    setup(node)
    listed = {
        level: rows(admin.get(reverse("node-list"), {"health": level}))
        for level in ("healthy", "warning", "unhealthy")
    }
    found_in = [level for level, names in listed.items() if "subject" in names]
    assert found_in == ([] if expected == "gone" else [expected])
    assert "bystander" in listed["healthy"]
    badge = "deregistered" if expected == "gone" else expected
    assert row_text(admin.get(reverse("node-list")), "subject").split()[2] == badge


def test_idle_while_held_is_found_by_the_warning_filter(admin, running_job, make_node):
    from controlplane.cluster.models import GPU

    make_node("idle-but-free", gpus=2)
    GPU.objects.filter(node__name="idle-but-free").update(throttle_reasons=["gpu_idle"])
    GPU.objects.filter(node__name="gpu-node-01", index=0).update(throttle_reasons=["gpu_idle"])
    assert rows(admin.get(reverse("node-list"), {"health": "warning"})) == ["gpu-node-01"]
    assert rows(admin.get(reverse("node-list"), {"health": "healthy"})) == ["idle-but-free"]


# --- the heat map -----------------------------------------------------------------------------


def test_the_heat_map_has_a_cell_per_gpu_with_its_utilization_and_job(
    admin, running_job, make_node
):
    from controlplane.cluster.models import GPU

    make_node("gpu-node-02", gpus=2)
    GPU.objects.filter(node__name="gpu-node-02", index=0).update(utilization_pct=42.4)
    GPU.objects.filter(node__name="gpu-node-02", index=1).update(healthy=False)
    response = admin.get(reverse("node-list"))
    job = f"resnet #{running_job.pk} (vision)"
    assert heat_labels(response) == [
        f"gpu-node-01 GPU 0: 93 % busy, {job}",
        f"gpu-node-01 GPU 1: 93 % busy, {job}",
        "gpu-node-01 GPU 2: no reading, free",
        "gpu-node-01 GPU 3: no reading, free",
        "gpu-node-02 GPU 0: 42 % busy, free",
        "gpu-node-02 GPU 1: out of service, free",
    ]
    cells = re.findall(r'<li class="heat-cell ([^"]*)"', page(response))
    assert cells == ["heat-4 held", "heat-4 held", "heat-none", "heat-none", "heat-2", "heat-out"]
    # Screen readers hear the same words as the tooltip.
    assert f'<span class="visually-hidden">gpu-node-01 GPU 0: 93 % busy, {job}</span>' in (
        html.unescape(page(response))
    )


def test_the_heat_map_follows_the_filter_and_the_page(admin, make_node):
    from controlplane.cluster.models import Node

    make_node("a-ready", gpus=2)
    make_node("b-cordoned", gpus=3)
    Node.objects.filter(name="b-cordoned").update(state="cordoned")
    labels = heat_labels(admin.get(reverse("node-list"), {"state": "cordoned"}))
    assert [label.split(":")[0] for label in labels] == [f"b-cordoned GPU {i}" for i in range(3)]


def test_the_filter_form_works_without_javascript_and_shows_what_was_chosen(admin, make_node):
    from controlplane.cluster.models import Node, Pool

    make_node("train-1", model="H100-SXM-80GB")
    make_node("serve-1", model="L40S")
    Node.objects.filter(name="serve-1").update(pool=Pool.objects.create(name="inference"))
    html_ = page(admin.get(reverse("node-list"), {"pool": "inference", "sort": "-util"}))
    form = re.search(r'<form method="get"[^>]*>(.*?)</form>', html_, re.S).group(1)
    assert "<option selected>inference</option>" in form and "<option>default</option>" in form
    assert "<option>L40S</option>" in form
    # Filtering again keeps the sort the list was in.
    assert '<input type="hidden" name="sort" value="-util">' in form


def test_a_node_cordoned_from_a_filtered_page_goes_back_to_that_page(admin, make_node):
    make_node("gpu-node-01")
    listed = page(admin.get(reverse("node-list"), {"q": "gpu", "page": "1"}))
    back = html.unescape(re.search(r'name="next" value="([^"]+)">', listed).group(1))
    assert back == "/cluster/nodes/?q=gpu&page=1"
    done = admin.post(reverse("node-action", args=["gpu-node-01", "cordon"]), {"next": back})
    assert done["Location"] == "/cluster/nodes/?q=gpu&page=1"
