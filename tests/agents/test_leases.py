"""The node's side of leases: the lease each answer grants, the fence that stops attempts before it
runs out, what the agent will not start, and reports that say who ended an attempt.

Real processes throughout (the process runtime, the fence as a process of its own where that
is what is tested); the control plane is the tiny one of conftest.py.
"""

import json
import os
import signal
import time
from dataclasses import replace

import pytest

from agents import lease as leases
from agents.fence import AGENT_LOCK, FENCE_LOCK, Fence, ensure_fence, holding, is_held
from agents.runtime.base import AttemptSpec, AttemptState
from agents.runtime.process import ProcessRuntime
from tests.agents.conftest import wait_until
from tests.agents.test_daemon import attempt, ended, make_agent, runtime_state, uuids, waiting_on


def write_lease(state_dir, *, kill_in_s: float, grace_s: float = 5.0, lease_s: float = 60.0):
    """A lease whose SIGKILL moment is `kill_in_s` from now (negative: past)."""
    margin_s = leases.margin_for(lease_s)
    lease = leases.Lease(
        boot_id=leases.boot_id(),
        expires_at=leases.boottime() + kill_in_s + margin_s,
        lease_s=lease_s,
        margin_s=margin_s,
        grace_s=grace_s,
        renewed_at_unix=time.time(),
    )
    leases.write_lease(state_dir, lease)
    return lease


def trapping(marker, log):
    """A job that notes its SIGTERM (then exits 143) and otherwise runs until marker exists."""
    return (
        "sh",
        "-c",
        f"trap 'echo term >> {log}; exit 143' TERM; echo start >> {log}; "
        f"while [ ! -e {marker} ]; do sleep 0.05; done",
    )


def running_job(control_plane, state_dir, tmp_path, attempt_id=1, **agent_options):
    control_plane.lease_s = 60.0
    agent = make_agent(control_plane, state_dir, **agent_options)
    log = tmp_path / f"job-{attempt_id}.log"
    control_plane.set_desired([attempt(attempt_id, *trapping(tmp_path / "go", log))])
    agent.cycle()
    wait_until(lambda: log.exists() and "start" in log.read_text(), what="the job to start")
    return agent, log


# --- the lease an answer grants ----------------------------------------------------------------


def test_an_answer_renews_the_lease_counted_from_when_the_heartbeat_was_sent(
    control_plane, state_dir
):
    control_plane.lease_s = 30.0
    agent = make_agent(control_plane, state_dir)
    before = leases.boottime()
    agent.cycle()
    after = leases.boottime()

    lease = leases.read_lease(state_dir)
    assert before + 30.0 <= lease.expires_at <= after + 30.0
    assert lease.kill_at == lease.expires_at - leases.margin_for(30.0)
    assert lease.of_this_boot


def _on_disk(state_dir):
    lease = leases.read_lease(state_dir)
    return lease, os.stat(state_dir / leases.LEASE_FILE).st_ino


def test_renewals_close_together_are_written_once_and_the_file_never_ends_later_than_the_truth(
    control_plane, state_dir, monkeypatch
):
    """Each answer renews the lease; the file (a new inode each time) follows within the lag."""
    control_plane.lease_s = 60.0
    agent = make_agent(control_plane, state_dir)
    sent_at = [1000.0]
    monkeypatch.setattr(leases, "boottime", lambda: sent_at[0])
    agent.cycle()
    first, inode = _on_disk(state_dir)
    lag_s = leases.rewrite_lag_s(60.0)
    writes = 0
    for step_s in (0.1, 0.2, 0.3, 0.25, 0.4, 0.05, 0.6, 0.3, 0.2, 1.5, 0.1):
        sent_at[0] += step_s
        agent.cycle()
        lease, now_inode = _on_disk(state_dir)
        writes += now_inode != inode
        inode = now_inode
        truth_s = sent_at[0] + 60.0
        # Never later than what the last answer granted, never more than the lag earlier.
        assert truth_s - lag_s < lease.expires_at <= truth_s
        # The agent decides on the lease the fence and the supervisor read.
        assert agent.lease.expires_at == lease.expires_at
    assert 0 < writes <= 5  # 11 answers: the file moves only once the lag is used up


def test_an_attempt_with_a_longer_grace_is_in_the_lease_file_before_the_next_renewal(
    control_plane, state_dir, tmp_path
):
    control_plane.lease_s = 60.0
    agent = make_agent(control_plane, state_dir)
    control_plane.set_desired([attempt(1, *waiting_on(tmp_path / "go"), grace_s=20.0)])
    agent.cycle()
    assert leases.read_lease(state_dir).grace_of(1) == 20.0
    control_plane.set_desired(
        [
            attempt(1, *waiting_on(tmp_path / "go"), grace_s=20.0),
            attempt(2, *waiting_on(tmp_path / "go"), grace_s=50.0),
        ]
    )
    agent.cycle()
    lease = leases.read_lease(state_dir)
    assert lease.grace_of(2) == 50.0 and lease.grace_of(1) >= 20.0
    (tmp_path / "go").touch()


def test_without_a_lease_in_the_answer_nothing_is_written(control_plane, state_dir):
    agent = make_agent(control_plane, state_dir)
    agent.cycle()
    assert leases.read_lease(state_dir) is None


def test_a_lease_of_another_boot_is_void(state_dir):
    lease = write_lease(state_dir, kill_in_s=3600)
    lease.boot_id = "another-boot"
    assert lease.remaining_s() == float("-inf")


def test_retries_come_often_enough_that_the_lease_cannot_run_out_between_two(
    control_plane, state_dir
):
    agent = make_agent(control_plane, state_dir)
    agent.backoff.max_s = 30.0
    agent.backoff.failures = 10
    agent.lease = write_lease(state_dir, kill_in_s=8.0, grace_s=0.0)
    assert agent._retry_delay_s() <= 8.0 / 4 + 0.01


def test_retries_come_often_enough_to_renew_before_the_fence_signals_a_job(
    control_plane, state_dir
):
    """The fence signals a job its grace before the kill: that is the deadline that counts."""
    agent = make_agent(control_plane, state_dir)
    agent.backoff.max_s = 30.0
    agent.backoff.failures = 10
    agent.lease = write_lease(state_dir, kill_in_s=10.0, grace_s=6.0)
    assert agent._retry_delay_s() <= (10.0 - 6.0) / 4 + 0.01
    # Once the first signal is due, every half second until the kill.
    agent.lease = write_lease(state_dir, kill_in_s=3.0, grace_s=6.0)
    assert agent._retry_delay_s() <= 0.5


# --- what the agent will not start -------------------------------------------------------------


def test_nothing_starts_when_the_lease_would_run_out_before_it_could_be_stopped(
    control_plane, state_dir, tmp_path
):
    control_plane.lease_s = 4.0  # its SIGKILL moment is 3 s away; the grace is 5 s
    agent = make_agent(control_plane, state_dir)
    control_plane.set_desired([attempt(2, "true")])
    agent.cycle()
    assert runtime_state(agent, 2) is None

    control_plane.lease_s = 60.0
    agent.cycle()
    assert runtime_state(agent, 2) is not None


def _lease_of_another_boot(state_dir):
    leases.write_lease(state_dir, replace(write_lease(state_dir, kill_in_s=60.0), boot_id="other"))


def _lease_json_only(state_dir):
    write_lease(state_dir, kill_in_s=60.0)
    (state_dir / leases.LEASE_DEADLINE_FILE).unlink()


def _own_grace_too_long(state_dir):
    # The lease holds for 10 s more, but this attempt's own grace is 30 s.
    lease = write_lease(state_dir, kill_in_s=10.0, grace_s=5.0)
    leases.write_lease(state_dir, replace(lease, graces={"3": 30.0}))


@pytest.mark.parametrize(
    "lease, why",
    [
        (lambda state_dir: write_lease(state_dir, kill_in_s=-1.0), "lease ran out"),
        (lambda state_dir: write_lease(state_dir, kill_in_s=3.0, grace_s=5.0), "lease ran out"),
        (_own_grace_too_long, "lease ran out"),
        (_lease_of_another_boot, "before a reboot"),
        (_lease_json_only, "cannot be read"),
    ],
)
@pytest.mark.usefixtures("every_supervisor")
def test_the_supervisor_refuses_a_start_under_a_lease_that_ran_out(state_dir, tmp_path, lease, why):
    lease(state_dir)
    ran = tmp_path / "ran"
    runtime = ProcessRuntime(state_dir)
    status = runtime.start(
        AttemptSpec(attempt_id=3, command=("sh", "-c", f"echo job-output; touch {ran}"))
    )
    assert status.state is AttemptState.FAILED_TO_START and status.fenced
    assert why in status.message
    assert b"job-output" not in runtime.read_logs(3, 0, 1000)
    assert not ran.exists()
    (adopted,) = ProcessRuntime(state_dir).adopt()
    assert adopted.state is AttemptState.FAILED_TO_START and adopted.fenced


@pytest.mark.parametrize(
    "lease",
    [
        lambda state_dir: None,  # no lease yet: a control plane without leases
        lambda state_dir: write_lease(state_dir, kill_in_s=60.0, grace_s=5.0),
        lambda state_dir: leases.write_lease(
            state_dir, replace(write_lease(state_dir, kill_in_s=60.0), graces={"3": 30.0})
        ),
    ],
)
@pytest.mark.usefixtures("every_supervisor")
def test_the_supervisor_starts_the_job_under_a_lease_that_holds(state_dir, lease):
    lease(state_dir)
    runtime = ProcessRuntime(state_dir)
    runtime.start(AttemptSpec(attempt_id=3, command=("sh", "-c", "exit 7")))
    status = wait_until(
        lambda: next((s for s in runtime.statuses() if s.state is not AttemptState.RUNNING), None),
        what="the job to end",
    )
    assert (status.state, status.exit_code, status.fenced) == (AttemptState.EXITED, 7, False)


def test_the_supervisors_clock_is_the_leases_clock():
    # The supervisor reads CLOCK_BOOTTIME from /proc/uptime (a shell has no clock_gettime).
    with open("/proc/uptime") as f:
        uptime_s = float(f.read().split()[0])
    assert abs(uptime_s - leases.boottime()) < 1.0


def test_a_gpu_of_an_attempt_being_stopped_goes_to_the_next_one_only_once_it_is_gone(
    control_plane, state_dir, tmp_path
):
    agent = make_agent(control_plane, state_dir)
    gpu = uuids(agent)[0]
    trace = tmp_path / "trace"
    # The first job takes a second to stop on SIGTERM; the next one notes when it starts.
    slow_to_stop = f"trap 'sleep 1; echo old-gone >> {trace}; exit 143' TERM; " + (
        "while true; do sleep 0.05; done"
    )
    control_plane.set_desired([attempt(4, "sh", "-c", slow_to_stop, gpus=[gpu])])
    agent.cycle()
    wait_until(lambda: runtime_state(agent, 4) is AttemptState.RUNNING, what="the first job")
    time.sleep(0.2)  # its trap is set

    control_plane.set_desired([attempt(5, "sh", "-c", f"echo new-start >> {trace}", gpus=[gpu])])
    agent.cycle()
    assert runtime_state(agent, 5) is None, "started while the GPU was still held"
    ended(agent, 4)
    agent.cycle()
    ended(agent, 5)

    assert trace.read_text().split() == ["old-gone", "new-start"]
    (stopped,) = [r for r in control_plane.reported(4) if r["state"] == "exited"]
    assert stopped["stop_cause"] == "unwanted"


def test_an_attempt_that_ends_by_itself_reports_no_stop_cause(control_plane, state_dir):
    agent = make_agent(control_plane, state_dir)
    control_plane.set_desired([attempt(6, "true")])
    agent.cycle()
    ended(agent, 6)
    agent.cycle()
    (report,) = [r for r in control_plane.reported(6) if r["state"] == "exited"]
    assert "stop_cause" not in report


# --- a control plane that keeps the lease but records nothing ----------------------------------


def test_a_degraded_answer_renews_the_lease_and_changes_nothing_else(
    control_plane, state_dir, tmp_path
):
    agent, log = running_job(control_plane, state_dir, tmp_path, attempt_id=7)
    control_plane.set_desired([attempt(8, "true")])
    control_plane.degraded = True
    (tmp_path / "go").touch()
    ended(agent, 7)
    before = leases.boottime()

    assert agent.cycle()

    # Renewed: no more than the lag a lease on disk may have behind the truth.
    assert leases.read_lease(state_dir).expires_at >= before + 60.0 - leases.rewrite_lag_s(60.0)
    assert runtime_state(agent, 8) is None  # nothing started on its word
    assert 7 in agent._meta  # the exit was not acknowledged: reported again next time
    control_plane.degraded = False
    agent.cycle()
    assert [r["state"] for r in control_plane.reported(7)][-2:] == ["exited", "exited"]


def test_a_degraded_answer_stops_nothing(control_plane, state_dir, tmp_path):
    agent, _ = running_job(control_plane, state_dir, tmp_path, attempt_id=9)
    control_plane.degraded = True
    agent.cycle()
    agent.cycle()
    assert runtime_state(agent, 9) is AttemptState.RUNNING
    (tmp_path / "go").touch()


# --- the fence ---------------------------------------------------------------------------------


def test_the_fence_does_nothing_while_the_lease_holds(control_plane, state_dir, tmp_path):
    agent, log = running_job(control_plane, state_dir, tmp_path, attempt_id=10)
    fence = Fence(state_dir, ProcessRuntime(state_dir))
    assert fence.check() == {}
    assert runtime_state(agent, 10) is AttemptState.RUNNING
    (tmp_path / "go").touch()


def test_the_fence_gives_notice_at_the_grace_before_the_lease_runs_out_then_kills(
    control_plane, state_dir, tmp_path
):
    agent, log = running_job(control_plane, state_dir, tmp_path, attempt_id=11)
    lease = write_lease(state_dir, kill_in_s=3.0, grace_s=5.0)  # inside the grace already
    fence = Fence(state_dir, ProcessRuntime(state_dir))

    assert fence.check() == {11: "term"}
    assert fence.check() == {}  # one notice, not one per look
    ended(agent, 11)
    assert log.read_text().split() == ["start", "term"]
    assert leases.fenced(state_dir, 11) is not None
    # Had it ignored the notice, the lease's end brings the SIGKILL.
    assert fence._due(lease, 11, lease.kill_at) == "kill"

    agent.cycle()
    (report,) = [r for r in control_plane.reported(11) if r["state"] == "exited"]
    assert (report["exit_code"], report["stop_cause"]) == (143, "fenced")


def test_the_fence_kills_at_once_what_runs_past_the_lease(control_plane, state_dir, tmp_path):
    agent, log = running_job(control_plane, state_dir, tmp_path, attempt_id=12)
    write_lease(state_dir, kill_in_s=-0.1)

    assert Fence(state_dir, ProcessRuntime(state_dir)).check() == {12: "kill"}

    ended(agent, 12)
    assert "term" not in log.read_text()  # no time was left for a notice
    agent.cycle()
    (report,) = [r for r in control_plane.reported(12) if r["state"] == "exited"]
    assert (report["exit_code"], report["stop_cause"]) == (137, "fenced")


def test_a_fence_process_stops_the_jobs_of_a_paused_agent_and_then_goes(
    control_plane, state_dir, tmp_path
):
    """The agent cannot act (SIGSTOP, dead): the fence, a process of its own, still does."""
    agent, log = running_job(control_plane, state_dir, tmp_path, attempt_id=13)
    write_lease(state_dir, kill_in_s=1.5, grace_s=1.0)
    process = ensure_fence(state_dir, "process", "node-t", None)
    try:
        assert process is not None
        wait_until(lambda: is_held(state_dir / FENCE_LOCK), what="the fence to hold its lock")
        assert ensure_fence(state_dir, "process", "node-t", None) is None  # one per node
        wait_until(lambda: runtime_state(agent, 13) is not AttemptState.RUNNING, 10, "the fence")
        assert log.read_text().split() == ["start", "term"]
        # No agent holds the state directory and nothing runs: the fence has nothing to guard.
        process.wait(timeout=20)
    finally:
        if process is not None and process.poll() is None:
            process.kill()


def test_the_fence_stays_while_an_agent_holds_the_state_directory(state_dir):
    with holding(state_dir / AGENT_LOCK):
        process = ensure_fence(state_dir, "process", "node-t", None)
        try:
            time.sleep(7)
            assert process.poll() is None
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=10)
    assert process.returncode == 0


# --- energy at the exit ------------------------------------------------------------------------


class RealTimeClock:
    """A wall clock the test moves by hand, starting in the past so that a real exit (stamped
    by the supervisor with the real time) falls between two of its readings."""

    def __init__(self, start: float) -> None:
        self.now_s = start

    def __call__(self) -> float:
        return self.now_s


def test_an_exit_seen_late_is_booked_with_the_energy_at_the_exit(
    control_plane, state_dir, tmp_path
):
    clock = RealTimeClock(time.time() - 100.0)
    agent = make_agent(control_plane, state_dir, clock=clock)
    gpu = uuids(agent)[0]
    control_plane.set_desired([attempt(14, *waiting_on(tmp_path / "go"), gpus=[gpu])])
    agent.cycle()
    started = clock.now_s
    clock.now_s += 50.0
    agent.cycle()
    draw_w = {g["uuid"]: g["power_draw_w"] for g in control_plane.last_heartbeat()["gpus"]}[gpu]
    (tmp_path / "go").touch()
    ended(agent, 14)
    # The agent looks again only a minute after the exit (a busy host).
    clock.now_s = time.time() + 60.0
    agent.cycle()

    (report,) = [r for r in control_plane.reported(14) if r["state"] == "exited"]
    ran_s = report["finished_at"] - started
    assert report["energy_j"] == pytest.approx(draw_w * ran_s, rel=0.02)
    assert report["energy_j"] / ran_s <= agent.gpu.inventory()[0].power_max_w


def test_the_state_dir_holds_the_lease_for_people_to_read(control_plane, state_dir):
    control_plane.lease_s = 30.0
    make_agent(control_plane, state_dir).cycle()
    data = json.loads((state_dir / leases.LEASE_FILE).read_text())
    assert set(data) >= {"boot_id", "expires_at", "lease_s", "margin_s", "renewed_at_unix"}
    assert oct(os.stat(state_dir).st_mode & 0o777) == "0o700"


def test_a_renewal_the_file_already_covers_for_every_running_attempt_waits_for_the_lag():
    """With the running attempts' own graces, a lease on disk that gives each of them at least
    its grace (notice no later than the renewal would) and the same signals is not rewritten
    until the lag is used up; one that gives any of them less is written at once."""
    later = 100.0 + leases.rewrite_lag_s(60.0) / 2
    long_job = leases.Lease.renewed(100.0, 60.0, 10.0, {1: 30.0})
    # The long job ended; the next one asks for the agent's own grace.
    assert not leases.renewal_worth_writing(
        long_job, leases.Lease.renewed(later, 60.0, 10.0, {2: 10.0}), {2: 10.0}, 10.0
    )
    # A start named its attempt with its own grace (_lease_covers); the next renewal says the
    # same for it in another form (the longest grace for every attempt).
    covered = replace(leases.Lease.renewed(100.0, 60.0, 10.0, {}), graces={"3": 30.0})
    renewed = leases.Lease.renewed(later, 60.0, 10.0, {3: 30.0})
    assert not leases.renewal_worth_writing(covered, renewed, {3: 30.0}, 10.0)
    assert covered.term_at(3) <= renewed.term_at(3)  # its notice comes no later
    # An attempt with a shorter grace than the file gives everyone: covered too.
    assert not leases.renewal_worth_writing(
        long_job,
        leases.Lease.renewed(later, 60.0, 10.0, {1: 30.0, 2: 5.0}),
        {1: 30.0, 2: 5.0},
        10.0,
    )

    plain = leases.Lease.renewed(100.0, 60.0, 10.0, {})
    for graces, renewed, own_grace_s in (
        ({4: 30.0}, leases.Lease.renewed(later, 60.0, 10.0, {4: 30.0}), 10.0),  # not covered
        (
            {5: 10.0},
            leases.Lease.renewed(later, 60.0, 10.0, {5: 10.0}, signals={5: "SIGUSR1"}),
            10.0,
        ),
        ({}, leases.Lease.renewed(later, 60.0, 20.0, {}), 20.0),  # a longer --stop-grace
        ({}, leases.Lease.renewed(later, 30.0, 10.0, {}), 10.0),  # a shorter lease
        ({}, leases.Lease.renewed(later, 60.0, 10.0, {}, margin_s=7.0), 10.0),  # another margin
        ({}, leases.Lease.renewed(99.0, 60.0, 10.0, {}), 10.0),  # ends earlier
        ({}, leases.Lease.renewed(100.0 + leases.rewrite_lag_s(60.0), 60.0, 10.0, {}), 10.0),
    ):
        assert leases.renewal_worth_writing(plain, renewed, graces, own_grace_s), renewed
    assert leases.renewal_worth_writing(
        long_job,
        leases.Lease.renewed(later, 60.0, 10.0, {6: 45.0}),
        {6: 45.0},
        10.0,
    )
    # Nothing on disk yet, or a lease of another boot: always written.
    assert leases.renewal_worth_writing(None, plain, {}, 10.0)
    assert leases.renewal_worth_writing(replace(plain, boot_id="another boot"), plain, {}, 10.0)


def test_the_lease_files_read_back_as_written(state_dir):
    lease = replace(
        leases.Lease.renewed(100.0, 60.0, 10.0, {}, signals={7: "SIGUSR1"}),
        graces={"7": 42.5},
    )
    leases.write_lease(state_dir, lease)
    assert leases.read_lease(state_dir) == lease
    assert (state_dir / leases.LEASE_DEADLINE_FILE).read_text() == leases.deadline_text(lease)
    assert not list(state_dir.glob("*.tmp"))
