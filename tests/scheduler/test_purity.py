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
