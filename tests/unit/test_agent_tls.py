"""Agents reach the console over TLS to a certificate they pin: the certificate (made once, key 0600), the
agents' listener faden serve runs (the /agent/ endpoints only), a heartbeat and a download through the agent's
own pinned connections, a wrong pin refused, plain HTTP refused unless FADEN_AGENT_PLAIN_HTTP, and the URLs
the console gives 0.10.0 and older agents."""
import hashlib
import http.client
import os
import signal
import socket
import ssl
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from django.test import Client

from clusters.transfer import ConsoleOrigin
from console import agent_tls
from console.jobs import JobError
from console.management.commands import serve
from tests.factories import MachineFactory
from tests.processes import database_url, free_port

AGENT_DIR = str(Path(__file__).resolve().parents[2] / "agent")
if AGENT_DIR not in sys.path:
    sys.path.insert(0, AGENT_DIR)

from fadenstack_agent import beat, pinning  # noqa: E402


def test_the_certificate_is_made_once_with_a_private_key(settings, tmp_path):
    settings.DATA_DIR = tmp_path
    certificate, key = agent_tls.ensure()
    pin = agent_tls.pin()

    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and stat.S_IMODE(certificate.stat().st_mode) == 0o600
    assert agent_tls.ensure() == (certificate, key) and agent_tls.pin() == pin  # not made again
    assert pin == hashlib.sha256(ssl.PEM_cert_to_DER_cert(certificate.read_text())).hexdigest()
    assert b"PRIVATE KEY" in key.read_bytes() and not list(tmp_path.glob(".*.tmp"))


@pytest.fixture(scope="module")
def listener(django_db_setup):
    """The agents' listener as faden serve starts it, on the test database."""
    from django.conf import settings

    port = free_port()
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "DATABASE_URL": database_url(),
           "FADEN_AGENT_PLAIN_HTTP": "0"}
    process = subprocess.Popen(serve.agents_argv(sys.executable, bind="127.0.0.1", port=port), env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 30
    context = pinning.pinned_context()
    while True:
        try:
            with context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=1)):
                break
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read().decode()
            time.sleep(0.1)
    yield port, agent_tls.pin()
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=15)
    assert settings.FADEN_AGENT_PLAIN_HTTP  # the suite's own setting, untouched


@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_over_tls_to_the_pinned_certificate_is_taken(listener):
    port, pin = listener
    token = "a-machine-heartbeat-token"
    machine = MachineFactory(heartbeat_token_hash=hashlib.sha256(token.encode()).hexdigest())
    opener = urllib.request.build_opener(beat._NoRedirect, pinning.PinnedHTTPSHandler(pin))
    config = {"url": f"https://127.0.0.1:{port}/agent/heartbeat/", "token": token}

    assert beat.send_beat(opener, config, {"agent_version": "0.10.0"}) == 200
    machine.refresh_from_db()
    assert machine.agent_version == "0.10.0"


@pytest.mark.django_db(transaction=True)
def test_another_certificate_is_refused_before_the_token_leaves(listener):
    port, pin = listener
    wrong = "0" * 64
    opener = urllib.request.build_opener(beat._NoRedirect, pinning.PinnedHTTPSHandler(wrong))
    with pytest.raises(beat.BeatFailed, match="not the one pinned at enrolment"):
        beat.send_beat(opener, {"url": f"https://127.0.0.1:{port}/agent/heartbeat/", "token": "t"}, {})

    conn = pinning.connection_class(True, wrong)("127.0.0.1", port, timeout=5)
    with pytest.raises(pinning.PinMismatch):
        conn.connect()
    assert conn.sock is None  # closed: nothing was sent


@pytest.mark.django_db(transaction=True)
def test_a_download_goes_through_the_pinned_connection_and_only_agent_paths_are_served(listener):
    port, pin = listener
    conn = pinning.connection_class(True, pin)("127.0.0.1", port, timeout=5)
    conn.request("GET", f"/agent/images/{'a' * 64}/", headers={"Authorization": "Bearer nope"})
    image = conn.getresponse()
    image.read()
    conn.request("GET", "/login/")
    page = conn.getresponse()
    said = page.read()
    conn.close()

    assert image.status == 401  # the download view, over TLS: refused for its token, not for the transport
    assert page.status == 404 and b"Only the machines' endpoints" in said

    plain = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    with pytest.raises((http.client.HTTPException, OSError)):  # no TLS, no answer
        plain.request("GET", "/agent/heartbeat/")
        plain.getresponse()


@pytest.mark.django_db
def test_plain_http_to_the_machines_endpoints_is_refused_unless_the_setting_allows_it(settings):
    token = "a-machine-heartbeat-token"
    MachineFactory(heartbeat_token_hash=hashlib.sha256(token.encode()).hexdigest())
    beat_now = lambda **kw: Client().post("/agent/heartbeat/", "{}", content_type="application/json",  # noqa: E731
                                          headers={"Authorization": f"Bearer {token}"}, **kw)
    settings.FADEN_AGENT_PLAIN_HTTP = False

    refused = beat_now()
    assert refused.status_code == 403 and "FADEN_AGENT_PLAIN_HTTP" in refused.json()["error"]
    assert Client().get(f"/agent/images/{'a' * 64}/").status_code == 403
    assert Client().get(f"/agent/models/{'a' * 64}/").status_code == 403
    assert beat_now(secure=True).status_code == 200

    settings.FADEN_AGENT_PLAIN_HTTP = True
    assert beat_now().status_code == 200


def test_with_faden_secure_the_agents_need_no_exemption(tmp_path):
    def exempt(**env):
        full = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings", "FADEN_DATA_DIR": str(tmp_path),
                "FADEN_SECURE": "true", "FADEN_AGENT_PLAIN_HTTP": "0", **env}
        code = "import django; django.setup(); from django.conf import settings; print(settings.SECURE_REDIRECT_EXEMPT)"
        return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, check=True).stdout.strip()

    assert exempt() == "[]"  # with FADEN_AGENT_PLAIN_HTTP (the suite's), ['^agent/'] as before


@pytest.mark.django_db
def test_a_0_10_agent_fetches_over_tls_with_the_pin_an_older_one_only_where_allowed(settings):
    origin = ConsoleOrigin(plain="http://198.18.0.1:8000", tls="https://198.18.0.1:8443", pin="ab" * 32)
    new, old = MachineFactory(agent_version="0.10.0"), MachineFactory(agent_version="0.9.2")

    source = origin.source(new, "/agent/images/x/", "download-token")
    assert (source.url, source.token, source.pin) == ("https://198.18.0.1:8443/agent/images/x/", "download-token", "ab" * 32)
    settings.FADEN_AGENT_PLAIN_HTTP = True
    assert origin.source(old, "/agent/images/x/", "t").url == "http://198.18.0.1:8000/agent/images/x/"
    settings.FADEN_AGENT_PLAIN_HTTP = False
    with pytest.raises(JobError, match=f"{old.name} has agent 0.9.2.*update its agent"):
        origin.source(old, "/agent/images/x/", "t")


def test_the_agents_url_follows_the_console_s_host_on_the_tls_port(settings):
    from machines import remote

    settings.FADEN_AGENT_TLS_URL, settings.FADEN_AGENT_TLS_PORT = "", 8443
    settings.FADEN_CONSOLE_URL = "https://console.example.org"
    assert remote.agent_console_url(None) == "https://console.example.org:8443"
    settings.FADEN_CONSOLE_URL = ""
    assert remote.agent_console_url(None, "fd00::1") == "https://[fd00::1]:8443"
    settings.FADEN_AGENT_TLS_URL = "https://agents.example.org:9443"
    assert remote.agent_console_url(None) == "https://agents.example.org:9443"


@pytest.mark.django_db
def test_the_page_of_a_machine_with_an_agent_before_tls_says_whether_plain_http_is_let_in(client, settings, admin_user):
    machine = MachineFactory(agent_version="0.9.2")
    client.force_login(admin_user)

    settings.FADEN_AGENT_PLAIN_HTTP = False
    refused = client.get(machine.get_absolute_url()).content.decode()
    settings.FADEN_AGENT_PLAIN_HTTP = True
    allowed = client.get(machine.get_absolute_url()).content.decode()
    current = client.get(MachineFactory(agent_version="0.10.0").get_absolute_url()).content.decode()

    assert "plain HTTP, which this console refuses" in refused and "update" in refused
    assert "plain HTTP, which this console still allows" in allowed
    assert "plain HTTP" not in current


@pytest.mark.django_db(transaction=True)
def test_a_model_file_s_first_copy_reaches_the_agent_through_the_listener(listener, tmp_path):
    """The agent's own ``blob fetch``, as the console sends it: a source with the download token and the pin."""
    import json

    from deployments.models import ModelFile, StoredModel
    from deployments.store import disk, machine_files
    from machines.agent_client import FileSource
    from tests.builders import cluster_of, gpu_machine

    port, pin = listener
    data = os.urandom((3 << 20) + 123)
    chunk = 1 << 20
    hashes = [hashlib.sha256(data[i:i + chunk]).hexdigest() for i in range(0, len(data), chunk)]
    digest = hashlib.sha256(data).hexdigest()
    model = StoredModel.objects.create(repo="org/tls", commit="c" * 40, bytes_total=len(data))
    ModelFile.objects.create(model=model, path="w.bin", size=len(data), sha256=digest, chunk_size=chunk, chunk_hashes=hashes)
    disk.ensure_dirs()
    disk.blob_path(digest).write_bytes(data)
    cluster = cluster_of([gpu_machine("lab-a", 11)])
    member = cluster.members.get()
    token = machine_files.file_token(machine_files.FileGrant(digest=digest, cluster_id=cluster.pk, machine_id=member.machine_id), 60)
    source = ConsoleOrigin(plain="http://127.0.0.1:9", tls=f"https://127.0.0.1:{port}", pin=pin).source(
        member.machine, f"/agent/models/{digest}/", token)
    spec = {"digest": digest, "size": len(data), "chunk_size": chunk, "chunk_hashes": hashes, "retry_seconds": 5,
            "source": {"url": source.url, "token": source.token, "pin": source.pin}}
    assert isinstance(source, FileSource) and source.url.startswith("https://")

    env = {**os.environ, "PYTHONPATH": AGENT_DIR, "FADEN_AGENT_HOME": str(tmp_path / "home"),
           "FADEN_AGENT_CONFIG": str(tmp_path / "agent.json"), "FADEN_AGENT_STORE": str(tmp_path / "store")}
    done = subprocess.run([sys.executable, "-m", "fadenstack_agent", "blob", "fetch"], input=json.dumps(spec).encode(),
                          env=env, capture_output=True, timeout=60)
    result = json.loads(done.stdout.decode().splitlines()[-1])

    assert done.returncode == 0, result
    assert result["bytes_fetched"] == len(data) and Path(result["path"]).read_bytes() == data
    disk.blob_path(digest).unlink()
