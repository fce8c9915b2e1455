"""The scheduling core stays a pure function: no framework, broker, NVML or I/O imports."""

import ast
from pathlib import Path

import pytest

FORBIDDEN = {
    "django",
    "rest_framework",
    "celery",
    "redis",
    "psycopg",
    "pynvml",
    "docker",
    "requests",
    "controlplane",
    "agents",
}
CORE = Path(__file__).resolve().parents[2] / "scheduler"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", sorted(CORE.rglob("*.py")), ids=lambda p: str(p.relative_to(CORE)))
def test_the_scheduler_core_imports_no_framework_or_io_library(path):
    assert not (_imports(path) & FORBIDDEN)


def test_the_agent_loads_the_gpu_model_and_none_of_the_planner():
    # A node agent needs the physics of a capped GPU (for its simulated GPUs), never the
    # scheduling policy: importing the whole agent must not pull the planner in.
    import subprocess
    import sys

    probe = (
        "import sys, agents.__main__, agents.daemon, agents.gpu.simulated; "
        "print(sorted(m for m in sys.modules if m.startswith('scheduler')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=CORE.parent
    )
    loaded = set(ast.literal_eval(done.stdout))
    assert "scheduler.gpu_model" in loaded
    assert not loaded & {"scheduler.power", "scheduler.policy", "scheduler.placement"}, loaded
