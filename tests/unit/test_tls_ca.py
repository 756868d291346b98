"""The console's TLS certificate authority (console/pki.py): its files, the certificates it signs (names,
lifetimes, usages), the requests it refuses, and the console's own client certificate."""
import datetime
import ipaddress
import ssl
import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from console import pki

ADDRESS = "10.77.0.12"


@pytest.fixture(autouse=True)
def tls_dir(settings, tmp_path):
    settings.FADEN_TLS_DIR = tmp_path / "data" / "tls"
    settings.FADEN_SECRETS_KEY_PATH = tmp_path / "data" / "secrets.key"
    settings.FADEN_CERT_DAYS = 30
    return settings.FADEN_TLS_DIR


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def request(key=None, *, cn: str | None = ADDRESS, sans=(ADDRESS,), dns=()) -> str:
    key = key or ec.generate_private_key(ec.SECP256R1())
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)] if cn else []))
    names = [x509.IPAddress(ipaddress.ip_address(a)) for a in sans] + [x509.DNSName(d) for d in dns]
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    algorithm = None if isinstance(key, ed25519.Ed25519PrivateKey) else hashes.SHA256()
    return builder.sign(key, algorithm).public_bytes(serialization.Encoding.PEM).decode()


def load(pem: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem.encode())


def usages(cert: x509.Certificate) -> set:
    return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


# -- the authority's files ------------------------------------------------------------------------


def test_the_authority_is_made_once_its_key_sealed_with_the_secrets_key_and_private(tls_dir):
    first = pki.ca_pem()
    assert pki.ca_pem() == first  # made once
    key_file = tls_dir / "ca.key"
    assert mode(key_file) == 0o600 and mode(tls_dir) == 0o700
    text = key_file.read_bytes()
    assert b"ENCRYPTED PRIVATE KEY" in text
    with pytest.raises(TypeError):  # no key without the password the secrets key gives
        serialization.load_pem_private_key(text, password=None)
    ca = load(first)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert ca.not_valid_after_utc - ca.not_valid_before_utc > datetime.timedelta(days=3000)


def test_another_secrets_key_cannot_open_the_authority(tls_dir, settings, tmp_path):
    pki.ca_pem()
    settings.FADEN_SECRETS_KEY_PATH = tmp_path / "other.key"

    with pytest.raises(pki.AuthorityError) as error:
        pki.sign_request(request(), address=ADDRESS, role="node")
    assert "secrets key" in str(error.value) and "BEGIN" not in str(error.value)


# -- what it signs --------------------------------------------------------------------------------


@pytest.mark.parametrize("role, expected", [
    ("node", {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}),
    ("copy", {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}),  # its agent asks /health with it
    ("client", {ExtendedKeyUsageOID.CLIENT_AUTH}),
])
def test_a_certificate_names_the_address_for_the_roles_usages_for_the_set_days(role, expected, settings):
    settings.FADEN_CERT_DAYS = 7
    issued = pki.sign_request(request(), address=ADDRESS, role=role, label="gpu-room")
    cert = load(issued.pem)

    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    loopback = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")] if role == "node" else []
    assert list(sans) == [x509.IPAddress(ipaddress.ip_address(ADDRESS)), *loopback]
    assert usages(cert) == expected
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    life = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert datetime.timedelta(days=7) <= life <= datetime.timedelta(days=7, minutes=6)
    assert issued.not_after == cert.not_valid_after_utc
    assert format(cert.serial_number, "x") == issued.serial
    assert cert.issuer == load(pki.ca_pem()).subject
    assert "gpu-room" in cert.subject.rfc4514_string()
    load(pki.ca_pem()).verify_directly_issued_by(load(pki.ca_pem()))
    cert.verify_directly_issued_by(load(pki.ca_pem()))


def test_usages_are_the_roles_whatever_the_request_asks():
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ADDRESS)]))
           .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), critical=False)
           .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
           .sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM).decode())
    cert = load(pki.sign_request(csr, address=ADDRESS, role="copy").pem)
    assert usages(cert) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False


def test_an_ipv6_address_and_an_rsa_key_are_signed():
    cert = load(pki.sign_request(request(rsa.generate_private_key(65537, 2048), cn="fd00::5", sans=("fd00::5",)),
                                 address="fd00::5", role="copy").pem)
    assert cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("fd00::5")]


@pytest.mark.parametrize("csr, words", [
    (lambda: request(cn="10.77.0.13", sans=("10.77.0.13",)), "not the machine's cluster address"),
    (lambda: request(sans=(ADDRESS, "10.77.0.13")), "10.77.0.13"),
    (lambda: request(dns=("console.example.com",)), "console.example.com"),
    (lambda: request(cn="*", sans=()), "not the machine's cluster address"),
    (lambda: request(ec.generate_private_key(ec.SECP256K1())), "curve"),
    (lambda: request(rsa.generate_private_key(65537, 1024)), "2048"),
    (lambda: request(ed25519.Ed25519PrivateKey.generate()), "ECDSA or RSA"),
    (lambda: "-----BEGIN CERTIFICATE REQUEST-----\nnope\n-----END CERTIFICATE REQUEST-----\n", "no certificate signing request"),
    (lambda: "", "no certificate signing request"),
])
def test_a_request_that_names_anything_but_the_address_or_has_a_weak_key_is_refused(csr, words):
    with pytest.raises(pki.CertificateError) as error:
        pki.sign_request(csr(), address=ADDRESS, role="node")
    assert words in str(error.value)


def test_a_request_without_names_gets_the_address_only():
    cert = load(pki.sign_request(request(cn=None, sans=()), address=ADDRESS, role="copy").pem)
    assert cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address(ADDRESS)]


def test_a_request_whose_signature_does_not_match_its_body_is_refused():
    """A request for another address with the address changed after it was signed."""
    der = x509.load_pem_x509_csr(request(cn="10.77.0.13", sans=()).encode()).public_bytes(serialization.Encoding.DER)
    tampered = x509.load_der_x509_csr(der.replace(b"10.77.0.13", ADDRESS.encode()))
    with pytest.raises(pki.CertificateError, match="signature"):
        pki.sign_request(tampered.public_bytes(serialization.Encoding.PEM).decode(), address=ADDRESS, role="node")


@pytest.mark.parametrize("address, role, words", [("gpu-1", "node", "not an IP address"), (ADDRESS, "admin", "no certificate role")])
def test_a_bad_address_or_role_is_refused(address, role, words):
    with pytest.raises(pki.CertificateError, match=words):
        pki.sign_request(request(), address=address, role=role)


def test_renewal_is_due_with_a_third_of_the_life_left():
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
    assert pki.renew_due(None)
    assert not pki.renew_due(now + datetime.timedelta(days=11), now=now)
    assert pki.renew_due(now + datetime.timedelta(days=9), now=now)


# -- the console's client certificate ---------------------------------------------------------------------


def test_the_client_certificate_is_for_clients_only_its_key_sealed_and_kept_across_renewals(tls_dir):
    files = pki.client_files()
    cert = load(files.cert.read_text())
    assert usages(cert) == {ExtendedKeyUsageOID.CLIENT_AUTH}
    assert mode(files.key) == 0o600 and b"ENCRYPTED PRIVATE KEY" in files.key.read_bytes()
    key_before = files.key.read_bytes()
    assert pki.client_files().cert.read_text() == files.cert.read_text()  # not due: the same one

    renewed = pki.client_files(renew=True)
    assert renewed.key.read_bytes() == key_before
    assert load(renewed.cert.read_text()).serial_number != cert.serial_number
    context = ssl.create_default_context(cafile=str(renewed.ca))
    context.load_cert_chain(str(renewed.cert), str(renewed.key), password=renewed.password)  # OpenSSL reads it


def test_a_node_certificate_serves_tls_that_a_client_of_the_authority_verifies(tmp_path):
    """The certificates work as TLS uses them: a server on the address's certificate, the console's client
    verifying it by its IP, with mutual authentication."""
    import socket
    import threading

    key = ec.generate_private_key(ec.SECP256R1())
    issued = pki.sign_request(request(key, cn="127.0.0.1", sans=("127.0.0.1",)), address="127.0.0.1", role="copy")
    (tmp_path / "s.pem").write_text(issued.pem)
    (tmp_path / "s.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tmp_path / "s.pem", tmp_path / "s.key")
    server.load_verify_locations(pki.ca_cert_path())
    server.verify_mode = ssl.CERT_REQUIRED
    listener = socket.create_server(("127.0.0.1", 0))
    seen = {}

    def serve():
        connection, _ = listener.accept()
        with server.wrap_socket(connection, server_side=True) as tls:
            seen["client"] = tls.getpeercert()["subject"]
            tls.sendall(b"ok")

    thread = threading.Thread(target=serve)
    thread.start()
    with socket.create_connection(listener.getsockname()) as raw, pki.client_ssl_context().wrap_socket(
            raw, server_hostname="127.0.0.1") as tls:
        assert tls.recv(2) == b"ok"
    thread.join(5)
    listener.close()
    assert ("commonName", "client") in [pair for rdn in seen["client"] for pair in rdn]
