"""The policy's switches an operator sets from the environment reach the scheduler's Config."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.scheduling.cycle import scheduler_config
from scheduler.model import Ordering, VictimOrder

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


@pytest.mark.parametrize(
    "setting, bound",
    [(None, "5"), ("", "5"), ("3", "3"), ("0", "0"), ("none", "None"), (" None ", "None")],
)
def test_the_preemption_bound_comes_from_the_environment(setting, bound):
    done = _run(**({} if setting is None else {"SCHEDULER_MAX_PREEMPTIONS": setting}))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == bound


@pytest.mark.parametrize("setting", ["three", "2.5", "-1"])
def test_a_preemption_bound_that_is_not_a_count_stops_the_process_with_its_name(setting):
    done = _run(SCHEDULER_MAX_PREEMPTIONS=setting)
    assert done.returncode != 0
    assert "SCHEDULER_MAX_PREEMPTIONS must be" in done.stderr


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"ordering": "fastest"}, "SCHEDULER_POLICY: ordering='fastest': expected one of fair,"),
        ({"min_runtime": 5}, "SCHEDULER_POLICY: unknown Config fields: min_runtime"),
    ],
)
def test_a_policy_setting_the_core_does_not_know_is_an_error_naming_it(
    settings, overrides, message
):
    settings.SCHEDULER_POLICY = overrides
    with pytest.raises(ValueError, match=message):
        scheduler_config()


def test_a_policy_choice_given_by_name_becomes_the_core_s_own_member(settings):
    # What an operator's settings hold is text; the core (which may run compiled, checking
    # every field's type) gets the member.
    settings.SCHEDULER_POLICY = {"ordering": "sjf", "victim_order": "youngest"}
    config = scheduler_config()
    assert config.ordering is Ordering.SJF
    assert config.victim_order is VictimOrder.YOUNGEST
