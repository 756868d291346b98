"""Secrets the console keeps in its database (the Hugging Face token), sealed with a key that is not there.

Each value is encrypted with Fernet (AES in CBC mode with an HMAC) under a key kept in a file of its
own: ``DATA_DIR/secrets.key`` (0600, in a 0700 directory), or where ``FADEN_SECRETS_KEY_PATH`` says,
made on first use. A copy of the database (a backup, a dump handed to someone) then gives no secret
away without that file too. Back the key up with the database: without it, the sealed values are lost.

A value sealed under another key (the file was replaced or lost) reads as not set, with a warning in
the log that names the secret, never its value; setting it again seals it under the key now there.
The name is sealed with the value, so a row copied under another name does not unseal either.

Values never leave this module but as ``secret_get``'s answer: no log line, error or report holds
one (``sensitive_variables`` keeps them out of Django's error reports).
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
from pathlib import Path
from secrets import token_urlsafe

from cryptography.fernet import Fernet, InvalidToken
from django.conf import settings
from django.views.decorators.debug import sensitive_variables

from console.files import write_once
from console.models import SealedSecret

logger = logging.getLogger(__name__)

KEY_FILE = "secrets.key"


class SecretsKeyError(Exception):
    """The key file is there but holds no key: set nothing rather than seal under a key nobody has."""


def secrets_key_path() -> Path:
    """Where the key is: the setting (or environment variable) FADEN_SECRETS_KEY_PATH, else the data directory's."""
    configured = getattr(settings, "FADEN_SECRETS_KEY_PATH", None) or os.environ.get("FADEN_SECRETS_KEY_PATH")
    return Path(configured) if configured else Path(settings.DATA_DIR) / KEY_FILE


@sensitive_variables()
def secret_set(name: str, value: str) -> None:
    """Seal ``value`` under ``name``, in place of any value it had."""
    if not name or not isinstance(value, str):
        raise ValueError("A secret needs a name and a text value.")
    SealedSecret.objects.update_or_create(name=name, defaults={"sealed": seal(name, value)})


@sensitive_variables()
def seal(name: str, value: str) -> str:
    """``value`` sealed under the secrets key, bound to ``name`` (unsealed under another name it reads as
    nothing): for a secret kept in a column of its own row rather than by name."""
    return _fernet().encrypt(_plain(name, value)).decode("ascii")


@sensitive_variables()
def secret_get(name: str) -> str | None:
    """The value sealed under ``name``; None when there is none, or when it cannot be unsealed (logged)."""
    sealed = SealedSecret.objects.filter(name=name).values_list("sealed", flat=True).first()
    return None if sealed is None else unseal(name, sealed)


@sensitive_variables()
def unseal(name: str, sealed: str) -> str | None:
    """What ``seal(name, ...)`` sealed; None when it cannot be unsealed (logged)."""
    try:
        plain = _fernet().decrypt(sealed.encode("ascii"))
    except SecretsKeyError as exc:
        logger.warning("The secret %s cannot be unsealed: %s It reads as not set.", name, exc)
        return None
    except (InvalidToken, UnicodeEncodeError):
        plain = b""
    prefix = f"{name}\0".encode()
    if not plain.startswith(prefix):
        logger.warning("The secret %s cannot be unsealed with the key in %s (was the key file replaced?); "
                       "it reads as not set until it is set again.", name, secrets_key_path())
        return None
    return plain[len(prefix):].decode("utf-8")


@sensitive_variables()
def secret_random(name: str) -> str:
    """The random token sealed under ``name`` (32 bytes, URL-safe), made the first time; callers at the same
    moment get the same one (the first row written wins)."""
    if (value := secret_get(name)) is not None:
        return value
    value = token_urlsafe(32)
    row, made = SealedSecret.objects.get_or_create(name=name, defaults={"sealed": seal(name, value)})
    if made:
        return value
    if (theirs := unseal(name, row.sealed)) is not None:
        return theirs
    secret_set(name, value)  # sealed with a key this console no longer has: a new one
    return value


def secret_is_set(name: str) -> bool:
    """Whether ``name`` holds a value this console can unseal."""
    return secret_get(name) is not None


def secret_clear(name: str) -> bool:
    """Forget ``name``'s value; whether there was one."""
    deleted, _ = SealedSecret.objects.filter(name=name).delete()
    return deleted > 0


@sensitive_variables()
def derived_password(purpose: str) -> bytes:
    """A password for ``purpose`` derived from the secrets key (HMAC-SHA256, in url-safe base64): what seals
    a file OpenSSL must read itself, such as the console's TLS keys (console/pki.py), in the format it reads
    (an encrypted PKCS#8 key). The same key file gives the same password; another key file, another one."""
    if not purpose:
        raise ValueError("A derived password needs a purpose.")
    digest = hmac.new(_key_bytes(), f"fadenstack derived password\0{purpose}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest)


@sensitive_variables()
def _plain(name: str, value: str) -> bytes:
    return f"{name}\0{value}".encode()


def _key_bytes() -> bytes:
    """The secrets key's 32 bytes, checked as _fernet checks them."""
    _fernet()
    return base64.urlsafe_b64decode(secrets_key_path().read_bytes().strip())


def _fernet() -> Fernet:
    path = secrets_key_path()
    try:
        key = path.read_bytes().strip()
    except FileNotFoundError:
        key = _key_make(path)
    try:
        return Fernet(key)
    except ValueError:
        raise SecretsKeyError(f"{path} holds no secrets key (32 bytes in url-safe base64): put back the file the "
                              f"secrets were sealed with, or remove it to make a new key and set the secrets again.") from None


def _key_make(path: Path) -> bytes:
    """Write a new key, 0600 in a 0700 directory, unless another process made one first: both then use that one."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_once(path, Fernet.generate_key() + b"\n")
    return path.read_bytes().strip()
