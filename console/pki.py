"""The console's TLS certificate authority: the certificates of the machines' cluster addresses and the console's own.

Ray between a cluster's machines (RAY_USE_TLS) and the copies' HTTPS (mutual TLS with the gateway and the
console's checks) trust this authority and nothing else. docs/https-and-trust.md tells the whole of it.

Kept like the SSH certificate authority (machines/ssh_ca.py): made once, on first use, under a lock, in
``FADEN_TLS_DIR`` (the data directory's ``tls/``, 0700): ``ca.key`` (0600) is its private key (ECDSA P-256)
in an encrypted PKCS#8 file whose password is derived from the secrets key (console/secrets.py), so a copy
of the data directory without that key gives no key away; ``ca.pem`` is its certificate, no secret, which
every machine gets. The console's client key (``client.key``, the gateway's and the checks' certificate) is
kept the same way, made by the console for itself; OpenSSL reads it with ``client_files()``'s password.

Keys of the machines are made on the machines (the agent's ``tls request``) and never leave them: this
module signs their signing requests (CSRs) for one address and one role, and refuses a request that names
anything else. Certificates are short-lived (``FADEN_CERT_DAYS``) and renewed before they expire.
"""
from __future__ import annotations

import datetime
import fcntl
import ipaddress
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from django.conf import settings
from django.views.decorators.debug import sensitive_variables

from console.files import write_once, writer_temporary
from console.secrets import derived_password

log = logging.getLogger(__name__)

CA_DAYS = 3650  # the authority's own certificate: ten years (its key is what matters; it never leaves the console)
CLOCK_SKEW = datetime.timedelta(minutes=5)  # valid from a little before it was signed: a machine's clock may be behind
MAX_DAYS = 397  # what browsers accept for a server certificate; the setting cannot go past it
RENEW_FRACTION = 3  # a certificate is renewed when less than a third of its life is left
CA_PASSWORD = "tls.ca"
CLIENT_PASSWORD = "tls.client"

SERVER = ExtendedKeyUsageOID.SERVER_AUTH
CLIENT = ExtendedKeyUsageOID.CLIENT_AUTH
# What each role's certificate is for. A Ray node both serves (GCS, raylet) and connects (to the others);
# a copy server serves the gateway and the checks; "client" connects only.
ROLES: dict[str, tuple[x509.ObjectIdentifier, ...]] = {
    "node": (SERVER, CLIENT),
    "copy": (SERVER, CLIENT),  # client too: the machine's agent presents it to ask its copies' /health
    "client": (CLIENT,),
}


# A Ray node's processes also reach each other on the machine itself (127.0.0.1, localhost), as Ray's own
# guide to its TLS has them in each node's certificate; a name that only ever means the machine itself.
LOOPBACK_NAMES = (x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost"))


class CertificateError(ValueError):
    """A signing request this authority will not sign; the message says why, in words a person reads."""


class AuthorityError(Exception):
    """The authority's files cannot be used; the message names the file, never its content."""


@dataclass(frozen=True)
class Issued:
    """A certificate signed: its PEM, serial (hex) and when it expires."""
    pem: str
    serial: str
    not_after: datetime.datetime


@dataclass(frozen=True)
class ClientFiles:
    """The console's client certificate as OpenSSL reads it (``ssl.SSLContext.load_cert_chain(cert, key, password)``),
    and the authority's certificate to verify the servers it calls (``load_verify_locations(ca)``)."""
    cert: Path
    key: Path
    password: bytes
    ca: Path
    not_after: datetime.datetime


def tls_dir() -> Path:
    return Path(settings.FADEN_TLS_DIR)


def ca_key_path() -> Path:
    return tls_dir() / "ca.key"


def ca_cert_path() -> Path:
    return tls_dir() / "ca.pem"


def cert_days() -> int:
    days = int(settings.FADEN_CERT_DAYS)
    if not 1 <= days <= MAX_DAYS:
        raise AuthorityError(f"FADEN_CERT_DAYS must be from 1 to {MAX_DAYS}, not {days}.")
    return days


def renew_due(not_after: datetime.datetime | None, *, now: datetime.datetime | None = None) -> bool:
    """Whether a certificate valid until ``not_after`` (None: none issued) is to be renewed now: less than
    a third of ``FADEN_CERT_DAYS`` is left."""
    if not_after is None:
        return True
    now = now or _now()
    return not_after - now < datetime.timedelta(days=cert_days()) / RENEW_FRACTION


# -- the authority --------------------------------------------------------------------------------


def ca_pem() -> str:
    """The authority's certificate (PEM): what every machine and every client trusts. Makes the authority on first use."""
    if not ca_cert_path().exists() or not ca_key_path().exists():
        _authority_make()
    return ca_cert_path().read_text()


def ca_certificate() -> x509.Certificate:
    return x509.load_pem_x509_certificate(ca_pem().encode("ascii"))


def ca_exists() -> bool:
    return ca_key_path().exists() and ca_cert_path().exists()


def _authority_make() -> None:
    """Make the key and its certificate, unless another process did first: under a lock beside them, each
    file written aside and linked in place (console/files.py), the certificate before the key."""
    directory = tls_dir()
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock_fd = os.open(directory / ".ca.lock", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        if ca_key_path().exists():
            if not ca_cert_path().exists():
                raise AuthorityError(f"{ca_cert_path()} is missing beside {ca_key_path()}: put it back from a backup, "
                                     f"or remove both to make a new authority (every cluster then needs Renew certificates).")
            return
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Fadenstack"),
                          x509.NameAttribute(NameOID.COMMON_NAME, f"Fadenstack console CA {os.urandom(4).hex()}")])
        certificate = (
            x509.CertificateBuilder()
            .subject_name(name).issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW)
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        _public_write(ca_cert_path(), certificate.public_bytes(serialization.Encoding.PEM))
        write_once(ca_key_path(), _sealed_key(key, CA_PASSWORD))
        log.info("Made the console's TLS certificate authority: %s (%s).", ca_cert_path(), certificate.subject.rfc4514_string())
    finally:
        fcntl.flock(lock_fd, fcntl.LOCK_UN)
        os.close(lock_fd)


@sensitive_variables()
def _sealed_key(key, purpose: str) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.BestAvailableEncryption(derived_password(purpose)))


@sensitive_variables()
def _key_load(path: Path, purpose: str):
    try:
        return serialization.load_pem_private_key(path.read_bytes(), password=derived_password(purpose))
    except (ValueError, TypeError):  # its words could quote the file: say only where it is
        raise AuthorityError(f"{path} cannot be opened with the secrets key ({purpose}): was the secrets key replaced? "
                             f"Put back the pair from a backup, or remove {path} to make a new one.") from None


def _public_write(path: Path, content: bytes) -> None:
    temporary = writer_temporary(path)
    temporary.write_bytes(content)
    temporary.chmod(0o644)  # no secret; the data directory (0700) keeps it to this user all the same
    os.replace(temporary, path)


# -- signing --------------------------------------------------------------------------------------


def address_of(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(str(text).strip())
    except ValueError:
        raise CertificateError(f"{text!r} is not an IP address: a certificate names a machine's cluster address.") from None


@sensitive_variables("ca_key")
def sign_request(csr_pem: str, *, address: str, role: str, label: str = "") -> Issued:
    """Sign the machine's signing request ``csr_pem`` for its cluster ``address`` in ``role`` (``ROLES``).

    The request must be signed by its own key (proof the machine holds it), name nothing but ``address``
    (its subject's common name, when it has one, and its subject alternative names, when it has any: the
    loopback names a Ray node's certificate carries too are accepted),
    and carry an ECDSA (P-256 or P-384) or RSA (2048 bits or more) key. The certificate names ``address``
    as its subject alternative name (what TLS checks; a Ray node's also 127.0.0.1 and localhost, which Ray's
    processes on one machine use between them) and is valid for ``FADEN_CERT_DAYS``; its usages
    are the role's, whatever the request asked for. ``label`` (the cluster's name) goes in its subject."""
    if role not in ROLES:
        raise CertificateError(f"{role!r} is no certificate role: {', '.join(ROLES)}.")
    wanted = address_of(address)
    try:
        csr = x509.load_pem_x509_csr(csr_pem.encode("ascii") if isinstance(csr_pem, str) else csr_pem)
    except (ValueError, UnicodeEncodeError):
        raise CertificateError("The machine's answer holds no certificate signing request in PEM.") from None
    if not csr.is_signature_valid:
        raise CertificateError("The signing request's signature is not valid: it was not made with its own key.")
    _key_check(csr.public_key())
    _names_check(csr, wanted)
    return _issue(csr.public_key(), address=wanted, role=role, label=label)


def _key_check(public) -> None:
    if isinstance(public, ec.EllipticCurvePublicKey):
        if public.curve.name not in ("secp256r1", "secp384r1"):
            raise CertificateError(f"The request's key is on the curve {public.curve.name}: P-256 or P-384 only.")
        return
    if isinstance(public, rsa.RSAPublicKey):
        if public.key_size < 2048:
            raise CertificateError(f"The request's RSA key has {public.key_size} bits: 2048 at least.")
        return
    raise CertificateError(f"The request's key is a {type(public).__name__}: ECDSA or RSA only.")


def _names_check(csr: x509.CertificateSigningRequest, wanted) -> None:
    for attribute in csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME):
        if attribute.value != str(wanted):
            raise CertificateError(f"The request names {attribute.value!r}, not the machine's cluster address {wanted}.")
    try:
        names = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return
    others = [n for n in names if not (isinstance(n, x509.IPAddress) and n.value == wanted) and n not in LOOPBACK_NAMES]
    if others:
        shown = ", ".join(str(getattr(n, "value", n)) for n in others)
        raise CertificateError(f"The request names {shown}, not only the machine's cluster address {wanted}.")


@sensitive_variables("ca_key")
def _issue(public, *, address, role: str, label: str) -> Issued:
    ca_pem()  # the authority, made on first use
    ca_key = _key_load(ca_key_path(), CA_PASSWORD)
    ca = x509.load_pem_x509_certificate(ca_cert_path().read_bytes())
    now = _now()
    not_after = now + datetime.timedelta(days=cert_days())
    subject = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Fadenstack")]
    if label:
        subject.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, label[:64]))
    subject.append(x509.NameAttribute(NameOID.COMMON_NAME, f"{role} {address}" if address else role))
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(subject))
        .issuer_name(ca.subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=isinstance(public, rsa.RSAPublicKey),
                                     content_commitment=False, data_encipherment=False, key_agreement=False,
                                     key_cert_sign=False, crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(list(ROLES[role])), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if address:
        names = [x509.IPAddress(address), *(LOOPBACK_NAMES if role == "node" else ())]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    certificate = builder.sign(ca_key, hashes.SHA256())
    return Issued(pem=certificate.public_bytes(serialization.Encoding.PEM).decode("ascii"),
                  serial=format(certificate.serial_number, "x"), not_after=not_after.replace(microsecond=0))


# -- the console's own client certificate -------------------------------------------------------------


def client_files(*, renew: bool = False) -> ClientFiles:
    """The console's client certificate (for the gateway and the checks), made on first use and renewed
    here when a third of its life is left (or ``renew``): the key stays, made once by the console for itself.
    Whoever loads it reloads after a renewal (``not_after`` changes)."""
    directory = tls_dir()
    ca_pem()
    key_path, cert_path = directory / "client.key", directory / "client.pem"
    if not key_path.exists():
        write_once(key_path, _sealed_key(ec.generate_private_key(ec.SECP256R1()), CLIENT_PASSWORD))
    current = _not_after(cert_path)
    if renew or renew_due(current):
        lock_fd = os.open(directory / ".client.lock", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            if renew or renew_due(_not_after(cert_path)):
                key = _key_load(key_path, CLIENT_PASSWORD)
                issued = _issue(key.public_key(), address=None, role="client", label="console")
                _public_write(cert_path, issued.pem.encode("ascii"))
                log.info("Issued the console's client certificate, valid until %s.", issued.not_after.isoformat())
        finally:
            fcntl.flock(lock_fd, fcntl.LOCK_UN)
            os.close(lock_fd)
        current = _not_after(cert_path)
    return ClientFiles(cert=cert_path, key=key_path, password=derived_password(CLIENT_PASSWORD),
                       ca=ca_cert_path(), not_after=current)


def client_ssl_context():
    """An ``ssl.SSLContext`` for the console's calls to a copy: it presents the client certificate and
    trusts only this authority (the copy's certificate names its address: check_hostname stays on)."""
    import ssl

    files = client_files()
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(files.ca))
    context.load_cert_chain(str(files.cert), str(files.key), password=files.password)
    return context


def _not_after(path: Path) -> datetime.datetime | None:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes()).not_valid_after_utc
    except (FileNotFoundError, ValueError):
        return None


def certificate_not_after(pem: str) -> datetime.datetime:
    """When the certificate in ``pem`` expires (UTC)."""
    try:
        return x509.load_pem_x509_certificate(pem.encode("ascii")).not_valid_after_utc
    except (ValueError, UnicodeEncodeError):
        raise CertificateError("No certificate in PEM.") from None


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
