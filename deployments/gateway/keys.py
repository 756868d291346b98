"""What a gateway key is: ``fs-`` and 32 random bytes (URL-safe base64), stored only as its sha256.

A random secret of 256 bits needs no slow hash: nobody guesses a preimage of its sha256, and the
gateway looks a request's key up by that digest in a dict, once per request, at no cost.
"""
from __future__ import annotations

import hashlib
import secrets

KEY_PREFIX = "fs-"
PREFIX_SHOWN = 8  # characters shown in lists, "fs-ab12c", followed by an ellipsis


def key_new() -> str:
    """A fresh secret, shown to its creator once and never stored."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_hash(secret: str) -> str:
    """The hex sha256 the database keeps and the gateway looks keys up by."""
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).hexdigest()


def key_prefix(secret: str) -> str:
    """The first characters, enough for a person to tell keys apart, far too few to guess the rest."""
    return secret[:PREFIX_SHOWN]
