"""What changed in a user's account, for those that must react: live sockets, the audit trail.

Two signals:

- ``account_changed``: a pre_save looks up, before a save that may write them, the fields that end
  sessions or make a superuser; the post_save after it sends ``account_changed`` with those that
  changed, as ``{field: (before, after)}``. A save with ``update_fields`` naming none of them
  (``last_login`` on every sign-in) costs no query.
- ``role_changed``: a user's role (console/roles.py) is held through groups, permissions and the
  superuser flag, and one change of role is often several writes (the Users page and the admin's
  form take the old group away, then give the new one). So the role each user had before a
  transaction first touched these is noted, and compared with the role they hold once it commits:
  one ``role_changed`` per user whose role differs, none when it was rolled back.
"""
from __future__ import annotations

from django.contrib.auth import get_user_model
from django.db import transaction
from django.db.models.signals import m2m_changed, post_save, pre_save
from django.dispatch import Signal

from console import roles

WATCHED = ("password", "is_active", "is_superuser")

account_changed = Signal()  # sender: the user model; user, changed: {field: (before, after)}
role_changed = Signal()  # sender: the user model; user, before, after: Role | None. Sent after the commit.


def _note_before(sender, instance, update_fields=None, **kwargs) -> None:
    instance._account_before = None
    instance._role_before = None
    if instance.pk is None or (update_fields is not None and not set(WATCHED) & set(update_fields)):
        return
    instance._account_before = sender.objects.filter(pk=instance.pk).values(*WATCHED).first()
    if instance._account_before and instance._account_before["is_superuser"] != instance.is_superuser:
        instance._role_before = _roles_held([instance.pk])  # a superuser is an Administrator, whatever its groups


def _send_changes(sender, instance, created, **kwargs) -> None:
    before = getattr(instance, "_account_before", None)
    instance._account_before = None
    if role_before := getattr(instance, "_role_before", None):
        instance._role_before = None
        _roles_check_on_commit(role_before)
    if created or not before:
        return
    changed = {field: (before[field], getattr(instance, field)) for field in WATCHED if before[field] != getattr(instance, field)}
    if changed:
        account_changed.send(sender=sender, user=instance, changed=changed)


# -- roles ----------------------------------------------------------------------------------------


def _roles_held(user_ids) -> dict[int, roles.Role | None]:
    """The role each user holds now, read from the database (a deactivated account keeps its own)."""
    return roles.roles_held(list(get_user_model().objects.filter(pk__in=user_ids).only("pk", "is_superuser")))


class _RolesCheck:
    """The roles some users held before the transaction changed them; run on commit, it sends
    ``role_changed`` for each user whose role is no longer the same."""

    def __init__(self) -> None:
        self.before: dict[int, roles.Role | None] = {}
        self.done = False  # run: a test's captured callbacks stay listed after they ran; later changes need a new one

    def __call__(self) -> None:
        self.done = True
        after = _roles_held(self.before)
        for user in get_user_model().objects.filter(pk__in=[pk for pk in after if after[pk] != self.before[pk]]):
            role_changed.send(sender=type(user), user=user, before=self.before[user.pk], after=after[user.pk])


def _roles_check_on_commit(before: dict[int, roles.Role | None]) -> None:
    """Compare these users' roles with ``before`` when the transaction commits (at once without one).

    A transaction has one check: the first note of a user's role wins, the one before any change."""
    connection = transaction.get_connection()
    open_savepoints = set(connection.savepoint_ids) | {None}  # None: an atomic block without a savepoint
    # A check registered in this transaction, in savepoints still open (or none), runs after this change.
    check = next((callback for savepoints, callback, _ in connection.run_on_commit
                  if isinstance(callback, _RolesCheck) and not callback.done and savepoints <= open_savepoints), None)
    if check is None:
        check = _RolesCheck()
        check.before.update(before)
        transaction.on_commit(check)
        return
    for pk, role in before.items():
        check.before.setdefault(pk, role)


def _on_m2m_changed(sender, instance, action, reverse, pk_set, **kwargs) -> None:
    """A user's groups or permissions changed, from the user's side or from the group's (permission's)."""
    if action not in ("pre_add", "pre_remove", "pre_clear", "post_add", "post_remove", "post_clear"):
        return
    if action.startswith("pre_"):
        if not reverse:
            user_ids = [instance.pk]
        elif action == "pre_clear":
            user_ids = list(instance.user_set.values_list("pk", flat=True))
        else:
            user_ids = list(pk_set)
        instance._roles_before = _roles_held(user_ids) if user_ids else {}
        return
    before = getattr(instance, "_roles_before", None)
    instance._roles_before = None
    if before:
        _roles_check_on_commit(before)


def connect_signals() -> None:
    """Called from the console's AppConfig.ready."""
    user_model = get_user_model()
    pre_save.connect(_note_before, sender=user_model, dispatch_uid="accounts.note_before")
    post_save.connect(_send_changes, sender=user_model, dispatch_uid="accounts.send_changes")
    for through in (user_model.groups.through, user_model.user_permissions.through):
        m2m_changed.connect(_on_m2m_changed, sender=through, dispatch_uid=f"accounts.roles.{through.__name__}")
