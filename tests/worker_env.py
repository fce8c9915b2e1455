"""Loaded with `-p tests.worker_env` (pyproject's addopts), before Django reads its settings.

Under pytest-xdist (`make test` runs two workers) each worker gets its own Redis database, as
pytest-django gives it its own PostgreSQL database (test_<name>_gw<N>): the cycle-request
markers, the node channels and the Celery queues of the servers a worker starts must not be
read or cleared by the other worker's tests. Without xdist this changes nothing.
"""

from __future__ import annotations

import os
import re

REDIS_DATABASES = 16  # Redis's default `databases`


def _worker_redis_url(url: str, worker: str) -> str:
    index = int(worker.removeprefix("gw"))
    match = re.fullmatch(r"(redis://[^/]*)(?:/(\d+))?", url)
    if match is None:
        return url
    base = int(match.group(2) or 0)
    # Downwards from the session's own database, which worker gw0 keeps.
    return f"{match.group(1)}/{(base - index) % REDIS_DATABASES}"


# The suites test the core from source (a compiled build, where one exists, is tested on its
# own: tests/scheduler/test_native.py); the servers and scripts the tests start inherit this.
os.environ.setdefault("GPUCP_CORE", "python")

_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw") and os.environ.get("REDIS_URL"):
    os.environ["REDIS_URL"] = _worker_redis_url(os.environ["REDIS_URL"], _worker)
