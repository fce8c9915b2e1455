"""The scheduling core: a pure function from a cluster snapshot to a plan.

Nothing in this package imports Django, Celery, Redis, NVML or a container engine, reads the
wall clock or does I/O; tests/scheduler/test_purity.py keeps it that way.
"""
