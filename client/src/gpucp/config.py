"""Where `gpucp login` keeps the control plane's URL and your token, and how they are read.

The file is `gpucp/config.yaml` in the user's configuration directory ($XDG_CONFIG_HOME, else
~/.config; %APPDATA% on Windows), or the path in GPUCP_CONFIG. It holds a token, so it is
written readable by its owner alone (0600, in a 0700 directory). GPUCP_URL and GPUCP_TOKEN, when
set, win over the file (CI jobs, scripts, a second cluster for one command).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    url: str | None
    token: str | None
    path: Path


def config_path() -> Path:
    explicit = os.environ.get("GPUCP_CONFIG")
    if explicit:
        return Path(explicit).expanduser()
    if sys.platform == "win32" and os.environ.get("APPDATA"):
        base = Path(os.environ["APPDATA"])
    else:
        base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "gpucp" / "config.yaml"


def load() -> Settings:
    path = config_path()
    stored: dict[str, object] = {}
    if path.exists():
        import yaml

        loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        if isinstance(loaded, dict):
            stored = loaded
    url = os.environ.get("GPUCP_URL") or _text(stored.get("url"))
    token = os.environ.get("GPUCP_TOKEN") or _text(stored.get("token"))
    return Settings(url=url.rstrip("/") if url else None, token=token, path=path)


def save(url: str, token: str) -> Path:
    """Writes the file readable by its owner alone; an existing one is replaced whole."""
    import yaml

    path = config_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    # Created 0600 from the start: the token is never readable by others, not even briefly.
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            yaml.safe_dump({"url": url.rstrip("/"), "token": token}, out)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return path


def forget() -> bool:
    path = config_path()
    if path.exists():
        path.unlink()
        return True
    return False


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None
