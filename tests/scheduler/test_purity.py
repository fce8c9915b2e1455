"""What the agent really loads at run time (the import contracts in pyproject.toml, checked by
`lint-imports` in `make test`, cover what each layer's source may import)."""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_agent_loads_the_gpu_model_and_none_of_the_planner():
    # A node agent needs the physics of a capped GPU (for its simulated GPUs), never the
    # scheduling policy: importing the whole agent must not pull the planner in.
    probe = (
        "import sys, agents.__main__, agents.daemon, agents.gpu.simulated; "
        "print(sorted(m for m in sys.modules if m.startswith('scheduler')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=REPO
    )
    loaded = set(ast.literal_eval(done.stdout))
    assert "scheduler.gpu_model" in loaded
    assert not loaded & {"scheduler.power", "scheduler.policy", "scheduler.placement"}, loaded
