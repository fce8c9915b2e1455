"""Every page at a desktop (1280x800) and a phone (390x844) width, in the real browser: the page
never scrolls sideways (a table wider than the screen scrolls inside its own wrapper, which
shows that it does), and no table column is hidden. A screenshot of each page at each width
lands in test-artifacts/screenshots/widths/ (not committed) for a person to look at.
"""

from __future__ import annotations

import re

import pytest

from tests.frontend import test_browser
from tests.frontend.test_browser import SCREENSHOTS, sign_in

pytestmark = [pytest.mark.browser, pytest.mark.slow]

browser = test_browser.browser
system = test_browser.system

WIDTHS = {"desktop": (1280, 800), "phone": (390, 844)}

# What the page measures of itself: sideways overflow of the document, hidden cells, and
# tables wider than their box that are not inside a box that scrolls sideways.
MEASURE = """
() => {
  const doc = document.documentElement;
  const hiddenCells = [...document.querySelectorAll("table th, table td")]
    .filter((c) => getComputedStyle(c).display === "none")
    .map((c) => c.textContent.trim().slice(0, 30));
  const unscrolled = [...document.querySelectorAll("table")].filter((t) => {
    let box = t.parentElement;
    while (box && box !== document.body) {
      const x = getComputedStyle(box).overflowX;
      if (x === "auto" || x === "scroll") return false;
      box = box.parentElement;
    }
    return t.getBoundingClientRect().right > window.innerWidth + 1;
  }).map((t) => (t.caption ? t.caption.textContent : t.querySelector("th")?.textContent || "")
    .trim().slice(0, 40));
  const scrolls = (el) => {
    for (let box = el.parentElement; box && box !== document.body; box = box.parentElement) {
      const x = getComputedStyle(box).overflowX;
      if (x === "auto" || x === "scroll" || x === "hidden") return true;
    }
    return false;
  };
  // The outermost elements that reach past the right edge: what to fix when the page overflows.
  const wide = [...document.body.querySelectorAll("*")]
    .filter((el) => el.getBoundingClientRect().right > window.innerWidth + 1 && !scrolls(el))
    .filter((el, _, all) => !all.includes(el.parentElement))
    .slice(0, 5)
    .map((el) => `${el.tagName.toLowerCase()}.${[...el.classList].join(".")}`);
  return {
    overflow: doc.scrollWidth - window.innerWidth,
    wide,
    hiddenCells,
    unscrolled,
  };
}
"""


@pytest.fixture
def pages(cluster_admin, vision, alice, make_job, make_node):
    """The pages a cluster admin opens, with something on each: a node, jobs, an array."""
    from controlplane.jobs import arrays

    job = make_job(vision, alice, name="a-job-with-a-rather-long-name-for-a-phone")
    make_node("gpu-node-01", gpus=8)
    _a_cluster_with_a_past(make_node)
    sweep = arrays.submit_array(
        tenant=vision,
        user=alice,
        fields={"name": "sweep", "image": "registry.local/t/s:1", "command": ["true"], "env": {}},
        spec="3",
        indexes=[0, 1, 2],
        max_parallel=1,
    ).array
    from controlplane.scheduling.models import WhatIfRun, WhatIfState
    from tests.controlplane.whatif.test_pages import SUMMARY

    # A done what-if: its report has charts and two wide tables.
    whatif = WhatIfRun.objects.create(
        params={"since": "2026-11-01T00:00:00+00:00", "until": "2026-12-01T00:00:00+00:00"},
        state=WhatIfState.DONE,
        progress=1.0,
        summary=SUMMARY,
    )
    return [
        "/",
        "/cluster/",
        "/cluster/nodes/",
        "/cluster/nodes/gpu-node-01/",
        "/cluster/nodes/?health=unhealthy&sort=-util",
        "/cluster/nodes/?state=sleeping",
        "/cluster/?window=7d",
        "/manage/tenants/",
        f"/manage/tenants/{vision.slug}/",
        f"/t/{vision.slug}/",
        f"/t/{vision.slug}/members/",
        "/manage/pools/",
        "/manage/whatif/",
        f"/manage/whatif/{whatif.pk}/",
        "/manage/audit/",
        "/jobs/",
        f"/jobs/{job.pk}/",
        f"/jobs/{job.pk}/cancel/",
        "/jobs/new/",
        "/arrays/",
        f"/arrays/{sweep.pk}/",
        "/tokens/",
        "/volumes/",
        "/no-such-page/",
    ]


def _a_cluster_with_a_past(make_node):
    """More nodes than a page holds, one with 16 GPUs and a long name, faults that take many
    words, and an hour of cycles and readings for the overview's charts."""
    import datetime as dt

    from django.utils import timezone

    from controlplane.cluster.models import GPU, GpuTelemetry, Node
    from controlplane.scheduling.models import SchedulingCycle

    for i in range(26):
        make_node(f"rack{i // 8}-gpu-{i:02d}", gpus=8)
    wide = make_node("a-node-with-a-rather-long-host-name.cluster.example.org", gpus=16)
    GPU.objects.filter(node=wide, index__in=[3, 11]).update(healthy=False, ecc_errors=12)
    GPU.objects.filter(node=wide, index=5).update(throttle_reasons=["hw_power_brake_slowdown"])
    Node.objects.filter(pk=wide.pk).update(
        conditions=[
            {"type": "GpuTelemetryFailed", "gpu_uuid": None, "message": "NVML: Unknown Error"}
        ]
    )
    now = timezone.now()
    for i, gpu in enumerate(GPU.objects.all()):
        gpu.utilization_pct = (i * 37) % 101
        gpu.save(update_fields=["utilization_pct"])
    for minute in range(60):
        at = now - dt.timedelta(minutes=minute)
        SchedulingCycle.objects.create(started_at=at, pending=minute % 13, starts=minute % 3)
        GpuTelemetry.objects.bulk_create(
            GpuTelemetry(
                gpu=gpu, bucket_at=at.replace(second=0, microsecond=0), utilization_pct=50.0
            )
            for gpu in GPU.objects.filter(node=wide)
        )


@pytest.mark.parametrize("width", list(WIDTHS))
def test_no_page_scrolls_sideways_or_hides_a_column(browser, system, pages, width):
    w, h = WIDTHS[width]
    context = browser.new_context(viewport={"width": w, "height": h})
    context.set_default_timeout(20_000)
    page = context.new_page()
    folder = SCREENSHOTS / "widths" / width
    folder.mkdir(parents=True, exist_ok=True)
    problems = []
    try:
        sign_in(page, system, "root-admin")
        for path in pages:
            response = page.goto(f"{system.url}{path}")
            assert response is not None and response.status in (200, 400, 404), path
            page.wait_for_load_state("networkidle")
            name = re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-") or "home"
            page.screenshot(path=str(folder / f"{name}.png"), full_page=True)
            seen = page.evaluate(MEASURE)
            if seen["overflow"] > 1:
                problems.append(
                    f"{path}: the page scrolls {seen['overflow']} px sideways ({seen['wide']})"
                )
            if seen["hiddenCells"]:
                problems.append(f"{path}: hidden columns {seen['hiddenCells'][:5]}")
            if seen["unscrolled"]:
                problems.append(f"{path}: tables cut off without scrolling {seen['unscrolled']}")
    finally:
        context.close()
    assert not problems, "\n".join(problems)
