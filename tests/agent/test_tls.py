"""``tls request|install|status``: the real agent as a subprocess, its files in a temporary secrets root
(FADEN_AGENT_SECRETS), a certificate authority made here as the console's makes its certificates."""

import datetime
import ipaddress
import json
import os
import stat
import subprocess

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.agent.imagehelpers import AGENT_DIR, PYTHON

ADDRESS = "198.18.1.11"


class Authority:
    def __init__(self):
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test CA")])
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(self.key.public_key())
                     .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                     .not_valid_after(now + datetime.timedelta(days=10))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                     .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.pem = self.cert.public_bytes(serialization.Encoding.PEM).decode()

    def sign(self, csr_pem: str, days: int = 30) -> str:
        csr = x509.load_pem_x509_csr(csr_pem.encode())
        now = datetime.datetime.now(datetime.timezone.utc)
        return (x509.CertificateBuilder().subject_name(csr.subject).issuer_name(self.cert.subject)
                .public_key(csr.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ADDRESS))]), critical=False)
                .sign(self.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM).decode())


class Machine:
    def __init__(self, tmp_path):
        self.root = tmp_path / "clusters"
        self.env = dict(os.environ, PYTHONPATH=AGENT_DIR, PYTHONDONTWRITEBYTECODE="1",
                        FADEN_AGENT_HOME=str(tmp_path / "agent-home"), FADEN_AGENT_SECRETS=str(self.root))

    def run(self, *argv, body=None):
        stdin = b"" if body is None else json.dumps(body).encode()
        proc = subprocess.run([PYTHON, "-m", "fadenstack_agent", "tls", *argv], input=stdin, capture_output=True,
                              env=self.env, timeout=60)
        events = [json.loads(line) for line in proc.stdout.decode().splitlines()]
        assert events and events[-1]["event"] in ("result", "error") and "Traceback" not in proc.stderr.decode(), proc
        return proc.returncode, events[-1], proc.stdout.decode() + proc.stderr.decode()

    def tls(self, name: str = ""):
        return self.root / "gpu-room" / "tls" / name


@pytest.fixture
def machine(tmp_path):
    return Machine(tmp_path)


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_request_makes_the_key_here_privately_and_answers_a_request_for_the_address_only(machine):
    code, result, output = machine.run("request", "--cluster", "gpu-room", "--role", "node,copy", "--address", ADDRESS)

    assert code == 0, result
    assert sorted(result["requests"]) == ["copy", "node"]
    csr = x509.load_pem_x509_csr(result["requests"]["node"].encode())
    assert csr.is_signature_valid
    assert csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == ADDRESS
    assert csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address(ADDRESS)]
    key = machine.tls("node.key.new")
    assert mode(key) == 0o600 and mode(machine.tls()) == 0o700 and mode(machine.tls().parent) == 0o700
    assert b"PRIVATE KEY" in key.read_bytes()
    assert "PRIVATE KEY" not in output  # the key never leaves the machine
    assert serialization.load_pem_private_key(key.read_bytes(), None).public_key() == csr.public_key()


def test_install_puts_the_certificate_beside_its_key_and_status_reads_its_expiry(machine):
    ca = Authority()
    _, asked, _ = machine.run("request", "--cluster", "gpu-room", "--role", "node", "--address", ADDRESS)
    cert = ca.sign(asked["requests"]["node"], days=30)

    code, result, _ = machine.run("install", "--cluster", "gpu-room", body={"ca": ca.pem, "certificates": {"node": cert}})

    assert code == 0, result
    expected = x509.load_pem_x509_certificate(cert.encode()).not_valid_after_utc.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert result["installed"]["node"]["not_after"] == expected
    assert not machine.tls("node.key.new").exists()
    for name in ("ca.pem", "node.pem", "node.key"):
        assert mode(machine.tls(name)) == 0o600
    _, status, _ = machine.run("status", "--cluster", "gpu-room")
    assert status["certificates"]["node"]["not_after"] == expected and status["pending"] == []
    assert status["ca"]["not_after"]


def test_a_renewal_keeps_the_key_in_use_until_its_successors_certificate_comes(machine):
    ca = Authority()
    _, asked, _ = machine.run("request", "--cluster", "gpu-room", "--role", "node", "--address", ADDRESS)
    machine.run("install", "--cluster", "gpu-room", body={"ca": ca.pem, "certificates": {"node": ca.sign(asked["requests"]["node"])}})
    key_before = machine.tls("node.key").read_bytes()

    _, again, _ = machine.run("request", "--cluster", "gpu-room", "--role", "node", "--address", ADDRESS)
    assert machine.tls("node.key").read_bytes() == key_before  # what Ray reads at its next start still matches
    _, status, _ = machine.run("status", "--cluster", "gpu-room")
    assert status["pending"] == ["node"]

    code, result, _ = machine.run("install", "--cluster", "gpu-room", body={"ca": ca.pem, "certificates": {"node": ca.sign(again["requests"]["node"])}})
    assert code == 0, result
    assert machine.tls("node.key").read_bytes() != key_before


@pytest.mark.parametrize("case", ["another key", "another authority", "not a certificate"])
def test_a_certificate_not_for_this_machines_key_or_not_from_the_authority_changes_nothing(machine, case):
    ca = Authority()
    _, asked, _ = machine.run("request", "--cluster", "gpu-room", "--role", "node", "--address", ADDRESS)
    other_key = ec.generate_private_key(ec.SECP256R1())
    other_csr = (x509.CertificateSigningRequestBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ADDRESS)]))
                 .sign(other_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM).decode())
    cert = {"another key": ca.sign(other_csr), "another authority": Authority().sign(asked["requests"]["node"]),
            "not a certificate": "hello"}[case]

    code, result, _ = machine.run("install", "--cluster", "gpu-room", body={"ca": ca.pem, "certificates": {"node": cert}})

    assert code != 0 and result["kind"] == "bad_input", result
    assert sorted(p.name for p in machine.tls().iterdir()) == ["node.key.new"]


@pytest.mark.parametrize("argv, words", [
    (["request", "--cluster", "Bad_Name", "--role", "node"], "--cluster"),
    (["request", "--cluster", "gpu-room", "--role", "admin"], "--role"),
    (["request", "--cluster", "gpu-room", "--role", "node", "--address", "gpu-1; rm -rf /"], "--address"),
])
def test_bad_flags_are_refused_in_words(machine, argv, words):
    code, result, _ = machine.run(*argv)
    assert code != 0 and result["kind"] == "bad_input" and words in result["message"]


def test_rays_tls_variables_follow_what_is_installed(machine, monkeypatch):
    from fadenstack_agent import tlsfiles

    monkeypatch.setenv("FADEN_AGENT_SECRETS", str(machine.root))
    assert tlsfiles.ray_tls_environ("gpu-room", in_container=True) == {}
    ca = Authority()
    _, asked, _ = machine.run("request", "--cluster", "gpu-room", "--role", "node", "--address", ADDRESS)
    machine.run("install", "--cluster", "gpu-room", body={"ca": ca.pem, "certificates": {"node": ca.sign(asked["requests"]["node"])}})

    assert tlsfiles.ray_tls_environ("gpu-room", in_container=True) == {
        "RAY_USE_TLS": "1", "RAY_TLS_SERVER_CERT": "/etc/fadenstack/cluster/tls/node.pem",
        "RAY_TLS_SERVER_KEY": "/etc/fadenstack/cluster/tls/node.key", "RAY_TLS_CA_CERT": "/etc/fadenstack/cluster/tls/ca.pem"}
    assert tlsfiles.ray_tls_environ("gpu-room", in_container=False)["RAY_TLS_SERVER_KEY"] == str(machine.tls("node.key"))
    monkeypatch.setenv("RAY_USE_TLS", "1")
    assert tlsfiles.export_ray_tls("other", in_container=True) == {} and "RAY_USE_TLS" not in os.environ
