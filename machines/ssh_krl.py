"""Key revocation lists (OpenSSH's KRL format, PROTOCOL.krl, as ``ssh-keygen -k`` writes them) for the
certificates the console's SSH certificate authority signed and took back. Pure: bytes out, no I/O.

A KRL names the authority's public key and the serials it revokes; sshd reads the file named by its
``RevokedKeys`` at every public key login and refuses a certificate listed there. The list travels with
a cluster's node settings (``/etc/fadenstack/ssh/revoked.krl``) and is replaced at once when a
certificate is taken back (the agent's ``node revocations write``). Serials are the certificates' own
(machines/ssh_certificates.py: the row's id, never repeated), so the list names each one exactly.

An empty list (no section) is a valid KRL: sshd refuses nothing for it, where a missing file would make
it refuse every public key, the console's own included.
"""
from __future__ import annotations

import base64
import struct
from collections.abc import Iterable

KRL_MAGIC = b"SSHKRL\n\0"
KRL_FORMAT_VERSION = 1
SECTION_CERTIFICATES = 1
CERT_SERIAL_LIST = 0x20
CERT_KEY_ID = 0x23


def _string(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


def _u64(value: int) -> bytes:
    return struct.pack(">Q", int(value))


def ca_key_blob(ca_public_key: str) -> bytes:
    """The authority's key as the wire blob a KRL names (the base64 of its ``.pub`` line)."""
    parts = ca_public_key.split()
    if len(parts) < 2:
        raise ValueError("The authority's public key is not an OpenSSH public key line.")
    return base64.b64decode(parts[1], validate=True)


def krl_bytes(*, ca_public_key: str, serials: Iterable[int] = (), key_ids: Iterable[str] = (), version: int,
              generated_at: int, comment: str = "") -> bytes:
    """A KRL revoking the certificates ``ca_public_key`` signed with these ``serials`` (and key ids).

    ``version`` is the list's own number (sshd ignores it; a larger one is newer), ``generated_at`` seconds
    since the epoch. Serials are written sorted and once each; serial 0 is never one of ours."""
    header = KRL_MAGIC + struct.pack(">I", KRL_FORMAT_VERSION) + _u64(version) + _u64(generated_at) + _u64(0)
    header += _string(b"") + _string(comment.encode("utf-8"))
    wanted = sorted({int(s) for s in serials if int(s) > 0})
    ids = sorted(set(key_ids))
    if not wanted and not ids:
        return header
    body = _string(ca_key_blob(ca_public_key)) + _string(b"")
    if wanted:
        body += bytes([CERT_SERIAL_LIST]) + _string(b"".join(_u64(s) for s in wanted))
    if ids:
        body += bytes([CERT_KEY_ID]) + _string(b"".join(_string(i.encode("utf-8")) for i in ids))
    return header + bytes([SECTION_CERTIFICATES]) + _string(body)
