"""Everything that changes a user: add one with a role, change a role, deactivate and reactivate.

The Users page calls these; each checks first that the one acting may manage users (an
Administrator). Nobody changes their own role or deactivates themselves: another Administrator
does, so there is always an Administrator left to do it.
"""
from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.db import transaction

from console import roles
from console.offers import Offer
from console.roles import MANAGE_USERS, Role

User = get_user_model()


OWN_ACCOUNT = "This is your own account: another Administrator changes its role or deactivates it."
NODE_LOGINS_FOR_OPERATORS = ("Node logins are allowed one by one for Operators only: an Administrator has them with the "
                             "role, and a Viewer never logs in to a machine.")


def user_offer(user, *, by, role: Role | None) -> Offer:
    """Whether ``by`` (of ``role``) may change ``user``'s role or active flag."""
    if user.pk == getattr(by, "pk", None):
        return MANAGE_USERS.offer(role).then(Offer(False, OWN_ACCOUNT, forbidden=True))
    return MANAGE_USERS.offer(role)


def user_create(*, username: str, email: str, password: str, role: Role, by) -> User:
    """Add a user with a role; the password goes through the console's password rules."""
    MANAGE_USERS.offer(roles.acting(by)).check()
    user = User(username=username, email=email)
    user.full_clean(exclude=["password"])
    validate_password(password, user)
    user.set_password(password)
    with transaction.atomic():
        user.save()
        roles.role_set(user, role)
    return user


def user_role_change(*, user, role: Role, by) -> None:
    """Give ``user`` another role, from the next thing they do (pages and API read it each time); their
    open pages' live cards come again for it at once (``role_changed``: console/live_sessions.py)."""
    user_offer(user, by=by, role=roles.acting(by)).check()
    with transaction.atomic():
        roles.role_set(user, role)


def user_active_set(*, user, active: bool, by) -> None:
    """Deactivate (they can no longer sign in, and their API token stops working) or reactivate."""
    user_offer(user, by=by, role=roles.acting(by)).check()
    user.is_active = active
    user.save(update_fields=["is_active"])



def user_node_logins_set(*, user, allowed: bool, by) -> None:
    """Allow an Operator to log in to the machines of clusters as root with a short-lived certificate,
    or take it back (certificates signed before stay valid until they expire: an hour by default)."""
    user_offer(user, by=by, role=roles.acting(by)).check()
    if roles.role_of(user) != roles.OPERATOR:
        raise ValidationError(NODE_LOGINS_FOR_OPERATORS)
    roles.node_logins_set(user, allowed)
