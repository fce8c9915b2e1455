"""The node agent: a plain daemon that reports what its node observes and does what it is told.

It never decides anything: the control plane's answer to each heartbeat is the desired state, and
the agent reconciles its GPUs (power caps) and its runtime (attempts) against it. No Django here.
"""

__version__ = "0.1.0"
