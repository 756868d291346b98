"""The Users page: an Administrator adds users with a role, changes roles and deactivates accounts;
nobody changes their own; the other roles are turned away."""
from html import unescape

import pytest
from django.contrib.auth import get_user_model
from django.http import HttpRequest
from django.test import Client
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from console import roles
from console.roles import ADMINISTRATOR, OPERATOR, VIEWER
from console.users import OWN_ACCOUNT
from tests.factories import NO_ROLE, UserFactory

pytestmark = pytest.mark.django_db

User = get_user_model()


@pytest.fixture
def administrator():
    return UserFactory(username="ada", role=ADMINISTRATOR)


@pytest.fixture
def client(administrator):
    client = Client()
    client.force_login(administrator)
    return client


def text(response) -> str:
    return unescape(response.content.decode())


def signs_in(username: str, password: str) -> bool:
    """Whether the password sign-in takes these: django-axes, first of the backends, needs the request
    (its documented way for tests: a blank HttpRequest)."""
    return Client().login(request=HttpRequest(), username=username, password=password)


def row(html: str, user) -> str:
    start = html.index(f'id="user-row-{user.pk}"')
    return html[start:html.index("</tr>", start)]


def test_the_page_lists_every_account_with_its_role_last_login_and_status(client, administrator):
    bob = UserFactory(username="bob", role=OPERATOR)
    gone = UserFactory(username="gone", role=VIEWER, is_active=False)
    odd = UserFactory(username="odd", role=NO_ROLE)

    html = text(client.get("/users/"))

    assert 'value="Operator" selected' in row(html, bob)
    assert "Deactivated" in row(html, gone) and "Reactivate" in row(html, gone)
    assert "No role" in row(html, odd)
    assert "never" in row(html, bob)
    assert ">you<" in row(html, administrator)


def test_an_administrator_adds_a_user_who_signs_in_with_the_role_given(client):
    response = client.post("/users/add/", {"username": "carol", "email": "carol@example.com",
                                           "password": "a-long-enough-passphrase", "role": "Operator"})

    assert response.status_code == 302
    carol = User.objects.get(username="carol")
    assert roles.role_of(carol) == OPERATOR
    assert signs_in("carol", "a-long-enough-passphrase")
    assert "carol can sign in now, as an Operator." in text(client.get("/users/"))


@pytest.mark.parametrize(("fields", "words"), [
    ({"password": "short"}, "This password is too short."),
    ({"password": "password123"}, "This password is too common."),
    ({"username": "ada"}, "A user with that username already exists."),
    ({"username": "no spaces"}, "Enter a valid username."),
    ({"role": "Owner"}, "Select a valid choice."),
])
def test_adding_a_user_the_rules_refuse_is_a_400_that_says_why_and_adds_nobody(client, fields, words):
    before = User.objects.count()

    response = client.post("/users/add/", {"username": "dave", "password": "a-long-enough-passphrase", "role": "Viewer", **fields})

    assert response.status_code == 400
    assert words in text(response)
    assert User.objects.count() == before


def test_an_administrator_changes_a_users_role_from_their_next_request(client):
    bob = UserFactory(username="bob", role=VIEWER)
    bobs = Client()
    bobs.force_login(bob)
    assert bobs.get("/users/").status_code == 403

    response = client.post(f"/users/{bob.pk}/role/", {"role": "Administrator"})

    assert response.status_code == 302
    assert roles.role_of(User.objects.get(pk=bob.pk)) == ADMINISTRATOR
    assert bobs.get("/users/").status_code == 200


def test_a_deactivated_user_can_no_longer_sign_in_nor_use_their_api_token_until_reactivated(client):
    bob = UserFactory(username="bob", role=OPERATOR)
    token = Token.objects.create(user=bob)
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")

    client.post(f"/users/{bob.pk}/active/", {"active": "false"})

    assert not signs_in("bob", "correct horse battery staple")
    assert api.get("/api/machines/").status_code == 401

    client.post(f"/users/{bob.pk}/active/", {"active": "true"})

    assert signs_in("bob", "correct horse battery staple")
    assert api.get("/api/machines/").status_code == 200


@pytest.mark.parametrize(("url", "form"), [("role", {"role": "Viewer"}), ("active", {"active": "false"})])
def test_nobody_changes_their_own_role_or_deactivates_themselves(client, administrator, url, form):
    response = client.post(f"/users/{administrator.pk}/{url}/", form)

    assert response.status_code == 403
    assert OWN_ACCOUNT in text(response)
    administrator.refresh_from_db()
    assert administrator.is_active and roles.role_of(administrator) == ADMINISTRATOR


def test_the_page_greys_out_an_administrators_own_row_and_says_why(client, administrator):
    own = row(text(client.get("/users/")), administrator)

    assert "<select" not in own
    assert f'title="{OWN_ACCOUNT}"' in own and "disabled" in own


@pytest.mark.parametrize("role", [VIEWER, OPERATOR], ids=str)
def test_the_users_page_is_an_administrators_and_says_so_to_the_others(role):
    client = Client()
    client.force_login(UserFactory(role=role))

    response = client.get("/users/")

    assert response.status_code == 403
    assert f"Your role is {role}: managing users needs an Administrator." in text(response)


# -- node logins ------------------------------------------------------------------------------------


def test_an_administrator_allows_an_operator_node_logins_and_takes_them_back(client):
    bob = UserFactory(username="bob", role=OPERATOR)
    before = row(text(client.get("/users/")), bob)

    allowed = text(client.post(f"/users/{bob.pk}/node-logins/", {"allowed": "true"}, follow=True))
    holds = roles.node_logins_allowed(User.objects.get(pk=bob.pk))
    taken = text(client.post(f"/users/{bob.pk}/node-logins/", {"allowed": "false"}, follow=True))

    assert "Not allowed" in before and ">Allow</button>" in before
    assert "bob may now log in to the machines of clusters as root" in allowed and "Take back" in row(allowed, bob)
    assert holds
    assert "bob can no longer get node login certificates" in taken
    assert not roles.node_logins_allowed(User.objects.get(pk=bob.pk))


def test_node_logins_are_allowed_one_by_one_for_operators_only(client, administrator):
    vic = UserFactory(username="vic", role=VIEWER)
    page = text(client.get("/users/"))

    refused = text(client.post(f"/users/{vic.pk}/node-logins/", {"allowed": "true"}, follow=True))

    assert "never" in row(page, vic) and "with the role" in row(page, administrator)
    assert "Node logins are allowed one by one for Operators only" in refused
    assert not roles.node_logins_allowed(User.objects.get(pk=vic.pk))


def test_an_operator_cannot_allow_themselves_node_logins(client):
    bob = UserFactory(username="bob", role=OPERATOR)
    own = Client()
    own.force_login(bob)

    response = own.post(f"/users/{bob.pk}/node-logins/", {"allowed": "true"})

    assert response.status_code == 403
    assert not roles.node_logins_allowed(User.objects.get(pk=bob.pk))
