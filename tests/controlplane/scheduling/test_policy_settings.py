"""The policy's switches an operator sets from the environment reach the scheduler's Config."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

_CONFIG_OF_A_FRESH_PROCESS = """
import django
django.setup()
from controlplane.scheduling.cycle import scheduler_config
print(scheduler_config().max_preemptions)
"""


def _run(**environment: str) -> subprocess.CompletedProcess:
    env = {
        "PATH": os.environ["PATH"],
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        **environment,
    }
    return subprocess.run(
        [sys.executable, "-c", _CONFIG_OF_A_FRESH_PROCESS],
        cwd=Path(__file__).resolve().parents[3],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("setting, bound", [(None, "None"), ("", "None"), ("3", "3"), ("0", "0")])
def test_the_preemption_bound_comes_from_the_environment(setting, bound):
    done = _run(**({} if setting is None else {"SCHEDULER_MAX_PREEMPTIONS": setting}))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == bound


@pytest.mark.parametrize("setting", ["three", "2.5", "-1"])
def test_a_preemption_bound_that_is_not_a_count_stops_the_process_with_its_name(setting):
    done = _run(SCHEDULER_MAX_PREEMPTIONS=setting)
    assert done.returncode != 0
    assert "SCHEDULER_MAX_PREEMPTIONS must be" in done.stderr
