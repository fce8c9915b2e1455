"""The SDK: `Client(url, token)` and a typed method for each operation of the REST API.

    from gpucp import Client
    gpucp = Client("https://gpucp.example.org", token="gpucp_...")
    job = gpucp.submit(image="repo/train:1", command=["python", "train.py"], gpus=2)
    for line in gpucp.follow_logs(job["id"]):
        print(line, end="")
    print(gpucp.wait(job["id"])["exit_code"])

Objects are the API's JSON, as dicts (the TypedDicts below name their main fields). Lists are
iterators that fetch page after page as they are read. A refusal raises the `ApiError`
subclass of its status, carrying the API's field errors.

Retries: a request that could not connect, or that the control plane answered 503 (it is
unavailable for a moment), is sent again with exponential backoff, but only when sending it
twice cannot do a thing twice: GET, PUT and DELETE, and a POST or PATCH only when it carries
an `Idempotency-Key` (the API then answers a repeat with what the first one did). Submits
always carry one, so a submit is retried safely and never creates two jobs.

`OPERATIONS` lists the API operations the SDK covers; tests/client compares it with the live
`/api/schema/` so that an operation the API gains is not forgotten here.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypedDict, TypeVar, cast
from urllib.parse import quote

import httpx

from gpucp import __version__
from gpucp.errors import ConnectionFailed, RateLimited, WaitTimeout, error_for

API = "/api/v1"
FINISHED_STATES = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})
# The longest a follower waits when the API says it asked too often (its Retry-After).
FOLLOW_MAX_RATE_WAIT_S = 60.0
# Every operation the SDK covers, as (METHOD, path template with {} for each path parameter),
# each with the SDK call that performs it.
OPERATIONS: dict[tuple[str, str], str] = {}
_SAFE_TO_REPEAT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
IDEMPOTENCY_KEY = "Idempotency-Key"

F = TypeVar("F", bound=Callable[..., Any])


def operation(method: str, path: str) -> Callable[[F], F]:
    """Records that the decorated method performs `METHOD path` (path parameters as {})."""

    def record(func: F) -> F:
        OPERATIONS[(method, path)] = func.__qualname__
        return func

    return record


class Job(TypedDict, total=False):
    id: int
    tenant: str
    submitted_by: str
    name: str
    image: str
    command: list[str]
    env: dict[str, str]
    gpus: int
    gpu_type: str
    state: str
    state_reason: str
    pending_reason_code: str
    pending_reason: str
    queue_position: int | None
    estimated_start_at: str | None
    submitted_at: str
    started_at: str | None
    finished_at: str | None
    exit_code: int | None
    attempt_count: int
    preemptions: int
    attempts: list[dict[str, Any]]
    events: list[dict[str, Any]]
    array: int | None
    array_index: int | None
    hold: str
    depends_on: list[dict[str, Any]]


class LogPage(TypedDict, total=False):
    job: int
    attempt: int | None
    attempts: list[int]
    node: str | None
    text: str
    size_bytes: int
    truncated: bool
    offset: int
    next_offset: int
    attempt_finished: bool
    finished: bool
    data_b64: str


class Array(TypedDict, total=False):
    id: int
    name: str
    tenant: str
    size: int
    max_parallel: int | None
    state: str
    counts: dict[str, int]
    submitted_at: str
    cancelled_at: str | None


class Client:
    """A connection to one control plane as one user (their API token)."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout_s: float = 30.0,
        max_retries: int = 4,
        backoff_s: float = 0.5,
        max_backoff_s: float = 8.0,
        transport: httpx.BaseTransport | None = None,
    ):
        self.url = url.rstrip("/")
        self.token = token
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        headers = {"User-Agent": f"gpucp-client/{__version__}", "Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(
            base_url=self.url,
            headers=headers,
            # Long enough for a log follower's answer, which waits up to 15 s for output.
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            transport=transport,
        )
        self.tenants = Resource(self, "tenants")
        self.memberships = Resource(self, "memberships")
        self.invitations = Invitations(self, "invitations")
        self.quotas = Resource(self, "quotas")
        self.budgets = Resource(self, "budgets")
        self.pools = Resource(self, "pools")
        self.nodes = Nodes(self, "nodes")
        self.gpus = Resource(self, "gpus")
        self.join_tokens = Resource(self, "join-tokens")
        self.gpu_claim_conflicts = GpuClaimConflicts(self, "gpu-claim-conflicts")
        self.api_tokens = Resource(self, "api-tokens")
        self.volumes = Resource(self, "volumes")

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the transport -------------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        """One request, retried where that is safe (see the module's note); raises on >= 400."""
        method = method.upper()
        headers = dict(headers or {})
        repeatable = method in _SAFE_TO_REPEAT or IDEMPOTENCY_KEY in headers
        query = _query(params)
        attempt = 0
        while True:
            answered: httpx.Response | None = None
            try:
                response = self._http.request(
                    method, path, params=query or None, json=json, headers=headers
                )
            except (httpx.TransportError, httpx.DecodingError) as exc:
                if not (repeatable and attempt < self.max_retries and _retryable_error(exc)):
                    raise ConnectionFailed(
                        f"cannot reach {self.url}: {exc or type(exc).__name__}"
                    ) from exc
            else:
                if response.status_code < 400:
                    return response
                if not (response.status_code == 503 and repeatable and attempt < self.max_retries):
                    raise _error(response)
                answered = response
            self._sleep_before_retry(attempt, answered)
            attempt += 1

    def _sleep_before_retry(self, attempt: int, response: httpx.Response | None) -> None:
        delay_s = min(self.max_backoff_s, self.backoff_s * 2**attempt)
        # Jitter: clients that failed together do not all come back at the same instant.
        delay_s *= random.uniform(0.5, 1.0)
        retry_after = response.headers.get("Retry-After") if response is not None else None
        if retry_after is not None:
            try:
                delay_s = min(self.max_backoff_s, max(delay_s, float(retry_after)))
            except ValueError:
                pass
        time.sleep(delay_s)

    def get(self, path: str, **params: Any) -> Any:
        return _json(self.request("GET", path, params=params))

    def post(self, path: str, body: Any = None, *, idempotency_key: str | None = None) -> Any:
        headers = {IDEMPOTENCY_KEY: idempotency_key} if idempotency_key else None
        return _json(self.request("POST", path, json=body, headers=headers))

    def paginate(self, path: str, **params: Any) -> Iterator[dict[str, Any]]:
        """Every item of a paginated list, fetching the next page as the last is read."""
        page: Any = self.get(path, **params)
        while True:
            if isinstance(page, list):  # a list the API does not paginate
                yield from page
                return
            yield from page.get("results", [])
            following = page.get("next")
            if not following:
                return
            # The API's link is absolute, with its own idea of the scheme and host (a proxy in
            # front may differ): keep ours, take its path and query.
            link = httpx.URL(self.url).copy_with(raw_path=httpx.URL(following).raw_path)
            page = _json(self.request("GET", str(link)))

    # -- who am I --------------------------------------------------------------------------------

    def whoami(self) -> dict[str, Any]:
        """The token in use (matched by its prefix among your tokens) and your tenants' roles."""
        token = None
        if self.token:
            token = next(
                (t for t in self.api_tokens.list() if self.token.startswith(t["prefix"])), None
            )
        tenants = [
            {"slug": t["slug"], "name": t["name"], "role": t.get("my_role")}
            for t in self.tenants.list()
        ]
        return {"url": self.url, "token": token, "tenants": tenants}

    # -- jobs ----------------------------------------------------------------------------------

    @operation("POST", "/api/v1/jobs/")
    def submit(
        self,
        spec: Mapping[str, Any] | None = None,
        *,
        idempotency_key: str | None = None,
        **fields: Any,
    ) -> Job:
        """Submit one job: the fields of POST /api/v1/jobs/ (image, command, gpus, ...,
        depends_on). A fresh Idempotency-Key is sent unless given, so retries are safe."""
        body = {**(spec or {}), **fields}
        key = idempotency_key or str(uuid.uuid4())
        return cast(Job, self.post(f"{API}/jobs/", body, idempotency_key=key))

    def submit_many(
        self, specs: Iterable[Mapping[str, Any]], *, idempotency_key: str | None = None
    ) -> list[Job]:
        """Submit a list of jobs (up to 1,000) in one request: all are created or none."""
        key = idempotency_key or str(uuid.uuid4())
        return cast(list[Job], self.post(f"{API}/jobs/", list(specs), idempotency_key=key))

    @operation("GET", "/api/v1/jobs/")
    def jobs(self, **filters: Any) -> Iterator[Job]:
        """Jobs you can see, newest first unless `ordering` says otherwise. Filters: state
        (one or a list), tenant, user, name, name_contains, gpu_type, priority,
        submitted_after, submitted_before, array, limit (page size), ordering."""
        return cast(Iterator[Job], self.paginate(f"{API}/jobs/", **filters))

    @operation("GET", "/api/v1/jobs/{}/")
    def job(self, job_id: int) -> Job:
        return cast(Job, self.get(f"{API}/jobs/{int(job_id)}/"))

    @operation("POST", "/api/v1/jobs/{}/cancel/")
    def cancel(self, job_id: int) -> Job:
        """Cancel a job (a Conflict when it has already finished)."""
        return cast(Job, self.post(f"{API}/jobs/{int(job_id)}/cancel/"))

    @operation("GET", "/api/v1/jobs/{}/logs/")
    def logs(
        self,
        job_id: int,
        *,
        attempt: int | None = None,
        tail: int | None = None,
        offset: int | None = None,
        follow: bool = False,
        encoding: str | None = None,
    ) -> LogPage:
        """An attempt's output (the latest by default): whole, its last `tail` lines, or from
        byte `offset` on; with `follow`, the API waits a while for output past `offset`."""
        params = {
            "attempt": attempt,
            "tail": tail,
            "offset": offset,
            "follow": "true" if follow else None,
            "encoding": encoding,
        }
        return cast(LogPage, self.get(f"{API}/jobs/{int(job_id)}/logs/", **params))

    def follow_logs(
        self,
        job_id: int,
        *,
        attempt: int | None = None,
        offset: int = 0,
        poll_s: float = 1.0,
        on_attempt: Callable[[Mapping[str, Any]], None] | None = None,
    ) -> Iterator[str]:
        """The job's output as it is written, piece by piece, until the job has ended and all
        of it was read. Without `attempt` it follows each new attempt in turn (a requeued
        job); `on_attempt(page)` is called when one starts."""
        current = attempt
        announced = None
        while True:
            try:
                page = self.logs(job_id, attempt=current, offset=offset, follow=True)
            except RateLimited as limited:
                # A person following several jobs can use up their request rate: following is
                # reading, so wait as the API says (within reason) and go on from the offset.
                time.sleep(min(FOLLOW_MAX_RATE_WAIT_S, limited.retry_after_s or poll_s))
                continue
            number = page.get("attempt")
            if number is not None and number != announced:
                announced = number
                current = number
                if on_attempt is not None:
                    on_attempt(page)
            if page.get("text"):
                yield page["text"]
            offset = page["next_offset"]
            if page.get("finished"):
                return
            if page.get("attempt_finished") and page["next_offset"] == page["offset"]:
                # This attempt has ended and said all it will.
                if attempt is not None:
                    return
                later = [n for n in page.get("attempts", []) if number is not None and n > number]
                if later:
                    current, offset = min(later), 0
                    continue
                if self.job(job_id)["state"] in FINISHED_STATES:
                    return
                time.sleep(poll_s)  # between attempts: the next one is not admitted yet
            elif not page.get("text"):
                # The API answered at once without output (its waiting followers are all
                # taken, or there is no attempt yet): ask again a moment later.
                time.sleep(poll_s if number is None else min(poll_s, 0.5))

    def wait(
        self,
        job_id: int,
        *,
        timeout_s: float | None = None,
        poll_s: float = 0.25,
        max_poll_s: float = 2.0,
    ) -> Job:
        """The job once it has ended (SUCCEEDED, FAILED or CANCELLED); WaitTimeout after
        timeout_s. It polls, from every poll_s up to every max_poll_s."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        interval_s = poll_s
        while True:
            job = self.job(job_id)
            if job["state"] in FINISHED_STATES:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"job {job_id} is still {job['state']} after {timeout_s} s")
            time.sleep(interval_s)
            interval_s = min(max_poll_s, interval_s * 1.5)

    # -- arrays ----------------------------------------------------------------------------------

    @operation("POST", "/api/v1/arrays/")
    def submit_array(
        self,
        spec: Mapping[str, Any] | None = None,
        *,
        array: str | int,
        max_parallel: int | None = None,
        idempotency_key: str | None = None,
        **fields: Any,
    ) -> Array:
        """Submit an array: every job field plus `array` ("0-99", "1,3,5-9" or a count N) and
        `max_parallel`. `{{array_index}}` / `{{array_size}}` in the command and env values
        are replaced per task."""
        body = {**(spec or {}), **fields, "array": array}
        if max_parallel is not None:
            body["max_parallel"] = max_parallel
        key = idempotency_key or str(uuid.uuid4())
        return cast(Array, self.post(f"{API}/arrays/", body, idempotency_key=key))

    @operation("GET", "/api/v1/arrays/")
    def arrays(self, **filters: Any) -> Iterator[Array]:
        return cast(Iterator[Array], self.paginate(f"{API}/arrays/", **filters))

    @operation("GET", "/api/v1/arrays/{}/")
    def array(self, array_id: int) -> Array:
        return cast(Array, self.get(f"{API}/arrays/{int(array_id)}/"))

    @operation("POST", "/api/v1/arrays/{}/cancel/")
    def cancel_array(self, array_id: int) -> Array:
        """Cancel every unfinished task of an array."""
        return cast(Array, self.post(f"{API}/arrays/{int(array_id)}/cancel/"))

    # -- accounting ------------------------------------------------------------------------------

    @operation("GET", "/api/v1/accounting/usage/")
    def usage(
        self, *, tenant: str | None = None, period: str | None = None, at: str | None = None
    ) -> list[dict[str, Any]]:
        """GPU-hours and kWh of each tenant you see in a period (day, month, ...), with the
        budgets they count against."""
        return cast(
            list[dict[str, Any]],
            self.get(f"{API}/accounting/usage/", tenant=tenant, period=period, at=at),
        )

    @operation("GET", "/api/v1/accounting/usage.csv")
    def usage_csv(
        self, *, tenant: str | None = None, period: str | None = None, at: str | None = None
    ) -> str:
        response = self.request(
            "GET",
            f"{API}/accounting/usage.csv",
            params={"tenant": tenant, "period": period, "at": at},
            headers={"Accept": "text/csv"},
        )
        return response.text

    @operation("GET", "/api/v1/audit/")
    def audit(self, **filters: Any) -> Iterator[dict[str, Any]]:
        """The audit trail you may read (every row for a cluster admin, your tenants' for a
        tenant admin), newest first. Filters: action (or its start, "quota"), object_type,
        object_id, tenant, actor, after, before."""
        return self.paginate(f"{API}/audit/", **filters)

    @operation("GET", "/api/v1/audit/{}/")
    def audit_event(self, event_id: int) -> dict[str, Any]:
        return cast(dict[str, Any], self.get(f"{API}/audit/{int(event_id)}/"))

    @operation("GET", "/api/v1/audit/csv/")
    def audit_csv(self, **filters: Any) -> str:
        """The same rows as CSV, before and after as JSON."""
        response = self.request(
            "GET", f"{API}/audit/csv/", params=filters, headers={"Accept": "text/csv"}
        )
        return response.text


class Resource:
    """The list, read, create, update and delete operations of one collection of the API."""

    # (METHOD, suffix) of the operations each collection offers, "" the list, "{}" an item.
    OFFERS: dict[str, tuple[str, ...]] = {
        "tenants": ("list", "create", "get", "replace", "update", "delete"),
        "memberships": ("list", "create", "get", "replace", "update", "delete"),
        "invitations": ("list", "create", "get", "delete"),
        "quotas": ("list", "create", "get", "replace", "update", "delete"),
        "budgets": ("list", "create", "get", "replace", "update", "delete"),
        "pools": ("list", "create", "get", "replace", "update", "delete"),
        "nodes": ("list", "get"),
        "gpus": ("list", "get"),
        "join-tokens": ("list", "create", "get", "delete"),
        "gpu-claim-conflicts": ("list", "get"),
        "api-tokens": ("list", "create", "get", "delete"),
        "volumes": ("list", "create", "get", "replace", "update", "delete"),
    }

    def __init__(self, client: Client, name: str):
        self.client = client
        self.name = name
        self.path = f"{API}/{name}/"

    def _item(self, key: int | str) -> str:
        return f"{self.path}{quote(str(key), safe='')}/"

    def list(self, **filters: Any) -> Iterator[dict[str, Any]]:
        """Every object you can see, page after page; filters as the API's query parameters."""
        return self.client.paginate(self.path, **filters)

    def get(self, key: int | str) -> dict[str, Any]:
        return cast(dict[str, Any], self.client.get(self._item(key)))

    def create(self, body: Mapping[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
        """Create one. POSTs carry no Idempotency-Key here, so they are never retried."""
        return cast(dict[str, Any], self.client.post(self.path, {**(body or {}), **fields}))

    def update(self, key: int | str, **fields: Any) -> dict[str, Any]:
        """Change some fields (PATCH)."""
        response = self.client.request("PATCH", self._item(key), json=fields)
        return cast(dict[str, Any], _json(response))

    def replace(self, key: int | str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Write every field (PUT)."""
        response = self.client.request("PUT", self._item(key), json=dict(body))
        return cast(dict[str, Any], _json(response))

    def delete(self, key: int | str) -> None:
        self.client.request("DELETE", self._item(key))

    def _action(self, key: int | str, verb: str, body: Any = None) -> dict[str, Any]:
        return cast(dict[str, Any], self.client.post(f"{self._item(key)}{verb}/", body))


class Nodes(Resource):
    def cordon(self, name: str) -> dict[str, Any]:
        """No new jobs on the node; running ones stay."""
        return self._action(name, "cordon")

    def uncordon(self, name: str) -> dict[str, Any]:
        return self._action(name, "uncordon")

    def drain(self, name: str) -> dict[str, Any]:
        """Cordon the node and requeue its jobs."""
        return self._action(name, "drain")

    def deregister(self, name: str) -> dict[str, Any]:
        return self._action(name, "deregister")


class Invitations(Resource):
    def accept(self, invitation_id: int) -> dict[str, Any]:
        return self._action(invitation_id, "accept")

    def decline(self, invitation_id: int) -> dict[str, Any]:
        return self._action(invitation_id, "decline")


class GpuClaimConflicts(Resource):
    def resolve(self, conflict_id: int, **fields: Any) -> dict[str, Any]:
        return self._action(conflict_id, "resolve", fields)


_VERBS = {
    "list": ("GET", ""),
    "create": ("POST", ""),
    "get": ("GET", "{}/"),
    "replace": ("PUT", "{}/"),
    "update": ("PATCH", "{}/"),
    "delete": ("DELETE", "{}/"),
}
_ACTIONS = {
    "nodes": ("cordon", "uncordon", "drain", "deregister"),
    "invitations": ("accept", "decline"),
    "gpu-claim-conflicts": ("resolve",),
}
for _name, _verbs in Resource.OFFERS.items():
    _attribute = _name.replace("-", "_")
    for _verb in _verbs:
        _method, _suffix = _VERBS[_verb]
        OPERATIONS[(_method, f"{API}/{_name}/{_suffix}")] = f"Client.{_attribute}.{_verb}"
    for _verb in _ACTIONS.get(_name, ()):
        OPERATIONS[("POST", f"{API}/{_name}/{{}}/{_verb}/")] = f"Client.{_attribute}.{_verb}"


def _query(params: Mapping[str, Any] | None) -> list[tuple[str, str | int | float | bool | None]]:
    """Query pairs, leaving out None; a list repeats its parameter (state=A&state=B)."""
    pairs: list[tuple[str, str | int | float | bool | None]] = []
    for name, value in (params or {}).items():
        values = value if isinstance(value, list | tuple) else [value]
        for item in values:
            if item is None:
                continue
            if isinstance(item, bool):
                item = "true" if item else "false"
            pairs.append((name, str(item)))
    return pairs


def _retryable_error(exc: Exception) -> bool:
    # Could not connect, or the connection broke before an answer: the request may or may not
    # have arrived, which is why only repeatable requests come here.
    return isinstance(exc, httpx.TransportError) and not isinstance(exc, httpx.UnsupportedProtocol)


def _json(response: httpx.Response) -> Any:
    if response.status_code == 204 or not response.content:
        return None
    return response.json()


def _error(response: httpx.Response) -> Exception:
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    error = error_for(
        response.status_code, body, response.request.method, str(response.request.url)
    )
    if isinstance(error, RateLimited):
        try:
            error.retry_after_s = float(response.headers.get("Retry-After", ""))
        except ValueError:
            pass
    return error
