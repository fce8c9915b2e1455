"""Job arrays in the web UI: submitted from the job form, followed on their page, cancelled."""

import re

import pytest
from django.urls import reverse

from controlplane.jobs.models import Hold, Job, JobArray, JobState
from tests.frontend.test_submit import VALID, error_at

pytestmark = pytest.mark.django_db


@pytest.fixture
def submit(client, alice, node):
    client.force_login(alice)

    def post(**changes):
        data = {**VALID, "gpus": "1", **changes}
        return client.post(reverse("job-submit"), {k: v for k, v in data.items() if v is not None})

    return post


def test_the_job_form_submits_an_array_and_shows_its_page(client, submit):
    response = submit(
        array="0-11", max_parallel="3", command="python sweep.py --point {{array_index}}"
    )
    array = JobArray.objects.get()
    assert response.status_code == 302
    assert response["Location"] == reverse("array-detail", args=[array.pk])
    tasks = list(Job.objects.filter(array=array).order_by("array_index"))
    assert [t.command[-1] for t in tasks] == [str(i) for i in range(12)]
    assert [t.hold for t in tasks].count(Hold.ARRAY) == 9

    page = client.get(response["Location"]).content.decode()
    assert "0 succeeded · 0 failed · 0 cancelled · 0 running · 3 pending · 9 held" in page
    # Its tasks are listed and linked; each task's page links back to the array.
    for task in tasks:
        assert reverse("job-detail", args=[task.pk]) in page
    job_page = client.get(reverse("job-detail", args=[tasks[5].pk])).content.decode()
    assert f'href="{reverse("array-detail", args=[array.pk])}"' in job_page
    assert "Waiting for a slot" in job_page
    listed = client.get(reverse("array-list")).content.decode()
    assert reverse("array-detail", args=[array.pk]) in listed


@pytest.mark.parametrize(
    "changes, field, words",
    [
        ({"array": "5-1"}, "array", "ends before it starts"),
        ({"array": "0-5000"}, "array", "At most 1000 tasks"),
        ({"array": "1,1"}, "array", "more than once"),
        ({"array": "0-3", "max_parallel": "9"}, "max_parallel", "between 1 and the array's size"),
        ({"array": "0-3", "max_parallel": "0"}, "max_parallel", "between 1 and the array's size"),
    ],
)
def test_array_errors_are_shown_at_their_field_and_nothing_is_written(
    submit, changes, field, words
):
    response = submit(**changes)
    assert response.status_code == 400
    assert words in error_at(response, field)
    assert not JobArray.objects.exists() and not Job.objects.exists()


def test_the_array_page_pages_its_tasks(client, submit):
    submit(array="120")
    array = JobArray.objects.get()
    first = client.get(reverse("array-detail", args=[array.pk])).content.decode()
    second = client.get(reverse("array-detail", args=[array.pk]) + "?page=3").content.decode()
    assert "Tasks 1–50 of 120" in first and "Tasks 101–120 of 120" in second
    assert re.search(r'<td class="num">119</td>', second)
    assert not re.search(r'<td class="num">119</td>', first)


def test_cancelling_an_array_asks_first_then_cancels_the_unfinished_tasks(client, submit):
    submit(array="4", max_parallel="1")
    array = JobArray.objects.get()
    url = reverse("array-cancel", args=[array.pk])
    page = client.get(reverse("array-detail", args=[array.pk])).content.decode()
    assert url in page
    confirm = client.get(url)
    assert confirm.status_code == 200 and "Yes, cancel the array" in confirm.content.decode()
    assert not Job.objects.filter(state=JobState.CANCELLED).exists()
    response = client.post(url)
    assert response.status_code == 302
    assert set(Job.objects.values_list("state", flat=True)) == {JobState.CANCELLED}
    after = client.get(reverse("array-detail", args=[array.pk])).content.decode()
    assert "Progress: cancelled" in after and url not in after


def test_a_viewer_sees_an_array_but_cannot_cancel_it(client, submit, vision_viewer):
    submit(array="2")
    array = JobArray.objects.get()
    client.force_login(vision_viewer)
    page = client.get(reverse("array-detail", args=[array.pk])).content.decode()
    assert reverse("array-cancel", args=[array.pk]) not in page
    assert client.post(reverse("array-cancel", args=[array.pk])).status_code == 403
    assert set(Job.objects.values_list("state", flat=True)) == {JobState.PENDING}


def test_a_cluster_admin_sets_a_tenants_array_limit_in_the_tenant_form(
    client, cluster_admin, vision, settings
):
    client.force_login(cluster_admin)
    url = reverse("manage-tenant", args=["vision"])
    form = {"slug": "vision", "name": "Vision lab", "weight": "1", "active": "on"}
    too_big = client.post(url, {**form, "max_array_size": str(settings.MAX_ARRAY_SIZE_CEILING + 1)})
    assert too_big.status_code == 400
    assert "MAX_ARRAY_SIZE_CEILING" in error_at(too_big, "max_array_size")
    vision.refresh_from_db()
    assert vision.max_array_size == 1000
    assert client.post(url, {**form, "max_array_size": "64"}).status_code == 302
    vision.refresh_from_db()
    assert vision.max_array_size == 64
