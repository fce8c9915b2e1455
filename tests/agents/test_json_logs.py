"""The agent's log lines as an operator reads them: JSON objects with the node's name on every
line and the job and attempt ids on lines about one attempt, or the familiar text lines.

agents.logcontext is shared with the control plane (settings.LOGGING names its filter and
formatters); its own behaviour is tested here, the control plane's lines in
tests/controlplane/test_json_logs.py.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import logging
import os
import signal
import subprocess
import sys
import threading

import pytest

from agents.__main__ import build_parser
from agents.logcontext import (
    PLAIN_FORMAT,
    ContextFilter,
    JsonFormatter,
    PlainFormatter,
    bound,
    current,
)
from tests.agents.conftest import REPO, wait_until


class Captured:
    """A handler as the agent and the control plane set theirs up, writing into a string."""

    def __init__(self, formatter: logging.Formatter) -> None:
        self.stream = io.StringIO()
        self.handler = logging.StreamHandler(self.stream)
        self.handler.addFilter(ContextFilter())
        self.handler.setFormatter(formatter)
        self.logger = logging.getLogger(f"tests.json_logs.{id(self)}")
        self.logger.addHandler(self.handler)
        self.logger.setLevel(logging.INFO)
        self.logger.propagate = False

    def text(self) -> str:
        return self.stream.getvalue()

    def objects(self) -> list[dict]:
        return [json.loads(line) for line in self.text().splitlines()]


@pytest.fixture
def as_json():
    return Captured(JsonFormatter(static_fields={"node": "gpu-07"}))


@pytest.fixture
def as_text():
    return Captured(PlainFormatter())


def test_a_json_line_has_its_time_level_logger_and_message_and_the_nodes_name(as_json):
    as_json.logger.warning("GPU %s: cap %.1f W not applied", "GPU-1", 300.0)

    (line,) = as_json.objects()
    assert list(line)[:4] == ["time", "level", "logger", "message"]
    assert line["level"] == "WARNING"
    assert line["logger"] == as_json.logger.name
    assert line["message"] == "GPU GPU-1: cap 300.0 W not applied"
    assert line["node"] == "gpu-07"
    assert line["time"].endswith("Z")
    logged_at = dt.datetime.fromisoformat(line["time"].replace("Z", "+00:00"))
    assert abs(dt.datetime.now(dt.UTC) - logged_at) < dt.timedelta(seconds=60)
    assert "job_id" not in line and "attempt_id" not in line


def test_lines_inside_a_bound_block_carry_its_ids_and_lines_after_it_none(as_json):
    with bound(job_id=12, attempt_id=31):
        as_json.logger.info("attempt 31 started (job 12)")
        with bound(tenant="vision"):
            as_json.logger.info("inner")
        as_json.logger.info("outer again")
    as_json.logger.info("agent stopped")

    started, inner, outer, after = as_json.objects()
    assert (started["job_id"], started["attempt_id"]) == (12, 31)
    assert "tenant" not in started
    assert (inner["job_id"], inner["attempt_id"], inner["tenant"]) == (12, 31, "vision")
    assert "tenant" not in outer and outer["attempt_id"] == 31
    assert not {"job_id", "attempt_id", "tenant"} & after.keys()
    assert after["node"] == "gpu-07"
    assert current() == {}


def test_an_exception_raised_in_a_block_is_logged_outside_it_with_the_blocks_ids(as_json):
    try:
        with bound(attempt_id=31, job_id=12):
            raise RuntimeError("the engine went away")
    except RuntimeError:
        as_json.logger.exception("heartbeat cycle failed; trying again after a backoff")

    (line,) = as_json.objects()
    assert (line["job_id"], line["attempt_id"]) == (12, 31)
    assert line["exc_info"].startswith("Traceback (most recent call last):")
    assert line["exc_info"].rstrip().endswith("RuntimeError: the engine went away")


def test_ids_bound_in_one_thread_never_reach_another_threads_lines(as_json):
    inside = threading.Event()
    logged = threading.Event()

    def work_on_an_attempt() -> None:
        with bound(attempt_id=7, job_id=3):
            inside.set()
            logged.wait(10)
            as_json.logger.info("from the attempt's thread")

    worker = threading.Thread(target=work_on_an_attempt)
    worker.start()
    assert inside.wait(10)
    as_json.logger.info("from the main thread, while the other is bound")
    logged.set()
    worker.join(10)

    main_line, worker_line = as_json.objects()
    assert main_line["message"].startswith("from the main thread")
    assert not {"job_id", "attempt_id"} & main_line.keys()
    assert (worker_line["job_id"], worker_line["attempt_id"]) == (3, 7)


def test_a_plain_line_without_ids_reads_exactly_as_before(as_text):
    record = logging.LogRecord(
        "agents.daemon", logging.INFO, __file__, 1, "registered as %s", ("n1",), None
    )
    before = logging.Formatter(PLAIN_FORMAT).format(record)

    as_text.logger.handle(record)

    assert as_text.text() == before + "\n"
    assert before.endswith(" INFO agents.daemon: registered as n1")


def test_a_plain_line_with_ids_ends_with_them_before_its_traceback(as_text):
    with bound(job_id=12, attempt_id=31, node="n1"):
        try:
            raise OSError("no space left")
        except OSError:
            as_text.logger.exception("attempt 31: start failed")

    first, *traceback = as_text.text().splitlines()
    assert first.endswith("attempt 31: start failed [job=12 attempt=31 node=n1]")
    assert traceback[0] == "Traceback (most recent call last):"
    assert traceback[-1] == "OSError: no space left"


def test_an_unknown_log_format_is_refused_naming_the_option(capsys, monkeypatch):
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["--url", "http://cp", "--log-format", "xml"])
    assert refused.value.code == 2
    assert "GPUCP_LOG_FORMAT / --log-format must be plain or json, not 'xml'" in (
        capsys.readouterr().err
    )

    monkeypatch.setenv("GPUCP_LOG_FORMAT", "yaml")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--url", "http://cp"])
    assert "must be plain or json, not 'yaml'" in capsys.readouterr().err

    monkeypatch.setenv("GPUCP_LOG_FORMAT", "JSON")
    assert build_parser().parse_args(["--url", "http://cp"]).log_format == "json"


def parsed_lines(text: str) -> list[dict]:
    """Every line as JSON: a line that is not fails the test, naming it."""
    objects = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            objects.append(json.loads(line))
        except ValueError:
            pytest.fail(f"line {number} is not JSON: {line!r}\n{text}")
    return objects


@pytest.mark.slow
def test_an_agent_with_json_logs_writes_only_json_naming_its_node_and_the_attempt_it_starts(
    control_plane, state_dir
):
    control_plane.heartbeat_interval_s = 0.3
    control_plane.set_desired(
        [
            {
                "attempt_id": 51,
                "job_id": 5,
                "image": "",
                "command": ["sh", "-c", "echo hi"],
                "env": {},
                "gpu_uuids": [],
                "cpus": 1.0,
                "memory_mib": 64,
                "max_runtime_s": None,
            }
        ]
    )
    env = {
        **os.environ,
        "GPUCP_URL": control_plane.url,
        "GPUCP_JOIN_TOKEN": control_plane.JOIN_TOKEN,
        "GPUCP_STATE_DIR": str(state_dir),
        "GPUCP_LOG_FORMAT": "json",
        "PYTHONPATH": str(REPO),
    }
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agents",
            "--runtime",
            "process",
            "--gpu-backend",
            "simulated:A100-SXM4-80GB:1",
            "--node-name",
            "json-node",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until(
            lambda: any(r["state"] == "exited" for r in control_plane.reported(51)),
            timeout_s=60,
            what="the job's exit report",
        )
        agent.send_signal(signal.SIGTERM)
        output, _ = agent.communicate(timeout=30)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.communicate()
    assert agent.returncode == 0, output

    lines = parsed_lines(output)
    assert lines, "the agent wrote nothing"
    assert {line["node"] for line in lines} == {"json-node"}
    (started,) = [line for line in lines if line["message"] == "attempt 51 started (job 5)"]
    assert (started["job_id"], started["attempt_id"], started["level"]) == (5, 51, "INFO")
    (ended,) = [line for line in lines if line["message"].startswith("attempt 51 ended")]
    assert (ended["job_id"], ended["attempt_id"]) == (5, 51)
    stopped = lines[-1]
    assert stopped["message"].startswith("agent stopped")
    assert not {"job_id", "attempt_id"} & stopped.keys()

    # The fence the agent started writes its own log, in the agent's format.
    fence_lines = parsed_lines((state_dir / "fence.log").read_text())
    assert fence_lines and {line["node"] for line in fence_lines} == {"json-node"}
    assert any(
        line["message"].startswith("guarding the attempts of json-node") for line in fence_lines
    )
