"""Bad input at the edge of the user API: a 400 naming the field or parameter, nothing written.

Every operation is read from the OpenAPI schema the API publishes, so an endpoint added later is
covered without touching this file. Sent through the real HTTP stack (APIClient, PostgreSQL):
- bodies with NUL or a lone surrogate (the raw JSON escape "\\ud800") in a value or a key,
  JSON nested thousands of levels deep, NaN / Infinity, numbers no column holds, far dates;
- query parameters the schema does not declare, repeated, with NUL, and limit / offset /
  ordering / date / yes-no values out of range.
"""

from __future__ import annotations

import datetime as dt
import json

import pytest
from django.apps import apps
from drf_spectacular.generators import SchemaGenerator

from controlplane.filters import FilterSet
from controlplane.pagination import MAX_PAGE_SIZE
from controlplane.parsers import MAX_JSON_DEPTH
from tests.controlplane.api.helpers import job_body

SCHEMA = SchemaGenerator().get_schema(request=None, public=True)
COMPONENTS = SCHEMA["components"]["schemas"]
OPERATIONS = [
    (path, method.upper(), operation)
    for path, methods in sorted(SCHEMA["paths"].items())
    for method, operation in sorted(methods.items())
    if path.startswith("/api/v1/")
]


def op_id(path: str, method: str) -> str:
    return f"{method} {path}"


def query_parameters(operation) -> dict[str, dict]:
    return {p["name"]: p for p in operation.get("parameters", ()) if p["in"] == "query"}


def body_properties(operation) -> dict[str, dict]:
    schema = operation["requestBody"]["content"]["application/json"]["schema"]
    if "$ref" in schema:
        schema = COMPONENTS[schema["$ref"].rsplit("/", 1)[-1]]
    return schema.get("properties", {})


BODY_OPERATIONS = [(p, m, o) for p, m, o in OPERATIONS if "requestBody" in o]
LIST_OPERATIONS = [(p, m, o) for p, m, o in OPERATIONS if query_parameters(o)]


def params_of(kind):
    """(operation, parameter) pairs whose schema is of the given kind."""
    return [
        pytest.param(path, method, name, id=f"{method} {path} {name}")
        for path, method, operation in LIST_OPERATIONS
        for name, parameter in query_parameters(operation).items()
        if kind(parameter)
    ]


def fields_of(kind):
    return [
        pytest.param(path, method, name, id=f"{method} {path} {name}")
        for path, method, operation in BODY_OPERATIONS
        for name, prop in body_properties(operation).items()
        if not prop.get("readOnly") and kind(prop)
    ]


# --- the world's objects, addressed as the schema's paths name them ----------------------------


@pytest.fixture
def admin(world):
    """A cluster admin (sees and may change everything) in a world with one of each object."""
    from controlplane.cluster.models import GpuClaimConflict
    from controlplane.tenancy.models import ApiToken

    world.ensure("vision_job", "vision_quota", "vision_budget", "carol_membership", "join_token")
    world.ensure("spare_pool", "vision_volume")
    ApiToken.issue(world.users["cluster_admin"], "automation")
    GpuClaimConflict.objects.create(
        gpu_uuid=f"GPU-{world.node.name}-0",
        claimant="intruder.example",
        holder=world.node,
        holder_name=world.node.name,
        reason="listed a GPU another node holds",
    )
    return world.client("cluster_admin")


def concrete(client, template: str) -> str | None:
    """The template with its path parameter filled from the first object its list shows."""
    if "{" not in template:
        return template
    head, rest = template.split("{", 1)
    key, tail = rest.split("}", 1)
    listed = client.get(head)
    results = listed.json().get("results", []) if listed.status_code == 200 else []
    if not results or key not in results[0]:
        return None
    return f"{head}{results[0][key]}{tail}"


def url_for(client, template: str) -> str:
    url = concrete(client, template)
    if url is None:
        pytest.skip(f"no object to address {template} with in this world")
    return url


def database_rows() -> dict:
    """Every row of every model of the control plane: what "nothing was written" compares."""
    rows = {}
    for label in ("tenancy", "cluster", "jobs", "scheduling", "storage"):
        for model in apps.get_app_config(label).get_models():
            rows[model._meta.label] = sorted(map(repr, model.objects.values_list()))
    return rows


# A body each write accepts as it is, so that the one field a test spoils is the only fault. A
# write the schema gains later fails test_every_write_has_a_valid_body_here until it has one.
CREATE_BODIES = {
    "/api/v1/api-tokens/": {"name": "ci"},
    "/api/v1/budgets/": {"tenant": "vision", "kind": "gpu_hours", "period": "month", "amount": 9},
    "/api/v1/invitations/": {"tenant": "vision", "invitee": "dora", "role": "member"},
    "/api/v1/jobs/": job_body(),
    "/api/v1/arrays/": job_body(array="0-2", max_parallel=2),
    "/api/v1/join-tokens/": {"pool": "default"},
    "/api/v1/memberships/": {"tenant": "vision", "user": "bob", "role": "viewer"},
    "/api/v1/pools/": {"name": "extra", "power_budget_w": 1000.0},
    "/api/v1/quotas/": {
        "tenant": "vision",
        "gpu_type": "A100-SXM4-80GB",
        "guaranteed_gpus": 1,
        "limit_gpus": 2,
    },
    "/api/v1/tenants/": {"slug": "extra", "name": "Extra lab"},
    "/api/v1/volumes/": {"name": "extra", "source": "/mnt/extra", "tenants": ["vision"]},
    "/api/v1/gpu-claim-conflicts/{id}/resolve/": {"resolution": "dismissed"},
}


def valid_body(client, path: str, method: str, url: str) -> dict:
    if method == "PATCH":
        return {}
    if method == "PUT":  # the object as it is, its writable fields
        current = client.get(url).json()
        writable = body_properties(SCHEMA["paths"][path]["put"])
        return {k: v for k, v in current.items() if k in writable}
    return dict(CREATE_BODIES[path])


def raw_body(body: dict, field: str, literal: str) -> str:
    """The body as JSON text with `field` set to a literal JSON cannot write from Python."""
    marker = '"@@literal@@"'
    return json.dumps({**body, field: "@@literal@@"}).replace(marker, literal, 1)


def send(client, method: str, url: str, raw: str, content_type="application/json"):
    return client.generic(method, url, raw.encode("utf-8"), content_type=content_type)


def assert_refused(response, field: str):
    assert response.status_code == 400, (response.status_code, response.content[:300])
    assert field in response.json(), response.json()


# --- bodies -------------------------------------------------------------------------------------


def a_string_field(operation) -> str:
    properties = body_properties(operation)
    strings = [n for n, p in properties.items() if p.get("type") == "string"]
    return (strings or sorted(properties) or ["name"])[0]


BODY_IDS = [op_id(p, m) for p, m, _ in BODY_OPERATIONS]


def test_every_write_has_a_valid_body_here_and_it_is_accepted(admin):
    """The bodies the tests below spoil one field of are valid as they are."""
    for path, method, _ in BODY_OPERATIONS:
        if method != "POST":
            continue
        assert path in CREATE_BODIES, f"add a valid body for {method} {path} to CREATE_BODIES"
        url = concrete(admin, path)
        if url is None:
            continue
        response = admin.post(url, CREATE_BODIES[path], format="json")
        assert response.status_code in (200, 201), (path, response.content[:300])


UNSTORABLE_JSON_STRINGS = {
    "nul": '"vision\\u0000"',
    "lone high surrogate": '"\\ud800"',
    "lone low surrogate": '"x\\udfffy"',
    "surrogate pair reversed": '"\\udc00\\ud800"',
}


@pytest.mark.parametrize("problem", list(UNSTORABLE_JSON_STRINGS))
@pytest.mark.parametrize(("path", "method", "operation"), BODY_OPERATIONS, ids=BODY_IDS)
def test_text_the_database_cannot_hold_is_refused_naming_the_field(
    admin, path, method, operation, problem
):
    url = url_for(admin, path)
    body = valid_body(admin, path, method, url)
    before = database_rows()
    for field in body_properties(operation):
        raw = raw_body(body, field, UNSTORABLE_JSON_STRINGS[problem])
        assert_refused(send(admin, method, url, raw), field)
    assert database_rows() == before


@pytest.mark.parametrize(("path", "method", "operation"), BODY_OPERATIONS, ids=BODY_IDS)
def test_unstorable_text_in_a_form_post_is_refused_too(admin, path, method, operation):
    url = url_for(admin, path)
    field = a_string_field(operation)
    before = database_rows()
    response = send(
        admin, method, url, f"{field}=a%00b", content_type="application/x-www-form-urlencoded"
    )
    assert_refused(response, field)
    assert database_rows() == before


@pytest.mark.parametrize(
    ("literal", "field", "says"),
    [
        ('["python", "a\\u0000b"]', "command", "command[1]"),
        ('["python", "\\ud83d"]', "command", "command[1]"),
        ('{"EPOCHS": "\\udead"}', "env", "env.EPOCHS"),
        ('{"A\\ud800": "1"}', "env", "key"),
        ('"vi\\u0000sion"', "tenant", "NUL"),
    ],
)
def test_a_job_submit_names_where_inside_a_field_the_bad_text_is(admin, literal, field, says):
    before = database_rows()
    response = send(admin, "POST", "/api/v1/jobs/", raw_body(job_body(), field, literal))
    assert_refused(response, field)
    assert says in " ".join(response.json()[field])
    assert database_rows() == before


def test_a_bad_field_name_is_refused_as_a_whole(admin):
    response = send(admin, "POST", "/api/v1/jobs/", '{"n\\u0000ame": "x"}')
    assert_refused(response, "non_field_errors")
    assert "field name" in response.json()["non_field_errors"][0]


def test_the_tenant_slug_is_checked_before_it_is_looked_up(world):
    """A NUL in the tenant of a create was a 500: the slug went to the database first."""
    world.ensure("users")
    before = database_rows()
    for role, url in [
        ("member", "/api/v1/jobs/"),
        ("tenant_admin", "/api/v1/memberships/"),
        ("cluster_admin", "/api/v1/quotas/"),
        ("cluster_admin", "/api/v1/budgets/"),
    ]:
        raw = raw_body(CREATE_BODIES[url], "tenant", '"vision\\u0000"')
        assert_refused(send(world.client(role), "POST", url, raw), "tenant")
    assert database_rows() == before


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH + 1, 5000, 100_000])
@pytest.mark.parametrize(("path", "method", "operation"), BODY_OPERATIONS, ids=BODY_IDS)
def test_json_nested_too_deep_is_refused_naming_the_field(admin, path, method, operation, levels):
    url = url_for(admin, path)
    body = valid_body(admin, path, method, url)
    field = a_string_field(operation)
    before = database_rows()
    response = send(admin, method, url, raw_body(body, field, "[" * levels + "]" * levels))
    assert_refused(response, field)
    assert "levels" in response.json()[field][0]
    assert database_rows() == before


def test_json_nested_deep_at_the_top_is_refused_as_a_whole(admin):
    response = send(admin, "POST", "/api/v1/jobs/", "[" * 5000 + "]" * 5000)
    assert_refused(response, "non_field_errors")


def test_nesting_within_the_limit_reaches_the_fields_own_rules(admin):
    depth = MAX_JSON_DEPTH - 1  # the body object is the first level
    command = "[" * depth + "]" * depth
    response = send(admin, "POST", "/api/v1/jobs/", raw_body(job_body(), "command", command))
    assert_refused(response, "command")
    assert "levels" not in " ".join(response.json()["command"])


def is_number(prop) -> bool:
    return prop.get("type") in ("integer", "number")


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400", "-1e999"])
@pytest.mark.parametrize(("path", "method", "field"), fields_of(is_number))
def test_non_finite_numbers_are_refused_naming_the_field(admin, path, method, field, literal):
    url = url_for(admin, path)
    body = valid_body(admin, path, method, url)
    before = database_rows()
    assert_refused(send(admin, method, url, raw_body(body, field, literal)), field)
    assert database_rows() == before


@pytest.mark.parametrize(
    "literal", [str(10**30), str(-(10**30)), str(2**63), str(-(2**63) - 1), "9" * 5000]
)
@pytest.mark.parametrize(("path", "method", "field"), fields_of(is_number))
def test_numbers_no_column_holds_are_refused_naming_the_field(admin, path, method, field, literal):
    url = url_for(admin, path)
    body = valid_body(admin, path, method, url)
    before = database_rows()
    assert_refused(send(admin, method, url, raw_body(body, field, literal)), field)
    assert database_rows() == before


@pytest.mark.parametrize(("path", "method", "operation"), BODY_OPERATIONS, ids=BODY_IDS)
def test_any_field_given_nan_or_a_number_past_64_bits_is_refused_naming_it(
    admin, path, method, operation
):
    """Whatever the field's type (e.g. priority: -10**30): the parser names it."""
    url = url_for(admin, path)
    body = valid_body(admin, path, method, url)
    before = database_rows()
    for field in body_properties(operation):
        for literal in ("NaN", str(-(10**30))):
            assert_refused(send(admin, method, url, raw_body(body, field, literal)), field)
    assert database_rows() == before


# Fields whose sensible values pass 2**31 (byte counts): tested just past their own bound.
WIDE_NUMBER_FIELDS = {"checkpoint_limit_bytes": 10**18}


@pytest.mark.parametrize("value", [2**31, -(2**31) - 1, 2**63 - 1, -(2**63), 1e308, -1e308])
@pytest.mark.parametrize(("path", "method", "field"), fields_of(is_number))
def test_absurd_numbers_within_64_bits_are_refused_by_the_fields_own_range(
    admin, path, method, field, value
):
    bound = WIDE_NUMBER_FIELDS.get(field)
    if bound is not None and abs(value) <= bound:
        value = bound + 1 if value > 0 else -(bound + 1)
    url = url_for(admin, path)
    body = valid_body(admin, path, method, url)
    before = database_rows()
    assert_refused(send(admin, method, url, json.dumps({**body, field: value})), field)
    assert database_rows() == before


def test_a_job_with_an_absurd_memory_size_is_refused_even_with_no_node_to_compare(world):
    world.ensure("users")  # no node: the cluster-size check has nothing to say
    body = {"tenant": "vision", "image": "registry.local/a/b:1", "command": ["x"], "gpus": 0}
    before = database_rows()
    response = world.client("member").post(
        "/api/v1/jobs/", {**body, "memory_mib": 2**40}, format="json"
    )
    assert_refused(response, "memory_mib")
    assert database_rows() == before


def is_date_time(prop) -> bool:
    return prop.get("format") == "date-time"


@pytest.mark.parametrize(
    "value",
    [
        "9999-12-31T23:59:59-23:59",  # past year 9999 in UTC
        "0001-01-01T00:00:00+23:59",  # before year 1 in UTC
        "9999-12-31T23:59:59Z",
        "9999-12-31",
        "0001-01-01T00:00:00Z",
        "10000-01-01T00:00:00Z",
        "2026-13-45T99:00:00Z",
    ],
)
@pytest.mark.parametrize(("path", "method", "field"), fields_of(is_date_time))
def test_far_dates_in_a_body_are_refused_naming_the_field(admin, path, method, field, value):
    url = url_for(admin, path)
    body = valid_body(admin, path, method, url)
    before = database_rows()
    response = send(admin, method, url, json.dumps({**body, field: value}))
    assert_refused(response, field)
    assert database_rows() == before


def test_a_body_that_is_not_utf8_is_a_400(admin):
    response = admin.generic(
        "POST", "/api/v1/jobs/", b'{"name": "\xff"}', content_type="application/json"
    )
    assert response.status_code == 400


# --- query parameters ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "method", "operation"), OPERATIONS, ids=[op_id(p, m) for p, m, _ in OPERATIONS]
)
def test_a_query_parameter_the_schema_does_not_declare_is_refused_naming_it(
    admin, path, method, operation
):
    url = concrete(admin, path) or path.replace("{", "0").replace("}", "")
    before = database_rows()
    response = admin.generic(method, f"{url}?stat=RUNNING")
    assert_refused(response, "stat")
    assert "Unknown query parameter" in response.json()["stat"][0]
    assert database_rows() == before


@pytest.mark.parametrize(("path", "method", "name"), params_of(lambda p: True))
def test_every_declared_query_parameter_refuses_a_nul(admin, path, method, name):
    response = admin.generic(method, f"{url_for(admin, path)}?{name}=a%00b")
    assert_refused(response, name)


@pytest.mark.parametrize(
    ("path", "method", "name"), params_of(lambda p: p["schema"].get("type") != "array")
)
def test_a_single_valued_query_parameter_given_twice_is_refused(admin, path, method, name):
    response = admin.generic(method, f"{url_for(admin, path)}?{name}=1&{name}=2")
    assert_refused(response, name)


def test_a_repeatable_parameter_may_be_repeated(admin):
    response = admin.get("/api/v1/jobs/?state=PENDING&state=RUNNING")
    assert response.status_code == 200
    assert response.json()["count"] == 1


def is_limit(p) -> bool:
    return p["name"] == "limit"


BAD_LIMITS = ["99999999999999999999", "1000000", str(MAX_PAGE_SIZE + 1), "0", "-1", "abc", "1e3"]
BAD_LIMITS += ["²", "", "1.5", " 5"]


@pytest.mark.parametrize(("path", "method", "name"), params_of(is_limit))
def test_a_limit_outside_one_to_the_page_maximum_is_refused(admin, path, method, name):
    url = url_for(admin, path)
    for raw in BAD_LIMITS:
        if raw == "":
            continue  # empty means the default page
        response = admin.generic(method, url, QUERY_STRING=f"limit={raw}")
        assert_refused(response, "limit")
    page = admin.generic(method, url, QUERY_STRING=f"limit={MAX_PAGE_SIZE}")
    assert page.status_code == 200


@pytest.mark.parametrize(("path", "method", "name"), params_of(is_limit))
def test_an_offset_that_is_not_a_whole_number_in_bigint_range_is_refused(admin, path, method, name):
    url = url_for(admin, path)
    for raw in ["-1", "99999999999999999999", str(2**63), "x", "1e3"]:
        assert_refused(admin.generic(method, url, QUERY_STRING=f"offset={raw}"), "offset")
    past_the_end = admin.generic(method, url, QUERY_STRING=f"offset={2**63 - 1}")
    assert past_the_end.status_code == 200
    assert past_the_end.json()["results"] == []


def test_the_schema_states_the_page_size_range():
    jobs = query_parameters(SCHEMA["paths"]["/api/v1/jobs/"]["get"])
    assert jobs["limit"]["schema"]["minimum"] == 1
    assert jobs["limit"]["schema"]["maximum"] == MAX_PAGE_SIZE
    assert jobs["offset"]["schema"]["minimum"] == 0


def test_no_page_holds_more_than_the_maximum(admin):
    assert admin.get("/api/v1/jobs/").json()["results"]  # a default page without a limit
    response = admin.get(f"/api/v1/jobs/?limit={MAX_PAGE_SIZE * 1000}")
    assert response.status_code == 400


def is_date_time_param(p) -> bool:
    return p["schema"].get("format") == "date-time"


@pytest.mark.parametrize(("path", "method", "name"), params_of(is_date_time_param))
def test_a_date_filter_out_of_range_in_utc_is_refused_naming_it(admin, path, method, name):
    url = url_for(admin, path)
    for raw in [
        "9999-12-31T23:59:59-19:35",
        "0001-01-01T00:00:00%2B19:35",
        "0001-01-01T00:00:00%2B00:01",
        "10000-01-01T00:00:00Z",
        "yesterday",
    ]:
        assert_refused(admin.generic(method, url, QUERY_STRING=f"{name}={raw}"), name)


@pytest.mark.parametrize(("path", "method", "name"), params_of(is_date_time_param))
def test_a_date_filter_with_a_large_utc_offset_inside_the_range_filters(admin, path, method, name):
    """PostgreSQL refuses offsets past 15:59; the filter converts to UTC first."""
    url = url_for(admin, path)
    for raw in ["0890-02-25T11:50:33-19:35", "2026-01-01T00:00:00%2B23:59", "9999-12-31T00:00:00Z"]:
        response = admin.generic(method, url, QUERY_STRING=f"{name}={raw}")
        assert response.status_code == 200, response.content[:300]


def test_date_filters_filter_by_the_moment_not_the_wall_clock(admin):
    from controlplane.jobs.models import Job

    # The instant the job was submitted, written with a -19:35 offset.
    offset = dt.timezone(-dt.timedelta(hours=19, minutes=35))
    instant = Job.objects.get().submitted_at.astimezone(offset).isoformat().replace("+", "%2B")
    assert admin.get(f"/api/v1/jobs/?submitted_after={instant}").json()["count"] == 1
    assert admin.get(f"/api/v1/jobs/?submitted_before={instant}").json()["count"] == 0


@pytest.mark.parametrize(
    ("path", "method", "name"), params_of(lambda p: p["schema"].get("type") == "boolean")
)
def test_a_yes_no_filter_given_anything_else_is_refused(admin, path, method, name):
    url = url_for(admin, path)
    assert_refused(admin.generic(method, url, QUERY_STRING=f"{name}=maybe"), name)
    for raw in ("true", "false"):
        assert admin.generic(method, url, QUERY_STRING=f"{name}={raw}").status_code == 200


def is_ordering(p) -> bool:
    return p["name"] == "ordering"


@pytest.mark.parametrize(("path", "method", "name"), params_of(is_ordering))
def test_every_ordering_the_schema_lists_works_and_no_other(admin, path, method, name):
    url = url_for(admin, path)
    parameter = query_parameters(SCHEMA["paths"][path][method.lower()])[name]
    allowed = parameter["schema"]["items"]["enum"]
    for value in allowed:
        assert admin.generic(method, url, QUERY_STRING=f"ordering={value}").status_code == 200
    both = ",".join(allowed[:2])
    assert admin.generic(method, url, QUERY_STRING=f"ordering={both}").status_code == 200
    for bad in ["bogus", f"{allowed[0]},bogus", "--" + allowed[0], f"{allowed[0]},", "password"]:
        response = admin.generic(method, url, QUERY_STRING=f"ordering={bad}")
        assert_refused(response, "ordering")


@pytest.mark.parametrize("period", ["day", "week", "month"])
@pytest.mark.parametrize("url", ["/api/v1/accounting/usage/", "/api/v1/accounting/usage.csv"])
def test_usage_for_a_period_past_the_calendar_is_refused_naming_at(admin, url, period):
    response = admin.get(f"{url}?at=9999-12-31&period={period}")
    assert_refused(response, "at")


@pytest.mark.parametrize("url", ["/api/v1/accounting/usage/", "/api/v1/accounting/usage.csv"])
def test_usage_at_the_ends_of_the_calendar_answers_when_the_period_fits(admin, url):
    assert admin.get(f"{url}?at=0001-01-01&period=week").status_code == 200  # a Monday
    assert admin.get(f"{url}?at=9999-12-30&period=day").status_code == 200
    assert admin.get(f"{url}?at=9999-11-30&period=month").status_code == 200


def test_a_url_key_no_object_could_have_is_not_found(admin):
    for url in ["/api/v1/tenants/vi%00sion/", "/api/v1/nodes/a%00b/", "/api/v1/gpus/G%00/"]:
        assert admin.get(url).status_code == 404


def test_every_filterset_refuses_what_it_cannot_use():
    """Each filterset derives from the base whose form bounds dates and yes/no values."""
    from controlplane.api_urls import router

    filtersets = {getattr(v, "filterset_class", None) for _, v, _ in router.registry} - {None}
    assert filtersets
    assert [f for f in filtersets if not issubclass(f, FilterSet)] == []
