"""A real browser enforces the Content-Security-Policy on every page, and nothing breaks: no
violation, no script error, Swagger UI renders, and the live regions still poll (and still hold
still while the reader's focus is inside them, which htmx no longer evaluates for us).
"""

from __future__ import annotations

import time

import pytest

from tests.frontend import test_browser
from tests.frontend.test_browser import sign_in

pytestmark = [pytest.mark.browser, pytest.mark.slow]

# The fixtures of the browser suite: Chromium, the live system, a tab.
browser = test_browser.browser
system = test_browser.system
page = test_browser.page

# Chromium reports a blocked script, style, eval or connection on the console; the event also
# catches what it reports only to the page.
REPORT_VIOLATIONS = """
document.addEventListener("securitypolicyviolation", (e) => {
  console.error(`CSP violation: ${e.violatedDirective} blocked ${e.blockedURI}`);
});
"""


@pytest.fixture
def problems(page):
    """Everything the browser complains about while the test runs: CSP reports, script errors."""
    seen: list[str] = []
    page.add_init_script(REPORT_VIOLATIONS)
    page.on(
        "console",
        lambda m: (
            seen.append(f"{page.url}: {m.text}")
            if m.type == "error" and ("Content Security Policy" in m.text or "CSP" in m.text)
            else None
        ),
    )
    page.on("pageerror", lambda e: seen.append(f"{page.url}: {e}"))
    return seen


def test_every_page_an_admin_opens_runs_under_the_policy_without_a_violation(
    page, system, problems, cluster_admin, vision, alice, make_job, make_node
):
    from playwright.sync_api import expect

    from controlplane.jobs import arrays

    job = make_job(vision, alice, name="csp-check")
    make_node("gpu-node-01", gpus=2)
    sweep = arrays.submit_array(
        tenant=vision,
        user=alice,
        fields={"name": "sweep", "image": "registry.local/t/s:1", "command": ["true"], "env": {}},
        spec="3",
        indexes=[0, 1, 2],
        max_parallel=1,
    ).array
    sign_in(page, system, "root-admin")
    for path in (
        "/cluster/",
        "/cluster/nodes/",
        "/cluster/nodes/gpu-node-01/",
        "/manage/tenants/",
        f"/manage/tenants/{vision.slug}/",
        f"/t/{vision.slug}/",
        f"/t/{vision.slug}/members/",
        "/manage/pools/",
        "/manage/whatif/",
        "/jobs/",
        f"/jobs/{job.pk}/",
        "/jobs/new/",
        "/arrays/",
        f"/arrays/{sweep.pk}/",
        f"/arrays/{sweep.pk}/cancel/",
        "/tokens/",
        "/admin/",
        "/admin/jobs/job/",
    ):
        response = page.goto(f"{system.url}{path}")
        assert response.status == 200, path
        assert "script-src 'self'" in response.headers["content-security-policy"]
        page.wait_for_load_state("networkidle")
        # Its own stylesheet applied: the policy let it load.
        assert page.evaluate("document.styleSheets.length") >= 1, path

    # The submit form's live preview is an htmx request on input: it still runs.
    page.goto(f"{system.url}/jobs/new/")
    page.get_by_label("Image").fill("registry.local/demo/csp:1")
    expect(page.locator("#curl-text")).to_contain_text("registry.local/demo/csp:1")

    # Swagger UI, from this site's own files, renders the API and its operations with every
    # request to anywhere but this server refused, as on a cluster with no internet.
    elsewhere: list[str] = []

    def refuse(route):
        elsewhere.append(route.request.url)
        route.abort()

    page.route(lambda url: not url.startswith(f"{system.url}/"), refuse)
    page.goto(f"{system.url}/api/docs/")
    expect(page.locator(".swagger-ui .opblock").first).to_be_visible(timeout=30_000)
    expect(page.locator(".swagger-ui .info .title")).to_contain_text("GPU control plane API")
    assert elsewhere == []

    assert problems == []


def test_a_live_region_polls_but_holds_still_while_focus_is_inside_it(
    page, system, problems, vision, alice, make_job
):
    make_job(vision, alice, name="waits-in-the-queue")
    sign_in(page, system, "alice")
    page.goto(f"{system.url}/jobs/")

    def is_poll(request):
        return request.headers.get("hx-request") == "true" and "/jobs/" in request.url

    polls: list[float] = []
    page.on("request", lambda r: polls.append(time.monotonic()) if is_poll(r) else None)
    # It polls (every 3 s) ...
    with page.expect_request(is_poll, timeout=10_000):
        pass
    page.wait_for_load_state("networkidle")
    # ... not while the reader is on one of its links ...
    page.locator("#job-results a", has_text="waits-in-the-queue").focus()
    focused_at = time.monotonic()
    page.wait_for_timeout(7_000)
    assert [t for t in polls if t > focused_at] == []
    # ... and again as soon as focus leaves.
    with page.expect_request(is_poll, timeout=10_000):
        page.evaluate("document.activeElement.blur()")
    assert problems == []
