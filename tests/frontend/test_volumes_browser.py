"""An admin defines a volume, a researcher finds it, and the admin deletes it after confirming, in
a real browser; the pages fit a phone's width."""

from __future__ import annotations

import pytest

from tests.frontend import test_browser
from tests.frontend.test_browser import nav, shoot, sign_in

# The real-browser suite's fixtures: a Chromium, a live system, a tab.
browser = test_browser.browser
system = test_browser.system
page = test_browser.page

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def fits_width(tab) -> bool:
    return tab.evaluate("document.documentElement.scrollWidth <= window.innerWidth")


def test_an_admin_defines_a_volume_a_researcher_finds_it_and_it_is_deleted_after_confirming(
    page, system, cluster_admin, alice, vision
):
    from controlplane.storage.models import Volume

    sign_in(page, system, cluster_admin.username)
    nav(page, "Storage").click()
    page.get_by_role("link", name="New volume").click()
    page.get_by_label("Name").fill("datasets")
    page.get_by_label("Source").fill("/mnt/../etc")
    page.get_by_label("vision").check()
    page.get_by_role("button", name="Save").click()
    assert "give the directory itself" in page.locator(".errorlist").first.inner_text()
    shoot(page, "volume-form", phone=True)
    page.get_by_label("Source").fill("/mnt/datasets")
    page.get_by_role("button", name="Save").click()
    page.get_by_role("row", name="datasets").wait_for()
    shoot(page, "volumes-admin", phone=True)
    page.set_viewport_size({"width": 390, "height": 844})
    assert fits_width(page)

    researcher = page.context.browser.new_context(viewport={"width": 390, "height": 844})
    tab = researcher.new_page()
    sign_in(tab, system, alice.username)
    nav(tab, "Volumes").click()
    assert "datasets" in tab.locator("main").inner_text()
    assert "/mnt/datasets" not in tab.content()
    assert fits_width(tab)
    shoot(tab, "volumes-researcher")
    researcher.close()

    page.goto(f"{system.url}/manage/volumes/datasets/")
    page.get_by_role("link", name="Delete…").click()
    assert Volume.objects.filter(name="datasets").exists()  # asked, not yet deleted
    page.get_by_role("button", name="Yes, delete").click()
    page.get_by_text("Volume datasets deleted.").wait_for()
    assert not Volume.objects.filter(name="datasets").exists()
