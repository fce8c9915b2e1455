"""Every power figure on every page agrees with what the GPUs report at that instant.

A newcomer saw a 1-GPU job "capped at 100 W" on an idle cluster, draws above caps, and caps that
summed past the pool's budget with nothing saying how. Here real agents with simulated GPUs run
jobs under a pool budget that binds; once the caps are applied the agents are paused, so the
GPUs' readings hold still, and the browser reads every watt figure of every page: each one is a
<data class="watts"> element that names what it is a figure of (frontend/templatetags/power.py),
checked against the GPU rows as the agents last reported them, read in the same instant as the
page. A watt figure written any other way fails the test as unchecked.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.frontend import test_browser
from tests.frontend.test_browser import sign_in

pytestmark = [pytest.mark.browser, pytest.mark.slow]

browser = test_browser.browser
system = test_browser.system

BUDGET_W = 1500.0
# The figures a page shows and their exact values, read in the browser. Charts are left out:
# they draw history (telemetry buckets), not the present, and their own tests check them.
READ = """
() => {
  const figures = [...document.querySelectorAll("data.watts")].map((el) => ({
    of: el.dataset.of, value: el.value, text: el.textContent.trim(),
  }));
  const unchecked = [];
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    const el = node.parentElement;
    if (el.closest("data.watts, figure.chart, script, style, textarea")) continue;
    const found = node.textContent.match(/\\d[\\d,.]*\\s*(k?W)\\b/g);
    if (found) unchecked.push(...found.map((t) => `${t} in <${el.tagName.toLowerCase()}>`));
  }
  return { figures, unchecked };
}
"""


def _truth() -> dict:
    """What the GPUs report now, and what follows from it for each pool."""
    from django.db.models import Count, Q

    from controlplane.cluster.models import GPU, Pool

    gpus = {
        g.uuid: g
        for g in GPU.objects.select_related("node__pool").annotate(
            held=Count("allocations", filter=Q(allocations__active=True))
        )
    }
    pools = {}
    for pool in Pool.objects.all():
        mine = [g for g in gpus.values() if g.node.pool_id == pool.pk]
        draws = [g.power_draw_w for g in mine if g.power_draw_w is not None]
        at_most = [
            (g.power_cap_w if g.held else g.power_draw_w)
            for g in mine
            if (g.power_cap_w if g.held else g.power_draw_w) is not None
        ]
        pools[pool.name] = {
            "draw": sum(draws) if draws else None,
            "budget": pool.power_budget_w,
            "at-most": sum(at_most) if at_most else None,
        }
    return {"gpus": gpus, "pools": pools}


def _gpu_value(gpu, what: str):
    return {
        "draw": gpu.power_draw_w,
        "cap": gpu.power_cap_w,
        "requested": gpu.desired_power_cap_w,
    }[what]


def _expected(of: str, truth: dict):
    kind, _, rest = of.partition(":")
    subject, _, what = rest.rpartition(":")
    if kind == "gpu":
        return [_gpu_value(truth["gpus"][subject], what)]
    if kind == "gpus":  # "N W each": every GPU listed has it
        return [_gpu_value(truth["gpus"][uuid], what) for uuid in subject.split("|")]
    if kind == "pool":
        return [truth["pools"][subject][what]]
    if kind == "node":
        mine = [g for g in truth["gpus"].values() if g.node.name == subject]
        values = [_gpu_value(g, what) for g in mine]
        known = [v for v in values if v is not None]
        return [sum(known) if known else None]
    raise AssertionError(f"a power figure of something unknown: {of!r}")


def _same(shown: str, expected) -> bool:
    if expected is None:
        return shown == ""
    return shown != "" and abs(float(shown) - float(expected)) < 1e-6


def _pause(system, sig) -> None:
    for process in system.agents.values():
        os.killpg(process.pid, sig)


def test_every_power_figure_on_every_page_is_what_the_gpus_report(
    browser, system, cluster_admin, vision, alice
):
    from controlplane.cluster import actions as cluster_actions
    from controlplane.cluster.models import GPU, Pool
    from controlplane.jobs import actions
    from controlplane.jobs.models import Job, JobState
    from controlplane.tenancy.models import Quota
    from tests.controlplane.scheduling.conftest import wait_until

    system.start_agent("sim-h100", model="H100-SXM-80GB", gpus=4)
    system.start_agent("sim-a100", model="A100-SXM4-80GB", gpus=4)
    pool = Pool.objects.get(name="default")
    Quota.objects.create(tenant=vision, gpu_type="A100-SXM4-80GB", guaranteed_gpus=4, limit_gpus=4)
    # 8 GPUs that could draw 4.4 kW: the budget binds once jobs run.
    cluster_actions.set_pool_power_budget(pool, BUDGET_W, actor=cluster_admin)
    common = {"image": "localhost/busybox:latest", "command": ["sleep", "600"]}
    big = actions.submit_job(
        tenant=vision, user=alice, name="big", gpus=3, gpu_type="H100-SXM-80GB", **common
    )
    small = actions.submit_job(
        tenant=vision, user=alice, name="small", gpus=1, gpu_type="A100-SXM4-80GB", **common
    )

    def settled() -> bool:
        # Both running, and every GPU reports a draw under a cap it has applied as asked.
        running = Job.objects.filter(pk__in=[big.pk, small.pk], state=JobState.RUNNING).count()
        unsettled = GPU.objects.exclude(
            power_draw_w__isnull=False,
            power_cap_w__isnull=False,
            desired_power_cap_w__isnull=False,
        ).count() + sum(
            1
            for cap, desired in GPU.objects.values_list("power_cap_w", "desired_power_cap_w")
            if cap is None or desired is None or abs(cap - desired) > 0.5
        )
        return running == 2 and unsettled == 0

    assert wait_until(settled, timeout_s=90, interval_s=0.5), list(
        GPU.objects.values_list("uuid", "power_draw_w", "power_cap_w", "desired_power_cap_w")
    )
    # Two heartbeats more, so every reading was taken under the caps now in force.
    time.sleep(5)
    _pause(system, signal.SIGSTOP)
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    context.set_default_timeout(20_000)
    page = context.new_page()
    nodes = list(GPU.objects.values_list("node__name", flat=True).distinct())
    paths = [
        "/",
        "/cluster/",
        "/cluster/nodes/",
        *(f"/cluster/nodes/{name}/" for name in nodes),
        "/manage/pools/",
        "/jobs/",
        f"/jobs/{big.pk}/",
        f"/jobs/{small.pk}/",
        f"/t/{vision.slug}/",
    ]
    checked: dict[str, int] = {}
    overview_text = ""
    problems: list[str] = []
    try:
        sign_in(page, system, cluster_admin.username)
        for path in paths:
            for _ in range(5):
                before = _truth()
                page.goto(f"{system.url}{path}")
                page.wait_for_load_state("networkidle")
                seen = page.evaluate(READ)
                after = _truth()
                # The scheduler may still move a requested cap between two reads: only a page
                # read in an instant with nothing moving is judged.
                if _fingerprint(before) == _fingerprint(after):
                    break
            else:
                raise AssertionError(f"{path}: the figures never held still for a page load")
            problems += [f"{path}: unchecked power figure {u!r}" for u in seen["unchecked"]]
            for figure in seen["figures"]:
                expected = _expected(figure["of"], after)
                if not all(_same(figure["value"], e) for e in expected):
                    problems.append(
                        f"{path}: {figure['text']!r} as {figure['of']} but the GPUs say {expected}"
                    )
                kind = figure["of"].split(":")[0] + ":" + figure["of"].rsplit(":", 1)[1]
                checked[kind] = checked.get(kind, 0) + 1
            if path == "/cluster/":
                overview_text = page.inner_text("main")
    finally:
        context.close()
        _pause(system, signal.SIGCONT)
    assert not problems, "\n".join(problems)
    # Not a test of nothing: each kind of figure appeared, on the pages that show it.
    for kind in ("gpu:draw", "gpu:cap", "pool:draw", "pool:budget", "pool:at-most", "gpus:cap"):
        assert checked.get(kind), (kind, checked)

    # And what the newcomer saw contradicts nothing: no GPU draws past its cap, the pool draws
    # under its budget, and where the busy GPUs' caps add up past it the page says why.
    truth = _truth()
    for gpu in truth["gpus"].values():
        assert gpu.power_draw_w <= gpu.power_cap_w + 0.5, gpu.uuid
    assert truth["pools"]["default"]["draw"] <= BUDGET_W
    if truth["pools"]["default"]["at-most"] > BUDGET_W:
        assert "Above the budget by design" in overview_text


def _fingerprint(truth: dict) -> tuple:
    return (
        tuple(
            (u, g.power_draw_w, g.power_cap_w, g.desired_power_cap_w, g.held)
            for u, g in sorted(truth["gpus"].items())
        ),
        tuple(sorted((name, tuple(sorted(p.items()))) for name, p in truth["pools"].items())),
    )
