"""Live sockets end with the session that opened them.

A websocket is authenticated once, when it connects; without more, a page left
open would go on receiving cards after its user logged out, changed the password
or was deactivated. So every socket also joins two groups of its own: its user's
and its session's. Logging out closes the session's sockets; a new password, a
deactivated or deleted account closes all of the user's (close code 4401, which
the page's live dot reads as "Signed out"). A reload signs in again where the
session still holds (the one that changed the password); Channels checks the
session as Django does, so the others are refused.
"""
from __future__ import annotations

import hashlib
import logging

from django.contrib.auth import get_user_model, user_logged_out
from django.db import transaction
from django.db.models.signals import post_delete

from console import accounts, pubsub

log = logging.getLogger(__name__)

CLOSE = {"type": "live.close"}  # handled by LiveConsumer.live_close


def user_group(user_id: int) -> str:
    return f"live.user.{user_id}"


def session_group(session_key: str) -> str:
    """The session's group, named by a hash: whoever reads Redis's channel names learns no session key."""
    return "live.session." + hashlib.sha256(session_key.encode()).hexdigest()[:32]


def socket_groups(user, session_key: str | None) -> list[str]:
    """The groups a socket of this user and session joins, besides its topics'."""
    return [user_group(user.pk)] + ([session_group(session_key)] if session_key else [])


def sockets_close(group: str) -> None:
    """Close every websocket in the group once the transaction commits."""

    def send() -> None:
        try:
            pubsub.send(group, CLOSE)
        except Exception:  # noqa: BLE001 - Redis away: the sockets' next reconnect is refused all the same
            log.exception("could not close the sockets of %s", group)

    transaction.on_commit(send)


def _on_logout(sender, request, user, **kwargs) -> None:
    session_key = getattr(getattr(request, "session", None), "session_key", None)
    if session_key:
        sockets_close(session_group(session_key))


def _on_account_changed(sender, user, changed, **kwargs) -> None:
    """A new password, or an account deactivated: every session of the user ends."""
    if "password" in changed or changed.get("is_active") == (True, False):
        sockets_close(user_group(user.pk))


def _on_user_deleted(sender, instance, **kwargs) -> None:
    sockets_close(user_group(instance.pk))


def connect_signals() -> None:
    """Called from the console's AppConfig.ready."""
    user_logged_out.connect(_on_logout, dispatch_uid="live_sessions.logout")
    accounts.account_changed.connect(_on_account_changed, dispatch_uid="live_sessions.account_changed")
    post_delete.connect(_on_user_deleted, sender=get_user_model(), dispatch_uid="live_sessions.post_delete")
