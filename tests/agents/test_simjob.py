"""The stand-in job of simulated nodes goes as fast as its GPUs' modelled speed lets it."""

import subprocess
import sys

import pytest

from agents.simjob import read_speed, run_work
from tests.agents.conftest import REPO


class Sleeper:
    def __init__(self) -> None:
        self.slept_s = 0.0

    def __call__(self, seconds: float) -> None:
        self.slept_s += seconds


def test_at_full_speed_the_work_takes_its_own_length():
    sleeper = Sleeper()
    assert run_work(10.0, lambda: 1.0, sleep=sleeper) == pytest.approx(10.0)
    assert sleeper.slept_s == pytest.approx(10.0)


def test_a_capped_gpu_at_half_speed_doubles_the_time():
    assert run_work(10.0, lambda: 0.5, sleep=Sleeper()) == pytest.approx(20.0)


def test_a_cap_that_changes_midway_changes_the_pace_from_then_on():
    speeds = iter([1.0] * 10 + [0.25] * 1000)  # 5 s of work at full speed, then a quarter
    assert run_work(10.0, lambda: next(speeds), step_s=0.5, sleep=Sleeper()) == pytest.approx(
        5.0 + 20.0
    )


def test_a_lost_gpu_makes_no_progress_until_it_is_back():
    speeds = iter([0.0] * 4 + [1.0] * 100)
    assert run_work(1.0, lambda: next(speeds), step_s=0.5, sleep=Sleeper()) == pytest.approx(3.0)


def test_the_speed_file_is_read_and_a_missing_one_falls_back(tmp_path):
    path = tmp_path / "speed"
    assert read_speed(str(path), 0.7) == 0.7
    path.write_text("0.812500\n")
    assert read_speed(str(path), 0.7) == 0.8125
    assert read_speed(None, 0.9) == 0.9


def test_the_job_runs_reports_progress_and_exits_with_the_code_asked_for(tmp_path):
    speed = tmp_path / "speed"
    speed.write_text("1.0\n")
    result = subprocess.run(
        [sys.executable, "-m", "agents.simjob", "--work-s", "0.2", "--step-s", "0.1"]
        + ["--exit-code", "3"],
        cwd=REPO,
        env={"GPUCP_SIM_SPEED_FILE": str(speed), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 3
    assert "progress 0.2/0.2 s of work at speed 1.000" in result.stdout
    assert result.stdout.strip().endswith("in 0.2 s")
