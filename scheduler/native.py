"""The core compiled with mypyc, used wherever a build of these very sources is present.

The planner and the simulator spend their time in plain Python (small objects, dicts, tuples,
sorted lists), which mypyc, the compiler that ships with the type checker this project already
runs strictly on ``scheduler``, turns into C: the saturated replays of issue 19 take 1.4-1.7x
less CPU, with every decision the same (docs/simulator-saturation.md, twelfth pass). The
source stays the one truth:

- a build is made from the exact bytes of every module of this package, and a digest of them
  (with the interpreter's tag) names its directory, ``var/build/core/<digest>/``: a module
  edited since is never shadowed by a stale build, it simply finds none;
- without a build, or with ``GPUCP_CORE=python``, everything runs from source as before;
  ``GPUCP_CORE=compiled`` refuses to run without one (what a benchmark that counts on it
  sets); the control plane and the agent default to ``python`` (controlplane/__init__.py);
- ``make core`` builds (scripts/build_core.py); the container image does not, since the
  processes it runs use the source.

This module is the package's one piece of I/O, at import only: it reads the package's sources
to find their build. It is never compiled itself (nor the packages' ``__init__`` files, which
call it before importing anything else).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from pathlib import Path

ENV = "GPUCP_CORE"
MODES = ("auto", "compiled", "python")
PACKAGE = "scheduler"
ROOT = Path(__file__).resolve().parents[1]
# Kept from source: every package's __init__ and __main__ (the import machinery calls this
# module from them, and a compiled __init__ would take its package's path over), this module,
# the report writers, which spend their time in matplotlib and file output, and what runs once
# per replay (loading a trace, summing up its results) or outside the planner (the power-model
# fit), which would only lengthen the build.
NOT_COMPILED_NAMES = frozenset({"__init__.py", "__main__.py"})
NOT_COMPILED = frozenset(
    {
        "native.py",
        "power_fit.py",
        "simulator/compare.py",
        "simulator/loaders.py",
        "simulator/metrics.py",
        "simulator/plots.py",
        "simulator/report.py",
        "simulator/sweep.py",
        # mypyc compiles no subclass of a builtin exception, and unpickles no frozen dataclass
        # (replays are kept as pickles).
        "simulator/errors.py",
        "simulator/results.py",
    }
)


def sources(root: Path = ROOT) -> list[Path]:
    """Every module of the package under ``root``, in a fixed order."""
    return sorted((root / PACKAGE).rglob("*.py"))


def compiled_modules(root: Path = ROOT) -> list[Path]:
    """The modules a build compiles, relative to ``root``."""
    base = root / PACKAGE
    return [
        p.relative_to(root)
        for p in sources(root)
        if p.name not in NOT_COMPILED_NAMES and p.relative_to(base).as_posix() not in NOT_COMPILED
    ]


def digest(root: Path = ROOT) -> str:
    """What names a build: every source byte of the package (a module a compiled one imports
    may lend it constants and types) and the interpreter the build is for."""
    h = hashlib.sha256(sys.implementation.cache_tag.encode())
    for path in sources(root):
        h.update(b"\0" + path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()[:20]


def build_dir(root: Path = ROOT) -> Path:
    return root / "var" / "build" / "core" / digest(root)


def locate(root: Path, mode: str) -> Path | None:
    """The build of the sources under ``root`` to run, None to run from source."""
    if mode not in MODES:
        raise ImportError(f"{ENV}={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "python":
        return None
    where = build_dir(root)
    if (where / "COMPLETE").is_file():
        return where
    if mode == "compiled":
        raise ImportError(
            f"{ENV}=compiled, but no build of these sources is at {where} "
            "(`make core` makes it; a build of other sources is never used)"
        )
    return None


@functools.cache
def _found() -> Path | None:
    where = locate(ROOT, os.environ.get(ENV, "auto"))
    if where is not None and str(where) not in sys.path:
        # The compiled modules share one library, imported by its own (digest-like) top-level
        # name: appended, so that it can shadow nothing.
        sys.path.append(str(where))
    return where


def attach(package: str, path: list[str]) -> None:
    """Put the build's directory of ``package`` before its sources on its import path, when a
    build of these sources is to be used."""
    where = _found()
    if where is not None:
        path.insert(0, str(where.joinpath(*package.split("."))))


def active() -> str:
    """How the planner runs in this process: ``mypyc <digest>`` or ``python``."""
    import scheduler.admit  # noqa: PLC0415 (the module whose form says it)

    file = scheduler.admit.__file__ or ""
    return f"mypyc {Path(file).parent.parent.name}" if not file.endswith(".py") else "python"
