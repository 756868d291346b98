"""The certificate the machines' agents reach the console with (heartbeats, the first copies of images and
model files): made once, self-signed, kept in the data directory (key 0600), and pinned by each agent.

No certificate authority vouches for it and none is needed: the console gives each agent the SHA-256 of
the certificate over SSH (enrolment, Update agent), and the agent refuses any other certificate before it
sends a byte. Served by ``faden serve``'s agents' listener on FADEN_AGENT_TLS_PORT (docs/security.md,
"The machines and the console").
"""
import datetime
import fcntl
import hashlib
import os
import socket
import ssl
from pathlib import Path

from django.conf import settings

LIFETIME_DAYS = 100 * 365  # pinned, not trusted through a chain: a new one means a new pin for every machine


def certificate_path() -> Path:
    return Path(settings.DATA_DIR) / "agent-tls.pem"


def key_path() -> Path:
    return Path(settings.DATA_DIR) / "agent-tls.key"


def ensure() -> tuple[Path, Path]:
    """The certificate and key, made the first time (the key written 0600, never replaced while it exists)."""
    cert, key = certificate_path(), key_path()
    if cert.exists() and key.exists():
        return cert, key
    lock = os.open(Path(settings.DATA_DIR) / "agent-tls.lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # faden serve and a worker may both come first
        if not (cert.exists() and key.exists()):
            _make(cert, key)
    finally:
        os.close(lock)
    return cert, key


def _make(cert: Path, key: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Fadenstack console (agents)")])
    now = datetime.datetime.now(datetime.timezone.utc)
    hostname = socket.gethostname()
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(private.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=LIFETIME_DAYS))
                   .add_extension(x509.SubjectAlternativeName([x509.DNSName(hostname)]), critical=False)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .sign(private, hashes.SHA256()))
    key_pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
    _write_new(key, key_pem)
    _write_new(cert, certificate.public_bytes(serialization.Encoding.PEM))


def _write_new(path: Path, data: bytes) -> None:
    """Into a temporary name made with O_EXCL and mode 0600, then renamed: never half a file, never readable by others."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.unlink()
    except FileNotFoundError:
        pass
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)


def pin() -> str:
    """The certificate's SHA-256 (of its DER form, 64 hex digits): what each agent compares with what it meets."""
    cert, _ = ensure()
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(cert.read_text())).hexdigest()


PLAIN_REFUSED = ("Agents reach the console over TLS (port {port}) and this console refuses them plain HTTP: update "
                 "this machine's agent (Update agent), or set FADEN_AGENT_PLAIN_HTTP=true to let older agents in.")


def agents_over_tls(view):
    """A machines' endpoint (/agent/...): over plain HTTP only where FADEN_AGENT_PLAIN_HTTP allows it (older
    agents); otherwise 403 with what to do, before the request's token or body is looked at."""
    import functools

    from django.http import JsonResponse

    @functools.wraps(view)
    def wrapped(request, *args, **kwargs):
        if not request.is_secure() and not settings.FADEN_AGENT_PLAIN_HTTP:
            return JsonResponse({"error": PLAIN_REFUSED.format(port=settings.FADEN_AGENT_TLS_PORT)}, status=403)
        return view(request, *args, **kwargs)

    return wrapped
