"""/api/docs/ works on a cluster with no internet: nothing it loads comes from another host.

(tests/frontend/test_browser_csp.py renders it in Chromium under the site's CSP, which allows
no other host.)"""

import re
from html.parser import HTMLParser

import pytest


class Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("src", "href") and value:
                self.urls.append(value)


@pytest.mark.django_db
def test_the_api_docs_load_nothing_from_another_host(client, alice):
    client.force_login(alice)
    page = client.get("/api/docs/")
    assert page.status_code == 200
    parser = Links()
    parser.feed(page.content.decode())
    assert parser.urls, "the page loads its files"
    external = [u for u in parser.urls if re.match(r"^([a-z]+:)?//", u)]
    assert external == []
    # The start-up script and the schema it fetches are this site's too.
    script_url = next(u for u in parser.urls if "script" in u.split("?", 1)[-1])
    script = client.get(script_url.replace("&amp;", "&")).content.decode()
    assert not re.search(r"""["'](https?:)?//(?!127\.0\.0\.1)""", script)
