"""docker-compose.yml describes a deployment Debian's docker-compose accepts as it is."""

import shutil
import subprocess

import pytest
import yaml

from .conftest import REPO

needs_compose = pytest.mark.skipif(
    shutil.which("docker-compose") is None,
    reason="docker-compose is not installed (scripts/install-system-deps.sh installs it)",
)


def compose_config(*args: str, env: dict | None = None) -> dict:
    result = subprocess.run(
        ["docker-compose", *args, "config"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


@needs_compose
def test_docker_compose_config_accepts_the_file_as_it_is():
    services = compose_config()["services"]
    assert set(services) == {
        "postgres", "redis", "migrate", "web", "worker", "beat", "agent", "fence"
    }  # fmt: skip
    # The agent and its fence belong on GPU hosts: `up` on the control-plane host leaves them out.
    assert services["agent"]["profiles"] == services["fence"]["profiles"] == ["agent"]


@needs_compose
def test_the_fence_guards_the_agents_state_and_engine_from_a_container_of_its_own():
    services = compose_config("--profile", "agent")["services"]
    agent, fence = services["agent"], services["fence"]
    assert fence["command"] == ["python", "-m", "agents.fence", "--stay"]
    assert fence["restart"] == "unless-stopped"
    for key in ("GPUCP_RUNTIME", "GPUCP_DOCKER_URL", "GPUCP_STATE_DIR", "GPUCP_NODE_NAME"):
        assert fence["environment"][key] == agent["environment"][key], key

    def mounts(service):
        return {v.split(":")[1] if isinstance(v, str) else v["target"] for v in service["volumes"]}

    assert mounts(fence) == mounts(agent) == {"/var/run/docker.sock", "/var/lib/gpucp-agent"}


@needs_compose
def test_the_services_run_the_production_processes():
    services = compose_config(env={"SECRET_KEY": "k" * 50, "POSTGRES_PASSWORD": "pw"})["services"]

    web = services["web"]
    assert web["command"][:2] == ["gunicorn", "controlplane.wsgi:application"]
    assert "--worker-class=gthread" in web["command"]
    assert web["environment"]["GPUCP_ENV"] == "production"
    assert web["environment"]["DATABASE_URL"] == "postgres://gpucp:pw@postgres:5432/gpucp"
    assert web["environment"]["REDIS_URL"] == "redis://redis:6379/0"
    assert services["worker"]["command"][:4] == ["celery", "-A", "controlplane", "worker"]
    assert services["beat"]["command"][:4] == ["celery", "-A", "controlplane", "beat"]
    assert services["migrate"]["command"] == ["python", "manage.py", "migrate", "--noinput"]


@needs_compose
def test_the_agent_service_drives_the_hosts_engine_and_gpus():
    agent = compose_config("--profile", "agent", env={"GPUCP_URL": "https://cp.example.org"})[
        "services"
    ]["agent"]

    assert agent["command"] == ["python", "-m", "agents"]
    assert agent["environment"]["GPUCP_RUNTIME"] == "docker"
    assert agent["environment"]["GPUCP_GPU_BACKEND"] == "nvml"
    assert agent["environment"]["GPUCP_URL"] == "https://cp.example.org"
    # Short syntax ("source:target[:mode]") in docker-compose 1.x, long syntax in 2.x.
    mounts = {}
    for v in agent["volumes"]:
        if isinstance(v, str):
            source, target = v.split(":")[:2]
        else:
            source, target = v["source"], v["target"]
        mounts[target] = source
    assert mounts["/var/run/docker.sock"] == "/var/run/docker.sock"
    assert "/var/lib/gpucp-agent" in mounts
    (gpus,) = agent["deploy"]["resources"]["reservations"]["devices"]
    assert gpus["driver"] == "nvidia"
