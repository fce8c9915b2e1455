"""Agents that die: a restarted agent adopts its jobs; a dead node's work moves elsewhere, once."""

import signal
import time

import pytest

from controlplane.jobs.models import JobEvent

from .conftest import job_processes, wait_until

pytestmark = pytest.mark.slow


def test_an_agent_killed_while_its_job_runs_adopts_it_on_restart_and_it_finishes_once(cluster):
    agent = cluster.start_agent("e2e-a")
    job_id = cluster.submit(["sh", "-c", "echo begin; sleep 6; echo end"])
    job = cluster.wait_for_state(job_id, "RUNNING")
    attempt_id = job["attempts"][0]["id"]
    wait_until(lambda: job_processes(attempt_id), 30, "the job's process")

    agent.kill(signal.SIGKILL)
    assert job_processes(attempt_id), "the job must outlive its agent"
    agent.start()

    job = cluster.wait_for_state(job_id, "SUCCEEDED", "FAILED", "PENDING")
    assert job["state"] == "SUCCEEDED"
    assert [(a["id"], a["state"]) for a in job["attempts"]] == [(attempt_id, "SUCCEEDED")]
    assert [e.kind for e in JobEvent.objects.filter(job_id=job_id, kind="running")] == ["running"]
    text = wait_until(
        lambda: (lambda t: t if "end" in t else None)(cluster.logs(job_id)["text"]),
        30,
        "the whole output",
    )
    # Ran once: one beginning, one end.
    assert text == "begin\nend\n"


def noting(trace, body: str) -> list[str]:
    """A job that notes its start, SIGTERM and end (with its attempt, GPUs and the time)."""
    note = (
        f'note() {{ echo "$1 $GPUCP_ATTEMPT_ID $CUDA_VISIBLE_DEVICES $(date +%s.%N)" >> {trace}; }}'
    )
    return ["sh", "-c", f"{note}; trap 'note term; exit 143' TERM; note start; {body}; note end"]


def notes(trace) -> list[tuple[str, int, str, float]]:
    """(what, attempt, GPUs, time) of every note, in the order written."""
    rows = []
    for line in trace.read_text().splitlines():
        what, attempt, gpus, at = line.split()
        rows.append((what, int(attempt), gpus, float(at)))
    return rows


def test_a_dead_agents_fence_stops_its_job_before_the_job_runs_elsewhere(cluster, tmp_path):
    old = cluster.start_agent("e2e-old")
    trace = tmp_path / "trace"
    # The first attempt would outlast the whole test; the next one is short. (`sleep & wait`:
    # a shell runs its trap only between commands.)
    first_run = tmp_path / "first-run"
    body = f"if mkdir {first_run} 2>/dev/null; then sleep 300 & wait; else sleep 2; fi"
    job_id = cluster.submit(noting(trace, body), restartable=True)
    job = cluster.wait_for_state(job_id, "RUNNING")
    stale_attempt = job["attempts"][0]["id"]
    assert job["attempts"][0]["node"] == "e2e-old"
    wait_until(lambda: job_processes(stale_attempt), 30, "the first attempt's process")
    cluster.start_agent("e2e-new")

    # Cut off for good: the agent is gone. Its job would keep running (like a partitioned
    # host's), but the node's fence, a process of its own, stops it before the lease runs out.
    old.kill(signal.SIGKILL)

    from controlplane.cluster.models import Node

    wait_until(
        lambda: not Node.objects.get(name="e2e-old").ready, 60, "e2e-old to become not ready"
    )
    job = cluster.wait_for_job(
        job_id,
        lambda j: len(j["attempts"]) == 2 and j["attempts"][1]["state"] == "RUNNING",
        "a second attempt running on e2e-new",
    )
    first, second = job["attempts"]
    assert (first["state"], second["node"]) == ("LOST", "e2e-new")
    assert not job_processes(stale_attempt), "the stale attempt still runs on the cut-off node"
    wait_until(lambda: any(n[:2] == ("start", second["id"]) for n in notes(trace)), 30, "start")
    (term_at,) = [at for what, a, _, at in notes(trace) if (what, a) == ("term", stale_attempt)]
    (start_at,) = [at for what, a, _, at in notes(trace) if (what, a) == ("start", second["id"])]
    assert term_at < start_at, "the job ran twice at once"

    # The old agent returns and says how its attempt ended: stopped by its fence.
    old.start()
    job = cluster.wait_for_state(job_id, "SUCCEEDED", "FAILED")
    assert job["state"] == "SUCCEEDED"
    assert [(a["node"], a["state"]) for a in job["attempts"]] == [
        ("e2e-old", "LOST"),
        ("e2e-new", "SUCCEEDED"),
    ]
    kinds = [e["kind"] for e in job["events"]]
    assert kinds.count("lost") == 1
    assert kinds.count("succeeded") == 1
    wait_until(lambda: Node.objects.get(name="e2e-old").ready, 30, "e2e-old to be back")
    late = wait_until(
        lambda: [e for e in cluster.job(job_id)["events"] if e["kind"] == "late_report"],
        30,
        "the old node's late report",
    )
    assert "stopped by its node" in late[0]["message"]


def test_a_paused_agents_fence_stops_its_jobs_before_their_gpus_go_to_anyone(cluster, tmp_path):
    """SIGSTOP past the lease: the agent cannot act, its fence does. With the jobs' own ledger:
    no job runs twice at once, and no GPU holds two jobs at once."""
    trace = tmp_path / "ledger"
    paused = cluster.start_agent("e2e-paused")
    first = cluster.submit(noting(trace, "sleep 300 & wait"), restartable=True)
    job = cluster.wait_for_state(first, "RUNNING")
    original = job["attempts"][0]["id"]
    wait_until(lambda: job_processes(original), 30, "the first job's process")
    cluster.start_agent("e2e-other")

    paused.proc.send_signal(signal.SIGSTOP)
    try:
        job = cluster.wait_for_job(
            first,
            lambda j: len(j["attempts"]) == 2 and j["attempts"][1]["state"] == "RUNNING",
            "the first job to run again on e2e-other",
        )
        assert job["attempts"][1]["node"] == "e2e-other"
        # A second job can go nowhere but to the paused node's GPU, once that node is back.
        second = cluster.submit(noting(trace, "sleep 1"), restartable=True)
        time.sleep(2)
        assert cluster.job(second)["state"] == "PENDING"
    finally:
        paused.proc.send_signal(signal.SIGCONT)
    job = cluster.wait_for_state(second, "SUCCEEDED", "FAILED")
    assert job["state"] == "SUCCEEDED" and job["attempts"][-1]["node"] == "e2e-paused"
    cluster.cancel(first)
    cluster.wait_for_state(first, "CANCELLED")

    # The ledger: when each attempt's process ran, on which GPU.
    spans: dict[int, list] = {}
    for _, attempt, gpus, at in notes(trace):
        span = spans.setdefault(attempt, [gpus, at, at])
        span[2] = max(span[2], at)
    assert {"term"} <= {w for w, a, _, _ in notes(trace) if a == original}
    by_gpu: dict[str, list] = {}
    for attempt, (gpus, begin, end) in spans.items():
        for gpu in gpus.split(","):
            by_gpu.setdefault(gpu, []).append((begin, end, attempt))
    for gpu, runs in by_gpu.items():
        runs.sort()
        for (_, end, a), (begin, _, b) in zip(runs, runs[1:], strict=False):
            assert end < begin, f"attempts {a} and {b} overlap on {gpu}"
    copy = cluster.job(first)["attempts"][1]["id"]
    assert spans[original][2] < spans[copy][1], "the first job ran twice at once"
