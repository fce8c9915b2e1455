"""The schema tells the truth: schemathesis against the real stack (gunicorn, Celery, PostgreSQL).

For every operation of /api/schema/, schemathesis generates valid and invalid requests (its
examples, coverage and fuzzing phases, fixed seed) as a tenant member and as a cluster admin.
The checks: no answer is a server error, and every status code is one the schema declares for
that operation. A new endpoint is covered as soon as it is in the schema.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ST = Path(sys.executable).with_name("st")
SEED = 20261203
EXAMPLES_PER_OPERATION = 4


@pytest.fixture
def people(control_plane, transactional_db, django_user_model):
    """A member of one tenant, a cluster admin, and a little of everything to read and act on."""
    from django.utils import timezone

    from controlplane.cluster.agent_auth import issue_join_token
    from controlplane.cluster.models import Pool
    from controlplane.jobs import actions
    from controlplane.tenancy.models import ApiToken, Budget, Membership, Quota, Tenant

    vision = Tenant.objects.create(slug="vision", name="Vision lab")
    nlp = Tenant.objects.create(slug="nlp", name="NLP lab")
    for tenant in (vision, nlp):
        Quota.objects.create(tenant=tenant, gpu_type="", guaranteed_gpus=4, limit_gpus=8)
        Budget.objects.create(tenant=tenant, kind="energy_kwh", period="month", amount=100)
    alice = django_user_model.objects.create_user("alice", password="a-long-pass-phrase-1")
    Membership.objects.create(user=alice, tenant=vision, role="member")
    admin = django_user_model.objects.create_user(
        "root", password="a-long-pass-phrase-2", is_staff=True, is_superuser=True
    )
    pool = Pool.objects.create(name="default")
    issue_join_token(pool, expires_at=timezone.now() + dt.timedelta(days=1))
    actions.submit_job(tenant=vision, user=alice, name="probe", command=["true"], gpus=1)
    _, member_token = ApiToken.issue(alice, "schemathesis")
    _, admin_token = ApiToken.issue(admin, "schemathesis")
    return {"member": member_token, "cluster admin": admin_token}


def run_schemathesis(url: str, token: str, report: Path) -> tuple[int, str, dict]:
    """One schemathesis run; (exit code, console output, JSON report)."""
    command = [
        str(ST),
        "run",
        f"{url}/api/schema/",
        "--url",
        url,
        "--checks",
        "not_a_server_error,status_code_conformance",
        "--phases",
        "examples,coverage,fuzzing",
        "--seed",
        str(SEED),
        "--max-examples",
        str(EXAMPLES_PER_OPERATION),
        "--workers",
        "2",
        "--no-shrink",
        "--header",
        f"Authorization: Bearer {token}",
        "--report",
        "json",
        "--report-json-path",
        str(report),
        "--warnings",
        "off",
    ]
    env = {
        **os.environ,
        "NO_COLOR": "1",
        "SCHEMATHESIS_TELEMETRY": "false",
        # schemathesis_site/sitecustomize.py: a CPython 3.11 bug under the two workers.
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).with_name("schemathesis_site")), os.environ.get("PYTHONPATH", "")]
        ),
    }
    # In the test's own directory: schemathesis keeps its example database in the working one.
    done = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=900, cwd=report.parent
    )
    data = json.loads(report.read_text()) if report.exists() else {}
    return done.returncode, done.stdout + done.stderr, data


@pytest.mark.parametrize("who", ["member", "cluster admin"])
def test_every_operation_answers_only_what_the_schema_declares(
    control_plane, people, who, tmp_path
):
    code, output, report = run_schemathesis(
        control_plane.url, people[who], tmp_path / "report.json"
    )

    # The console output names each failing operation and check, with a curl to reproduce it.
    assert code == 0, output[-20000:]
    operations, cases = report["operations"], report["test_cases"]
    assert report["complete"] and not report["failures"] and not report["errors"], output
    # Every operation was really exercised, not skipped or lost to errors.
    assert operations["tested"] == operations["total"] > 50, operations
    assert operations["errored"] == 0 and cases["errored"] == 0, report
    assert cases["generated"] >= 20 * operations["total"], cases
    print(
        f"schemathesis as {who}: {operations['tested']} operations, "
        f"{cases['generated']} cases, {cases['with_failures']} with failures"
    )
