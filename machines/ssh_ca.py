"""The console's SSH certificate authority: its key, and the certificates it signs for node logins.

Machines trust this authority for root logins (machines/sshd.py writes what sshd reads), so a
person logs in with a short-lived certificate the console signs for their own public key and no
key of theirs is ever copied to a machine. docs/ssh-certificates.md tells the whole of it.

The private key (Ed25519) is kept like the console's own SSH key (machines/remote.py): a file in
OpenSSH's format, 0600 in a 0700 directory, beside that key in the data directory
(``FADEN_SSH_CA_KEY_PATH``), made private again at every start by config/data_dir.py, and backed
up with the data directory. It is made on first use under a lock, so two processes starting at
once never make two. It never leaves this module: not to the database, a log line, a task's
arguments, an error's words or a command line (signing is done here, in Python, with the
``cryptography`` package's certificate builder: no ssh-keygen, nothing in ``ps``). The public key
is no secret: ``ca_public_key`` gives it to whoever asks, and it goes to every machine.
"""
from __future__ import annotations

import base64
import fcntl
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    SSHCertificateBuilder,
    SSHCertificateType,
    load_ssh_private_key,
    load_ssh_public_key,
)
from django.conf import settings
from django.views.decorators.debug import sensitive_variables

from console.files import write_once, writer_temporary
from machines import ssh_rules

log = logging.getLogger(__name__)

CLOCK_SKEW_SECONDS = 60  # a certificate is valid from a minute before it was signed: a machine's clock may be behind
MAX_SECONDS = 24 * 3600  # a certificate cannot be revoked: a day at most
# What a node login may do besides running commands: a terminal, and port forwarding (the tunnels
# to Ray's dashboard). Not agent or X11 forwarding: root on a shared machine could use them.
EXTENSIONS = (b"permit-port-forwarding", b"permit-pty")
KEY_ID_PREFIX = "fadenstack"


class CertificateAuthorityError(Exception):
    """The authority's key file cannot be used; the message names the file, never its content."""


def ca_key_path() -> Path:
    return Path(settings.FADEN_SSH_CA_KEY_PATH)


def ca_public_key_path() -> Path:
    return ca_key_path().with_suffix(".pub")


@sensitive_variables()
def _private_key() -> Ed25519PrivateKey:
    """The authority's private key, made on first use. Only this module's signing reads it."""
    path = ca_key_path()
    if not path.exists():
        _key_make(path)
    try:
        key = load_ssh_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError):  # its words could quote the file: say only where it is
        raise CertificateAuthorityError(
            f"{path} holds no SSH private key without a passphrase: put back the authority's key from a backup, "
            f"or remove the file to make a new authority that every machine must then trust anew.") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise CertificateAuthorityError(f"{path} holds an SSH key that is not Ed25519: the authority's key is an Ed25519 key.")
    return key


@sensitive_variables()
def _key_make(path: Path) -> None:
    """Write a new key pair, the private key 0600 in a 0700 directory, unless another process made one
    first. Under a lock (a file beside the key) so that only one is ever made; the key appears whole
    (written aside, then linked in place, never over a key that is there)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock_fd = os.open(path.with_name(f".{path.name}.lock"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        if path.exists():  # another process made it while this one waited
            return
        private = Ed25519PrivateKey.generate()
        pem = private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption())
        public = private.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        # The public part first: whoever sees the private key finds its public one beside it.
        _public_write(path.with_suffix(".pub"), f"{public.decode('ascii')} fadenstack-ssh-ca\n")
        write_once(path, pem)
        log.info("Made the console's SSH certificate authority: %s (public key %s).",
                 path, ssh_rules.fingerprint_of(_blob(public.decode("ascii"))))
    finally:
        fcntl.flock(lock_fd, fcntl.LOCK_UN)
        os.close(lock_fd)


def _public_write(path: Path, line: str) -> None:
    temporary = writer_temporary(path)
    temporary.write_text(line)
    temporary.chmod(0o644)  # no secret; the data directory (0700) keeps it to this user all the same
    os.replace(temporary, path)


def _blob(line: str) -> bytes:
    return base64.b64decode(line.split()[1])


def ca_public_key() -> str:
    """The authority's public key, one line (``ssh-ed25519 AAAA... fadenstack-ssh-ca``): what every
    machine's sshd trusts (``TrustedUserCAKeys``). Makes the authority on first use; the public
    file is written again from the private key when it went missing."""
    public_path = ca_public_key_path()
    if not ca_key_path().exists() or not public_path.exists():
        public = _private_key().public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        if not public_path.exists():
            _public_write(public_path, f"{public.decode('ascii')} fadenstack-ssh-ca\n")
    return public_path.read_text().strip()


def ca_fingerprint(*, create: bool = True) -> str:
    """The authority's public key's SHA256 fingerprint; "" when it has none yet and ``create`` is False."""
    if not create and not ca_key_path().exists():
        return ""
    return ssh_rules.fingerprint_of(_blob(ca_public_key()))


def key_id_for(*, username: str, cluster: str, serial: int) -> str:
    """The certificate's key id, which sshd logs at each login: it names the person, the cluster
    and the certificate's serial (``fadenstack:alice:gpu-room:17``)."""
    for part in (username, cluster):
        if not part or any(c.isspace() or c == ":" or not c.isprintable() for c in part):
            raise ValueError(f"{part!r} cannot be part of a certificate's key id.")
    return f"{KEY_ID_PREFIX}:{username}:{cluster}:{serial}"


@sensitive_variables("ca_key")
def certificate_for(public_key: str, *, principals: Sequence[str], key_id: str, valid_seconds: int, serial: int) -> str:
    """An OpenSSH user certificate for ``public_key``, signed by the authority: one line to save as
    ``<key>-cert.pub``. Valid from a minute ago (clock skew) for ``valid_seconds`` (the caller
    passes ``FADEN_SSH_CERT_SECONDS``; a day at most) for ``principals`` (the logins it opens:
    machines/sshd.py). ``serial``: from the counter that never repeats (machines/ssh_certificates.py).

    The key is checked here too (ssh_rules): nothing but an accepted public key is ever signed."""
    parsed = ssh_rules.public_key_parse(public_key, ca_fingerprint=ca_fingerprint())
    if problem := ssh_rules.principals_problem(list(principals)):
        raise ValueError(problem)
    if not 1 <= valid_seconds <= MAX_SECONDS:
        raise ValueError(f"A certificate is valid from 1 second to a day ({MAX_SECONDS} s), not {valid_seconds} s.")
    if not 0 < serial < 2**64:
        raise ValueError(f"A certificate's serial is a positive 64-bit number, not {serial}.")
    if not key_id or "\n" in key_id:
        raise ValueError("A certificate needs a key id on one line.")
    now = int(time.time())
    ca_key = _private_key()
    builder = (
        SSHCertificateBuilder()
        .public_key(load_ssh_public_key(f"{parsed.kind} {parsed.blob}".encode("ascii")))
        .type(SSHCertificateType.USER)
        .serial(serial)
        .key_id(key_id.encode("utf-8"))
        .valid_principals([p.encode("ascii") for p in principals])
        .valid_after(now - CLOCK_SKEW_SECONDS)
        .valid_before(now + valid_seconds)
    )
    for extension in EXTENSIONS:
        builder = builder.add_extension(extension, b"")
    certificate = builder.sign(ca_key)
    line = certificate.public_bytes().decode("ascii")
    return f"{line} {key_id}"
