"""Compile the scheduling core with mypyc into var/build/core/<digest>/ (`make core`).

    .venv/bin/python scripts/build_core.py [ROOT]     # once per version of scheduler/'s sources

The package then imports the compiled modules wherever the build matches its sources
(scheduler/native.py says how, and when it does not). It needs a C compiler, the Python headers
and mypy (a dev dependency; the container image installs it in its build stage only). It builds
from a copy of the sources in a staging directory next to the target, and moves the result into
place in one rename, so a build cut short, or two at once, never leaves a half-made one that
the package would load. An existing build of the same sources is kept as it is.

MYPYC_OPT_LEVEL (default 1: as fast here as 3 on the replays, at half the build time) is
passed on to mypyc.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def _native() -> ModuleType:
    # scheduler/native.py on its own, not through the package: importing the package would
    # settle, before the build exists, that this process runs from source.
    spec = importlib.util.spec_from_file_location("_core_native", REPO / "scheduler" / "native.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


native = _native()


def build(root: Path = REPO, quiet: bool = False) -> Path:
    """The build of the sources under ``root``, made now if there is none."""
    target = native.build_dir(root)
    if (target / "COMPLETE").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="staging-", dir=target.parent))
    try:
        for src in native.sources(root):
            copy = staging / src.relative_to(root)
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, copy)
        modules = [m.as_posix() for m in native.compiled_modules(root)]
        env = dict(os.environ, MYPYC_OPT_LEVEL=os.environ.get("MYPYC_OPT_LEVEL", "1"))
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "mypyc", *modules],
            cwd=staging,
            env=env,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"mypyc failed ({done.returncode}):\n{done.stdout[-4000:]}{done.stderr[-4000:]}"
            )
        out = staging / "out"
        made = []
        for lib in staging.rglob("*.so"):
            if out in lib.parents or "build" in lib.relative_to(staging).parts[:1]:
                continue
            place = out / lib.relative_to(staging)
            place.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(lib, place)
            made.append(place.relative_to(out).as_posix())
        if not made:
            raise RuntimeError("mypyc reported success but made no extension module")
        (out / "COMPLETE").write_text("".join(f"{m}\n" for m in sorted(made)), encoding="utf-8")
        try:
            out.rename(target)
        except OSError:
            if not (target / "COMPLETE").is_file():
                raise
            # Another build of the same sources got there first: it is the same build.
        if not quiet:
            print(
                f"built {len(modules)} modules into {target} in {time.monotonic() - started:.0f} s"
            )
        return target
    finally:
        shutil.rmtree(staging, ignore_errors=True)


if __name__ == "__main__":
    root = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else REPO
    print(build(root))
