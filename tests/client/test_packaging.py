"""The client installs on a laptop without the server: its own distribution, a short pinned
dependency list, and no import of anything of the server's."""

import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

CLIENT = Path(__file__).resolve().parents[2] / "client"
# What the client may depend on: an HTTP client, a CLI framework, YAML, tables.
ALLOWED = {"httpx", "click", "pyyaml", "rich"}
SERVER_PACKAGES = (
    "django",
    "rest_framework",
    "celery",
    "kombu",
    "psycopg",
    "redis",
    "controlplane",
    "scheduler",
    "agents",
    "frontend",
)


def requirement_name(requirement: str) -> str:
    return requirement.split("==")[0].split("[")[0].strip().lower()


def test_the_client_depends_on_a_few_pinned_libraries_and_none_of_the_servers():
    project = tomllib.loads((CLIENT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "gpucp-client"
    assert project["scripts"] == {"gpucp": "gpucp.cli:main"}
    requirements = project["dependencies"]
    assert {requirement_name(r) for r in requirements} <= ALLOWED
    assert all("==" in r for r in requirements), "pin every dependency"
    # The installed client is this one (make venv installs it from ./client).
    installed = metadata.requires("gpucp-client") or []
    assert sorted(installed) == sorted(requirements)


def test_the_client_runs_with_the_servers_packages_unimportable(tmp_path):
    blocker = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {SERVER_PACKAGES!r}:
            raise ImportError("the client imported " + name)
sys.meta_path.insert(0, Block())
from gpucp import Client, errors
from gpucp import cli, client, config, jobfile
Client("http://127.0.0.1:9", "t").close()
sys.argv = ["gpucp", "--help"]
cli.main()
"""
    done = subprocess.run(
        [sys.executable, "-c", blocker], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "gpucp login" in done.stdout
