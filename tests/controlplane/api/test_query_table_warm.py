"""The table of documented query parameters is built when a web process starts (wsgi.py), so
the first request of each gunicorn worker does not spend half a second building it; a failure
to build it there does not keep the process from starting."""

import logging
import subprocess
import sys
from pathlib import Path

from controlplane import api
from controlplane.jobs.api.views import JobViewSet

ROOT = Path(__file__).resolve().parents[3]


def test_importing_the_wsgi_application_builds_the_table():
    # A fresh interpreter: this one may have built the table in an earlier test.
    probe = (
        "import os, django; "
        "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'controlplane.settings'); "
        "django.setup(); "
        "import controlplane.api as api; assert api._table is None; "
        "import controlplane.wsgi; "
        "from controlplane.jobs.api.views import JobViewSet; "
        "print(sorted(api._table[(JobViewSet, 'list')])[:3])"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().startswith("["), out.stdout
    assert out.stdout.strip() != "[]"


def test_a_failure_at_start_is_logged_and_the_first_request_builds_it(monkeypatch, caplog):
    monkeypatch.setattr(api, "_table", None)
    real = api._query_parameters_by_operation

    def broken():
        raise RuntimeError("schema generator failed")

    monkeypatch.setattr(api, "_query_parameters_by_operation", broken)
    with caplog.at_level(logging.ERROR, logger="controlplane.api"):
        api.warm_query_parameters()
    assert "could not build the table" in caplog.text
    assert api._table is None

    monkeypatch.setattr(api, "_query_parameters_by_operation", real)
    assert "state" in (api.documented_query_parameters(JobViewSet, "list") or {})
