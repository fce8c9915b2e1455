"""`python -m agents` / `gpucp-agent`: run the node agent.

Every flag has an environment variable (shown in --help), so a container or a systemd unit can
configure it without a command line. The join token is best given by environment or file, not
by flag (a flag shows in `ps`).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from types import FrameType
from typing import overload

from agents import __version__
from agents.logcontext import configure as configure_logging
from agents.logcontext import format_option

DEFAULT_STATE_DIR = "/var/lib/gpucp-agent"


@overload
def _env(name: str, default: str) -> str: ...
@overload
def _env(name: str, default: None = None) -> str | None: ...
def _env(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def _labels(values: list[str]) -> dict[str, str]:
    labels: dict[str, str] = {}
    for value in values:
        for item in value.split(","):
            if not item.strip():
                continue
            key, sep, val = item.partition("=")
            if not sep or not key.strip():
                raise argparse.ArgumentTypeError(f"a label is key=value, got {item!r}")
            labels[key.strip()] = val.strip()
    return labels


def build_parser() -> argparse.ArgumentParser:
    """The command line; defaults come from GPUCP_* variables."""
    p = argparse.ArgumentParser(
        prog="gpucp-agent",
        description="The gpucp node agent: reports GPUs and runs the attempts the control "
        "plane assigns to this node.",
    )
    p.add_argument(
        "--url",
        "--server",
        dest="url",
        default=_env("GPUCP_URL"),
        help="control plane base URL [GPUCP_URL] (required)",
    )
    p.add_argument(
        "--join-token",
        default=_env("GPUCP_JOIN_TOKEN"),
        help="join token (gcpj_...) for the first start [GPUCP_JOIN_TOKEN]",
    )
    p.add_argument(
        "--join-token-file",
        default=_env("GPUCP_JOIN_TOKEN_FILE"),
        help="file holding the join token [GPUCP_JOIN_TOKEN_FILE]",
    )
    p.add_argument(
        "--node-name",
        "--name",
        dest="node_name",
        default=_env("GPUCP_NODE_NAME", socket.gethostname()),
        help="this node's name [GPUCP_NODE_NAME, default: the host name]",
    )
    p.add_argument(
        "--state-dir",
        default=_env("GPUCP_STATE_DIR", DEFAULT_STATE_DIR),
        help=f"where the node token and attempt records live [GPUCP_STATE_DIR, {DEFAULT_STATE_DIR}]",
    )
    p.add_argument(
        "--runtime",
        choices=("docker", "process"),
        default=_env("GPUCP_RUNTIME", "docker"),
        help="run attempts as containers or as plain processes [GPUCP_RUNTIME, docker]",
    )
    p.add_argument(
        "--docker-url",
        default=_env("GPUCP_DOCKER_URL"),
        help="engine API, e.g. unix:///run/podman/podman.sock "
        "[GPUCP_DOCKER_URL, else DOCKER_HOST, else the default socket]",
    )
    p.add_argument(
        "--gpu-backend",
        default=_env("GPUCP_GPU_BACKEND", "auto"),
        help="nvml, simulated:<profile>[:count] or auto (NVML when nvmlInit() works, else "
        "simulated:H100-SXM-80GB:8) [GPUCP_GPU_BACKEND, auto]",
    )
    p.add_argument(
        "--label",
        action="append",
        default=[_env("GPUCP_LABELS", "")],
        help="node label key=value, repeatable or comma-separated [GPUCP_LABELS]",
    )
    p.add_argument(
        "--heartbeat-interval-s",
        type=float,
        default=float(_env("GPUCP_HEARTBEAT_INTERVAL_S", "0")),
        help="seconds between heartbeats; 0 = what the control plane says "
        "[GPUCP_HEARTBEAT_INTERVAL_S]",
    )
    p.add_argument(
        "--watch-timeout-s",
        type=float,
        default=float(_env("GPUCP_WATCH_TIMEOUT_S", "20")),
        help="long-poll timeout [GPUCP_WATCH_TIMEOUT_S, 20]",
    )
    p.add_argument("--no-watch", action="store_true", help="periodic heartbeats only")
    p.add_argument(
        "--stop-grace-s",
        type=float,
        default=float(_env("GPUCP_STOP_GRACE_S", "10")),
        help="seconds between the stop signal and SIGKILL, for attempts the control plane "
        "gives no grace_s [GPUCP_STOP_GRACE_S, 10]",
    )
    p.add_argument(
        "--power-cap-dry-run",
        action="store_true",
        default=_env("GPUCP_POWER_CAP_DRY_RUN", "") in ("1", "true", "yes"),
        help="validate power caps but never write them [GPUCP_POWER_CAP_DRY_RUN=1]",
    )
    p.add_argument(
        "--stop-jobs-on-exit",
        action="store_true",
        default=_env("GPUCP_STOP_JOBS_ON_EXIT", "") in ("1", "true", "yes"),
        help="stop every attempt when the agent stops (for a laptop demo; on a real node "
        "jobs outlive the agent and are adopted) [GPUCP_STOP_JOBS_ON_EXIT=1]",
    )
    p.add_argument(
        "--no-fence",
        action="store_true",
        default=_env("GPUCP_FENCE", "1") in ("0", "false", "no"),
        help="do not start the node's fence (agents.fence), which stops every attempt before "
        "the node's lease runs out; without it a node cut off from the control plane keeps "
        "running jobs that may be started elsewhere [GPUCP_FENCE=0]",
    )
    p.add_argument(
        "--job-path-prepend",
        default=_env("GPUCP_JOB_PATH_PREPEND", ""),
        metavar="DIR[:DIR...]",
        help="absolute folders put first on every process-runtime job's PATH, e.g. the agent's "
        "virtualenv bin so that a job's `python` is the agent's [GPUCP_JOB_PATH_PREPEND, none]",
    )
    p.add_argument(
        "--supervisor",
        choices=("auto", "compiled", "bash"),
        default=_env("GPUCP_SUPERVISOR", "auto"),
        help="what supervises each process-runtime job: compiled (supervise.c, built once with "
        "the host's C compiler into the state folder, and forked for each job by one server "
        "process of the agent), bash (supervise.sh), or auto: compiled where it builds "
        "[GPUCP_SUPERVISOR, auto]",
    )
    p.add_argument(
        "--supervisor-dir",
        default=_env("GPUCP_SUPERVISOR_DIR"),
        metavar="DIR",
        help="where the compiled supervisor is built and kept, once per version; agents on one "
        "host (simulated nodes) may share one [GPUCP_SUPERVISOR_DIR, <state-dir>/bin]",
    )
    p.add_argument(
        "--advertise-address",
        default=_env("GPUCP_ADVERTISE_ADDRESS"),
        help="the address other nodes reach this node's jobs at (a multi-node job's master "
        "address when its rank 0 runs here) [GPUCP_ADVERTISE_ADDRESS, default: the source "
        "address of the route to the control plane]",
    )
    p.add_argument(
        "--job-port-range",
        type=_port_range,
        default=_env("GPUCP_JOB_PORT_RANGE", "29500-29999"),
        metavar="LOW-HIGH",
        help="ports the control plane may give a job whose rank 0 runs here as its master "
        "port [GPUCP_JOB_PORT_RANGE, 29500-29999]",
    )
    p.add_argument(
        "--cpus",
        type=int,
        default=None,
        help="CPUs to report (default: the host's; a simulated node's: its GPUs' server share)",
    )
    p.add_argument(
        "--memory-mib",
        type=int,
        default=None,
        help="memory to report (default: the host's; a simulated node's: its GPUs' server share)",
    )
    p.add_argument(
        "--log-level",
        default=_env("GPUCP_LOG_LEVEL", "INFO"),
        help="DEBUG, INFO, WARNING [GPUCP_LOG_LEVEL, INFO]",
    )
    p.add_argument(
        "--log-format",
        type=format_option,
        default=_env("GPUCP_LOG_FORMAT", "plain"),
        help="plain: text lines; json: one JSON object per line, with the node name, and the "
        "job and attempt ids of lines about one attempt [GPUCP_LOG_FORMAT, plain]",
    )
    p.add_argument("--version", action="version", version=f"gpucp-agent {__version__}")
    return p


def _port_range(text: str) -> tuple[int, int]:
    """LOW-HIGH, two ports with LOW <= HIGH."""
    try:
        low, high = (int(part) for part in str(text).split("-", 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LOW-HIGH, e.g. 29500-29999") from None
    if not 1 <= low <= high <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: ports 1 to 65535, LOW <= HIGH")
    return low, high


def main(argv: list[str] | None = None) -> int:
    """Run the agent until SIGTERM or SIGINT; jobs keep running after it exits."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # The node's name is on every JSON line: a log pipeline gathers many nodes' lines in one
    # place. A plain line is read on its node, and leaves it out.
    configure_logging(
        args.log_format,
        getattr(logging, str(args.log_level).upper(), logging.INFO),
        static_fields={"node": args.node_name},
    )
    if not args.url:
        parser.error("the control plane URL is required (--url or GPUCP_URL)")
    try:
        labels = _labels(args.label)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    join_token = args.join_token
    if not join_token and args.join_token_file:
        join_token = Path(args.join_token_file).read_text().strip()

    # Imported here so that --help works without the heavier libraries.
    from agents.client import ControlPlaneClient
    from agents.daemon import Agent, AgentConfig, RegistrationRefused
    from agents.gpu import GpuError, make_backend
    from agents.runtime import make_runtime
    from agents.runtime.process import handle_ignored_stop_signals

    state_dir = Path(args.state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(state_dir, 0o700)
    config = AgentConfig(
        url=args.url,
        state_dir=state_dir,
        node_name=args.node_name,
        join_token=join_token,
        labels=labels,
        runtime=args.runtime,
        gpu_backend=args.gpu_backend,
        advertise_address=args.advertise_address or None,
        job_port_range=args.job_port_range,
        heartbeat_interval_s=args.heartbeat_interval_s or None,
        watch=not args.no_watch,
        watch_timeout_s=args.watch_timeout_s,
        stop_grace_s=args.stop_grace_s,
        power_cap_dry_run=args.power_cap_dry_run,
        stop_jobs_on_exit=args.stop_jobs_on_exit,
        fence=not args.no_fence,
        log_format=args.log_format,
        docker_url=args.docker_url,
        cpus=args.cpus,
        memory_mib=args.memory_mib,
    )
    log = logging.getLogger("agents")
    try:
        gpu = make_backend(args.gpu_backend, node_name=args.node_name, state_dir=str(state_dir))
    except (GpuError, ValueError) as exc:
        log.error("GPU backend %s: %s", args.gpu_backend, exc)
        return 2
    try:
        runtime = make_runtime(
            args.runtime,
            state_dir=state_dir,
            node_name=args.node_name,
            docker_url=args.docker_url,
            gpu_device_requests=gpu.real_devices,
            job_path_prepend=tuple(d for d in args.job_path_prepend.split(os.pathsep) if d),
            supervisor=args.supervisor,
            supervisor_dir=args.supervisor_dir,
        )
    except (RuntimeError, ValueError) as exc:
        log.error("runtime %s: %s", args.runtime, exc)
        gpu.close()
        return 2
    client = ControlPlaneClient(args.url, state_dir=state_dir, join_token=join_token)
    if not client.node_token and not join_token:
        log.error("no node token in %s and no join token (GPUCP_JOIN_TOKEN)", client.token_path)
        runtime.close()
        gpu.close()
        return 2
    agent = Agent(config, client=client, gpu=gpu, runtime=runtime)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("%s: stopping the agent (jobs keep running)", signal.Signals(signum).name)
        agent.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    handle_ignored_stop_signals()
    log.info(
        "gpucp-agent %s: node %s, %s runtime, %s GPUs (%d), control plane %s",
        __version__,
        args.node_name,
        runtime.name,
        gpu.kind,
        len(gpu.inventory()),
        args.url,
    )
    try:
        agent.run()
    except RegistrationRefused as exc:
        log.error("registration refused: %s", exc)
        return 3
    except RuntimeError as exc:  # another agent holds the state directory
        log.error("%s", exc)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
