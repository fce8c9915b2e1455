"""Production serves the UI's own CSS and JS from the web process (gunicorn alone serves none)."""

import re

from django.core.management import call_command
from django.test import Client, override_settings

PRODUCTION_STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"},
}


def test_with_debug_off_the_login_pages_stylesheet_is_served_after_collectstatic(db, tmp_path):
    with override_settings(DEBUG=False, STATIC_ROOT=tmp_path, STORAGES=PRODUCTION_STORAGES):
        # The admin's and the API browser's files are left out: this is about the UI's own, and
        # hashing and compressing every file of every app would make the test slow.
        call_command(
            "collectstatic",
            interactive=False,
            verbosity=0,
            ignore_patterns=["admin/*", "rest_framework/*", "drf_spectacular*/*"],
        )
        client = Client()
        login = client.get("/login/")
        assert login.status_code == 200
        (href,) = re.findall(r'<link rel="stylesheet" href="([^"]+)"', login.content.decode())
        # A content-hashed name, so browsers may cache it for good and still see a new release.
        assert re.fullmatch(r"/static/frontend/app\.[0-9a-f]{12}\.css", href), href
        css = client.get(href)
        assert css.status_code == 200
        assert css["Content-Type"].startswith("text/css")
        assert "immutable" in css["Cache-Control"]
        body = b"".join(css.streaming_content)
        assert body == (tmp_path / href.removeprefix("/static/")).read_bytes()
        gzipped = client.get(href, HTTP_ACCEPT_ENCODING="gzip")
        assert gzipped["Content-Encoding"] == "gzip"
