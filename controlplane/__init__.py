import os

# The control plane runs the scheduling core from source even where a compiled build of it
# exists (scheduler.native: the build is for the simulator's long replays). Code compiled by
# mypyc checks every annotation at run time, so a value the source tolerates (a policy setting
# given by name, a number of another type from the database) would stop the scheduling cycle;
# the control plane's suites run against the source. GPUCP_CORE set explicitly still decides.
os.environ.setdefault("GPUCP_CORE", "python")

from .celery import app as celery_app  # noqa: E402

__all__ = ["celery_app"]
