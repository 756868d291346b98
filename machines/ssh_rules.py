"""Who may ask the console's SSH certificate authority for a certificate, and for which key. Pure: no I/O.

A node login is root on that machine, so a certificate is for an Administrator, or for an Operator
an Administrator allowed node logins (``console.node_login``, console/roles.py); a Viewer never.
The key is one OpenSSH public key line of a type we trust to be strong today: ssh-ed25519,
ecdsa-sha2-nistp256/384/521, or ssh-rsa of at least 3072 bits. Not a certificate (we sign keys,
not certificates), and not the certificate authority's own key. Each refusal is one sentence that
says why, for the page, the API and the command line alike.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import re
from dataclasses import dataclass

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.serialization import load_ssh_public_key
from django.core.exceptions import ValidationError

from console import roles
from console.offers import ALLOWED, Offer

ACCEPTED_KINDS = ("ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521", "ssh-rsa")
RSA_MIN_BITS = 3072
ACCEPTED_WORDS = f"ssh-ed25519, ecdsa-sha2-nistp256/384/521, or ssh-rsa of at least {RSA_MIN_BITS} bits"
CERTIFICATE_SUFFIX = "-cert-v01@openssh.com"
# Words that open a public key line of some type OpenSSH knows, though not one we accept.
KEY_KIND = re.compile(r"^(ssh-[a-z0-9-]+|ecdsa-sha2-[a-z0-9-]+|sk-[a-z0-9@.-]+|rsa-sha2-[0-9]+|x509v3-[a-z0-9-]+)$")
EXAMPLE = "ssh-ed25519 AAAA... you@laptop"
# What sshd's AuthorizedPrincipalsFile and a certificate's principals can hold safely: no spaces,
# no commas (ssh-keygen's separator), no pattern characters.
PRINCIPAL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")

NO_KEY = f"Paste a public key: one line such as {EXAMPLE}."
PRIVATE_KEY = "This is a private key: paste the public one (the .pub file) and keep the private key to yourself."
RFC4716 = "This public key is in the SSH2 format: convert it with ssh-keygen -i -f key.pub and paste the line that prints."
CERTIFICATE = ("This is an SSH certificate, not a public key: paste the public key it was made for "
               "(the .pub file without -cert in its name).")
NOT_OPENSSH = f"This is not an OpenSSH public key: paste one line such as {EXAMPLE}."
CA_KEY = "This is the console's own certificate authority key, which cannot sign for itself: paste your own public key."


def _several_lines(count: int) -> str:
    return f"Paste one public key on one line: this text has {count} lines."


def _kind_refused(kind: str) -> str:
    return f"Keys of type {kind} are not accepted: use {ACCEPTED_WORDS}."


def _rsa_short(bits: int) -> str:
    return (f"This ssh-rsa key has {bits} bits and RSA keys need at least {RSA_MIN_BITS}: "
            f"make an ed25519 key with ssh-keygen -t ed25519.")


class PublicKeyRefused(ValidationError):
    """A public key the certificate authority does not sign for; ``message`` is the one sentence."""


@dataclass(frozen=True)
class PublicKey:
    kind: str  # ssh-ed25519
    blob: str  # the key's base64, as in the line
    comment: str
    bits: int
    fingerprint: str  # SHA256:..., as ssh-keygen -l prints it

    @property
    def line(self) -> str:
        """The key as one line, the comment kept: what is stored, and signed."""
        return f"{self.kind} {self.blob}" + (f" {self.comment}" if self.comment else "")


def fingerprint_of(blob: bytes) -> str:
    """SHA256:<base64 without padding> of the key's wire bytes: ssh-keygen -l's form."""
    return "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode("ascii").rstrip("=")


def public_key_parse(text: str, *, ca_fingerprint: str = "") -> PublicKey:
    """The public key in ``text``, or PublicKeyRefused with the sentence that says what is wrong.

    ``ca_fingerprint``: the certificate authority's own key, refused (a certificate for the
    authority's key would let whoever holds it log in on its own)."""
    text = (text or "").strip()
    if not text:
        raise PublicKeyRefused(NO_KEY, code="empty")
    if "PRIVATE KEY" in text:
        raise PublicKeyRefused(PRIVATE_KEY, code="private")
    if "BEGIN SSH2 PUBLIC KEY" in text:
        raise PublicKeyRefused(RFC4716, code="rfc4716")
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) > 1:
        raise PublicKeyRefused(_several_lines(len(lines)), code="lines")
    parts = text.split(None, 2)
    kind = parts[0]
    if kind.endswith(CERTIFICATE_SUFFIX):
        raise PublicKeyRefused(CERTIFICATE, code="certificate")
    if kind not in ACCEPTED_KINDS:
        if KEY_KIND.match(kind):
            raise PublicKeyRefused(_kind_refused(kind), code="kind")
        raise PublicKeyRefused(NOT_OPENSSH, code="invalid")
    if len(parts) < 2:
        raise PublicKeyRefused(NOT_OPENSSH, code="invalid")
    blob_text = parts[1]
    try:
        blob = base64.b64decode(blob_text, validate=True)
        key = load_ssh_public_key(f"{kind} {blob_text}".encode("ascii"))
    except (binascii.Error, ValueError, UnsupportedAlgorithm, UnicodeEncodeError):
        # The type word and the key inside disagree, or the key's data is cut or not base64.
        raise PublicKeyRefused(NOT_OPENSSH, code="invalid") from None
    bits = getattr(key, "key_size", 256)  # RSA and ECDSA keys say; an Ed25519 key is 256 bits
    if kind == "ssh-rsa" and bits < RSA_MIN_BITS:
        raise PublicKeyRefused(_rsa_short(bits), code="rsa_bits")
    fingerprint = fingerprint_of(blob)
    if ca_fingerprint and fingerprint == ca_fingerprint:
        raise PublicKeyRefused(CA_KEY, code="ca_key")
    comment = " ".join(parts[2].split()) if len(parts) > 2 else ""
    comment = "".join(c for c in comment if c.isprintable())[:200]
    return PublicKey(kind=kind, blob=blob_text, comment=comment, bits=bits, fingerprint=fingerprint)


# -- who may ask ----------------------------------------------------------------------------------

NODE_LOGIN_NEEDS = "logging in to a node needs an Administrator, or an Operator an Administrator allowed node logins"
CONSOLE_ITSELF = "A certificate names the person who logs in: the console signs none for itself."


def node_login_offer(*, role: roles.Role | None, allowed: bool) -> Offer:
    """Whether a person of ``role`` may have a certificate for a node login; ``allowed``: they hold
    ``console.node_login`` (an Administrator gave it to them, or to a group of theirs)."""
    if role is roles.CONSOLE:
        return Offer(False, CONSOLE_ITSELF, forbidden=True)
    if role is roles.ADMINISTRATOR or (role is roles.OPERATOR and allowed):
        return ALLOWED
    if role is roles.OPERATOR:
        return Offer(False, "Your role is Operator and node logins are not allowed for you yet: "
                            "an Administrator can allow them.", forbidden=True)
    who = f"Your role is {role}" if role is not None else "Your account has no role"
    return Offer(False, f"{who}: {NODE_LOGIN_NEEDS}.", forbidden=True)


def principals_problem(principals: list[str]) -> str:
    """Why these principals cannot go in a certificate, or "" when they can."""
    if not principals:
        return "A certificate needs at least one principal: which logins it is for."
    if len(principals) > 256:  # OpenSSH refuses a certificate with more (SSHKEY_CERT_MAX_PRINCIPALS)
        return f"A certificate holds at most 256 principals, not {len(principals)}: sign for the cluster's principal."
    bad = next((p for p in principals if not isinstance(p, str) or not PRINCIPAL.match(p)), None)
    if bad is not None:
        return f"The principal {bad!r} is not one sshd reads safely: letters, digits and . _ : @ - only."
    return ""


def certificate_request_offer(*, role: roles.Role | None, node_logins_allowed: bool, public_key: str,
                              ca_fingerprint: str) -> Offer:
    """A request for a certificate: the person first (a Viewer reads the same sentence whatever they
    pasted), then their key."""
    who = node_login_offer(role=role, allowed=node_logins_allowed)
    if not who.ok:
        return who
    try:
        public_key_parse(public_key, ca_fingerprint=ca_fingerprint)
    except PublicKeyRefused as refused:
        return Offer(False, refused.message)
    return ALLOWED
