"""A page's message ("Job ... cancelled.") reaches the next page that shows messages, once,
whatever requests come between; requests that never add or show one make no message storage
(controlplane.lazy_messages)."""

import pytest
from django.urls import reverse

from controlplane import lazy_messages

pytestmark = pytest.mark.django_db


@pytest.fixture
def storages_made(monkeypatch):
    made = []
    real = lazy_messages.default_storage
    monkeypatch.setattr(
        lazy_messages, "default_storage", lambda request: made.append(request.path) or real(request)
    )
    return made


def test_a_message_waits_through_other_requests_and_shows_once(
    client, alice, running_job, storages_made
):
    client.force_login(alice)
    detail = reverse("job-detail", args=[running_job.pk])
    cancelled = client.post(reverse("job-cancel", args=[running_job.pk]))
    assert cancelled.status_code == 302 and cancelled["Location"] == detail
    # Requests that never show messages leave it where it is.
    for path in ("/api/v1/", f"/api/v1/jobs/{running_job.pk}/", "/favicon.ico"):
        assert client.get(path).status_code in (200, 301, 302)
    message = f"Job {running_job.name} (#{running_job.pk}) cancelled."
    assert message in client.get(detail).content.decode()
    assert message not in client.get(detail).content.decode()  # shown once
    # The storage was made for the cancel and the two pages, not for the API or the icon.
    assert storages_made == [reverse("job-cancel", args=[running_job.pk]), detail, detail]
