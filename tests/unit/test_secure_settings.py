"""Running behind TLS: FADEN_SECURE=true; the machines' own endpoints stay on plain HTTP where FADEN_AGENT_PLAIN_HTTP
allows it (the suite's setting; tests/unit/test_agent_tls.py without it)."""
import os
import re
import subprocess
import sys

import pytest
from django.test import Client

from tests.factories import MachineFactory


def deploy_check_warnings(tmp_path, **env) -> set[str]:
    """The ids of the warnings ``faden check --deploy`` prints with these settings."""
    full_env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings", "FADEN_DATA_DIR": str(tmp_path), **env}
    full_env.pop("DATABASE_URL", None)
    full_env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)  # the browser tests' (Playwright's) setting, not a deployment's
    done = subprocess.run([sys.executable, "-m", "config.cli", "check", "--deploy"], env=full_env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, f"`faden check --deploy` exited {done.returncode}:\n{done.stdout}{done.stderr}"
    assert "System check identified" in done.stdout + done.stderr, done.stdout + done.stderr
    return set(re.findall(r"\((\w+\.W\d+)\)", done.stdout + done.stderr))


def test_with_faden_secure_the_deploy_check_warns_only_about_hsts_preload_the_operator_s_choice(tmp_path):
    assert deploy_check_warnings(tmp_path, FADEN_SECURE="true") == {"security.W021"}
    assert deploy_check_warnings(tmp_path, FADEN_SECURE="true", FADEN_HSTS_PRELOAD="true") == set()


def test_without_it_the_check_names_what_it_would_turn_on(tmp_path):
    assert deploy_check_warnings(tmp_path) == {"security.W004", "security.W008", "security.W012", "security.W016"}


@pytest.fixture
def secure(settings):
    """The settings FADEN_SECURE=true gives."""
    settings.SECURE_SSL_REDIRECT = settings.SESSION_COOKIE_SECURE = settings.CSRF_COOKIE_SECURE = True
    settings.SECURE_HSTS_SECONDS = 31536000


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/", "/login/", "/machines/", "/api/machines/", "/api/schema/swagger/"])
def test_browsers_and_the_api_are_sent_to_https(secure, path):
    response = Client().get(path)

    assert response.status_code == 301
    assert response["Location"] == f"https://testserver{path}"


@pytest.mark.django_db
def test_a_machine_s_heartbeat_over_plain_http_is_not_redirected(secure):
    import hashlib

    token = "a-machine-heartbeat-token"
    MachineFactory(heartbeat_token_hash=hashlib.sha256(token.encode()).hexdigest())

    response = Client().post("/agent/heartbeat/", "{}", content_type="application/json", headers={"Authorization": f"Bearer {token}"})

    assert response.status_code == 200
    assert Client().get(f"/agent/images/{'a' * 64}/").status_code == 401  # answered over HTTP, not redirected


@pytest.mark.django_db
def test_over_https_the_cookies_are_secure_and_hsts_is_sent(secure, admin_user):
    client = Client()
    page = client.get("/login/", secure=True)
    response = client.post("/login/", {"username": "admin", "password": "correct horse battery staple"}, secure=True)

    assert page["Strict-Transport-Security"].startswith("max-age=31536000")
    assert client.cookies["csrftoken"]["secure"]
    assert response.status_code == 302 and client.cookies["sessionid"]["secure"]


@pytest.mark.django_db
def test_every_page_carries_a_policy_that_allows_scripts_and_styles_from_the_console_only(admin_client):
    policy = admin_client.get("/machines/")["Content-Security-Policy"]
    directives = dict(part.strip().split(" ", 1) for part in policy.split(";"))

    assert directives["script-src"] == "'self'"
    assert directives["style-src"] == "'self'"
    assert directives["default-src"] == "'self'"
    assert directives["frame-ancestors"] == "'none'"


@pytest.mark.django_db
def test_the_browsable_api_allows_inline_styles_but_still_no_inline_script(admin_client):
    policy = admin_client.get("/api/machines/", headers={"Accept": "text/html"})["Content-Security-Policy"]
    directives = dict(part.strip().split(" ", 1) for part in policy.split(";"))

    assert directives["style-src"] == "'self' 'unsafe-inline'"
    assert directives["script-src"] == "'self'"
