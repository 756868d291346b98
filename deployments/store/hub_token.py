"""The server's Hugging Face token: what the console downloads gated and private models with.

Set, replaced and removed by an Administrator (the Settings page, ``/api/settings/hugging-face-token/``)
or given as ``FADEN_HF_TOKEN`` in the console's environment, which wins while it is set. A token set
here is sealed at rest (console/secrets.py). Pages and the API say only whether one is set and where
it comes from; the token itself is on no command line, in no log, task argument, API answer or error
message: whoever needs it calls ``hf_token()`` when it uses it (a job, in the worker; a machine gets
it on its standard input). Each change is in the audit trail, without the value.
"""
from __future__ import annotations

import os

from django.core.exceptions import ValidationError
from django.views.decorators.debug import sensitive_variables

from console import roles, secrets
from console.audit import audit_record
from console.choices import AuditOutcome

SECRET_NAME = "huggingface.token"
ENV_VAR = "FADEN_HF_TOKEN"
SOURCE_ENVIRONMENT = "environment"
SOURCE_SETTINGS = "settings"
TOKEN_MIN_CHARS, TOKEN_MAX_CHARS = 8, 1024
PRINTABLE_ASCII = frozenset(map(chr, range(0x21, 0x7F)))  # no space: a token has none inside

CHANGE_SETTINGS = roles.Action("changing the console's settings", roles.ADMINISTRATOR)


def may_change_settings(user) -> roles.Offer:
    """Whether the user may see the Settings page and change what it holds (Administrators), and when not, why."""
    return CHANGE_SETTINGS.offer(roles.role_of(user))


def hf_token() -> str | None:
    """The token to download with: FADEN_HF_TOKEN when set, else the one set on the Settings page, else None."""
    return os.environ.get(ENV_VAR, "").strip() or secrets.secret_get(SECRET_NAME)


def hf_token_source() -> str | None:
    """Where ``hf_token()`` comes from: "environment", "settings", or None when there is none."""
    if os.environ.get(ENV_VAR, "").strip():
        return SOURCE_ENVIRONMENT
    return SOURCE_SETTINGS if secrets.secret_is_set(SECRET_NAME) else None


def hf_token_saved() -> bool:
    """Whether a token is set on the Settings page (the environment's may hide it)."""
    return secrets.secret_is_set(SECRET_NAME)


@sensitive_variables()
def hf_token_clean(token) -> str:
    """The token as it is kept: trimmed, with no whitespace inside, 8 to 1024 printable ASCII characters.
    A refusal says what is wrong in words, never with the token in them."""
    if not isinstance(token, str):
        raise ValidationError("The token must be text.", code="invalid")
    token = token.strip()
    if not token:
        raise ValidationError("Enter the token.", code="required")
    if any(character.isspace() for character in token):
        raise ValidationError("A Hugging Face token has no spaces or line breaks inside: copy it again, whole.", code="invalid")
    if not set(token) <= PRINTABLE_ASCII:
        raise ValidationError("A Hugging Face token holds only letters, digits and signs such as _ and - "
                              "(printable ASCII): copy it again from Hugging Face.", code="invalid")
    if not TOKEN_MIN_CHARS <= len(token) <= TOKEN_MAX_CHARS:
        raise ValidationError(f"A Hugging Face token is {TOKEN_MIN_CHARS} to {TOKEN_MAX_CHARS} characters long: "
                              "copy it again, whole.", code="invalid")
    return token


@sensitive_variables()
def hf_token_set(*, token: str, by) -> str:
    """Set or replace the token (an Administrator; ``by`` None is the console itself, a shell on the
    server); the words the audit trail and the page say of it."""
    CHANGE_SETTINGS.offer(roles.acting(by)).check()
    token = hf_token_clean(token)
    replaced = secrets.secret_is_set(SECRET_NAME)
    secrets.secret_set(SECRET_NAME, token)
    said = "The Hugging Face token was replaced." if replaced else "The Hugging Face token was set."
    if os.environ.get(ENV_VAR, "").strip():
        said += f" {ENV_VAR} still gives the token the console uses, as long as it is set."
    _audit(said, by)
    return said


def hf_token_remove(*, by) -> str:
    """Remove the token set on the Settings page (an Administrator); FADEN_HF_TOKEN, when set, is left."""
    CHANGE_SETTINGS.offer(roles.acting(by)).check()
    removed = secrets.secret_clear(SECRET_NAME)
    said = "The Hugging Face token was removed." if removed else "No Hugging Face token was set here: nothing was removed."
    if removed:
        _audit(said, by)
    return said


def _audit(said: str, by) -> None:
    audit_record(action="settings.hf_token", outcome=AuditOutcome.DONE, user=by, target="Hugging Face token", message=said)
