"""The console's side of the gateway's keys: create one (its secret shown once), revoke one. What a key is
(its secret, digest and prefix) is ``deployments/gateway/keys.py``, which the gateway process reads too."""
from __future__ import annotations

from django.core.exceptions import ValidationError
from django.utils import timezone

from console import roles
from console.roles import OPERATOR, Action
from deployments.gateway import keys
from deployments.models import Deployment, GatewayKey

KEY_CREATE = Action("creating a gateway key", OPERATOR)
KEY_REVOKE = Action("revoking a gateway key", OPERATOR)
KEY_NAME_MAX = 100


def gateway_key_create(*, name: str, deployments: list[str] | None = None, user=None) -> tuple[GatewayKey, str]:
    """A new key for the gateway, and its secret: returned here once, stored only as its sha256.

    ``deployments`` limits it to those names (each must be a deployment's); None or empty: every one.
    The caller shows the secret to the person who asked and forgets it: never log it or put it in a
    message (messages are the audit trail's words)."""
    KEY_CREATE.offer(roles.acting(user)).check()
    name = (name or "").strip()
    if not name:
        raise ValidationError({"name": "Name the key: what or who it is for, such as a team or an application."})
    if len(name) > KEY_NAME_MAX or not name.isprintable():
        raise ValidationError({"name": f"A key's name is at most {KEY_NAME_MAX} printable characters."})
    names = gateway_key_deployments_check(deployments)
    secret = keys.key_new()
    key = GatewayKey.objects.create(name=name, prefix=keys.key_prefix(secret),
                                    key_hash=keys.key_hash(secret), deployments=names, created_by=_user(user))
    return key, secret


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
