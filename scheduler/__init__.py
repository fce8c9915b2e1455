"""The scheduling core: a pure function from a cluster snapshot to a plan.

Nothing in this package imports Django, Celery, Redis, NVML or a container engine, reads the
wall clock or does I/O; tests/scheduler/test_purity.py keeps it that way. The one exception is
at import: ``scheduler.native`` looks for a compiled build of these sources and, where there is
one, puts it first on the package's path.
"""

from scheduler import native as _native

_native.attach(__name__, __path__)
