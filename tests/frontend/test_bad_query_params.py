"""Bad input on the web UI's pages: a 400 page that says what is wrong, never a 500.

A NUL character in any parameter of any page (the database cannot hold or search for it) is
refused before the page runs; the job list's filters refuse values they cannot use, in place.
Pages are read from the URL conf, so a page added later is covered too.
"""

from __future__ import annotations

import html
import re

import pytest
from django.apps import apps
from django.urls import URLPattern, URLResolver, reverse
from django.urls.converters import IntConverter, SlugConverter

import frontend.urls

EXAMPLE_VALUES = {IntConverter: "1", SlugConverter: "vision"}


def pages(patterns=frontend.urls.urlpatterns, prefix="/"):
    """Every page of the web UI as a concrete path (ids and names need not exist)."""
    for entry in patterns:
        if isinstance(entry, URLResolver):
            yield from pages(entry.url_patterns, prefix + str(entry.pattern))
            continue
        assert isinstance(entry, URLPattern)
        route = str(entry.pattern)
        for name, converter in entry.pattern.converters.items():
            value = EXAMPLE_VALUES.get(type(converter), "gpu-node-01")
            route = re.sub(rf"<(\w+:)?{name}>", value, route)
        yield prefix + route


PAGES = sorted(set(pages()))


def database_rows() -> dict:
    rows = {}
    for label in ("tenancy", "cluster", "jobs", "scheduling"):
        for model in apps.get_app_config(label).get_models():
            rows[model._meta.label] = sorted(map(repr, model.objects.values_list()))
    return rows


def text_of(response) -> str:
    return html.unescape(re.sub(r"<[^>]+>", " ", response.content.decode()))


@pytest.fixture
def admin_client(client, cluster_admin, running_job):
    client.force_login(cluster_admin)
    return client


def test_the_pages_are_found():
    assert len(PAGES) > 20
    assert "/jobs/" in PAGES and "/manage/tenants/vision/" in PAGES


@pytest.mark.parametrize("page", PAGES)
def test_a_nul_in_a_query_parameter_of_any_page_is_a_400_naming_it(admin_client, page):
    before = database_rows()
    response = admin_client.get(page, {"name": "a\x00b"})
    assert response.status_code == 400
    assert re.search(r"name\s*:\s*Contains a NUL character", text_of(response))
    assert database_rows() == before


@pytest.mark.parametrize("page", PAGES)
def test_a_nul_in_a_form_posted_to_any_page_is_a_400_and_writes_nothing(admin_client, page):
    before = database_rows()
    response = admin_client.post(page, {"name": "a\x00b", "tenant": "vision", "user": "bob"})
    assert response.status_code == 400
    assert "NUL character" in text_of(response)
    assert database_rows() == before


def test_a_nul_in_a_parameter_name_is_refused_too(admin_client):
    response = admin_client.get("/jobs/?na%00me=x")
    assert response.status_code == 400
    assert "NUL character" in text_of(response)


@pytest.mark.parametrize("field", ["name", "tenant", "user"])
def test_the_job_list_filters_named_in_the_issue_are_refused_not_a_500(admin_client, field):
    response = admin_client.get(f"/jobs/?{field}=%00")
    assert response.status_code == 400
    assert field in text_of(response)


@pytest.mark.parametrize(
    ("query", "field", "says"),
    [
        ("state=SLEEPING", "state", "not one of the available choices"),
        ("sort=password", "sort", "not one of the available choices"),
        ("tenant=not a slug", "tenant", "valid “slug”"),
        ("name=" + "x" * 201, "name", "at most 200 characters"),
    ],
)
def test_a_job_list_filter_it_cannot_use_is_an_error_on_the_page(admin_client, query, field, says):
    response = admin_client.get(f"/jobs/?{query}")
    assert response.status_code == 400
    text = " ".join(text_of(response).split())
    assert "These filters cannot be applied" in text
    assert re.search(rf"{field}\s*:[^:]*{re.escape(says)}", text), text
    # No list that would look like the answer to the filter.
    assert "resnet" not in text


def test_valid_job_list_filters_still_filter(admin_client, running_job):
    response = admin_client.get("/jobs/?state=RUNNING&tenant=vision&user=alice&sort=-name")
    assert response.status_code == 200
    assert "resnet" in text_of(response)
    assert admin_client.get("/jobs/?state=active").status_code == 200


def test_a_page_for_a_name_with_a_nul_is_not_found(admin_client):
    assert admin_client.get("/cluster/nodes/gpu%00node/").status_code == 404


@pytest.mark.parametrize("value", ["²", "٣", "99999999999999999999999", "-1", "1.0", ""])
def test_ids_and_numbers_in_the_query_that_are_not_plain_digits_are_ignored(
    admin_client, running_job, value
):
    assert admin_client.get(reverse("job-submit"), {"copy": value}).status_code == 200
    log = admin_client.get(reverse("job-log", args=[running_job.pk]), {"attempt": value})
    assert log.status_code == 200


def test_a_pool_form_naming_no_pool_is_not_found(admin_client):
    assert admin_client.post(reverse("manage-pools"), {"pool": "abc"}).status_code == 404


def test_a_member_added_by_a_name_with_a_nul_is_refused_and_nobody_is_added(admin_client):
    from controlplane.tenancy.models import Membership

    before = Membership.objects.count()
    response = admin_client.post(
        reverse("tenant-members", args=["vision"]), {"user": "bob\x00", "role": "member"}
    )
    assert response.status_code == 400
    assert Membership.objects.count() == before


def test_a_job_submitted_to_a_tenant_with_a_nul_is_refused_and_nothing_is_created(
    client, alice, node
):
    from controlplane.jobs.models import Job

    client.force_login(alice)
    response = client.post(
        reverse("job-submit"),
        {"tenant": "vision\x00", "image": "registry.local/a/b:1", "command": "python x.py"},
    )
    assert response.status_code == 400
    assert not Job.objects.exists()


def test_the_forms_refuse_unstorable_text_even_without_the_page_boundary(alice, vision, node):
    """The forms check text themselves, so code that fills them outside a request is safe."""
    from frontend.forms import JobSubmitForm, MembershipForm

    job = JobSubmitForm(
        {"tenant": "vi\x00sion", "image": "registry.local/a/b:1", "command": "x"},
        user=alice,
        tenants=[vision],
    )
    assert not job.is_valid()
    assert "tenant" in job.errors
    member = MembershipForm({"user": "bob\ud800", "role": "member"}, tenant=vision)
    assert not member.is_valid()
    assert "user" in member.errors
