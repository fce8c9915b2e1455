"""While PostgreSQL cannot be reached the API answers 503 with Retry-After, and pages a 503 page:
never a 500, which says a bug. The outage is real: the connection goes to a port where nothing
listens, so psycopg's own connection refusal is what the views meet."""

import socket

import pytest
from django.db import connection
from django.test import Client
from rest_framework.test import APIClient

from controlplane.tenancy.models import ApiToken

pytestmark = pytest.mark.django_db(transaction=True)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


class _DatabaseDown:
    def __enter__(self):
        self.saved = {k: connection.settings_dict.get(k) for k in ("HOST", "PORT")}
        connection.close()
        connection.settings_dict.update(HOST="127.0.0.1", PORT=str(_closed_port()))

    def __exit__(self, *exc):
        connection.close()
        connection.settings_dict.update(self.saved)


def test_the_api_answers_503_with_retry_after_and_then_works_again(alice, vision):
    if connection.vendor != "postgresql":
        pytest.skip("the outage is of a PostgreSQL server")
    _, raw = ApiToken.issue(alice, "ci")
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    body = {"image": "registry.example.org/train:1", "command": ["true"], "gpus": 0}
    browser = Client()
    browser.force_login(alice)

    with _DatabaseDown():
        answers = [api.get("/api/v1/jobs/"), api.post("/api/v1/jobs/", body, format="json")]
        page = browser.get("/")

    for answer in answers:
        assert answer.status_code == 503, answer.content
        assert answer["Retry-After"] == "5"
        assert "database cannot be reached" in answer.json()["detail"]
    assert page.status_code == 503 and page["Retry-After"] == "5"
    # Nothing was written, and the next request after the outage is served.
    assert api.get("/api/v1/jobs/").json()["count"] == 0
    assert api.post("/api/v1/jobs/", body, format="json").status_code == 201


def test_a_bug_in_the_database_layer_is_still_a_500(alice, monkeypatch):
    """Only unreachability and its kin are 503s: an IntegrityError nobody caught is a bug."""
    from django.db import IntegrityError

    from controlplane.jobs.api import views

    def broken(*args, **kwargs):
        raise IntegrityError("duplicate key value violates unique constraint")

    monkeypatch.setattr(views.JobViewSet, "list", broken)
    _, raw = ApiToken.issue(alice, "ci")
    api = APIClient(raise_request_exception=False)
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    assert api.get("/api/v1/jobs/").status_code == 500
