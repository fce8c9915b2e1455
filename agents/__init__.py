"""The node agent: a plain daemon that reports what its node observes and does what it is told.

It never decides anything: the control plane's answer to each heartbeat is the desired state, and
the agent reconciles its GPUs (power caps) and its runtime (attempts) against it. No Django here.
"""

import os

# Its simulated GPUs use the core's GPU model from source, as the control plane does (see
# controlplane/__init__.py): a host's build of the core is for the simulator.
os.environ.setdefault("GPUCP_CORE", "python")

__version__ = "0.1.0"
