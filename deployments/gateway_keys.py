"""The console's side of the gateway's keys: create one (its secret shown once), change its limits, revoke one.
What a key is (its secret, digest and prefix) is ``deployments/gateway/keys.py``, which the gateway process reads
too; the gateway enforces the limits (``deployments/gateway/limits.py``) within a second of a change."""
from __future__ import annotations

from django.core.exceptions import ValidationError
from django.utils import timezone

from console import roles
from console.roles import OPERATOR, Action
from deployments.gateway import keys
from deployments.models import Deployment, GatewayKey

KEY_CREATE = Action("creating a gateway key", OPERATOR)
KEY_REVOKE = Action("revoking a gateway key", OPERATOR)
KEY_LIMITS = Action("changing a gateway key's limits", OPERATOR)
KEY_NAME_MAX = 100
REQUESTS_PER_MINUTE_MAX = 10_000_000
TOKENS_PER_MINUTE_MAX = 10**12
LIMITS = {  # field: (what it counts, in words; the largest allowed)
    "requests_per_minute": ("requests", REQUESTS_PER_MINUTE_MAX),
    "tokens_per_minute": ("tokens (prompt and completion)", TOKENS_PER_MINUTE_MAX),
}
UNCHANGED = object()


def gateway_key_create(*, name: str, deployments: list[str] | None = None, requests_per_minute=None,
                       tokens_per_minute=None, user=None) -> tuple[GatewayKey, str]:
    """A new key for the gateway, and its secret: returned here once, stored only as its sha256.

    ``deployments`` limits it to those names (each must be a deployment's); None or empty: every one.
    ``requests_per_minute`` and ``tokens_per_minute`` are its limits (None or "": no limit; see
    ``gateway_key_limits_check``).
    The caller shows the secret to the person who asked and forgets it: never log it or put it in a
    message (messages are the audit trail's words)."""
    KEY_CREATE.offer(roles.acting(user)).check()
    name = (name or "").strip()
    if not name:
        raise ValidationError({"name": "Name the key: what or who it is for, such as a team or an application."})
    if len(name) > KEY_NAME_MAX or not name.isprintable():
        raise ValidationError({"name": f"A key's name is at most {KEY_NAME_MAX} printable characters."})
    names = gateway_key_deployments_check(deployments)
    limits = gateway_key_limits_check(requests_per_minute=requests_per_minute, tokens_per_minute=tokens_per_minute)
    secret = keys.key_new()
    key = GatewayKey.objects.create(name=name, prefix=keys.key_prefix(secret), key_hash=keys.key_hash(secret),
                                    deployments=names, created_by=_user(user), **limits)
    return key, secret


def gateway_key_limits_check(**given) -> dict[str, int | None]:
    """The limits as numbers (None: no limit), from what a form or the API gave: a whole number from 1, given as
    a number or in the digits 0-9; None or blank for no limit. ValidationError naming each field refused, in words."""
    found, problems = {}, {}
    for field, raw in given.items():
        what, high = LIMITS[field]
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            found[field] = None
            continue
        value = raw if isinstance(raw, int) and not isinstance(raw, bool) else None
        if isinstance(raw, str) and raw.strip().lstrip("-").isascii() and raw.strip().lstrip("-").isdigit():
            value = int(raw.strip())
        if value is None:
            problems[field] = (f"Give the {what} a minute as a whole number, such as 60, or leave it empty for no "
                               f"limit; {_shown(raw)} is not one.")
        elif value < 1:
            problems[field] = (f"Give at least 1 {what.split(' ')[0].rstrip('s')} a minute, or leave it empty for no "
                               f"limit: {value:,} would refuse every request (revoke the key to stop it).")
        elif value > high:
            problems[field] = f"At most {high:,} {what} a minute; leave it empty for no limit."
        else:
            found[field] = value
    if problems:
        raise ValidationError(problems)
    return found


def gateway_key_limits_change(*, key: GatewayKey, requests_per_minute=UNCHANGED, tokens_per_minute=UNCHANGED,
                              user=None) -> GatewayKey:
    """Set the key's limits (left out: unchanged; None or "": no limit). The gateway holds the key to them within
    a second; what it counted in the last minute still counts."""
    KEY_LIMITS.offer(roles.acting(user)).check()
    given = {field: value for field, value in (("requests_per_minute", requests_per_minute),
                                               ("tokens_per_minute", tokens_per_minute)) if value is not UNCHANGED}
    limits = gateway_key_limits_check(**given)
    if key.revoked:
        raise ValidationError({"key": f"The key {key.name} was revoked: its limits no longer matter."})
    if limits:
        GatewayKey.objects.filter(pk=key.pk).update(**limits)
        key.refresh_from_db(fields=list(limits))
    return key


def limits_in_words(key: GatewayKey) -> str:
    """"60 requests and 100,000 tokens a minute", or "no limit"."""
    parts = [f"{key.requests_per_minute:,} request{'s' if key.requests_per_minute != 1 else ''}"
             if key.requests_per_minute is not None else "",
             f"{key.tokens_per_minute:,} token{'s' if key.tokens_per_minute != 1 else ''}"
             if key.tokens_per_minute is not None else ""]
    parts = [part for part in parts if part]
    return f"{' and '.join(parts)} a minute" if parts else "no limit"


def _shown(raw) -> str:
    text = str(raw)
    return repr(text[:24] + "…") if len(text) > 24 else repr(text)


def gateway_key_deployments_check(deployments) -> list[str]:
    """The deployment names a key is limited to, each once, in order; ValidationError naming any that
    is not a deployment's."""
    if not deployments:
        return []
    if not isinstance(deployments, (list, tuple)) or not all(isinstance(n, str) for n in deployments):
        raise ValidationError({"deployments": "Give the names of deployments, as clients use them."})
    names = list(dict.fromkeys(n.strip() for n in deployments if n.strip()))
    known = set(Deployment.objects.filter(name__in=names).values_list("name", flat=True))
    if unknown := [n for n in names if n not in known]:
        raise ValidationError({"deployments": f"No deployment is named {', '.join(repr(n) for n in unknown[:5])}"
                                              f"{' and more' if len(unknown) > 5 else ''}."})
    return names


def gateway_key_revoke(*, key: GatewayKey, user=None) -> GatewayKey:
    """Revoke the key: the gateway refuses it within a second. The row stays, for the record; revoking
    a revoked key changes nothing."""
    KEY_REVOKE.offer(roles.acting(user)).check()
    GatewayKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now(), revoked_by=_user(user))
    key.refresh_from_db(fields=["revoked_at", "revoked_by"])
    return key


def _user(user):
    return user if user is not None and user.is_authenticated else None
