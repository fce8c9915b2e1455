"""The `gpucp` command (docs/cli.md). Every command is a thin layer over gpucp.Client.

Start-up stays short: the HTTP client and YAML are imported by the commands that use them,
not here, so `gpucp --help` and completion load little more than click.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

if TYPE_CHECKING:
    from gpucp.client import Client

# Exit codes (docs/cli.md, "Exit codes"). With --wait, and for `gpucp wait`, the job's own exit
# code instead when the CLI itself did not fail.
EXIT_USAGE = 2
EXIT_AUTH = 3
EXIT_REFUSED = 4
EXIT_UNREACHABLE = 5
EXIT_WAIT_TIMEOUT = 6
# The job ended without an exit code of its own (cancelled, lost, failed before it started).
EXIT_NO_JOB_EXIT_CODE = 125

OUTPUTS = ("table", "wide", "json", "yaml")
F = TypeVar("F", bound=Callable[..., Any])
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def fail(message: str, code: int) -> NoReturn:
    click.echo(f"gpucp: {message}", err=True)
    sys.exit(code)


class Root(click.Group):
    """Turns the SDK's exceptions into one line on stderr and a documented exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        from gpucp import errors

        try:
            return super().invoke(ctx)
        except errors.Unauthorized as exc:
            fail(
                f"the control plane refused the token ({exc.one_line()}); "
                "log in again: gpucp login URL",
                EXIT_AUTH,
            )
        except errors.ServerError as exc:
            fail(f"the control plane failed: HTTP {exc.status}: {exc.one_line()}", EXIT_UNREACHABLE)
        except errors.ApiError as exc:
            fail(f"refused (HTTP {exc.status}): {exc.one_line()}", EXIT_REFUSED)
        except errors.ConnectionFailed as exc:
            fail(str(exc), EXIT_UNREACHABLE)
        except errors.WaitTimeout as exc:
            fail(str(exc), EXIT_WAIT_TIMEOUT)
        except ValueError as exc:
            from gpucp.jobfile import JobFileError

            if isinstance(exc, JobFileError):
                fail(str(exc), EXIT_USAGE)
            raise
        except BrokenPipeError:
            # `gpucp logs ID | head`: the reader left; that is not an error.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(0)


@click.group(cls=Root, context_settings=CONTEXT)
@click.option("--url", envvar="GPUCP_URL", help="Control plane URL (else the login's).")
@click.option("--token", envvar="GPUCP_TOKEN", help="API token (else the login's).")
@click.version_option(package_name="gpucp-client", prog_name="gpucp")
@click.pass_context
def cli(ctx: click.Context, url: str | None, token: str | None) -> None:
    """Submit, follow and manage jobs on a GPU control plane.

    \b
    First:  gpucp login https://gpucp.example.org
    Then:   gpucp run --gpus 1 --image repo/img:tag --wait -- python train.py
            gpucp submit job.yaml --follow
            gpucp ls
    Every command has --help with examples; docs/cli.md has the rest.
    """
    ctx.obj = {"url": url, "token": token}


def client(ctx: click.Context) -> Client:
    """The SDK client for the login (or GPUCP_URL / GPUCP_TOKEN / --url / --token)."""
    from gpucp import config
    from gpucp.client import Client

    obj = ctx.find_root().obj
    if "client" not in obj:
        settings = config.load()
        url = obj["url"] or settings.url
        token = obj["token"] or settings.token
        if not url or not token:
            fail("not logged in: run gpucp login URL (or set GPUCP_URL and GPUCP_TOKEN)", EXIT_AUTH)
        obj["client"] = Client(url, token)
    return obj["client"]  # type: ignore[no-any-return]


def output_option(default: str = "table") -> Callable[[F], F]:
    return click.option(
        "-o",
        "--output",
        type=click.Choice(OUTPUTS),
        default=default,
        show_default=True,
        help="table, wide (more columns), json or yaml.",
    )


# -- login -------------------------------------------------------------------------------------


@cli.command(
    epilog="""\b
Examples:
  gpucp login https://gpucp.example.org
  echo "$TOKEN" | gpucp login https://gpucp.example.org --token-stdin"""
)
@click.argument("url")
@click.option("--token-stdin", is_flag=True, help="Read the token from standard input.")
@click.pass_context
def login(ctx: click.Context, url: str, token_stdin: bool) -> None:
    """Store the control plane's URL and your API token (in your config dir, mode 0600).

    Create a token on the web UI's Tokens page (URL/tokens/). The token is checked before it
    is stored.
    """
    from gpucp import config
    from gpucp.client import Client

    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        fail(f"{url!r} is not a URL: give it with http:// or https://", EXIT_USAGE)
    if token_stdin:
        token = sys.stdin.readline().strip()
    elif ctx.find_root().obj.get("token"):
        token = ctx.find_root().obj["token"]
    else:
        token = click.prompt(
            f"API token (create one at {url}/tokens/)", hide_input=True, err=True
        ).strip()
    if not token:
        fail("no token given", EXIT_USAGE)
    with Client(url, token) as checking:
        me = checking.whoami()
    path = config.save(url, token)
    name = (me["token"] or {}).get("name", "?")
    click.echo(f"Logged in to {url} with token {name!r}; saved in {path}")


@cli.command()
def logout() -> None:
    """Forget the stored URL and token (the token itself stays valid: revoke it on the web)."""
    from gpucp import config

    if config.forget():
        click.echo(f"Removed {config.config_path()}")
    else:
        click.echo("Not logged in.")


@cli.command()
@output_option()
@click.pass_context
def whoami(ctx: click.Context, output: str) -> None:
    """The control plane, the token in use and your tenants with your role in each."""
    me = client(ctx).whoami()
    if output in ("json", "yaml"):
        emit(me, output)
        return
    token = me["token"] or {}
    click.echo(f"URL:     {me['url']}")
    if token:
        scopes = ",".join(token.get("scopes") or []) or "all"
        expires = token.get("expires_at") or "never"
        click.echo(
            f"Token:   {token['name']} ({token['prefix']}…), scopes {scopes}, expires {expires}"
        )
    for tenant in me["tenants"]:
        role = tenant["role"] or "(cluster admin view)"
        click.echo(f"Tenant:  {tenant['slug']:<20} {role}")


# -- submitting --------------------------------------------------------------------------------


def _submit_options(func: Any) -> Any:
    for option in reversed(
        [
            click.option(
                "--set",
                "sets",
                multiple=True,
                metavar="KEY=VALUE",
                help="Override a field (value read as YAML); env.NAME=value sets a variable.",
            ),
            click.option("--array", "array", help='Make it an array: "0-99", "1,3,5-9" or N.'),
            click.option("--max-parallel", type=int, help="With --array: tasks at once at most."),
            click.option("--wait", is_flag=True, help="Block until it ends; exit with its code."),
            click.option(
                "-f", "--follow", is_flag=True, help="Stream its output (implies --wait)."
            ),
            click.option("-q", "--quiet", is_flag=True, help="Print only the new job's id."),
            click.option("--idempotency-key", help="Your own key (else a fresh UUID is sent)."),
        ]
    ):
        func = option(func)
    return func


@cli.command(
    epilog="""\b
Examples:
  gpucp submit train.yaml
  gpucp submit train.yaml --set gpus=4 --set env.LR=1e-4 --follow
  gpucp submit sweep.yaml --array 0-9 --max-parallel 2
  cat job.yaml | gpucp submit -

\b
A job file is YAML with the API's job fields (comments allowed):
  name: resnet
  image: registry.example.org/vision/train:2.3
  command: [python, train.py, --lr, "3e-4"]
  gpus: 2"""
)
@click.argument("job_file")
@_submit_options
@click.pass_context
def submit(ctx: click.Context, /, job_file: str, **options: Any) -> None:
    """Submit the job in JOB_FILE (YAML; - reads standard input)."""
    from gpucp import jobfile

    spec = jobfile.apply_sets(jobfile.load(job_file), list(options.pop("sets")))
    _submit_and_report(ctx, spec, **options)


@cli.command(
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    epilog="""\b
Examples:
  gpucp run --gpus 2 --image repo/img:tag -- python train.py --lr 3e-4
  gpucp run --image busybox --wait -- sh -c 'echo hello'
  gpucp run --gpus 1 --image repo/img:tag --env SEED=1 --follow -- python eval.py""",
)
@click.option("--image", help="Container image.")
@click.option("--gpus", type=int, help="GPUs (default: the API's, 1).")
@click.option("--gpu-type", help="GPU model, e.g. H100-SXM-80GB.")
@click.option("--name", help="A name to find the job by.")
@click.option("--tenant", help="Tenant slug (needed if you belong to several).")
@click.option("--priority", help="Priority class.")
@click.option("--cpus", type=int)
@click.option("--memory-mib", type=int)
@click.option("--max-runtime-s", type=int)
@click.option("--env", "envs", multiple=True, metavar="NAME=VALUE", help="An env variable.")
@_submit_options
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
@click.pass_context
def run(
    ctx: click.Context, /, command: tuple[str, ...], envs: tuple[str, ...], **options: Any
) -> None:
    """Submit COMMAND as a job, with fields as options (everything after -- is the command)."""
    from gpucp import jobfile

    spec: dict[str, Any] = {"command": list(command)}
    for field in RUN_FIELDS:
        value = options.pop(field)
        if value is not None:
            spec[field] = value
    sets = [f"env.{e}" for e in envs] + list(options.pop("sets"))
    _submit_and_report(ctx, jobfile.apply_sets(spec, sets), **options)


RUN_FIELDS = (
    "image",
    "gpus",
    "gpu_type",
    "name",
    "tenant",
    "priority",
    "cpus",
    "memory_mib",
    "max_runtime_s",
)


def _submit_and_report(
    ctx: click.Context,
    spec: dict[str, Any],
    *,
    array: str | None,
    max_parallel: int | None,
    wait: bool,
    follow: bool,
    quiet: bool,
    idempotency_key: str | None,
) -> None:
    api = client(ctx)
    array_spec = array if array is not None else spec.pop("array", None)
    if max_parallel is None:
        max_parallel = spec.pop("max_parallel", None)
    if array_spec is not None:
        created = api.submit_array(
            spec, array=array_spec, max_parallel=max_parallel, idempotency_key=idempotency_key
        )
        click.echo(
            created["id"]
            if quiet
            else f"Submitted array {created['id']} ({created.get('size')} tasks)"
        )
        if wait or follow:
            sys.exit(_wait_for_array(api, created["id"], quiet))
        return
    job = api.submit(spec, idempotency_key=idempotency_key)
    if quiet:
        click.echo(job["id"])
    else:
        click.echo(
            f"Submitted job {job['id']}"
            + (f" ({job['name']})" if job.get("name") else "")
            + f" to {job.get('tenant')}: {job.get('state')}",
            err=follow,
        )
    if follow:
        _stream_logs(api, job["id"], attempt=None, offset=0)
    if wait or follow:
        sys.exit(_report_end(api.wait(job["id"]), quiet or follow))


def _wait_for_array(api: Client, array_id: int, quiet: bool) -> int:
    import time

    interval_s = 0.5
    while True:
        shown = api.array(array_id)
        if shown.get("state") in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(interval_s)
        interval_s = min(5.0, interval_s * 1.5)
    if not quiet:
        click.echo(f"Array {array_id}: {shown.get('state')} {shown.get('counts')}")
    return 0 if shown.get("state") == "succeeded" else 1


def job_exit_code(job: Mapping[str, Any]) -> int:
    """The exit code `--wait` ends with: the job's own (docs/cli.md, "Exit codes")."""
    if job["state"] == "SUCCEEDED":
        return 0
    code = job.get("exit_code")
    if job["state"] == "CANCELLED" or code is None or code == 0:
        return EXIT_NO_JOB_EXIT_CODE
    # A death by signal N is reported as -N or as 128+N; a shell writes it 128+N.
    return 128 - code if code < 0 else min(int(code), 255)


def _report_end(job: Mapping[str, Any], to_stderr: bool) -> int:
    code = job_exit_code(job)
    reason = f": {job['state_reason']}" if job.get("state_reason") else ""
    exit_code = job.get("exit_code")
    click.echo(
        f"Job {job['id']} {job['state']}"
        + (f" (exit code {exit_code})" if exit_code is not None else "")
        + reason,
        err=to_stderr,
    )
    return code


# -- reading -----------------------------------------------------------------------------------


@cli.command(
    "ls",
    epilog="""\b
Examples:
  gpucp ls
  gpucp ls --state running --state pending -o wide
  gpucp ls --user alice --name-contains sweep -o json | jq '.[].id'
  gpucp ls --all-tenants          # cluster admins: every tenant's jobs""",
)
@click.option("--state", "states", multiple=True, help="PENDING, RUNNING, ... (repeat for any).")
@click.option("--tenant", help="Tenant slug.")
@click.option("--user", help="Submitter's username.")
@click.option("--name", help="Exact name.")
@click.option("--name-contains", help="Part of the name, any case.")
@click.option("--gpu-type")
@click.option("--priority")
@click.option("--array", "array_id", type=int, help="Tasks of this array.")
@click.option("--since", help="Submitted at or after (ISO 8601).")
@click.option("--all-tenants", is_flag=True, help="Cluster admins: every tenant, not only yours.")
@click.option("--limit", type=int, default=50, show_default=True, help="Most jobs shown (0: all).")
@output_option()
@click.pass_context
def list_jobs(ctx: click.Context, /, output: str, limit: int, all_tenants: bool, **f: Any) -> None:
    """List jobs, newest first (those of your tenants; filters as on the web list)."""
    api = client(ctx)
    filters: dict[str, Any] = {
        "state": [s.upper() for s in f["states"]] or None,
        "tenant": f["tenant"],
        "user": f["user"],
        "name": f["name"],
        "name_contains": f["name_contains"],
        "gpu_type": f["gpu_type"],
        "priority": f["priority"],
        "array": f["array_id"],
        "submitted_after": f["since"],
        "ordering": "-submitted_at",
    }
    jobs = list(_take(_jobs_of_my_tenants(api, filters, all_tenants), limit))
    show_rows(jobs, output, JOB_COLUMNS, JOB_WIDE_COLUMNS)


def _jobs_of_my_tenants(api: Client, filters: dict[str, Any], all_tenants: bool) -> Iterator[Any]:
    if all_tenants or filters.get("tenant"):
        yield from api.jobs(**filters)
        return
    tenants = list(api.tenants.list())
    mine = [t["slug"] for t in tenants if t.get("my_role")]
    if len(mine) == len(tenants):
        # The API shows exactly your tenants' jobs: one list.
        yield from api.jobs(**filters)
        return
    # A cluster admin sees every tenant's jobs; without --all-tenants only their own tenants'.
    merged: list[dict[str, Any]] = []
    for slug in mine:
        merged.extend(_take(api.jobs(**{**filters, "tenant": slug}), 1000))
    yield from sorted(merged, key=lambda j: (j["submitted_at"], j["id"]), reverse=True)


def _take(items: Iterable[Any], limit: int) -> Iterator[Any]:
    for count, item in enumerate(items):
        if limit and count >= limit:
            return
        yield item


@cli.command(
    epilog="""\b
Examples:
  gpucp show 42
  gpucp show 42 -o json | jq .attempts"""
)
@click.argument("job_id", type=int)
@output_option()
@click.pass_context
def show(ctx: click.Context, job_id: int, output: str) -> None:
    """One job: state and reason, queue position and ETA, attempts (node, GPUs, energy),
    and its timeline."""
    job = client(ctx).job(job_id)
    if output in ("json", "yaml"):
        emit(job, output)
        return
    lines = [
        ("Job", f"{job['id']} {job.get('name') or ''}".strip()),
        ("Tenant / user", f"{job.get('tenant')} / {job.get('submitted_by')}"),
        ("State", job["state"] + (f" ({job['state_reason']})" if job.get("state_reason") else "")),
        ("Image", job.get("image")),
        ("Command", " ".join(job.get("command") or [])),
        ("GPUs", f"{job.get('gpus')} {job.get('gpu_type') or 'any type'}"),
        ("Priority", job.get("priority")),
    ]
    if job["state"] == "PENDING":
        lines += [
            ("Waiting because", job.get("pending_reason") or job.get("pending_reason_code")),
            ("Queue position", job.get("queue_position")),
            ("Estimated start", job.get("estimated_start_at")),
        ]
    if job.get("hold"):
        lines.append(("Held", job["hold"]))
    if job.get("array") is not None:
        lines.append(("Array", f"{job['array']} task {job.get('array_index')}"))
    for dependency in job.get("depends_on") or []:
        target = (
            f"job {dependency['job']}"
            if dependency.get("job")
            else f"array {dependency.get('array')}"
        )
        lines.append(
            ("Depends on", f"{target} {dependency.get('condition')}: {dependency.get('state')}")
        )
    lines += [
        ("Submitted", job.get("submitted_at")),
        ("Started", job.get("started_at")),
        ("Finished", job.get("finished_at")),
        ("Exit code", job.get("exit_code")),
    ]
    for label, value in lines:
        if value not in (None, ""):
            click.echo(f"{label + ':':<17}{value}")
    attempts = job.get("attempts") or []
    if attempts:
        click.echo("\nAttempts:")
        rows = [
            {
                "#": a["number"],
                "NODE": a.get("node"),
                "STATE": a.get("state"),
                "GPUS": ",".join(f"{g.get('node')}:{g.get('index')}" for g in a.get("gpus") or []),
                "EXIT": a.get("exit_code"),
                "GPU-H": f"{(a.get('gpu_seconds') or 0) / 3600:.3f}",
                "KWH": f"{(a.get('energy_j') or 0) / 3.6e6:.4f}"
                + ("~" if a.get("energy_estimated") else ""),
                "STOP": a.get("stop_reason") or "",
            }
            for a in attempts
        ]
        print_table(rows, list(rows[0]))
    events = job.get("events") or []
    if events:
        click.echo("\nTimeline:")
        for event in events:
            actor = f" by {event['actor']}" if event.get("actor") else ""
            click.echo(f"  {event['at']}  {event['kind']:<12}{actor} {event.get('message') or ''}")


@cli.command(
    epilog="""\b
Examples:
  gpucp logs 42
  gpucp logs 42 -f               # follow until the job ends
  gpucp logs 42 --tail 100 -f
  gpucp logs 42 --attempt 1"""
)
@click.argument("job_id", type=int)
@click.option("-f", "--follow", is_flag=True, help="Keep printing output as it is written.")
@click.option("--attempt", type=int, help="Attempt number (default: the latest).")
@click.option("--tail", type=int, help="Only the last N lines.")
@click.pass_context
def logs(
    ctx: click.Context, job_id: int, follow: bool, attempt: int | None, tail: int | None
) -> None:
    """A job's output (stdout and stderr together)."""
    api = client(ctx)
    offset = 0
    if not follow or tail is not None:
        page = api.logs(job_id, attempt=attempt, tail=tail)
        _write(page["text"])
        if not follow:
            if page.get("truncated"):
                click.echo(
                    "gpucp: (the start was cut off: use --tail, or the web UI's full log)", err=True
                )
            return
        offset = page.get("next_offset", 0)
    _stream_logs(api, job_id, attempt=attempt, offset=offset)


def _stream_logs(api: Client, job_id: int, *, attempt: int | None, offset: int) -> None:
    """Prints the output as it comes until the job ends; without `attempt`, each attempt in
    turn (a requeued job's next one after a line on stderr)."""
    seen: set[int] = set()

    def header(page: Mapping[str, Any]) -> None:
        number = page.get("attempt")
        if number is not None and number not in seen:
            if seen:
                click.echo(f"--- attempt {number} on {page.get('node')} ---", err=True)
            seen.add(number)

    for piece in api.follow_logs(job_id, attempt=attempt, offset=offset, on_attempt=header):
        _write(piece)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


@cli.command(epilog="Example:\n  gpucp cancel 42 43 44")
@click.argument("job_ids", type=int, nargs=-1, required=True)
@click.pass_context
def cancel(ctx: click.Context, job_ids: tuple[int, ...]) -> None:
    """Cancel jobs (a running one is stopped; its GPUs free when its node confirms)."""
    from gpucp import errors

    api = client(ctx)
    refused = 0
    for job_id in job_ids:
        try:
            job = api.cancel(job_id)
        except (errors.Conflict, errors.NotFound) as exc:
            click.echo(f"gpucp: job {job_id}: {exc.one_line()}", err=True)
            refused += 1
            continue
        click.echo(f"Job {job_id}: {job['state']}")
    if refused:
        sys.exit(EXIT_REFUSED)


@cli.command(
    epilog="""\b
Examples:
  gpucp wait 42 && echo done
  gpucp wait 42 43 --timeout 3600"""
)
@click.argument("job_ids", type=int, nargs=-1, required=True)
@click.option("--timeout", "timeout_s", type=float, help="Give up after this many seconds.")
@click.pass_context
def wait(ctx: click.Context, job_ids: tuple[int, ...], timeout_s: float | None) -> None:
    """Wait until the jobs end; exit 0 if all succeeded, else with the first failure's code."""
    import time

    api = client(ctx)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    result = 0
    for job_id in job_ids:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        code = _report_end(api.wait(job_id, timeout_s=left), to_stderr=False)
        if code and not result:
            result = code
    sys.exit(result)


@cli.command(
    epilog="""\b
Examples:
  gpucp queue
  gpucp queue --tenant vision -o wide"""
)
@click.option("--tenant", help="Tenant slug.")
@click.option("--all-tenants", is_flag=True, help="Cluster admins: every tenant.")
@output_option()
@click.pass_context
def queue(ctx: click.Context, tenant: str | None, all_tenants: bool, output: str) -> None:
    """What waits in your tenants' queues, in order: why, and when it should start."""
    api = client(ctx)
    filters = {"state": ["PENDING"], "tenant": tenant}
    pending = list(_jobs_of_my_tenants(api, filters, all_tenants))
    pending.sort(
        key=lambda j: (j.get("queue_position") is None, j.get("queue_position") or 0, j["id"])
    )
    show_rows(pending, output, QUEUE_COLUMNS, QUEUE_COLUMNS + ["gpu_type", "priority", "hold"])


@cli.command(
    epilog="""\b
Examples:
  gpucp usage
  gpucp usage --period day --tenant vision -o json"""
)
@click.option("--tenant", help="Tenant slug.")
@click.option("--period", help="day, week or month (the API's default otherwise).")
@click.option("--at", help="A time inside the period wanted (ISO 8601).")
@output_option()
@click.pass_context
def usage(
    ctx: click.Context, tenant: str | None, period: str | None, at: str | None, output: str
) -> None:
    """GPU-hours and energy (kWh) per tenant in a period, against the tenant's budgets."""
    rows = client(ctx).usage(tenant=tenant, period=period, at=at)
    if output in ("json", "yaml"):
        emit(rows, output)
        return
    table = [
        {
            "TENANT": r["tenant"],
            "PERIOD": f"{r['period']} from {str(r['period_start'])[:10]}",
            "GPU-HOURS": _against(r["gpu_hours"], r.get("gpu_hours_budget")),
            "KWH": _against(r["energy_kwh"], r.get("energy_kwh_budget")),
        }
        for r in rows
    ]
    print_table(table, ["TENANT", "PERIOD", "GPU-HOURS", "KWH"])


def _against(used: float, budget: float | None) -> str:
    if budget:
        return f"{used:.2f} / {budget:.2f} ({100 * used / budget:.0f}%)"
    return f"{used:.2f}"


@cli.command(
    epilog="""\b
Examples:
  gpucp top
  gpucp top -o json"""
)
@output_option()
@click.pass_context
def top(ctx: click.Context, output: str) -> None:
    """The cluster: pools' power against their budget, nodes, and GPUs in use by tenant."""
    from gpucp import errors

    api = client(ctx)
    running = list(api.jobs(state=["ADMITTED", "RUNNING"], limit=500))
    by_tenant: dict[str, int] = {}
    for job in running:
        by_tenant[job["tenant"]] = by_tenant.get(job["tenant"], 0) + int(job.get("gpus") or 0)
    try:
        pools = list(api.pools.list())
        nodes = list(api.nodes.list())
    except errors.Forbidden:
        pools, nodes = [], []
    view = {"pools": pools, "nodes": nodes, "gpus_by_tenant": by_tenant}
    if output in ("json", "yaml"):
        emit(view, output)
        return
    if pools:
        print_table(
            [
                {
                    "POOL": p["name"],
                    "NODES": p.get("nodes"),
                    "GPUS": p.get("gpus"),
                    "DRAW_W": _watts(p.get("power_draw_w")),
                    "BUDGET_W": _watts(p.get("power_budget_w")),
                    "USE": f"{100 * p['power_draw_w'] / p['power_budget_w']:.0f}%"
                    if p.get("power_draw_w") is not None and p.get("power_budget_w")
                    else "",
                }
                for p in pools
            ],
            ["POOL", "NODES", "GPUS", "DRAW_W", "BUDGET_W", "USE"],
        )
        click.echo()
    if nodes:
        print_table(
            [
                {
                    "NODE": n["name"],
                    "POOL": n.get("pool"),
                    "STATE": n.get("state"),
                    "GPUS_USED": f"{n.get('gpus_allocated')}/{n.get('gpus_total')}",
                    "DRAW_W": _watts(n.get("power_draw_w")),
                    "MODELS": ",".join(n.get("gpu_models") or []),
                }
                for n in nodes
            ],
            ["NODE", "POOL", "STATE", "GPUS_USED", "DRAW_W", "MODELS"],
        )
        click.echo()
    print_table(
        [{"TENANT": t, "GPUS_IN_USE": n} for t, n in sorted(by_tenant.items())] or [],
        ["TENANT", "GPUS_IN_USE"],
    )


def _watts(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}"


@cli.command()
@output_option()
@click.pass_context
def nodes(ctx: click.Context, output: str) -> None:
    """Nodes: state, GPUs in use, power draw."""
    rows = list(client(ctx).nodes.list())
    show_rows(
        rows,
        output,
        ["name", "pool", "state", "gpus_allocated", "gpus_total", "power_draw_w"],
        None,
    )


# -- arrays ------------------------------------------------------------------------------------


@cli.group(
    epilog="Arrays are submitted with `gpucp submit FILE --array 0-99` or `gpucp run --array`."
)
def array() -> None:
    """Job arrays: one job file, many tasks."""


@array.command("ls")
@output_option()
@click.pass_context
def array_list(ctx: click.Context, output: str) -> None:
    """Arrays you can see, with their tasks' counts."""
    rows = [
        {**a, "counts": " ".join(f"{k}={v}" for k, v in (a.get("counts") or {}).items() if v)}
        for a in client(ctx).arrays()
    ]
    show_rows(
        rows, output, ["id", "name", "tenant", "size", "max_parallel", "state", "counts"], None
    )


@array.command("show")
@click.argument("array_id", type=int)
@output_option("yaml")
@click.pass_context
def array_show(ctx: click.Context, array_id: int, output: str) -> None:
    """One array."""
    emit(client(ctx).array(array_id), "yaml" if output in ("table", "wide") else output)


@array.command("cancel")
@click.argument("array_ids", type=int, nargs=-1, required=True)
@click.pass_context
def array_cancel(ctx: click.Context, array_ids: tuple[int, ...]) -> None:
    """Cancel every unfinished task of the arrays."""
    for array_id in array_ids:
        shown = client(ctx).cancel_array(array_id)
        click.echo(f"Array {array_id}: {shown.get('state')}")


# -- shell completion --------------------------------------------------------------------------


@cli.command(
    epilog="""\b
Examples:
  gpucp completion bash >> ~/.bashrc
  gpucp completion zsh > "${fpath[1]}/_gpucp"
  gpucp completion fish > ~/.config/fish/completions/gpucp.fish"""
)
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion(shell: str) -> None:
    """Print the shell completion script for SHELL."""
    from click.shell_completion import get_completion_class

    completer = get_completion_class(shell)
    assert completer is not None
    click.echo(completer(cli, {}, "gpucp", "_GPUCP_COMPLETE").source())


# -- output ------------------------------------------------------------------------------------

JOB_COLUMNS = ["id", "name", "state", "gpus", "tenant", "submitted_by", "submitted_at"]
JOB_WIDE_COLUMNS = JOB_COLUMNS + [
    "gpu_type",
    "priority",
    "queue_position",
    "estimated_start_at",
    "exit_code",
    "pending_reason",
]
QUEUE_COLUMNS = [
    "queue_position",
    "id",
    "name",
    "submitted_by",
    "gpus",
    "estimated_start_at",
    "pending_reason",
]


def show_rows(
    rows: list[dict[str, Any]], output: str, columns: list[str], wide: list[str] | None
) -> None:
    if output in ("json", "yaml"):
        emit(rows, output)
        return
    chosen = wide if output == "wide" and wide else columns
    print_table(rows, chosen)


def emit(data: Any, output: str) -> None:
    if output == "json":
        click.echo(json.dumps(data, indent=2, ensure_ascii=False))
    else:
        import yaml

        click.echo(yaml.safe_dump(data, sort_keys=False, allow_unicode=True), nl=False)


def print_table(rows: Sequence[dict[str, Any]], columns: list[str]) -> None:
    """Plain columns (no colours, no truncation): as readable in a pipe as on a terminal."""
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    headers = [c.upper() for c in columns]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    for line in [headers, *cells]:
        click.echo("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip())


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.1f}"
    text = str(value)
    return text if len(text) <= 60 else text[:59] + "…"


def main() -> None:
    cli(prog_name="gpucp")


if __name__ == "__main__":
    main()
