"""Each copy's own key: the engine refuses ``/v1/*`` without it, so a copy answers only the gateway.

Made at the copy's first start (``secrets.token_urlsafe``), kept sealed in ``Copy.api_key_sealed`` under a
name bound to the copy (a sealed key moved to another row unseals to nothing), given to the engine as
``VLLM_API_KEY`` in its environment (never its command line: ``ps`` does not show it), and sent by the
gateway as ``Authorization: Bearer`` in place of the client's gateway key. A copy started before copies had
keys has none: nothing is sent to it until it starts again. The gateway imports this module (it may not
import the console), which reaches the sealing in ``console/secrets.py``.
"""
from __future__ import annotations

import secrets as random

from console import secrets

KEY_BYTES = 32


def _name(copy_id: int) -> str:
    return f"deployments.copy.{copy_id}.api_key"


def copy_key_ensure(copy) -> str:
    """The copy's key, made and sealed on its row the first time."""
    if copy.api_key_sealed and (key := copy_key_of(copy.pk, copy.api_key_sealed)):
        return key
    key = random.token_urlsafe(KEY_BYTES)
    copy.api_key_sealed = secrets.seal(_name(copy.pk), key)
    type(copy).objects.filter(pk=copy.pk).update(api_key_sealed=copy.api_key_sealed)
    return key


def copy_key_of(copy_id: int, sealed: str) -> str | None:
    """The key a copy's row holds; None for a copy without one (or one this console cannot unseal)."""
    return secrets.unseal(_name(copy_id), sealed) if sealed else None
