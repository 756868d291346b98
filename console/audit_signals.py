"""The audit entries a request's url does not tell: sign-ins and sign-outs, API tokens made and revoked,
users made and deleted, roles (groups) given and taken, an account's flags and password changed.

Each is recorded wherever it happens: in a page, the API, the admin, or a command on the server
(``faden drf_create_token``, ``faden changepassword``), which records no person and no address.
Failed sign-ins are recorded by console/logins.py, with the log line that goes with them.
"""
from __future__ import annotations

from django.contrib.auth import get_user_model, user_logged_in, user_logged_out
from django.contrib.auth.models import Group
from django.db.models.signals import m2m_changed, post_delete, post_save
from rest_framework.authtoken.models import Token, TokenProxy

from console import accounts
from console.audit import audit_record
from console.choices import AuditOutcome

ACCOUNT_WORDS = {
    ("password", None): "Password changed.",
    ("is_active", False): "Deactivated.",
    ("is_active", True): "Activated again.",
    ("is_superuser", True): "Made a superuser.",
    ("is_superuser", False): "No longer a superuser.",
    ("is_staff", True): "May use the admin.",
    ("is_staff", False): "May no longer use the admin.",
}


def _done(action: str, *, target: str, message: str, **who) -> None:
    audit_record(action=action, outcome=AuditOutcome.DONE, target=target, message=message, **who)


def _on_logged_in(sender, request, user, **kwargs) -> None:
    _done("login", request=request, user=user, target=f"user {user.get_username()}", message="Signed in.")


def _on_logged_out(sender, request, user, **kwargs) -> None:
    if user is not None:
        _done("logout", request=request, user=user, target=f"user {user.get_username()}", message="Signed out.")


def _on_token_saved(sender, instance, created, **kwargs) -> None:
    if created:
        owner = instance.user.get_username()
        _done("token.created", target=f"user {owner}", message=f"An API token was made for {owner}.")


def _on_token_deleted(sender, instance, **kwargs) -> None:
    owner = instance.user.get_username()
    _done("token.revoked", target=f"user {owner}", message=f"The API token of {owner} was revoked.")


def _on_user_saved(sender, instance, created, **kwargs) -> None:
    if created:
        _done("user.created", target=f"user {instance.get_username()}", message=f"The user {instance.get_username()} was made.")


def _on_user_deleted(sender, instance, **kwargs) -> None:
    _done("user.deleted", target=f"user {instance.get_username()}", message=f"The user {instance.get_username()} was deleted.")


def _on_account_changed(sender, user, changed, **kwargs) -> None:
    words = [ACCOUNT_WORDS[(field, None if field == "password" else after)] for field, (_, after) in changed.items()]
    _done("user.changed", target=f"user {user.get_username()}", message=" ".join(words))


def _on_groups_changed(sender, instance, action, reverse, pk_set, **kwargs) -> None:
    """A user's groups (roles) changed: from the user's side (user.groups.add) or the group's (group.user_set.add)."""
    if action not in ("post_add", "post_remove", "pre_clear"):
        return
    verb = {"post_add": "Added to", "post_remove": "Removed from", "pre_clear": "Removed from"}[action]
    if not reverse:  # instance is a user, pk_set its groups
        users = [instance]
        groups = Group.objects.filter(pk__in=pk_set) if action != "pre_clear" else instance.groups.all()
    else:  # instance is a group, pk_set its users
        users = list(get_user_model().objects.filter(pk__in=pk_set)) if action != "pre_clear" else list(instance.user_set.all())
        groups = [instance]
    names = ", ".join(sorted(group.name for group in groups))
    for user in users:
        if names:
            _done("user.groups", target=f"user {user.get_username()}", message=f"{verb} {names}.")


def connect_signals() -> None:
    """Called from the console's AppConfig.ready."""
    user_model = get_user_model()
    user_logged_in.connect(_on_logged_in, dispatch_uid="audit.logged_in")
    user_logged_out.connect(_on_logged_out, dispatch_uid="audit.logged_out")
    for token_model in (Token, TokenProxy):  # the admin saves tokens as TokenProxy: a signal of its own
        post_save.connect(_on_token_saved, sender=token_model, dispatch_uid=f"audit.{token_model.__name__}_saved")
        post_delete.connect(_on_token_deleted, sender=token_model, dispatch_uid=f"audit.{token_model.__name__}_deleted")
    post_save.connect(_on_user_saved, sender=user_model, dispatch_uid="audit.user_saved")
    post_delete.connect(_on_user_deleted, sender=user_model, dispatch_uid="audit.user_deleted")
    accounts.account_changed.connect(_on_account_changed, dispatch_uid="audit.account_changed")
    m2m_changed.connect(_on_groups_changed, sender=user_model.groups.through, dispatch_uid="audit.groups_changed")
