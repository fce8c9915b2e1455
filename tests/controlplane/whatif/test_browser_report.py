"""A cluster admin reads a finished what-if's report in a real browser: the tables of the stored
summary, under the site's Content-Security-Policy, and its Markdown download."""

from __future__ import annotations

import pytest

from controlplane.scheduling.models import WhatIfRun
from tests.controlplane.whatif import test_pages
from tests.frontend import test_browser, test_browser_csp
from tests.frontend.test_browser import sign_in

pytestmark = [pytest.mark.browser, pytest.mark.slow]

# The browser suite's fixtures: Chromium, the live system, a tab, and what the browser reports.
browser = test_browser.browser
system = test_browser.system
page = test_browser.page
problems = test_browser_csp.problems
done_run = test_pages.done_run


def test_an_admin_reads_the_report_and_downloads_it(
    page, system, problems, cluster_admin, done_run: WhatIfRun
):
    from playwright.sync_api import expect

    sign_in(page, system, "root-admin")
    page.goto(f"{system.url}/manage/whatif/{done_run.pk}/")
    report = page.get_by_role("region", name="Report")
    expect(report.get_by_role("heading", level=2)).to_have_text(
        "What-if on 2026-11-01 00:00 to 2026-12-01 00:00 UTC"
    )
    runs = report.get_by_role("table").first
    real = runs.get_by_role("row").filter(
        has=page.get_by_role("rowheader", name="what really happened")
    )
    expect(real.get_by_role("cell").first).to_have_text("900.0")
    whatif = runs.get_by_role("row").filter(
        has=page.get_by_role("rowheader", name="simulated: what-if")
    )
    expect(whatif.get_by_role("cell").nth(11)).to_have_text("1 (+1 unfinished)")
    expect(report.get_by_role("listitem").first).to_have_text("vision: weight 1 -> 2")

    with page.expect_download() as download:
        report.get_by_role("link", name="Download as Markdown").click()
    assert download.value.suggested_filename == f"whatif-{done_run.pk}.md"
    text = open(download.value.path(), encoding="utf-8").read()
    assert text == done_run.report_markdown
    assert problems == []
