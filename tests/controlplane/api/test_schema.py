"""The OpenAPI schema: generated without a warning, valid, and listing every endpoint."""

import re

import pytest
import yaml
from django.core.exceptions import ValidationError as DjangoValidationError
from django.core.management import call_command
from drf_spectacular.drainage import GENERATOR_STATS
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from controlplane.api_urls import router
from controlplane.jobs import validation
from controlplane.jobs.api.views import MAX_BATCH_JOBS


@pytest.fixture(scope="module")
def schema(tmp_path_factory):
    GENERATOR_STATS.reset()
    path = tmp_path_factory.mktemp("openapi") / "schema.yaml"
    # --fail-on-warn raises on any warning or error; --validate checks it against OpenAPI 3.
    call_command("spectacular", "--fail-on-warn", "--validate", "--file", str(path))
    return yaml.safe_load(path.read_text())


def test_the_schema_generates_without_warnings_and_is_valid(schema):
    assert schema["openapi"].startswith("3.")
    assert schema["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"


def test_every_endpoint_and_method_is_in_the_schema(schema):
    paths = schema["paths"]
    expected = []
    for prefix, viewset, _ in router.registry:
        for route in router.get_routes(viewset):
            methods = [m for m, a in route.mapping.items() if hasattr(viewset, a)]
            if not methods:
                continue
            lookup = getattr(viewset, "lookup_url_kwarg", None) or viewset.lookup_field
            lookup = "id" if lookup == "pk" else lookup  # drf-spectacular's SCHEMA_COERCE_PATH_PK
            url = route.url.replace("^", "").replace("$", "").replace("{prefix}", prefix)
            url = url.replace("{lookup}", "{" + lookup + "}").replace("{trailing_slash}", "/")
            url = "/api/v1/" + url.replace("{url_path}", route.initkwargs.get("url_path", ""))
            expected.extend((url, m) for m in methods)
    assert len(expected) > 40
    missing = [(url, m) for url, m in expected if m not in paths.get(url, {})]
    assert missing == []
    for url in (
        "/api/v1/accounting/usage/",
        "/api/v1/jobs/{id}/cancel/",
        "/api/v1/jobs/{id}/logs/",
    ):
        assert url in paths


def test_the_submit_body_and_the_logs_answer_are_described(schema):
    submit = schema["paths"]["/api/v1/jobs/"]["post"]
    schemas = schema["components"]["schemas"]

    def resolved(ref_or_schema):
        ref = ref_or_schema.get("$ref")
        return schemas[ref.rsplit("/", 1)[-1]] if ref else ref_or_schema

    one, many = resolved(submit["requestBody"]["content"]["application/json"]["schema"])["oneOf"]
    body = resolved(one)
    assert {"image", "command", "env", "gpus", "gpu_type", "priority"} <= set(body["properties"])
    # Or a list of such bodies; the answer is one job or a list of them.
    assert many["type"] == "array" and resolved(many["items"]) == body
    assert str(MAX_BATCH_JOBS) in submit["description"]
    created = resolved(submit["responses"]["201"]["content"]["application/json"]["schema"])
    assert [resolved(created["oneOf"][0]), created["oneOf"][1]["type"]] == [
        schemas["JobDetail"],
        "array",
    ]
    logs = schema["paths"]["/api/v1/jobs/{id}/logs/"]["get"]
    assert {p["name"] for p in logs["parameters"]} >= {"id", "tail", "attempt"}
    assert "409" in schema["paths"]["/api/v1/jobs/{id}/cancel/"]["post"]["responses"]


def test_the_interactive_docs_are_served(client):
    assert client.get("/api/docs/").status_code == 200
    assert client.get("/api/schema/").status_code == 200


def _error_codes(operation) -> set[str]:
    return {code for code in operation["responses"] if code.startswith(("4", "5"))}


def test_every_operation_declares_the_errors_every_endpoint_can_give(schema):
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            # Bad parameters or body, no or a dead token, and the rate limits apply everywhere.
            assert {"400", "401", "429"} <= _error_codes(operation), (method, path)
            if "{" in path:
                assert "404" in _error_codes(operation), (method, path)
            if method != "get":
                assert "403" in _error_codes(operation), (method, path)


def test_admin_only_reads_declare_403_and_reads_anyone_may_make_do_not(schema):
    assert "403" in _error_codes(schema["paths"]["/api/v1/join-tokens/"]["get"])
    assert "403" not in _error_codes(schema["paths"]["/api/v1/pools/"]["get"])
    assert "409" in _error_codes(schema["paths"]["/api/v1/jobs/{id}/cancel/"]["post"])
    assert "409" in _error_codes(schema["paths"]["/api/v1/pools/{name}/"]["delete"])


def test_the_schema_states_the_image_reference_rule(schema):
    image = schema["components"]["schemas"]["JobSubmitRequest"]["properties"]["image"]
    assert image["pattern"] == validation.IMAGE_PATTERN


@settings(max_examples=80, deadline=None, database=None)
@given(st.from_regex(validation.IMAGE_PATTERN, fullmatch=True))
def test_every_image_the_schema_pattern_allows_is_accepted(image):
    assume(len(image) <= validation.MAX_IMAGE_CHARS)
    assert validation.clean_image(image) == image


@settings(max_examples=150, deadline=None, database=None)
@given(
    st.text(alphabet="abcAZ09.:/@_-é\n ", max_size=40)
    | st.from_regex(validation.IMAGE_PATTERN, fullmatch=True).map(lambda s: s[:-1])
)
def test_what_the_schema_pattern_refuses_validation_refuses(candidate):
    in_schema = (
        re.fullmatch(validation.IMAGE_PATTERN.strip("^$"), candidate) is not None
        and len(candidate) <= validation.MAX_IMAGE_CHARS  # the schema's maxLength
    )
    try:
        validation.clean_image(candidate)
        accepted = True
    except DjangoValidationError:
        accepted = False
    assert accepted == in_schema, candidate


@pytest.mark.parametrize(
    "image, ok",
    [
        ("docker.io/library/python:3.12", True),
        ("localhost/train:1", True),
        ("registry:5000/team/train@sha256:" + "a" * 64, True),
        ("registry/team/train:1", False),  # no registry host
        ("docker.io/library/python", False),  # no tag or digest
        ("docker.io/library/python:é", False),  # tags are ASCII
    ],
)
def test_image_references_at_the_edges(image, ok):
    assert (re.fullmatch(validation.IMAGE_PATTERN.strip("^$"), image) is not None) == ok
