"""Shared set-up for the benchmarks that need Django: a throwaway PostgreSQL database.

Each benchmark creates its own database next to the one DATABASE_URL names (suffix `_bench_*`),
migrates it, and drops it at the end, so it never touches real data.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def setup_django() -> None:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    import django

    django.setup()


@contextmanager
def bench_database(suffix: str, *, keep: bool = False):
    """Create, migrate and (unless keep) drop a database named <DATABASE_URL's name>_<suffix>."""
    from django.conf import settings
    from django.db import connection

    if connection.vendor != "postgresql":
        sys.exit("This benchmark needs PostgreSQL: set DATABASE_URL=postgres://...")
    db = settings.DATABASES["default"]
    original = db["NAME"]
    db.setdefault("TEST", {})["NAME"] = f"{original}_{suffix}"
    name = connection.creation.create_test_db(verbosity=0, autoclobber=True, keepdb=False)
    try:
        yield name
    finally:
        if not keep:
            connection.creation.destroy_test_db(original, verbosity=0)


def median(values: list[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
