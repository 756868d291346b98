"""A person's own SSH public keys, kept on their profile: the console signs node-login certificates for
them by name (docs/ssh-certificates.md). The page (machines/profile_views.py) and the API
(machines/profile_api.py) call these; each person sees and changes only their own keys."""
from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from django.http import Http404

from machines.models import UserPublicKey

NO_SUCH_KEY = "You have no such key: it may have been removed already."


def user_public_keys(user) -> QuerySet[UserPublicKey]:
    """``user``'s keys, by name."""
    return UserPublicKey.objects.filter(user=user).order_by("name")


def user_public_key_add(*, user, name: str, key: str) -> UserPublicKey:
    """Keep ``key`` (one OpenSSH public key line) on ``user``'s profile as ``name``. Refused field by
    field with the rules' sentences (machines/ssh_rules.py) and the model's: the same key or name twice."""
    if user is None or not user.is_authenticated:
        raise ValidationError("A key belongs to a person: sign in to add one.")
    row = UserPublicKey(user=user, name=(name or "").strip(), key=key)  # stripped before the blank check
    row.full_clean()
    row.save()
    return row


def user_public_key_remove(*, user, key_id: int) -> UserPublicKey:
    """Take one of ``user``'s keys off their profile. Certificates signed for it stay valid until they
    expire (an hour by default): a certificate cannot be revoked."""
    row = UserPublicKey.objects.filter(user=user, pk=key_id).first() if user is not None else None
    if row is None:
        raise Http404(NO_SUCH_KEY)
    row.delete()
    return row
