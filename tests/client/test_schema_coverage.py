"""The SDK keeps up with the API: every operation of the live /api/schema/ has an SDK call.

The schema is the server's own, generated now from its code (not a copy kept here), so an
endpoint added to the API fails this test until the SDK covers it or it is listed below with
the reason it is left out.
"""

import re

import pytest
from gpucp.client import OPERATIONS

# (METHOD, path) the SDK leaves out on purpose, each with why.
LEFT_OUT = {
    # None yet: every operation is covered.
}


def operations_of(schema: dict) -> set[tuple[str, str]]:
    found = set()
    for path, methods in schema["paths"].items():
        for method in methods:
            if method in ("get", "post", "put", "patch", "delete"):
                found.add((method.upper(), re.sub(r"\{[^}]+\}", "{}", path)))
    return found


@pytest.fixture
def schema(client):
    response = client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    return response.json()


@pytest.mark.django_db
def test_every_operation_of_the_api_has_an_sdk_call(schema):
    served = operations_of(schema)
    assert len(served) > 50  # the real schema, not an empty one
    missing = served - set(OPERATIONS) - set(LEFT_OUT)
    assert not missing, f"the SDK has no call for {sorted(missing)}: add one to gpucp.client"


@pytest.mark.django_db
def test_every_sdk_call_names_an_operation_the_api_serves(schema):
    served = operations_of(schema)
    # Arrays are built alongside the SDK; until their endpoints are served, only they may be
    # absent. Any other path the API does not serve is a typo in the SDK.
    unknown = {op for op in set(OPERATIONS) - served if not op[1].startswith("/api/v1/arrays/")}
    assert not unknown, f"the SDK calls operations the API does not serve: {sorted(unknown)}"
    assert not set(LEFT_OUT) & set(OPERATIONS), "an operation both covered and left out"
