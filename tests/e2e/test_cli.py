"""The `gpucp` command against the live control plane: login, submit from a job file, run,
--wait and --follow, logs -f, ls, cancel, and how refusals read. It runs the installed command
(`pip install ./client`, as `make venv` does) in a process of its own, as a person would.

Here rather than in tests/client/ so that it shares this suite's control plane (one gunicorn
and one worker for the session) instead of starting another.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import textwrap
import threading
from pathlib import Path

import pytest

from .conftest import BIN, IMAGE

pytestmark = pytest.mark.slow
GPUCP = str(BIN / "gpucp")


@pytest.fixture
def gpucp(cluster, tmp_path):
    """Runs `gpucp ARGS`, with its own config file and no GPUCP_* from outside."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCP_")}
    env["GPUCP_CONFIG"] = str(tmp_path / "config" / "gpucp" / "config.yaml")

    def run(*args: str, stdin: str | None = None, extra_env: dict | None = None, timeout_s=120):
        return subprocess.run(
            [GPUCP, *args],
            input=stdin,
            capture_output=True,
            text=True,
            env={**env, **(extra_env or {})},
            timeout=timeout_s,
        )

    run.env = env
    return run


def test_a_researchers_session_with_the_command_line(cluster, gpucp, tmp_path):
    # Log in: the token is checked, then stored where only its owner can read it.
    login = gpucp("login", cluster.cp.url, "--token-stdin", stdin=cluster.user_token + "\n")
    assert login.returncode == 0, login.stderr
    config = Path(gpucp.env["GPUCP_CONFIG"])
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert cluster.user_token in config.read_text()
    whoami = gpucp("whoami", "-o", "json")
    assert json.loads(whoami.stdout)["tenants"] == [
        {"slug": "vision", "name": "Vision lab", "role": "member"}
    ]

    cluster.start_agent("cli-a", gpus=2)

    # A job file with comments, two fields overridden on the command line; --follow streams
    # its output and the command ends with the job's exit code.
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        textwrap.dedent(
            f"""\
            # What a researcher keeps next to the code.
            name: from-the-file   # replaced by --set
            image: {IMAGE}
            command: [sh, -c, 'echo "$GREETING from $GPUCP_JOB_ID"; exit 0']
            gpus: 1
            """
        )
    )
    submitted = gpucp(
        "submit", str(job_file), "--set", "name=from-set", "--set", "env.GREETING=hi", "--follow"
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = int(submitted.stderr.split("Submitted job ")[1].split()[0])
    assert f"hi from {job_id}\n" in submitted.stdout
    assert cluster.job(job_id)["name"] == "from-set"

    # run --wait: the job's own exit code, 0 and not.
    failing = gpucp(
        "run", "--image", IMAGE, "--set", "restartable=false", "--wait", "--", "sh", "-c", "exit 3"
    )
    assert failing.returncode == 3, failing.stderr
    assert "FAILED (exit code 3)" in failing.stdout

    # ls -o json lists both, newest first; wide and table read too.
    listed = json.loads(gpucp("ls", "-o", "json").stdout)
    assert [j["id"] for j in listed][1] == job_id and len(listed) == 2
    assert "from-set" in gpucp("ls", "-o", "wide").stdout

    # The other views read: the job's attempts and timeline, the queue, usage, the cluster.
    shown = gpucp("show", str(job_id))
    assert shown.returncode == 0, shown.stderr
    assert "cli-a" in shown.stdout and "Timeline:" in shown.stdout
    assert json.loads(gpucp("queue", "-o", "json").stdout) == []
    assert [row["tenant"] for row in json.loads(gpucp("usage", "-o", "json").stdout)] == ["vision"]
    top = gpucp("top")
    assert top.returncode == 0 and "vision" not in top.stdout  # nothing of vision runs now

    # A refusal is one line naming the field, and a non-zero exit.
    refused = gpucp("run", "--image", IMAGE, "--set", "gpus=-1", "--", "true")
    assert refused.returncode == 4
    (line,) = refused.stderr.strip().splitlines()
    assert "gpus:" in line

    # A token the control plane refuses says how to log in again.
    bad = gpucp("ls", extra_env={"GPUCP_TOKEN": "gpucp_not-a-token"})
    assert bad.returncode == 3 and "gpucp login" in bad.stderr


def test_logs_follow_a_running_job_to_its_end_and_cancel_stops_one(cluster, gpucp):
    cluster.start_agent("cli-b", gpus=2)
    env = {"GPUCP_URL": cluster.cp.url, "GPUCP_TOKEN": cluster.user_token}
    # Three lines a second apart, then a long pause and the end: the first line must reach
    # the terminal while the job is still running (the agents ship output every second).
    job_id = cluster.submit(
        ["sh", "-c", "for i in 1 2 3; do echo line $i; sleep 1; done; sleep 5; echo end"]
    )
    follower = subprocess.Popen(
        [GPUCP, "logs", str(job_id), "-f"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**gpucp.env, **env},
    )
    lines: list[tuple[str, str]] = []

    def read():
        assert follower.stdout is not None
        for line in follower.stdout:
            lines.append((line, cluster.job(job_id)["state"]))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        follower.wait(timeout=120)
    finally:
        follower.kill()
        reader.join(timeout=10)
    assert follower.returncode == 0, follower.stderr.read() if follower.stderr else ""
    assert [text for text, _ in lines] == ["line 1\n", "line 2\n", "line 3\n", "end\n"]
    # Streamed: the first line was on the terminal before the job ended.
    assert lines[0][1] in ("ADMITTED", "RUNNING")
    assert cluster.job(job_id)["state"] == "SUCCEEDED"

    # cancel, then wait: a cancelled job's wait ends with 125, the documented code.
    sleeper = cluster.submit(["sh", "-c", "echo started; exec sleep 300"])
    cluster.wait_for_state(sleeper, "RUNNING")
    cancelled = subprocess.run(
        [GPUCP, "cancel", str(sleeper)], capture_output=True, text=True, env={**gpucp.env, **env}
    )
    assert cancelled.returncode == 0 and "CANCELLED" in cancelled.stdout
    waited = subprocess.run(
        [GPUCP, "wait", str(sleeper)], capture_output=True, text=True, env={**gpucp.env, **env}
    )
    assert waited.returncode == 125
    again = subprocess.run(
        [GPUCP, "cancel", str(sleeper)], capture_output=True, text=True, env={**gpucp.env, **env}
    )
    assert again.returncode == 4 and "already finished" in again.stderr
