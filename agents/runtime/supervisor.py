"""Which program supervises a process-runtime attempt: supervise.c, built here, or supervise.sh.

Both keep the same contract and write the same records (agents/runtime/process.py), so an
agent of either kind adopts the other's attempts and an upgrade may switch while jobs run. The
compiled one costs a fork of its fork server per job (an exec of it where the server cannot),
where bash's start cost about 2 ms more CPU per job (benchmarks/bench_throughput.py, a flood of
short jobs);
it is built once per source version with the host's C compiler (a GPU host has one: the
driver's kernel module is built with it) into the agent's state folder, and bash runs the
jobs of a host that has none.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("supervise.c")
SCRIPT = Path(__file__).with_name("supervise.sh")
KINDS = ("auto", "compiled", "bash")
# Static first: the dynamic loader's work at each exec is a third of a small program's start.
_FLAG_SETS = (("-O2", "-static"), ("-O2",))
_BUILD_TIMEOUT_S = 120.0

# Built or found, and seen to run, in this process, by program name (its source digest): every
# runtime of one process (the tests make many) shares one build while its file is there.
_built: dict[str, Path] = {}
_built_lock = threading.Lock()


class SupervisorError(RuntimeError):
    """The compiled supervisor was asked for and cannot be built here."""


@dataclass(frozen=True, slots=True)
class Supervisor:
    kind: str  # "compiled" or "bash"
    argv: tuple[str, ...]  # what comes before the attempt's arguments

    @property
    def needs_bash_signals(self) -> bool:
        """bash can neither trap nor reset a signal it started with ignored (see start())."""
        return self.kind == "bash"


def bash_supervisor() -> Supervisor:
    bash = shutil.which("bash")
    if bash is None:
        raise RuntimeError("the process runtime needs bash on the agent's PATH")
    return Supervisor("bash", (bash, "-p", str(SCRIPT)))


def resolve(kind: str, build_dir: Path) -> Supervisor:
    """The supervisor of `kind`: "auto" is the compiled one where it builds, else bash."""
    if kind not in KINDS:
        raise ValueError(f"unknown supervisor {kind!r}: use {', '.join(KINDS)}")
    if kind == "bash":
        return bash_supervisor()
    try:
        return Supervisor("compiled", (str(build(build_dir)),))
    except SupervisorError as exc:
        if kind == "compiled":
            raise
        log.warning("%s; jobs are supervised by bash (about 2 ms more CPU per job)", exc)
        return bash_supervisor()


def _runs(program: Path) -> Path:
    """The program, once seen to run here: without arguments it says how it is used (and exits
    2, which an agent started with SIGCHLD ignored cannot see). A folder mounted noexec, or a
    build for another machine, fails here and not at every job's start."""
    try:
        done = subprocess.run([str(program)], capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SupervisorError(f"{program} does not run here: {exc}") from exc
    if b"usage:" not in done.stderr:
        raise SupervisorError(f"{program} does not run here (exit {done.returncode})")
    return program


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and (found := shutil.which(name)):
            return found
    return None


def program_path(build_dir: Path, source: bytes | None = None) -> Path:
    """Where build_dir keeps the build of `source` (this module's supervise.c): named by its
    digest, so each version of it has its own."""
    digest = hashlib.sha256(SOURCE.read_bytes() if source is None else source).hexdigest()[:16]
    return build_dir / f"supervise-{digest}"


def build(build_dir: Path) -> Path:
    """The compiled supervisor of this source, built into build_dir unless it is there, and
    seen to run (once per process)."""
    source = SOURCE.read_bytes()
    target = program_path(build_dir, source)
    with _built_lock:
        known = _built.get(target.name)
        if known is not None and os.access(known, os.X_OK):
            return known
        if os.access(target, os.X_OK):
            _built[target.name] = _runs(target)
            return target
        build_dir.mkdir(parents=True, exist_ok=True)
        # Agents sharing a build folder (--supervisor-dir: many simulated nodes on one host)
        # build it once: the others wait for that build, then take it.
        with open(build_dir / ".build.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if os.access(target, os.X_OK):
                _built[target.name] = _runs(target)
                return target
            return _compile(source, target, build_dir)


def _compile(source: bytes, target: Path, build_dir: Path) -> Path:
    """Build `source` (the text the digest in target's name was taken of) into target."""
    compiler = _compiler()
    if compiler is None:
        raise SupervisorError("no C compiler (cc, gcc, clang or $CC) to build supervise.c")
    errors = []
    for flags in _FLAG_SETS:
        # Built beside its final name and renamed: an agent killed mid-build never leaves a
        # cut program under the name that is run.
        fd, tmp = tempfile.mkstemp(prefix=".supervise-", dir=build_dir)
        os.close(fd)
        try:
            done = subprocess.run(
                [compiler, *flags, "-x", "c", "-o", tmp, "-"],
                input=source,
                capture_output=True,
                timeout=_BUILD_TIMEOUT_S,
                check=False,
            )
            if done.returncode == 0:
                os.chmod(tmp, 0o755)
                os.replace(tmp, target)
                _built[target.name] = _runs(target)
                log.info("built the job supervisor %s (%s)", target, " ".join(flags))
                return target
            said = done.stderr.decode(errors="replace").strip().splitlines()
            errors.append(said[-1] if said else f"exit {done.returncode}")
        except (OSError, subprocess.TimeoutExpired) as exc:
            errors.append(str(exc))
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise SupervisorError(f"supervise.c does not build with {compiler}: {'; '.join(errors)}")
