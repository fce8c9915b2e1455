"""The core compiled with mypyc (scheduler/native.py): used only where it was built from the very
sources beside it, and deciding exactly as they do."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler import native
from tests.scheduler import native_probe

REPO = Path(__file__).resolve().parents[2]


def copy_of_sources(root: Path) -> Path:
    shutil.copytree(
        REPO / "scheduler", root / "scheduler", ignore=shutil.ignore_patterns("__pycache__")
    )
    return root


def fake_build(root: Path) -> Path:
    where = native.build_dir(root)
    where.mkdir(parents=True)
    (where / "COMPLETE").write_text("scheduler/admit.so\n")
    return where


def edited(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\n# edited\n")


def test_a_build_of_these_sources_is_found_and_a_half_made_one_is_not(tmp_path):
    root = copy_of_sources(tmp_path)
    assert native.locate(root, "auto") is None

    where = native.build_dir(root)
    where.mkdir(parents=True)  # a build cut short: no COMPLETE
    assert native.locate(root, "auto") is None

    (where / "COMPLETE").write_text("")
    assert native.locate(root, "auto") == where
    assert native.locate(root, "compiled") == where


@pytest.mark.parametrize(
    "module",
    sorted(p.relative_to(REPO / "scheduler").as_posix() for p in native.sources(REPO)),
)
def test_a_build_is_never_used_once_any_module_of_the_core_has_changed(tmp_path, module):
    # Compiled or not, any module may lend the compiled ones constants and types: a build made
    # before an edit of any of them is stale.
    root = copy_of_sources(tmp_path)
    fake_build(root)
    edited(root / "scheduler" / module)

    assert native.locate(root, "auto") is None
    with pytest.raises(ImportError, match="no build of these sources.*make core"):
        native.locate(root, "compiled")


def test_the_source_runs_when_asked_for_and_an_unknown_mode_is_named(tmp_path):
    root = copy_of_sources(tmp_path)
    fake_build(root)
    assert native.locate(root, "python") is None
    with pytest.raises(ImportError, match="GPUCP_CORE='fast': expected one of auto, compiled"):
        native.locate(root, "fast")


def test_the_control_plane_and_the_agent_run_the_core_from_source():
    # The build is for the simulator: the control plane and the agent keep the source (see
    # controlplane/__init__.py), whatever a developer built.
    probe = "import controlplane, agents, os; print(os.environ['GPUCP_CORE'])"
    env = {k: v for k, v in os.environ.items() if k != "GPUCP_CORE"}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=REPO, capture_output=True, text=True
    )
    assert done.stdout.strip() == "python", done.stderr


def build() -> Path:
    """The real build of this checkout's core (kept in var/build/core, made once per version of
    the sources: about 75 s here)."""
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "build_core.py")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return Path(done.stdout.strip().splitlines()[-1])


def python_with_core(mode: str, args: list[str], cwd: Path = REPO) -> str:
    """The output of a fresh interpreter run with GPUCP_CORE=mode in ``cwd``."""
    env = dict(os.environ, GPUCP_CORE=mode, PYTHONPATH=str(cwd))
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


ACTIVE = ["-c", "from scheduler import native; print(native.active())"]


# Both tests need the build: on one worker, so that it is made once, not twice at once.
@pytest.mark.slow
@pytest.mark.xdist_group("native-build")
def test_the_compiled_core_decides_exactly_as_the_source_does():
    where = build()
    assert (where / "COMPLETE").is_file()
    compiled = json.loads(python_with_core("compiled", ["-m", "tests.scheduler.native_probe"]))
    assert compiled["core"] == f"mypyc {where.name}"

    from_source = native_probe.fingerprints()
    assert native.active() == "python"
    differing = {
        case: (digest, compiled["fingerprints"].get(case))
        for case, digest in from_source.items()
        if compiled["fingerprints"].get(case) != digest
    }
    assert not differing
    assert len(from_source) > len(native_probe.PRESETS)


@pytest.mark.slow
@pytest.mark.xdist_group("native-build")
def test_the_import_takes_the_build_of_its_sources_and_leaves_a_stale_one(tmp_path):
    where = build()
    root = copy_of_sources(tmp_path)
    shutil.copytree(where, native.build_dir(root))

    assert python_with_core("auto", ACTIVE, root).strip() == f"mypyc {where.name}"
    edited(root / "scheduler" / "quota.py")
    assert python_with_core("auto", ACTIVE, root).strip() == "python"
