"""The three roles: who holds which, the groups that carry them, and the sentence that refuses an action."""
import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AnonymousUser, Group, Permission
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import connection
from django.test.utils import CaptureQueriesContext

from console import roles
from console.management.commands.serve import Command as Serve
from console.offers import ALLOWED, Offer
from console.roles import ADMINISTRATOR, OPERATOR, VIEWER, Action
from tests.factories import NO_ROLE, UserFactory

pytestmark = pytest.mark.django_db

STOPPING = Action("stopping a cluster", OPERATOR)
ENROLLING = Action("adding a machine", ADMINISTRATOR)


# -- who holds which role ---------------------------------------------------------------------------


@pytest.mark.parametrize("role", roles.ROLES, ids=str)
def test_a_user_holds_the_role_of_the_group_they_are_in(role):
    assert roles.role_of(UserFactory(role=role)) == role


def test_a_superuser_is_an_administrator_whatever_their_groups():
    assert roles.role_of(UserFactory(role=NO_ROLE, is_superuser=True)) == ADMINISTRATOR


def test_an_account_in_no_group_has_no_role():
    assert roles.role_of(UserFactory(role=NO_ROLE)) is None


def test_a_deactivated_account_and_nobody_signed_in_have_no_role():
    assert roles.role_of(UserFactory(role=ADMINISTRATOR, is_active=False)) is None
    assert roles.role_of(AnonymousUser()) is None
    assert roles.role_of(None) is None


def test_in_two_groups_a_user_holds_the_higher_role():
    user = UserFactory(role=VIEWER)
    user.groups.add(Group.objects.get(name="Operator"))
    assert roles.role_of(get_user_model().objects.get(pk=user.pk)) == OPERATOR


def test_the_roles_of_a_page_of_users_are_read_in_two_queries_and_agree_with_each_users_own():
    users = [UserFactory(role=role) for role in (*roles.ROLES, NO_ROLE)]
    users += [UserFactory(role=NO_ROLE, is_superuser=True), UserFactory(role=OPERATOR, is_active=False)]
    users = list(get_user_model().objects.filter(pk__in=[u.pk for u in users]))

    with CaptureQueriesContext(connection) as queries:
        found = roles.roles_held(users)

    assert len(queries) == 2
    assert found == {user.pk: roles.role_of(user) if user.is_active else OPERATOR for user in users}


def test_the_console_acting_on_its_own_may_do_what_any_role_may():
    assert roles.acting(None) == roles.CONSOLE
    assert ENROLLING.offer(roles.acting(None)).ok
    assert roles.acting(UserFactory(role=VIEWER)) == VIEWER


# -- the groups -------------------------------------------------------------------------------------


def codenames(group: str) -> set[str]:
    return set(Group.objects.get(name=group).permissions.filter(content_type__app_label="console")
               .values_list("codename", flat=True))


def test_each_group_holds_its_own_permission_and_those_of_the_roles_below_it():
    assert codenames("Viewer") == {"read"}
    assert codenames("Operator") == {"read", "operate"}
    assert codenames("Administrator") >= {"read", "operate", "administer"}


def test_administrators_hold_every_model_permission_for_the_admin_and_the_others_none():
    administrators = Group.objects.get(name="Administrator")
    assert administrators.permissions.count() == Permission.objects.count()
    assert set(Group.objects.get(name="Viewer").permissions.values_list("codename", flat=True)) == {"read"}
    assert set(Group.objects.get(name="Operator").permissions.values_list("codename", flat=True)) == {"read", "operate"}


def test_syncing_the_groups_again_takes_back_a_permission_given_to_a_role_by_hand():
    viewers = Group.objects.get(name="Viewer")
    viewers.permissions.add(Permission.objects.get(codename="administer"))

    roles.groups_sync()
    roles.groups_sync()

    assert codenames("Viewer") == {"read"}
    assert Group.objects.filter(name__in=["Viewer", "Operator", "Administrator"]).count() == 3


# -- giving a role ------------------------------------------------------------------------------------


def test_giving_a_role_replaces_the_previous_one_and_makes_administrators_staff():
    user = UserFactory(role=VIEWER)

    roles.role_set(user, ADMINISTRATOR)
    assert (roles.role_of(user), user.is_staff) == (ADMINISTRATOR, True)

    roles.role_set(user, OPERATOR)
    assert (roles.role_of(user), user.is_staff) == (OPERATOR, False)
    assert list(user.groups.values_list("name", flat=True)) == ["Operator"]


def test_a_superuser_given_a_lower_role_keeps_no_power_above_it():
    user = UserFactory(role=NO_ROLE, is_superuser=True)

    roles.role_set(user, VIEWER)

    user = get_user_model().objects.get(pk=user.pk)
    assert not user.is_superuser
    assert roles.role_of(user) == VIEWER


def test_the_first_user_faden_serve_makes_is_an_administrator(monkeypatch):
    monkeypatch.setenv("FADEN_ADMIN_PASSWORD", "a-first-password-for-the-test")
    serve = Serve()

    serve._ensure_admin()

    assert roles.role_of(get_user_model().objects.get(username="admin")) == ADMINISTRATOR


# -- the refusal --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("role", "action", "sentence"), [
    (VIEWER, STOPPING, "Your role is Viewer: stopping a cluster needs an Operator."),
    (VIEWER, ENROLLING, "Your role is Viewer: adding a machine needs an Administrator."),
    (OPERATOR, ENROLLING, "Your role is Operator: adding a machine needs an Administrator."),
    (None, STOPPING, "Your account has no role: stopping a cluster needs an Operator."),
])
def test_an_action_refuses_a_role_below_the_one_it_needs_with_a_sentence_that_names_both(role, action, sentence):
    offer = action.offer(role)

    assert offer == Offer(False, sentence, forbidden=True)
    with pytest.raises(PermissionDenied, match=sentence):
        offer.check()


@pytest.mark.parametrize("role", [OPERATOR, ADMINISTRATOR], ids=str)
def test_an_action_allows_the_role_it_needs_and_those_above(role):
    assert STOPPING.offer(role) == ALLOWED


def test_a_refusal_for_the_state_of_things_is_a_validation_error_and_the_role_is_asked_first():
    busy = Offer(False, "gpu-room is busy.")

    with pytest.raises(ValidationError, match="gpu-room is busy."):
        STOPPING.offer(OPERATOR).then(busy).check()
    assert STOPPING.offer(VIEWER).then(busy).why == "Your role is Viewer: stopping a cluster needs an Operator."
