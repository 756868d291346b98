"""Who may do what: three roles, each a Django group with the permissions of the roles below it plus its own.

- Viewer: reads every page and the API, and watches live updates; changes nothing.
- Operator: also runs clusters (create, start, stop, repair, add and remove machines, deploy) and
  refreshes machines' facts (it changes nothing about which machines the console trusts).
- Administrator: also enrols and deletes machines, trusts host keys, manages users, API tokens and
  the server's credentials, and uses the Django admin.

Node logins (root on a cluster's machines, with an SSH certificate the console signs) are a
permission of their own, ``console.node_login``: every Administrator holds it, and an Operator
when an Administrator allows it, through the group "Node logins" (``node_logins_set``) or given to
the user directly in the admin. A Viewer never logs in to a node, whatever they hold
(machines/ssh_rules.py decides).

A role is a permission on ``console.Access`` (``console.read``, ``console.operate``,
``console.administer``); a user's role is the highest one they hold, through its group (a
superuser holds them all). An account without one (made in the admin and given no group) signs in
to a page that says so and reads nothing: nobody gets access by being forgotten.

Each action says which role it needs as an ``Action`` beside its other preconditions (the apps'
``actions.py``); its offer is refused with a sentence such as "Your role is Viewer: stopping a
cluster needs an Operator." The groups are put right after every ``migrate`` (``groups_sync``).
"""
from __future__ import annotations

from dataclasses import dataclass

from django.apps import apps as global_apps

from console.offers import ALLOWED, Offer

APP = "console"


@dataclass(frozen=True)
class Role:
    name: str  # the group's name, and what the pages call it
    codename: str  # its own permission on console.Access
    rank: int  # a role holds the permissions of every role of a lower rank
    description: str  # the permission's name, as the admin lists it

    def __str__(self) -> str:
        return self.name

    @property
    def permission(self) -> str:
        return f"{APP}.{self.codename}"

    @property
    def slug(self) -> str:
        return self.name.lower()

    @property
    def article(self) -> str:
        return "an" if self.name[0] in "AEIOU" else "a"


VIEWER = Role("Viewer", "read", 1, "Read every page and the API, and watch live updates")
OPERATOR = Role("Operator", "operate", 2, "Run clusters: create, start, stop, repair, add and remove machines, deploy")
ADMINISTRATOR = Role("Administrator", "administer", 3,
                     "Enrol and delete machines, trust host keys, manage users, API tokens and credentials")
ROLES = (VIEWER, OPERATOR, ADMINISTRATOR)
# Not a role anyone holds: the console itself acting, with no person behind it (a task, beat).
CONSOLE = Role("Console", "", 99, "")


@dataclass(frozen=True)
class Grant:
    """A permission given on top of a role, to a user or through a group of its own name."""

    group: str
    codename: str
    description: str

    @property
    def permission(self) -> str:
        return f"{APP}.{self.codename}"


NODE_LOGIN = Grant("Node logins", "node_login", "Log in to the machines of clusters as root, with an SSH certificate")
GRANTS = (NODE_LOGIN,)

NO_ROLE = "Your account has no role yet: an Administrator gives you one on the Users page."


def role_of(user) -> Role | None:
    """The user's role, or None: no role given, an inactive account, or nobody signed in."""
    if user is None or not user.is_active:
        return None
    return next((role for role in reversed(ROLES) if user.has_perm(role.permission)), None)


def roles_held(users) -> dict[int, Role | None]:
    """The role each of a page of users holds, in two queries whatever their number: ``role_of``,
    except that a deactivated account keeps its role, to have it again when reactivated."""
    from django.contrib.auth.models import Permission

    ids = [user.pk for user in users]
    held: dict[int, set[str]] = {pk: set() for pk in ids}
    mine = Permission.objects.filter(content_type__app_label=APP)
    for pk, codename in [*mine.filter(group__user__in=ids).values_list("group__user", "codename"),
                         *mine.filter(user__in=ids).values_list("user", "codename")]:
        held[pk].add(codename)
    return {
        user.pk: ADMINISTRATOR if user.is_superuser else next((role for role in reversed(ROLES) if role.codename in held[user.pk]), None)
        for user in users
    }


def acting(user) -> Role | None:
    """The role a service checks: the user's, or the console's own when no person acts (user None)."""
    return CONSOLE if user is None else role_of(user)


def role_named(name: str) -> Role | None:
    return next((role for role in ROLES if role.name == name or role.slug == name), None)


@dataclass(frozen=True)
class Action:
    """Something only some roles may do: the least role it needs, and how a refusal names it."""

    doing: str  # "stopping a cluster"
    needs: Role

    def offer(self, role: Role | None) -> Offer:
        """Allowed for ``needs`` and the roles above it; refused with the sentence that says why."""
        if role is not None and role.rank >= self.needs.rank:
            return ALLOWED
        who = f"Your role is {role}" if role is not None else "Your account has no role"
        return Offer(False, f"{who}: {self.doing} needs {self.needs.article} {self.needs}.", forbidden=True)


MANAGE_USERS = Action("managing users", ADMINISTRATOR)


# -- the groups ----------------------------------------------------------------------------------


def groups_sync(*, using: str = "default") -> None:
    """Each role's group, with exactly its permissions: its own and those of the roles below it; the
    Administrators' also every model permission, for the Django admin. Idempotent: run after every
    migrate, it adds the permissions of new models and takes back any given to a role by hand."""
    from django.contrib.auth.models import Group, Permission

    permissions = Permission.objects.db_manager(using)
    own = {role: permissions.get(content_type__app_label=APP, codename=role.codename) for role in ROLES}
    for role in ROLES:
        group, _ = Group.objects.db_manager(using).get_or_create(name=role.name)
        held = [own[lower] for lower in ROLES if lower.rank <= role.rank]
        group.permissions.set(list(permissions.all()) if role is ADMINISTRATOR else held)
    for grant in GRANTS:  # exactly its permission: the role still decides (a Viewer in it logs in nowhere)
        group, _ = Group.objects.db_manager(using).get_or_create(name=grant.group)
        group.permissions.set([permissions.get(content_type__app_label=APP, codename=grant.codename)])


def groups_sync_after_migrate(sender, *, using: str = "default", **kwargs) -> None:
    """post_migrate of the console: the other apps' permissions are made as their own post_migrate
    runs, some after this one; make them all now, so that the Administrators get every one."""
    from django.contrib.auth.management import create_permissions

    for app_config in global_apps.get_app_configs():
        create_permissions(app_config, verbosity=0, using=using)
    groups_sync(using=using)


def role_set(user, role: Role) -> None:
    """Give ``user`` this role in place of any other: its group, staff for the Administrators (the
    admin's own flag), and no superuser power left over that would outrank it. One transaction: the
    role changes once (console/accounts.py sends ``role_changed`` when it commits)."""
    from django.contrib.auth.models import Group
    from django.db import transaction

    groups = {group.name: group for group in Group.objects.filter(name__in=[r.name for r in ROLES])}
    with transaction.atomic():
        user.groups.remove(*(groups[r.name] for r in ROLES if r is not role))
        user.groups.add(groups[role.name])
        user.is_staff = role is ADMINISTRATOR
        user.is_superuser = user.is_superuser and role is ADMINISTRATOR
        user.save(update_fields=["is_staff", "is_superuser"])
    for cache in ("_perm_cache", "_user_perm_cache", "_group_perm_cache"):
        user.__dict__.pop(cache, None)


def node_logins_allowed(user) -> bool:
    """Whether ``user`` holds ``console.node_login`` (an Administrator does through the role's group).
    Not whether they may log in: a Viewer holding it may not (machines/ssh_rules.node_login_offer)."""
    return user is not None and user.is_active and user.has_perm(NODE_LOGIN.permission)


def node_logins_held(users) -> set[int]:
    """The ids among ``users`` allowed node logins through the group (one query, for a page of users)."""
    from django.contrib.auth.models import Group

    return set(Group.objects.filter(name=NODE_LOGIN.group, user__in=[u.pk for u in users]).values_list("user", flat=True))


def node_logins_set(user, allowed: bool) -> None:
    """Allow ``user`` node logins, or take them back, through the group "Node logins" (the audit trail
    records the change as it records any group's). Who may do this (an Administrator) is the
    caller's check, as for ``role_set``."""
    from django.contrib.auth.models import Group

    group = Group.objects.get(name=NODE_LOGIN.group)
    if allowed:
        user.groups.add(group)
    else:
        user.groups.remove(group)
    for cache in ("_perm_cache", "_user_perm_cache", "_group_perm_cache"):
        user.__dict__.pop(cache, None)


def context(request) -> dict:
    """Templates' ``role``: the signed-in user's (the side bar shows it and what only some roles see)."""
    return {"role": role_of(getattr(request, "user", None))}
