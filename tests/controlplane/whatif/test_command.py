"""python manage.py whatif on a small real history: the table, its figures, and its errors."""

import re
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from controlplane.scheduling.whatif.replay import CURRENT_LABEL, REAL_LABEL, WHATIF_LABEL
from controlplane.tenancy.models import Quota
from tests.controlplane.whatif.conftest import SINCE, T0, UNTIL

pytestmark = pytest.mark.django_db


def whatif(*args: str) -> str:
    out = StringIO()
    call_command("whatif", "--since", SINCE, "--until", UNTIL, *args, stdout=out)
    return out.getvalue()


def table_rows(text: str) -> dict[str, dict[str, str]]:
    """The summary table as {run label: {column: cell}}."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    header = next(line for line in lines if line.startswith("| run |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    rows = {}
    for line in lines[lines.index(header) + 1 :]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != len(columns):
            break
        rows[cells[0]] = dict(zip(columns, cells, strict=True))
    return rows


def number(cell: str) -> float:
    return float(re.sub(r"[^0-9.\-]", "", cell.split(" ")[0]))


@pytest.fixture
def two_gpu_node(make_node):
    return make_node("n1", gpus=2)


@pytest.fixture
def one_gpu_at_a_time(vision, alice, two_gpu_node, finished_job):
    """Vision may hold one GPU: of two 600 s jobs submitted together, the second waited 600 s."""
    Quota.objects.filter(tenant=vision).update(guaranteed_gpus=1, limit_gpus=1)
    finished_job(vision, alice, two_gpu_node, submit_s=0, wait_s=0, run_s=600)
    finished_job(vision, alice, two_gpu_node, submit_s=0, wait_s=600, run_s=600)


def test_the_report_sets_what_really_happened_next_to_the_simulated_runs(one_gpu_at_a_time):
    rows = table_rows(whatif("--quota", "vision:H100-SXM-80GB=2:2"))
    assert list(rows) == [REAL_LABEL, CURRENT_LABEL, WHATIF_LABEL]
    real = rows[REAL_LABEL]
    # Read from the rows: queues of 0 and 600 s, JCTs of 600 and 1,200 s.
    assert number(real["mean queue (s)"]) == 300.0
    assert number(real["mean JCT (s)"]) == 900.0
    assert real["jobs"] == "2"


def test_the_current_config_replays_to_what_really_happened(one_gpu_at_a_time):
    rows = table_rows(whatif("--quota", "vision:H100-SXM-80GB=2:2"))
    current = rows[CURRENT_LABEL]
    # The loop is quiet when each job arrives or ends, so each request runs its cycle at once
    # (controlplane/wakeups.py): the first job starts on arrival, the second when the first
    # ends, queues of 0 and 600 s, as really happened.
    assert number(current["mean queue (s)"]) == pytest.approx(300, abs=0.051)
    assert number(current["mean JCT (s)"]) == pytest.approx(900, abs=0.051)


def test_a_second_gpu_for_the_tenant_removes_the_wait(one_gpu_at_a_time):
    rows = table_rows(whatif("--quota", "vision:H100-SXM-80GB=2:2"))
    whatif_row = rows[WHATIF_LABEL]
    assert number(whatif_row["mean queue (s)"]) == pytest.approx(0, abs=0.051)
    assert number(whatif_row["mean JCT (s)"]) == pytest.approx(600, abs=0.051)
    assert number(whatif_row["waited"]) == 0.0


def test_the_report_says_what_changes_against_the_current_values(one_gpu_at_a_time):
    text = whatif("--quota", "vision:H100-SXM-80GB=2:2", "--weight", "vision=2")
    assert "vision: quota H100-SXM-80GB (guaranteed/limit GPUs) 1/1 -> 2/2" in text
    assert "vision: weight 1 -> 2" in text


@pytest.fixture
def busy_history(vision, nlp, alice, bob, make_node, finished_job):
    """Vision (limit 4 of 8 GPUs) submits bursts that queue; nlp runs a little beside it."""
    node = make_node("n8", gpus=8)
    Quota.objects.filter(tenant=vision).update(guaranteed_gpus=2, limit_gpus=4)
    Quota.objects.filter(tenant=nlp).update(guaranteed_gpus=2, limit_gpus=4)
    clock_s = 0.0
    for i in range(12):
        # Real history in sequence (one at a time): each waited for the one before.
        run_s = 300 + 97 * (i % 5)
        finished_job(
            vision,
            alice,
            node,
            submit_s=60 * i,
            wait_s=max(0, clock_s - 60 * i),
            run_s=run_s,
            gpus=2 if i % 3 else 1,
        )
        clock_s = max(clock_s, 60 * i) + run_s
    for i in range(3):
        finished_job(nlp, bob, node, submit_s=30 + 400 * i, wait_s=0, run_s=200, gpus=1)
    return node


def test_more_gpus_through_a_quota_never_raise_the_simulated_mean_queue(busy_history):
    rows = table_rows(whatif("--quota", "vision:H100-SXM-80GB=2:8"))
    current, more = rows[CURRENT_LABEL], rows[WHATIF_LABEL]
    assert number(more["mean queue (s)"]) <= number(current["mean queue (s)"])
    assert number(more["mean queue (s)"]) < number(current["mean queue (s)"]), "vision queued"
    assert number(more["mean JCT (s)"]) <= number(current["mean JCT (s)"])


def test_a_what_if_policy_is_replayed_on_the_same_jobs(busy_history):
    rows = table_rows(whatif("--policy", "fifo-static"))
    assert rows[WHATIF_LABEL]["jobs"] == rows[REAL_LABEL]["jobs"] == "15"
    # On its own partition every tenant is its own reference: rho is 1.
    assert number(rows[WHATIF_LABEL]["max rho"]) == pytest.approx(1.0)


def test_preemptions_that_really_happened_are_counted(vision, alice, two_gpu_node, finished_job):
    finished_job(vision, alice, two_gpu_node, submit_s=0, run_s=300, preempted_after_s=120)
    finished_job(vision, alice, two_gpu_node, submit_s=10, run_s=300)
    real = table_rows(whatif())[REAL_LABEL]
    assert real["preempt"] == "1"
    # The preempted attempt held its GPU 120 s: that is what the preemption cost.
    assert number(real["GPU-h lost"]) == pytest.approx(round(120 / 3600, 1))


def test_cancelled_jobs_are_left_out_and_counted(
    vision, alice, two_gpu_node, finished_job, make_job
):
    from controlplane.jobs import actions

    finished_job(vision, alice, two_gpu_node, submit_s=0, run_s=300)
    actions.cancel_job(make_job(vision, alice, name="gave-up", submitted_at=T0))
    text = whatif()
    assert "Left out: 1 cancelled." in text
    assert table_rows(text)[REAL_LABEL]["jobs"] == "1"


def test_without_changes_the_report_has_the_real_and_the_current_rows(one_gpu_at_a_time):
    assert list(table_rows(whatif())) == [REAL_LABEL, CURRENT_LABEL]


def test_out_writes_the_report_and_its_plots(one_gpu_at_a_time, tmp_path):
    text = whatif(
        "--quota",
        "vision:H100-SXM-80GB=2:2",
        "--power-budget",
        "default=900",
        "--out",
        str(tmp_path),
    )
    report = (tmp_path / "report.md").read_text()
    assert report.startswith(text.splitlines()[0])
    assert "pool default: power budget none -> 900 W" in report
    for png in ("jct_cdf.png", "queue_per_tenant.png", "utilization.png", "power.png"):
        assert (tmp_path / png).stat().st_size > 1000
        assert f"]({png})" in report


@pytest.mark.parametrize(
    "args, argument, words",
    [
        (["--weight", "robotics=2"], "--weight", "unknown tenant 'robotics'"),
        (["--quota", "robotics:H100-SXM-80GB=1:2"], "--quota", "unknown tenant 'robotics'"),
        (
            ["--quota", "vision:H100-SXM-80GB=8"],
            "--quota",
            "is not TENANT:GPU_TYPE=GUARANTEED:LIMIT",
        ),
        (["--quota", "vision=8:16"], "--quota", "is not TENANT:GPU_TYPE=GUARANTEED:LIMIT"),
        (["--quota", "vision:H100-SXM-80GB=9:8"], "--quota", "the limit is below the guarantee"),
        (["--quota", "vision:A100=1:2"], "--quota", "no GPU of type 'A100'"),
        (["--weight", "vision=0"], "--weight", "above 0"),
        (["--weight", "vision"], "--weight", "is not TENANT=WEIGHT"),
        (["--power-budget", "default=lots"], "--power-budget", "is not POOL=WATTS"),
        (["--power-budget", "attic=500"], "--power-budget", "unknown pool 'attic'"),
        (["--policy", "lottery"], "--policy", "unknown policy 'lottery'"),
    ],
)
def test_bad_arguments_are_refused_naming_the_argument(vision, two_gpu_node, args, argument, words):
    with pytest.raises(CommandError) as raised:
        whatif(*args)
    assert str(raised.value).startswith(f"{argument}: ")
    assert words in str(raised.value)


def test_a_period_that_ends_before_it_begins_is_refused(vision, two_gpu_node):
    with pytest.raises(
        CommandError, match=r"^--since: 2026-12-01T00:00:00\+00:00 is not before --until"
    ):
        call_command("whatif", "--since", "2026-12-01", "--until", "2026-11-01", stdout=StringIO())


def test_a_malformed_date_is_refused_naming_the_argument(vision, two_gpu_node):
    with pytest.raises(CommandError, match=r"^--until: '1st of December' is not a date"):
        call_command("whatif", "--since", SINCE, "--until", "1st of December", stdout=StringIO())


def test_a_period_without_finished_jobs_says_so(one_gpu_at_a_time):
    with pytest.raises(CommandError, match="no finished job was submitted"):
        call_command("whatif", "--since", "2025-01-01", "--until", "2025-02-01", stdout=StringIO())


def test_the_replays_report_their_progress_in_order_up_to_the_end(busy_history):
    from controlplane.scheduling.whatif.params import build_params
    from controlplane.scheduling.whatif.replay import run_whatif

    seen: list[float] = []
    params = build_params(since=SINCE, until=UNTIL, quotas=["vision:H100-SXM-80GB=2:8"])
    run_whatif(params, progress=seen.append)
    assert seen == sorted(seen)
    assert seen[-1] == 1.0
    # The reference, the current config and the what-if: each ends a third further.
    assert any(0 < f < 1 for f in seen)


def test_a_job_admitted_a_moment_after_its_submit_did_not_wait(
    vision, alice, make_node, finished_job
):
    # A real cluster admits a job that finds free GPUs within a cycle (here 2 s): that is not
    # waiting, or every job of a real history would have "waited" against the simulation's
    # instant starts. The one that waited a minute for a GPU did.
    node = make_node("n1", gpus=1)
    finished_job(vision, alice, node, submit_s=0, wait_s=2, run_s=600)
    finished_job(vision, alice, node, submit_s=560, wait_s=60 - 18, run_s=600)
    real = table_rows(whatif())[REAL_LABEL]
    assert real["waited"] == "50.0 %"
