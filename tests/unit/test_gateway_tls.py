"""The gateway to copies behind mutual TLS: it presents the console's client certificate and trusts only the
console's authority; a copy whose certificate another authority signed is out of rotation, the request goes to
another copy. The copies are tests/upstreams.py's engine serving HTTPS with a certificate of console/pki.py."""
import ipaddress
import ssl

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from console import pki
from deployments.gateway.routes import copy_url
from tests.unit.test_gateway import (a_key, answered_by, chat, cluster, deployment_of, redis, serving, start_gateway,  # noqa: F401
                                     upstreams)

pytestmark = pytest.mark.django_db(transaction=True)


def copy_context(*, authority=None) -> ssl.SSLContext:
    """A copy's server context: a certificate for 127.0.0.1 signed by the console's authority (or another),
    client certificates of the console's authority required."""
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
           .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
           .sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM).decode())
    pem = (authority or pki.sign_request)(csr, address="127.0.0.1", role="copy").pem
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        with open(f"{directory}/copy.pem", "w") as fh:
            fh.write(pem)
        with open(f"{directory}/copy.key", "wb") as fh:
            fh.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(f"{directory}/copy.pem", f"{directory}/copy.key")
    context.load_verify_locations(cadata=pki.ca_pem())
    context.verify_mode = ssl.CERT_REQUIRED
    return context


@pytest.fixture
def tls_dir(settings, tmp_path):
    settings.FADEN_TLS_DIR = tmp_path / "tls"
    return settings.FADEN_TLS_DIR


def tls_copy(deployment, upstream, number):
    copy = serving(deployment, upstream, number)
    copy.tls = True
    copy.save(update_fields=["tls"])
    return copy


def test_the_gateway_calls_a_copy_behind_mutual_tls_with_its_client_certificate(tls_dir, cluster, upstreams, start_gateway):
    secure = upstreams("secure", tls=copy_context())
    llama = deployment_of(cluster, name="llama")
    tls_copy(llama, secure, 1)
    secret = a_key()
    gateway = start_gateway()
    client = gateway.client(secret)

    answers = [chat(client, "llama") for _ in range(5)]

    assert [a.status_code for a in answers] == [200] * 5 and {answered_by(a) for a in answers} == {"secure"}
    assert secure.refused_tls == 0 and secure.arrived() == 5
    assert copy_url("127.0.0.1", secure.port, tls=True) == secure.url
    # Kept alive: five requests, one handshake (the pool keeps the connection).
    assert len(secure.server.open_sockets) <= 2


def test_a_copy_whose_certificate_the_console_did_not_sign_is_out_of_rotation(tls_dir, cluster, upstreams, start_gateway):
    other_dir = tls_dir.parent / "other-authority"

    def other_authority(csr, **kwargs):  # another console's authority: the gateway does not trust it
        from django.test import override_settings

        with override_settings(FADEN_TLS_DIR=other_dir):
            return pki.sign_request(csr, **kwargs)

    impostor, secure = upstreams("impostor", tls=copy_context(authority=other_authority)), upstreams("secure", tls=copy_context())
    plain = upstreams("plain")  # a plain engine where a copy behind TLS is recorded: no handshake, no request
    llama = deployment_of(cluster, name="llama")
    tls_copy(llama, impostor, 1)
    tls_copy(llama, secure, 2)
    tls_copy(llama, plain, 3)
    secret = a_key()
    gateway = start_gateway(probe_every=60)
    client = gateway.client(secret)

    answers = [chat(client, "llama") for _ in range(6)]

    assert [a.status_code for a in answers] == [200] * 6 and {answered_by(a) for a in answers} == {"secure"}
    out = {copy.number: copy.out_reason for copy in gateway.app.table.out_of_rotation()}
    assert set(out) == {1, 3} and "TLS handshake failed" in out[1], out
    assert impostor.arrived() == 0 and plain.arrived() == 0
