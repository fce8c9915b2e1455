"""Every page works under the Content-Security-Policy it is served with: it names only this
site's own scripts and stylesheets, and nothing in it needs what the policy forbids (inline
<script> or <style>, event-handler attributes, javascript: URLs, htmx conditions, which are
evaluated code). The browser tests (test_browser_csp.py) watch a real browser obey it.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from django.contrib import admin
from django.contrib.staticfiles import finders
from django.urls import reverse

from tests.frontend import test_access
from tests.frontend.test_access import EVERY_PAGE, url_for

objects = test_access.objects  # the fixture: one of everything a page can be about

pytestmark = pytest.mark.django_db


def same_origin(url: str) -> bool:
    # In a template's source, "{% static %}" and "{% url %}" are this site's URLs, and a
    # variable is known only once rendered (the rendered pages are checked too).
    return (url.startswith("/") and not url.startswith("//")) or url.startswith(("{%", "{{"))


def policy_of(response) -> dict[str, list[str]]:
    header = response["Content-Security-Policy"]
    return {d.split()[0]: d.split()[1:] for d in header.split(";") if d.strip()}


class WhatThePageNeeds(HTMLParser):
    """Collects everything in a page the policy would block."""

    def __init__(self):
        super().__init__()
        self.blocked: list[str] = []
        self.in_inline_script = False

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        for name, value in attrs:
            if name.startswith("on") or name.startswith("hx-on"):
                self.blocked.append(f"<{tag} {name}=...> (event handler)")
            if value and value.strip().lower().startswith("javascript:"):
                self.blocked.append(f"<{tag} {name}={value!r}>")
        if tag == "script":
            src = attributes.get("src")
            if not src:
                self.in_inline_script = True
            elif not same_origin(src):
                self.blocked.append(f"<script src={src!r}> (another origin)")
        if tag == "style":
            self.blocked.append("<style> (inline stylesheet)")
        if tag == "link" and attributes.get("rel") in ("stylesheet", "icon"):
            href = attributes.get("href", "")
            if not same_origin(href) and href != "data:,":
                self.blocked.append(f"<link href={href!r}> (another origin)")
        if "[" in attributes.get("hx-trigger", ""):
            self.blocked.append(f"hx-trigger={attributes['hx-trigger']!r} (evaluated condition)")

    def handle_data(self, data):
        if self.in_inline_script and data.strip():
            self.blocked.append(f"inline <script>{data.strip()[:60]}")

    def handle_endtag(self, tag):
        if tag == "script":
            self.in_inline_script = False


def blocked_in(html: str) -> list[str]:
    parser = WhatThePageNeeds()
    parser.feed(html)
    return parser.blocked


def assert_served_under_the_policy(response):
    assert response.status_code == 200, (response.status_code, response.get("Location"))
    policy = policy_of(response)
    assert policy["script-src"] == ["'self'"]
    assert policy["style-src"] == ["'self'"]
    assert policy["default-src"] == ["'self'"]
    assert blocked_in(response.content.decode()) == []


GET_PAGES = [p for p in EVERY_PAGE if p[2] == "get"]


@pytest.mark.parametrize("name,kwargs,method", GET_PAGES)
def test_every_page_of_the_ui_needs_nothing_the_policy_forbids(
    client, objects, cluster_admin, name, kwargs, method
):
    client.force_login(cluster_admin)
    assert_served_under_the_policy(client.get(url_for(name, kwargs, objects), follow=True))


@pytest.mark.parametrize("name,kwargs,method", GET_PAGES)
def test_the_live_fragments_htmx_swaps_in_need_nothing_the_policy_forbids(
    client, objects, cluster_admin, name, kwargs, method
):
    client.force_login(cluster_admin)
    response = client.get(url_for(name, kwargs, objects), HTTP_HX_REQUEST="true", follow=True)
    assert response.status_code == 200
    assert blocked_in(response.content.decode()) == []


def test_the_sign_in_page_and_a_researchers_pages_need_nothing_the_policy_forbids(
    client, objects, alice
):
    assert_served_under_the_policy(client.get("/login/"))
    client.force_login(alice)
    for url in ("/", reverse("job-list"), reverse("job-detail", args=[objects["job"]])):
        assert_served_under_the_policy(client.get(url, follow=True))


def test_the_api_docs_load_swagger_ui_from_this_site_and_start_it_from_a_file(client, alice):
    client.force_login(alice)
    page = client.get("/api/docs/")
    assert_served_under_the_policy(page)
    html = page.content.decode()
    assert "cdn." not in html
    (script_url,) = [u for u in _script_sources(html) if "script" in u.split("?", 1)[-1]]
    script = client.get(script_url)
    assert script.status_code == 200
    assert script["Content-Type"].startswith("application/javascript")
    assert b"SwaggerUIBundle(" in script.content
    # Swagger UI itself: this site's static files (served by WhiteNoise after collectstatic).
    for url in _script_sources(html):
        if url != script_url:
            assert finders.find(url.removeprefix("/static/")), url


def _script_sources(html: str) -> list[str]:
    class Scripts(HTMLParser):
        sources: list[str] = []

        def handle_starttag(self, tag, attrs):
            if tag == "script" and dict(attrs).get("src"):
                self.sources.append(dict(attrs)["src"].replace("&amp;", "&"))

    parser = Scripts()
    parser.sources = []
    parser.feed(html)
    return parser.sources


def test_the_admins_pages_need_nothing_the_policy_forbids(client, objects, cluster_admin):
    client.force_login(cluster_admin)
    assert_served_under_the_policy(client.get(reverse("admin:index")))
    for model in admin.site._registry:
        meta = model._meta
        url = reverse(f"admin:{meta.app_label}_{meta.model_name}_changelist")
        assert_served_under_the_policy(client.get(url))


def test_no_template_of_the_ui_needs_what_the_policy_forbids():
    """The pages above are opened; this holds every template to the rule, new pages included."""
    import frontend

    templates = sorted((Path(frontend.__file__).parent / "templates").rglob("*.html"))
    assert len(templates) > 30
    for template in templates:
        source = re.sub(r"{#.*?#}", "", template.read_text(), flags=re.S)
        source = re.sub(r"{% comment %}.*?{% endcomment %}", "", source, flags=re.S)
        assert blocked_in(source) == [], template


# --- the header, built once (controlplane.content_security) ---------------------------------


def _expected(report_only: bool = False) -> str:
    from csp.utils import build_policy

    return build_policy(report_only=report_only)


@pytest.mark.parametrize(
    "path", ["/login/", "/api/v1/", "/api/v1/jobs/", "/api/agent/v1/heartbeat", "/no-such-page/"]
)
def test_every_answer_carries_the_policy_django_csp_builds_from_the_settings(
    client, alice, path, monkeypatch
):
    # Pages, API answers (a 401 and a 200), an agent's refused heartbeat, a 404: the same header,
    # and none of them builds it again (django-csp's per-response path is not taken).
    import csp.middleware

    built = []
    real = csp.middleware.build_policy
    monkeypatch.setattr(csp.middleware, "build_policy", lambda **kw: built.append(kw) or real(**kw))
    client.force_login(alice)
    for _ in range(3):
        response = client.get(path)
        assert response["Content-Security-Policy"] == _expected()
        assert "Content-Security-Policy-Report-Only" not in response
    assert built == []


def test_a_changed_policy_is_served_at_once(client, settings):
    directives = settings.CONTENT_SECURITY_POLICY["DIRECTIVES"]
    settings.CONTENT_SECURITY_POLICY = {
        "DIRECTIVES": {**directives, "img-src": ["'self'", "https://images.example.org"]},
        "EXCLUDE_URL_PREFIXES": ["/api/"],
    }
    settings.CONTENT_SECURITY_POLICY_REPORT_ONLY = {"DIRECTIVES": {"default-src": ["'none'"]}}
    login = client.get("/login/")
    assert "https://images.example.org" in login["Content-Security-Policy"]
    assert login["Content-Security-Policy"] == _expected()
    assert login["Content-Security-Policy-Report-Only"] == _expected(report_only=True)
    api = client.get("/api/v1/")
    assert "Content-Security-Policy" not in api  # an excluded prefix
    assert api["Content-Security-Policy-Report-Only"] == _expected(report_only=True)


@pytest.mark.parametrize("nonce_in_policy", [False, True])
def test_a_view_that_changes_its_policy_or_uses_a_nonce_gets_what_django_csp_gives_it(
    rf, settings, nonce_in_policy
):
    from csp.constants import NONCE
    from csp.decorators import csp_exempt, csp_update
    from csp.middleware import CSPMiddleware as Library
    from django.http import HttpResponse

    from controlplane.content_security import CSPMiddleware

    if nonce_in_policy:
        directives = settings.CONTENT_SECURITY_POLICY["DIRECTIVES"]
        settings.CONTENT_SECURITY_POLICY = {
            "DIRECTIVES": {**directives, "script-src": ["'self'", NONCE]}
        }

    def plain(request):
        return HttpResponse("ok")

    def with_nonce(request):
        return HttpResponse(f"<script nonce='{request.csp_nonce}'></script>")

    def header(middleware, view):
        value = middleware(view)(rf.get("/somewhere/")).headers.get("Content-Security-Policy")
        return None if value is None else re.sub(r"'nonce-[^']+'", "'nonce-N'", value)

    views = {
        "plain": plain,
        "updated": csp_update({"img-src": ["https://cdn.example.org"]})(plain),
        "exempt": csp_exempt()(plain),
        "nonce": with_nonce,
    }
    got = {name: header(CSPMiddleware, view) for name, view in views.items()}
    assert got == {name: header(Library, view) for name, view in views.items()}
    assert got["plain"] == _expected() and got["exempt"] is None
    assert "https://cdn.example.org" in got["updated"]
    assert ("'nonce-N'" in got["nonce"]) is nonce_in_policy
    # Asking for a nonce once the header is written is an error, as with django-csp alone.
    request = rf.get("/somewhere/")
    CSPMiddleware(plain)(request)
    with pytest.raises(Exception, match="not available after the CSP header"):
        str(request.csp_nonce)
