"""A real container engine for the tests: Podman's Docker API, set up for this checkout."""

import subprocess
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[1] / "scripts" / "podman-setup.sh"


def docker_host() -> str:
    """DOCKER_HOST of Podman's Docker API (scripts/podman-setup.sh); where none can be had, the
    calling test skips and says why."""
    try:
        result = subprocess.run(
            ["bash", str(SETUP)], capture_output=True, text=True, timeout=300, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"no container engine: {SETUP.name} could not run ({exc})")
    if result.returncode != 0:
        pytest.skip(f"no container engine: {SETUP.name} failed: {result.stderr.strip()[-500:]}")
    lines = [line for line in result.stdout.splitlines() if line.startswith("DOCKER_HOST=")]
    if not lines:
        pytest.skip(f"no container engine: {SETUP.name} printed no DOCKER_HOST")
    return lines[-1].removeprefix("DOCKER_HOST=")
