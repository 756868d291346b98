"""TLS to the console's pinned certificate, on the agent's side: the pin's forms, ``heartbeat start --pin``
and a fetch spec's pin checked, and a blob fetched over TLS from a source showing the pinned certificate,
refused at once (and without its token) from one showing another."""
import datetime
import hashlib
import http.server
import os
import ssl
import threading

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from fadenstack_agent import pinning
from fadenstack_agent.protocol import AgentError
from tests.agent.test_blob import _RangeSource, machines  # noqa: F401  (a fixture)
from tests.agent.test_cli import AGENT_DIR, final, run_agent
from tests.agent.imagehelpers import MiB, spec_for



@pytest.fixture
def env(tmp_path):
    """As tests/agent/test_cli.py's: the agent's own home, the source on PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": AGENT_DIR, "FADEN_AGENT_HOME": str(tmp_path / "home"),
            "FADEN_AGENT_CONFIG": str(tmp_path / "agent.json"), "FADEN_AGENT_STORE": str(tmp_path / "home" / "store")}


def self_signed(directory):
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "console")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    (directory / "c.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / "k.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                        serialization.NoEncryption()))
    return directory / "c.pem", directory / "k.pem", hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


class _Recording(_RangeSource):
    def do_GET(self):
        self.server.tokens.append(self.headers.get("Authorization"))
        super().do_GET()


@pytest.fixture
def tls_source(tmp_path):
    data = bytes(range(256)) * (3 * MiB // 256)
    cert, key, pin = self_signed(tmp_path)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recording)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    server.data, server.tokens, server.pin = data, [], pin
    server.url = "https://127.0.0.1:%d/agent/images/x/" % server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def blob_of(data):
    return {"digest": hashlib.sha256(data).hexdigest(), "size": len(data), "chunk_size": MiB,
            "chunk_hashes": [hashlib.sha256(data[i:i + MiB]).hexdigest() for i in range(0, len(data), MiB)]}


def test_a_pin_may_be_written_as_a_fingerprint_and_nothing_else_is_one():
    assert pinning.parse_pin("sha256:" + ":".join(["AB"] * 32)) == "ab" * 32
    for bad in ("", "ab" * 31, "zz" * 32, "md5:" + "ab" * 32):
        with pytest.raises(AgentError, match="--pin must be the SHA-256"):
            pinning.parse_pin(bad)


@pytest.mark.parametrize(("args", "words"), [
    (["--url", "https://h/agent/heartbeat/", "--pin", "nope"], "--pin must be the SHA-256"),
    (["--url", "http://h/agent/heartbeat/", "--pin", "ab" * 32], "--pin goes with an https:// URL"),
])
def test_heartbeat_start_checks_its_pin(env, args, words):
    code, events, _ = run_agent(["heartbeat", "start", *args], env, stdin=b"token\n")
    assert code == 2 and final(events)["kind"] == "bad_input" and words in final(events)["message"]


def test_a_blob_comes_over_tls_from_the_pinned_certificate_only(machines, tls_source):  # noqa: F811
    blob, b = blob_of(tls_source.data), machines("b")
    spec = spec_for(blob, tls_source.url, retry_seconds=30)

    spec["source"].update(token="download-token", pin="0" * 64)
    code, events = b.run(["blob", "fetch"], stdin=spec)
    assert code == 1 and final(events)["kind"] == "not_retryable"
    assert "not the one pinned at enrolment" in final(events)["message"]
    assert tls_source.tokens == []  # refused before a request was sent

    spec["source"]["pin"] = tls_source.pin
    code, events = b.run(["blob", "fetch"], stdin=spec)
    assert code == 0 and final(events)["size"] == blob["size"]
    assert set(tls_source.tokens) == {"Bearer download-token"}

    spec["source"].update(url=tls_source.url.replace("https", "http"))
    code, events = b.run(["blob", "fetch"], stdin=spec)
    assert code == 2 and "pin goes with an https:// url" in final(events)["message"]
