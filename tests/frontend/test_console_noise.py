"""What the console shows a newcomer: one line per refused request, and no favicon 404s."""

import logging

import pytest
from django.urls import reverse

from controlplane.log_filters import ClientErrorsWithoutTraceback

pytestmark = pytest.mark.django_db


@pytest.fixture
def console_lines(monkeypatch):
    """What every logging handler writing to a stream prints, as formatted lines."""
    printed: list[str] = []

    def emit(handler, record):
        printed.append(handler.format(record))

    monkeypatch.setattr(logging.StreamHandler, "emit", emit)
    return printed


def test_a_refused_page_is_one_console_line_without_a_traceback(client, alice, console_lines):
    client.force_login(alice)
    response = client.get(reverse("node-list"))
    assert response.status_code == 403
    forbidden = [line for line in console_lines if "Forbidden" in line]
    assert len(forbidden) == 1, console_lines
    assert "Traceback" not in forbidden[0]


@pytest.mark.parametrize("status,kept", [(403, False), (404, False), (500, True)])
def test_only_server_errors_keep_their_traceback(status, kept):
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        import sys

        record = logging.LogRecord(
            "django.request", logging.ERROR, __file__, 1, "x", None, sys.exc_info()
        )
    record.status_code = status
    assert ClientErrorsWithoutTraceback().filter(record)
    assert (record.exc_info is not None) is kept


def test_the_favicon_browsers_ask_for_is_the_uis_icon(client):
    from django.contrib.staticfiles import finders
    from django.templatetags.static import static

    response = client.get("/favicon.ico")
    assert response.status_code == 302
    assert response["Location"] == static("frontend/favicon.svg")
    with open(finders.find("frontend/favicon.svg"), "rb") as icon:
        assert icon.read().startswith(b"<svg")
    # The pages name the same icon, so no browser asks for /favicon.ico on them.
    page = client.get(reverse("login")).content.decode()
    assert f'<link rel="icon" href="{static("frontend/favicon.svg")}"' in page
