"""Dependencies on the web: the submit form's "Start after" box and the job page's lists."""

import pytest
from django.urls import reverse

from controlplane.jobs.dependencies import DependencySpec
from controlplane.jobs.models import Job, JobDependency

from .test_submit import VALID, error_at

pytestmark = pytest.mark.django_db


@pytest.fixture
def submit(client, alice, node):
    client.force_login(alice)

    def post(depends_on: str):
        return client.post(reverse("job-submit"), {**VALID, "depends_on": depends_on})

    return post


def test_the_form_submits_a_job_that_waits(submit, pending_job):
    response = submit(f"job {pending_job.pk}\nafter job {pending_job.pk} failed")
    assert response.status_code == 302, error_at(response, "depends_on")
    job = Job.objects.exclude(pk=pending_job.pk).get()
    assert job.hold == "dependency"
    assert list(job.dependencies.values_list("on_job_id", "condition")) == [
        (pending_job.pk, "succeeded"),
        (pending_job.pk, "failed"),
    ]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("job", 'Line 1 ("job"): write job 12'),
        ("\njob twelve", "Line 2: Must be the job's id"),
        ("job 999999999", "Line 1: No job 999999999 in this tenant"),
        ("job {id} maybe", "Line 1: Must be one of succeeded, failed, finished"),
        ("job {id}\n\njob {id}", "Line 3: The same dependency as depends_on[0].job"),
    ],
)
def test_a_bad_line_is_named_at_the_box_and_nothing_is_created(submit, pending_job, text, words):
    before = (Job.objects.count(), JobDependency.objects.count())
    response = submit(text.format(id=pending_job.pk))
    assert response.status_code == 400
    assert words in error_at(response, "depends_on"), response.context["form"].errors
    assert set(response.context["form"].errors) == {"depends_on"}
    assert (Job.objects.count(), JobDependency.objects.count()) == before


def test_the_job_page_lists_what_it_waits_for_and_what_waits_for_it(
    client, alice, make_job, vision, pending_job
):
    waiting = make_job(
        vision, alice, name="evaluate", depends_on=[DependencySpec("failed", pending_job.pk)]
    )
    client.force_login(alice)
    page = client.get(reverse("job-detail", args=[waiting.pk])).content.decode()
    assert f'href="{reverse("job-detail", args=[pending_job.pk])}"' in page
    assert f"waiting for job {pending_job.pk} to fail" in page
    assert "Waiting for its dependencies: the scheduler does not consider it" in page
    assert "Queue position" not in page
    upstream = client.get(reverse("job-detail", args=[pending_job.pk])).content.decode()
    assert "1 job waits for this one" in upstream
    assert f'href="{reverse("job-detail", args=[waiting.pk])}"' in upstream
