"""What a save changed in a user's account, for those that must react: live sockets, the audit trail.

A pre_save looks up, before a save that may write them, the fields that end sessions or change
what the user may do; the post_save after it sends ``account_changed`` with those that changed,
as ``{field: (before, after)}``. A save with ``update_fields`` naming none of them (``last_login``
on every sign-in) costs no query.
"""
from __future__ import annotations

from django.contrib.auth import get_user_model
from django.db.models.signals import post_save, pre_save
from django.dispatch import Signal

WATCHED = ("password", "is_active", "is_superuser", "is_staff")

account_changed = Signal()  # sender: the user model; user, changed: {field: (before, after)}


def _note_before(sender, instance, update_fields=None, **kwargs) -> None:
    instance._account_before = None
    if instance.pk is None or (update_fields is not None and not set(WATCHED) & set(update_fields)):
        return
    instance._account_before = sender.objects.filter(pk=instance.pk).values(*WATCHED).first()


def _send_changes(sender, instance, created, **kwargs) -> None:
    before = getattr(instance, "_account_before", None)
    instance._account_before = None
    if created or not before:
        return
    changed = {field: (before[field], getattr(instance, field)) for field in WATCHED if before[field] != getattr(instance, field)}
    if changed:
        account_changed.send(sender=sender, user=instance, changed=changed)


def connect_signals() -> None:
    """Called from the console's AppConfig.ready."""
    user_model = get_user_model()
    pre_save.connect(_note_before, sender=user_model, dispatch_uid="accounts.note_before")
    post_save.connect(_send_changes, sender=user_model, dispatch_uid="accounts.send_changes")
