"""The wake-ups sit below every app, and the apps whose actions wake the scheduling loop do not
import the loop: no import cycle runs through them (lazy imports inside functions included)."""

import ast
from pathlib import Path

import pytest

CONTROLPLANE = Path(__file__).resolve().parents[2] / "controlplane"
APPS = ("accounting", "cluster", "jobs", "scheduling", "tenancy")


def imported_modules(path: Path) -> set[str]:
    """Every module the file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_the_wakeups_import_no_app():
    modules = imported_modules(CONTROLPLANE / "wakeups.py")
    apps = {m for m in modules if m.split(".")[:2] in [["controlplane", a] for a in APPS]}
    assert not apps, apps


@pytest.mark.parametrize("app", ["jobs", "cluster", "tenancy"])
def test_apps_that_ask_for_cycles_do_not_import_the_scheduling_loop(app):
    for path in sorted((CONTROLPLANE / app).rglob("*.py")):
        if "migrations" in path.parts:
            continue
        loop = {m for m in imported_modules(path) if m.startswith("controlplane.scheduling")}
        assert not loop, (str(path.relative_to(CONTROLPLANE)), loop)
