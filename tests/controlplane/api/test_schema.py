"""The OpenAPI schema: generated without a warning, valid, and listing every endpoint."""

import pytest
import yaml
from django.core.management import call_command
from drf_spectacular.drainage import GENERATOR_STATS

from controlplane.api_urls import router


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
    body_ref = submit["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    body = schema["components"]["schemas"][body_ref.rsplit("/", 1)[-1]]
    assert {"image", "command", "env", "gpus", "gpu_type", "priority"} <= set(body["properties"])
    logs = schema["paths"]["/api/v1/jobs/{id}/logs/"]["get"]
    assert {p["name"] for p in logs["parameters"]} >= {"id", "tail", "attempt"}
    assert "409" in schema["paths"]["/api/v1/jobs/{id}/cancel/"]["post"]["responses"]


def test_the_interactive_docs_are_served(client):
    assert client.get("/api/docs/").status_code == 200
    assert client.get("/api/schema/").status_code == 200
