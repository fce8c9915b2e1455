"""Production settings pass Django's deployment checklist, and production answers carry what a
browser acts on (Secure cookies, HSTS, a Content-Security-Policy) through the real stack: the
gunicorn command docker-compose.yml runs, behind a TLS proxy that says so in X-Forwarded-Proto.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import yaml

from tests import ports

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# This file's ports (no other suite uses 18550-18599).
PORTS = range(18550, 18600)
HOST = "cp.example.org"
PASSWORD = "a-long-passphrase-for-tests-7"


def production_env(**overrides: str) -> dict[str, str]:
    """What docs/deployment.md tells an operator to set, and nothing from this shell."""
    env = {
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", "/tmp"),
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "GPUCP_ENV": "production",
        "SECRET_KEY": secrets.token_urlsafe(50),
        "DATABASE_URL": os.environ.get("DATABASE_URL", "postgres://gpucp@127.0.0.1:5432/gpucp"),
        "ALLOWED_HOSTS": f"{HOST},127.0.0.1",
        "CSRF_TRUSTED_ORIGINS": f"https://{HOST}",
        "SECURE_PROXY_SSL_HEADER": "X-Forwarded-Proto: https",
    }
    env.update(overrides)
    return env


def manage(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_the_deployment_checklist_finds_nothing_in_production_settings():
    result = manage("check", "--deploy", "--fail-level", "WARNING", env=production_env())
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "System check identified no issues (0 silenced)." in output
    assert "WARNING" not in output.upper(), output


@pytest.mark.slow
@pytest.mark.parametrize(
    "variable,value,check_id",
    [
        ("SECURE_SSL_REDIRECT", "0", "security.W008"),
        ("SECURE_HSTS_SECONDS", "0", "security.W004"),
        ("SECURE_HSTS_INCLUDE_SUBDOMAINS", "no", "security.W005"),
        ("SESSION_COOKIE_SECURE", "0", "security.W012"),
        ("CSRF_COOKIE_SECURE", "false", "security.W016"),
        ("SECRET_KEY", "short-and-guessable", "security.W009"),
    ],
)
def test_an_operator_who_turns_a_protection_off_hears_it_from_the_checklist(
    variable, value, check_id
):
    result = manage(
        "check", "--deploy", "--fail-level", "WARNING", env=production_env(**{variable: value})
    )
    assert result.returncode == 1
    assert re.findall(r"\((security\.\w+)\)", result.stderr) == [check_id], result.stderr


# The real stack -----------------------------------------------------------------------------


def compose_web_command(port: int) -> list[str]:
    """docker-compose.yml's web command with its defaults, bound to `port`, sized for a test."""
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    command = []
    for arg in compose["services"]["web"]["command"]:
        arg = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", arg)
        if arg.startswith("--bind="):
            arg = f"--bind=127.0.0.1:{port}"
        elif arg.startswith("--workers="):
            arg = "--workers=1"
        elif arg.startswith("--threads="):
            arg = "--threads=4"
        command.append(arg)
    assert command[0] == "gunicorn", command
    return [str(BIN / "gunicorn"), *command[1:]]


def free_port() -> int:
    return ports.free_port(PORTS)


@dataclass
class ProductionServer:
    url: str
    env: dict[str, str]  # its environment, for `manage.py` commands next to it


@pytest.fixture
def production_server(transactional_db, tmp_path):
    """gunicorn as docker-compose.yml runs it, in production mode, on the test database."""
    from tests.e2e.conftest import database_url_of_test_db

    env = production_env(
        DATABASE_URL=database_url_of_test_db(),
        STATIC_ROOT=str(tmp_path / "static"),
        # gunicorn itself believes X-Forwarded-Proto from 127.0.0.1 unless told otherwise; a
        # TLS proxy in another container is not 127.0.0.1, so only Django's own setting
        # (SECURE_PROXY_SSL_HEADER) may make these requests secure, as in the deployment.
        FORWARDED_ALLOW_IPS="192.0.2.1",
    )
    # What the image does at build time; the admin's and the API browser's files are left out,
    # hashing and compressing them would only make the test slow.
    collected = manage(
        "collectstatic", "--noinput", "--verbosity=0",
        "--ignore=admin/*", "--ignore=rest_framework/*", "--ignore=drf_spectacular*",
        "--ignore=django_htmx/ext/*",
        env=env,
    )  # fmt: skip
    assert collected.returncode == 0, collected.stderr
    port = free_port()
    log = tmp_path / "gunicorn.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            compose_web_command(port),
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"gunicorn exited:\n{log.read_text()[-3000:]}"
            try:
                requests.get(f"{url}/login/", timeout=2, allow_redirects=False)
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline, f"gunicorn did not answer:\n{log.read_text()}"
                time.sleep(0.2)
        yield ProductionServer(url=url, env=env)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def through_the_proxy() -> requests.Session:
    """A browser's requests as the TLS proxy passes them on."""
    session = requests.Session()
    session.headers.update({"Host": HOST, "X-Forwarded-Proto": "https"})
    return session


def cookie_attributes(response: requests.Response, name: str) -> set[str]:
    (header,) = [c for c in response.raw.headers.getlist("Set-Cookie") if c.startswith(name + "=")]
    return {part.strip().split("=")[0].lower() for part in header.split(";")[1:]}


@pytest.mark.slow
def test_production_answers_carry_secure_cookies_hsts_and_a_content_security_policy(
    production_server, make_user, settings
):
    from django.conf import global_settings

    # The suite hashes passwords with MD5 for speed; production accepts only its own hashers.
    settings.PASSWORD_HASHERS = global_settings.PASSWORD_HASHERS
    make_user("carol", password=PASSWORD)
    browser = through_the_proxy()

    login = browser.get(f"{production_server.url}/login/", allow_redirects=False)
    assert login.status_code == 200
    assert login.headers["Strict-Transport-Security"] == (
        "max-age=31536000; includeSubDomains; preload"
    )
    policy = dict(
        (d.split()[0], d.split()[1:]) for d in login.headers["Content-Security-Policy"].split(";")
    )
    assert policy["default-src"] == policy["script-src"] == policy["style-src"] == ["'self'"]
    assert policy["object-src"] == policy["frame-ancestors"] == ["'none'"]
    assert login.headers["X-Content-Type-Options"] == "nosniff"
    assert login.headers["X-Frame-Options"] == "DENY"
    assert {"secure", "samesite"} <= cookie_attributes(login, "csrftoken")
    # gunicorn names itself but not its version; the TLS proxy may drop even that.
    assert not re.search(r"\d", login.headers.get("Server", ""))

    # The browser sends the cookie back only over HTTPS, which the proxy reports.
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', login.text).group(1)
    signed_in = browser.post(
        f"{production_server.url}/login/",
        data={"username": "carol", "password": PASSWORD, "csrfmiddlewaretoken": token},
        headers={
            "Referer": f"https://{HOST}/login/",
            "Cookie": f"csrftoken={login.cookies['csrftoken']}",
        },
        allow_redirects=False,
    )
    assert signed_in.status_code == 302, signed_in.text[:2000]
    assert {"secure", "httponly", "samesite"} <= cookie_attributes(signed_in, "sessionid")
    assert "Strict-Transport-Security" in signed_in.headers

    # The API's answers carry the same headers (Swagger UI and the browsable API are pages too).
    api = browser.get(f"{production_server.url}/api/v1/jobs/", allow_redirects=False)
    assert api.status_code in (401, 403)
    assert "Content-Security-Policy" in api.headers
    assert "Strict-Transport-Security" in api.headers


@pytest.mark.slow
def test_production_sends_plain_http_to_https_and_believes_no_client_about_the_scheme(
    production_server,
):
    plain = requests.get(
        f"{production_server.url}/login/?next=/jobs/", headers={"Host": HOST}, allow_redirects=False
    )
    assert plain.status_code == 301
    assert plain.headers["Location"] == f"https://{HOST}/login/?next=/jobs/"
    # A header other than the one the operator named proves nothing.
    spoofed = requests.get(
        f"{production_server.url}/login/",
        headers={"Host": HOST, "X-Forwarded-Ssl": "on", "X-Forwarded-Protocol": "ssl"},
        allow_redirects=False,
    )
    assert spoofed.status_code == 301
    assert "Strict-Transport-Security" not in spoofed.headers
