"""``faden ssh`` (the client package): from another computer with the console's URL and a token, over the REST
API only. The console answers through the Django test client (and once through a real HTTP server, for
urllib's side); the exec of ssh is replaced, so each test reads the argv that would have run."""
import json
import os
import stat
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from cryptography.hazmat.primitives.serialization import load_ssh_public_identity
from django.test import Client
from rest_framework.authtoken.models import Token

import client.api
import client.cli
import client.ssh
from console import roles
from machines.models import Machine
from tests.builders import build, cluster_of, gpu_machine
from tests.factories import UserFactory

URL = "http://console.test"


@pytest.fixture(autouse=True)
def ca_and_runtime_dir(settings, tmp_path, monkeypatch):
    settings.FADEN_SSH_CA_KEY_PATH = tmp_path / "ca" / "ca_ed25519"
    settings.FADEN_SSH_CERT_SECONDS = 3600
    settings.FADEN_MACHINES_REACHABLE = True
    settings.FADEN_SSH_JUMP = ""
    (tmp_path / "run").mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))


@pytest.fixture
def execs(monkeypatch):
    """The argv each exec of ssh would have run (nothing runs)."""
    calls = []
    monkeypatch.setattr(client.ssh, "_exec", lambda program, argv: calls.append((program, list(argv))))
    return calls


@pytest.fixture
def key(tmp_path) -> Path:
    """A private key and its .pub, as ssh-keygen leaves them; returns the private key's path."""
    private = ed25519.Ed25519PrivateKey.generate()
    path = tmp_path / "keys" / "id_ed25519"
    path.parent.mkdir()
    path.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                           serialization.NoEncryption()))
    path.chmod(0o600)
    public = private.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    path.with_name("id_ed25519.pub").write_text(public.decode() + " ada@laptop\n")
    return path


@pytest.fixture
def room(db):
    return cluster_of([gpu_machine("lab-a", 11), gpu_machine("lab-b", 12, ssh_port=2222)], runtime=build("2.1.0"))


def token_for(role=roles.ADMINISTRATOR, username="ada") -> str:
    return Token.objects.create(user=UserFactory(username=username, role=role)).key


def django_send(method, url, headers, body):
    """The console, answered by the Django test client: the same URLs, headers and body urllib would send."""
    parts = urlsplit(url)
    assert f"{parts.scheme}://{parts.netloc}" == URL
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    response = Client().generic(method, path, data=body or b"", content_type=headers.get("Content-Type", "application/json"),
                                HTTP_AUTHORIZATION=headers["Authorization"], HTTP_ACCEPT=headers["Accept"])
    return response.status_code, response.content


def faden(*argv, token, send=django_send):
    return client.cli.main(list(argv), send=send, environ={"FADEN_URL": URL, "FADEN_TOKEN": token})


# -- logging in ------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_faden_ssh_signs_a_certificate_for_the_node_and_runs_ssh_with_it(room, key, execs, capsys):
    status = faden("ssh", "gpu-room", "node-1", "-i", str(key), token=token_for())

    assert status == 0
    ((program, argv),) = execs
    certificate = Path(argv[argv.index("-o") + 1].removeprefix("CertificateFile="))
    assert program == "ssh"
    assert argv == ["ssh", "-i", str(key), "-o", f"CertificateFile={certificate}", "-o", "IdentitiesOnly=yes",
                    "-p", "2222", "--", "root@198.18.0.12"]
    signed = load_ssh_public_identity(certificate.read_bytes())
    lab_b = room.members.get(machine__name="lab-b").machine_id
    assert signed.valid_principals == [f"fadenstack-cluster-{room.pk}-machine-{lab_b}".encode()]
    assert signed.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode() \
        == " ".join(key.with_name("id_ed25519.pub").read_text().split()[:2])
    assert stat.S_IMODE(certificate.stat().st_mode) == 0o600 and stat.S_IMODE(certificate.parent.stat().st_mode) == 0o700
    said = capsys.readouterr()
    assert signed.key_id.decode() in said.err
    assert f"Its host key, as the console trusts it: {Machine.objects.get(name='lab-b').host_key_fingerprint}" in said.err
    assert certificate.read_text().split()[1] not in said.out + said.err


@pytest.mark.django_db
def test_without_a_node_it_logs_in_to_the_head_and_a_command_after_the_node_is_passed_on(room, key, execs):
    token = token_for()
    faden("ssh", "gpu-room", "-i", str(key.with_name("id_ed25519.pub")), token=token)
    faden("ssh", "gpu-room", "0", "-i", str(key), "--", "nvidia-smi", "-L", token=token)

    (_, head), (_, command) = execs
    assert head[-2:] == ["--", "root@198.18.0.11"]
    assert head[2] == str(key)  # the .pub named: ssh gets the private key beside it
    assert command[-4:] == ["--", "root@198.18.0.11", "nvidia-smi", "-L"]


@pytest.mark.django_db
def test_with_the_machines_not_reachable_ssh_jumps_through_the_console_host(room, key, execs, settings):
    settings.FADEN_MACHINES_REACHABLE = False
    settings.FADEN_SSH_JUMP = "me@console.example.com"

    faden("ssh", "gpu-room", "node-0", "-i", str(key), token=token_for())

    ((_, argv),) = execs
    assert argv[argv.index("-J") + 1] == "me@console.example.com"
    assert argv.index("-J") < argv.index("--")


@pytest.mark.django_db
def test_a_cluster_that_does_not_exist_is_named_and_nothing_runs(room, key, execs, capsys):
    status = faden("ssh", "nope", "-i", str(key), token=token_for())

    assert status == 1 and not execs
    assert "faden ssh: There is no cluster named nope on http://console.test." in capsys.readouterr().err


@pytest.mark.django_db
def test_the_consoles_refusal_is_printed_in_its_own_words(room, key, execs, capsys):
    status = faden("ssh", "gpu-room", "-i", str(key), token=token_for(roles.VIEWER, "vic"))

    assert status == 1 and not execs
    assert ("The console refused: Your role is Viewer: logging in to a node needs an Administrator"
            in capsys.readouterr().err)


@pytest.mark.django_db
def test_a_node_the_cluster_does_not_have_is_refused_by_the_console(room, key, execs, capsys):
    assert faden("ssh", "gpu-room", "node-9", "-i", str(key), token=token_for()) == 1
    assert "gpu-room has no node node-9" in capsys.readouterr().err and not execs


@pytest.mark.django_db
def test_a_bad_token_says_the_console_refused_it(room, key, execs, capsys):
    assert faden("ssh", "gpu-room", "-i", str(key), token="not-a-token") == 1
    assert "The console refused the token:" in capsys.readouterr().err


def test_no_key_no_url_or_no_token_each_say_what_to_do(tmp_path, execs, capsys):
    missing = client.cli.main(["ssh", "gpu-room", "-i", str(tmp_path / "nokey")], send=django_send,
                          environ={"FADEN_URL": URL, "FADEN_TOKEN": "t"})
    no_url = client.cli.main(["ssh", "gpu-room"], send=django_send, environ={"FADEN_TOKEN": "t"})
    no_token = client.cli.main(["ssh", "gpu-room", "--url", URL], send=django_send, environ={})

    err = capsys.readouterr().err
    assert missing == 1 and f"No public key at {tmp_path / 'nokey.pub'}: make one with ssh-keygen -t ed25519" in err
    assert no_url == 2 and "Give the console's URL: FADEN_URL=" in err
    assert no_token == 2 and "Give an API token: FADEN_TOKEN=" in err
    assert not execs


# -- what goes into ssh's argv -------------------------------------------------------------------------


@pytest.mark.parametrize("field, value", [("ssh_address", "-oProxyCommand=touch /tmp/x"), ("ssh_address", "a b"),
                                          ("ssh_user", "-l"), ("ssh_port", "22; id"), ("ssh_port", True)])
def test_an_answer_ssh_would_misread_is_refused_before_anything_runs(tmp_path, field, value):
    node = {"ssh_user": "root", "ssh_address": "198.18.0.12", "ssh_port": 22} | {field: value}
    key = client.ssh.Key(identity=tmp_path / "id", public_line="ssh-ed25519 AAAA")

    with pytest.raises(client.api.ClientError):
        client.ssh.ssh_argv(node, jump="", key=key, certificate=tmp_path / "c")
    with pytest.raises(client.api.ClientError):
        client.ssh.ssh_argv({"ssh_user": "root", "ssh_address": "h", "ssh_port": 22}, jump="-oProxyCommand=x", key=key,
                        certificate=tmp_path / "c")


def test_a_certificate_path_with_blanks_or_a_percent_is_given_as_ssh_reads_it(tmp_path):
    key = client.ssh.Key(identity=tmp_path / "id", public_line="")
    node = {"ssh_user": "root", "ssh_address": "h", "ssh_port": 22}

    argv = client.ssh.ssh_argv(node, jump="", key=key, certificate=Path("/run/my dir/50%-cert.pub"))

    assert argv[4] == 'CertificateFile="/run/my dir/50%%-cert.pub"'


def test_expired_certificates_are_removed_from_the_private_directory_and_fresh_ones_kept(tmp_path):
    where = client.ssh.private_dir()
    old = where / f"gpu-room-3-{int(time.time()) - 10}-cert.pub"
    old.write_text("old\n")
    soon = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 3600))

    fresh = client.ssh.certificate_write("ssh-ed25519-cert-v01@openssh.com AAAA id", cluster="gpu room/1", serial=4, valid_before=soon)

    assert not old.exists()
    assert fresh.parent == where == tmp_path / "run" / f"faden-ssh-{os.getuid()}"
    assert fresh.name.startswith("gpu_room_1-4-") and fresh.read_text() == "ssh-ed25519-cert-v01@openssh.com AAAA id\n"


def test_a_directory_others_can_enter_is_refused(tmp_path):
    where = tmp_path / "run" / f"faden-ssh-{os.getuid()}"
    where.mkdir(mode=0o755)
    where.chmod(0o755)

    with pytest.raises(client.api.ClientError, match="is not a directory private to you"):
        client.ssh.private_dir()


# -- over real HTTP ------------------------------------------------------------------------------


class CannedConsole(BaseHTTPRequestHandler):
    """Answers the two requests faden ssh makes, as the console would; records what it was sent."""

    seen: list = []

    def log_message(self, *args):
        pass

    def _answer(self, status, body: bytes, kind="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.seen.append(("GET", self.path, self.headers["Authorization"], None))
        if self.path.startswith("/api/clusters/?name=broken"):
            return self._answer(502, b"<html>Bad gateway</html>", "text/html")
        self._answer(200, json.dumps({"results": [{"id": 7, "name": "gpu-room"}]}).encode())

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append(("POST", self.path, self.headers["Authorization"], body))
        answer = {"certificate": "ssh-ed25519-cert-v01@openssh.com AAAA fadenstack:ada:gpu-room:5", "serial": 5,
                  "key_id": "fadenstack:ada:gpu-room:5", "valid_before": "2099-01-01T00:00:00Z", "jump": "",
                  "nodes": [{"name": "node-0", "machine": "lab-a", "ssh_user": "root", "ssh_address": "10.0.0.5", "ssh_port": 22}]}
        self._answer(201, json.dumps(answer).encode())


@pytest.fixture
def canned():
    CannedConsole.seen = []
    server = HTTPServer(("127.0.0.1", 0), CannedConsole)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_over_http_the_token_goes_in_the_header_and_the_key_in_the_body(canned, key, execs):
    status = client.cli.main(["ssh", "gpu-room", "-i", str(key), "--url", canned + "/"], environ={"FADEN_TOKEN": "s3cret"})

    assert status == 0
    (listing, asked) = CannedConsole.seen
    assert listing[:3] == ("GET", "/api/clusters/?name=gpu-room", "Token s3cret")
    assert asked[:3] == ("POST", "/api/clusters/7/ssh-certificates/", "Token s3cret")
    assert asked[3] == {"public_key": key.with_name("id_ed25519.pub").read_text().strip(), "node": "node-0"}
    assert execs[0][1][-1] == "root@10.0.0.5"


def test_over_http_an_answer_that_is_not_the_api_and_a_console_that_is_not_there_are_named(canned, key, execs, capsys):
    broken = client.cli.main(["ssh", "broken", "-i", str(key)], environ={"FADEN_URL": canned, "FADEN_TOKEN": "t"})
    with socket_closed() as nowhere:
        gone = client.cli.main(["ssh", "gpu-room", "-i", str(key)], environ={"FADEN_URL": nowhere, "FADEN_TOKEN": "t"})

    err = capsys.readouterr().err
    assert broken == 1 and f"The console at {canned} answered 502: is FADEN_URL the console's address?" in err
    assert gone == 1 and f"Could not reach the console at {nowhere}:" in err
    assert not execs


class socket_closed:
    """A local URL nothing listens on."""

    def __enter__(self):
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def __exit__(self, *exc):
        self.sock.close()


# -- no server in the client ------------------------------------------------------------------------


def test_faden_ssh_runs_without_django_settings_or_a_data_directory(tmp_path):
    data = tmp_path / "no-data-dir"
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "FADEN_DATA_DIR": str(data)}
    code = ("import sys; from config import cli; sys.argv = ['faden', 'ssh', 'gpu-room']; status = cli.main(); "
            "import django.conf; assert not django.conf.settings.configured; "
            "assert not [m for m in sys.modules if m.split('.')[0] in ('console', 'machines', 'clusters', 'deployments')]; "
            "sys.exit(status)")

    done = subprocess.run([sys.executable, "-c", code], cwd=Path(client.__file__).parents[1], env=env,
                          capture_output=True, text=True, timeout=60)

    assert done.returncode == 2, done.stderr
    assert "faden ssh: Give the console's URL" in done.stderr
    assert not data.exists() and not (tmp_path / ".local").exists()
