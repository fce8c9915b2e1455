"""A person using the UI in a real browser (Playwright driving Debian's Chromium) against the real
system: a live server with the embedded scheduling loop and simulated GPU agents.

Screenshots of the main pages land in test-artifacts/screenshots/ (not committed).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from django.conf import settings as django_settings

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
SCREENSHOTS = Path(django_settings.BASE_DIR) / "test-artifacts" / "screenshots"
PASSWORD = "pw-for-tests-1"
# Generous: the machine is shared, and a slow run must not read as a broken UI.
STATE_TIMEOUT_MS = 90_000


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: `make test` installs it (apt-get install chromium)")
    playwright_api = pytest.importorskip("playwright.sync_api")
    # Playwright's sync API keeps an event loop in this thread; the ORM calls the tests make
    # between browser steps are still plain synchronous code.
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    with playwright_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()
    if previous is None:
        os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    else:
        os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def system(transactional_db, settings, tmp_path):
    from controlplane.scheduling.embedded import SchedulingLoop
    from tests.frontend.live_system import LiveSystem, start_server

    settings.SCHEDULER_EMBEDDED = True
    settings.DEBUG = False
    server = start_server()
    loop = SchedulingLoop(interval_s=1.0, debounce_s=0.1, liveness_interval_s=2.0).start()
    live = LiveSystem(url=f"http://127.0.0.1:{server.port}", state_root=tmp_path)
    try:
        yield live
    finally:
        live.stop()
        loop.stop()
        server.terminate()


@pytest.fixture
def page(browser, system):
    context = browser.new_context(viewport={"width": 1366, "height": 900})
    context.set_default_timeout(20_000)
    tab = context.new_page()
    yield tab
    context.close()


def shoot(page, name: str, *, phone: bool = False) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)
    if phone:
        size = page.viewport_size
        page.set_viewport_size({"width": 390, "height": 844})
        page.screenshot(path=str(SCREENSHOTS / f"{name}-phone.png"), full_page=True)
        page.set_viewport_size(size)


def sign_in(page, system, username: str) -> None:
    page.goto(f"{system.url}/")
    assert "/login/" in page.url
    page.get_by_label("Username").fill(username)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_load_state("networkidle")
    assert "/login/" not in page.url


def nav(page, name: str):
    return page.get_by_role("navigation", name="Main").get_by_role("link", name=name, exact=True)


def job_state(page):
    return page.locator("#status-h .badge")


def test_a_researcher_fixes_a_form_error_submits_and_watches_the_job_succeed(
    page, system, alice, vision, tmp_path
):
    from playwright.sync_api import expect

    from controlplane.jobs.models import Job

    # The job waits for these files, so the test decides when it goes on, not a clock.
    go, done = tmp_path / "go", tmp_path / "done"
    system.start_agent("sim-node-1")
    sign_in(page, system, "alice")
    shoot(page, "dashboard", phone=True)

    nav(page, "Submit").click()
    page.get_by_label("Name", exact=True).fill("hello-gpus")
    page.get_by_label("Image").fill("train-without-registry")
    page.get_by_label("Command").fill(
        f"sh -c 'echo waiting; while [ ! -e {go} ]; do sleep 0.2; done; "
        f"for i in 1 2 3; do echo step $i of 3; done; while [ ! -e {done} ]; do sleep 0.2; done; "
        "echo all done'"
    )
    page.get_by_label("GPUs", exact=True).fill("2")
    page.get_by_role("button", name="Submit job").click()

    image_errors = page.locator("#id_image_errors")
    expect(image_errors).to_contain_text("is not an image reference")
    expect(page.get_by_label("Image")).to_have_attribute("aria-invalid", "true")
    assert Job.objects.count() == 0
    shoot(page, "submit-with-error", phone=True)

    page.get_by_label("Image").fill("registry.local/demo/hello:1")
    expect(page.locator("#curl-text")).to_contain_text("registry.local/demo/hello:1")
    page.get_by_role("button", name="Submit job").click()

    expect(page.locator("h1")).to_contain_text("hello-gpus")
    job = Job.objects.get()
    assert page.url.endswith(f"/jobs/{job.pk}/")
    # The page follows the job by itself: PENDING, then RUNNING with its first output.
    expect(job_state(page)).to_have_text("RUNNING", timeout=STATE_TIMEOUT_MS)
    expect(page.locator("#job-live")).to_contain_text("sim-node-1")
    expect(page.locator("pre.log")).to_contain_text("waiting", timeout=STATE_TIMEOUT_MS)
    shoot(page, "job-running", phone=True)

    # Its full output, on a page of its own, follows it: lines written after the page was
    # loaded appear without a reload.
    page.locator("#job-full-log").click()
    output = page.locator("#job-output")
    expect(output).to_contain_text("waiting")
    expect(page.locator("#job-output-status")).to_contain_text("Following")
    page.evaluate("window.notReloaded = true")
    go.touch()
    expect(output).to_contain_text("step 3 of 3", timeout=STATE_TIMEOUT_MS)
    assert page.evaluate("window.notReloaded === true")
    shoot(page, "job-output", phone=True)

    nav(page, "Jobs").click()
    badge = page.locator("#job-results tbody tr", has_text="hello-gpus").locator(".badge")
    expect(badge).to_have_text("RUNNING")
    page.evaluate("window.notReloaded = true")
    done.touch()
    expect(badge).to_have_text("SUCCEEDED", timeout=STATE_TIMEOUT_MS)
    assert page.evaluate("window.notReloaded === true")  # htmx swapped it in; no reload
    shoot(page, "job-list", phone=True)

    page.get_by_role("link", name="hello-gpus").click()
    expect(job_state(page)).to_have_text("SUCCEEDED")
    expect(page.locator("pre.log")).to_contain_text("step 3 of 3")
    expect(page.locator("pre.log")).to_contain_text("all done")
    expect(page.locator("#job-attempts")).to_contain_text("SUCCEEDED")
    shoot(page, "job-succeeded")

    nav(page, "API tokens").click()
    page.get_by_label("Name").fill("laptop")
    page.get_by_role("button", name="Create token").click()
    secret = page.locator("#new-token").inner_text()
    assert secret.startswith("gcp_")
    shoot(page, "tokens", phone=True)
    nav(page, "API tokens").click()
    expect(page.get_by_role("table")).to_contain_text("laptop")
    assert secret not in page.content()


def test_a_researcher_cancels_a_running_job_after_confirming(page, system, alice, vision):
    from playwright.sync_api import expect

    from controlplane.jobs.models import AttemptState, Job, JobAttempt

    system.start_agent("sim-node-1")
    sign_in(page, system, "alice")
    page.goto(f"{system.url}/jobs/new/")
    page.get_by_label("Name", exact=True).fill("long-run")
    page.get_by_label("Image").fill("registry.local/demo/sleep:1")
    page.get_by_label("Command").fill("sh -c 'echo started; sleep 120'")
    page.get_by_role("button", name="Submit job").click()
    expect(job_state(page)).to_have_text("RUNNING", timeout=STATE_TIMEOUT_MS)
    expect(page.locator("pre.log")).to_contain_text("started", timeout=STATE_TIMEOUT_MS)

    page.get_by_role("link", name="Cancel job…").click()
    expect(page.locator("h1")).to_contain_text("Cancel job long-run")
    shoot(page, "cancel-confirm")
    job = Job.objects.get()
    assert job.state == "RUNNING"  # asking is not cancelling
    page.get_by_role("button", name="Yes, cancel the job").click()

    expect(page.locator(".messages")).to_contain_text("cancelled")
    expect(job_state(page)).to_have_text("CANCELLED")
    # The agent kills the process and reports it; only then are the GPUs given back.
    attempt = JobAttempt.objects.get(job=job)
    deadline_ms = STATE_TIMEOUT_MS
    while attempt.state in (AttemptState.ADMITTED, AttemptState.RUNNING) and deadline_ms > 0:
        page.wait_for_timeout(500)
        deadline_ms -= 500
        attempt.refresh_from_db()
    assert attempt.state == AttemptState.STOPPED
    assert not attempt.allocations.filter(active=True).exists()


def test_an_admin_changes_a_quota_and_the_dashboard_follows(page, system, cluster_admin, vision):
    from playwright.sync_api import expect

    from controlplane.tenancy.models import Quota

    system.start_agent("sim-node-1")
    sign_in(page, system, "root-admin")
    shoot(page, "cluster-overview", phone=True)
    nav(page, "Nodes").click()
    expect(page.locator("#nodes-live")).to_contain_text("sim-node-1")
    shoot(page, "nodes")

    nav(page, "Tenants").click()
    shoot(page, "tenants")
    page.get_by_role("link", name="vision", exact=True).click()
    page.get_by_role("link", name="Edit the H100-SXM-80GB quota").click()
    page.get_by_label("Guaranteed GPUs").fill("20")
    page.get_by_label("Limit (GPUs)").fill("10")
    page.get_by_role("button", name="Save").click()
    expect(page.locator("#id_limit_gpus_errors")).to_contain_text("at least guaranteed_gpus")
    shoot(page, "quota-with-error")
    assert Quota.objects.get(tenant=vision).limit_gpus == 16

    page.get_by_label("Limit (GPUs)").fill("24")
    page.get_by_role("button", name="Save").click()
    expect(page.locator(".messages")).to_contain_text("Quota of vision saved")
    shoot(page, "tenant-edit")

    page.get_by_role("link", name="Dashboard", exact=True).click()
    expect(page.locator("#gpus-h")).to_be_visible()
    expect(page.locator("#dashboard-live")).to_contain_text("guaranteed 20 · limit 24")
    shoot(page, "tenant-dashboard-as-admin")

    page.get_by_role("link", name="Members", exact=True).click()
    expect(page.locator("h1")).to_contain_text("Members of Vision lab")
    shoot(page, "members")
    nav(page, "Pools").click()
    expect(page.get_by_label("Power budget (W)")).to_be_visible()
    shoot(page, "pools")
