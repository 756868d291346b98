"""Signing in: failures are logged and audited with the name tried and the address, and a run of them
from one address or for one user is refused for a while, the correct password included."""
import logging
from datetime import timedelta

import pytest
from axes.models import AccessAttempt
from django.test import Client
from django.utils import timezone

from console.choices import AuditOutcome
from console.models import AuditEntry
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

PASSWORD = "correct horse battery staple"  # the factory's


def sign_in(username: str, password: str, *, address: str = "198.51.100.7", path: str = "/login/"):
    return Client(REMOTE_ADDR=address).post(path, {"username": username, "password": password})


def signed_in(response) -> bool:
    return response.status_code == 302 and "_auth_user_id" in response.client.session


def test_a_failed_sign_in_is_logged_and_audited_with_the_name_tried_and_the_address(caplog):
    UserFactory(username="ada")
    caplog.set_level(logging.WARNING, logger="console.logins")

    response = sign_in("ada", "not her password")

    assert response.status_code == 200  # the sign-in page again, with its error
    assert "Failed sign-in for 'ada' from 198.51.100.7: wrong user name or password" in caplog.text
    assert "not her password" not in caplog.text
    entry = AuditEntry.objects.get(action="login.failed")
    assert (entry.username, entry.address, entry.outcome) == ("ada", "198.51.100.7", AuditOutcome.REFUSED)
    assert entry.user is None


def test_a_sign_in_is_audited_too():
    user = UserFactory(username="ada")

    assert signed_in(sign_in("ada", PASSWORD))
    entry = AuditEntry.objects.get(action="login")
    assert (entry.user, entry.address, entry.outcome) == (user, "198.51.100.7", AuditOutcome.DONE)


def test_after_five_failures_from_one_address_even_the_right_password_is_refused_with_a_page_that_says_why():
    UserFactory(username="ada")
    for guess in range(5):
        sign_in(f"someone-{guess}", "guess")

    refused = sign_in("ada", PASSWORD)

    assert refused.status_code == 429
    page = refused.content.decode()
    assert "Too many failed sign-ins from this address or for this user name" in page
    assert "refused for 15 minutes" in page
    assert "auth__card" in page  # the sign-in pages' own shell
    assert not signed_in(refused)
    assert signed_in(sign_in("ada", PASSWORD, address="198.51.100.8"))  # another address is not held up


def test_after_five_failures_for_one_user_name_it_is_refused_from_every_address():
    UserFactory(username="ada")
    UserFactory(username="grace")
    for guess in range(5):
        sign_in("ada", "guess", address=f"203.0.113.{guess}")

    assert sign_in("ada", PASSWORD, address="198.51.100.20").status_code == 429
    assert signed_in(sign_in("grace", PASSWORD, address="198.51.100.20"))


def test_the_refusal_ends_after_the_cool_off():
    UserFactory(username="ada")
    for _ in range(5):
        sign_in("ada", "guess")
    assert sign_in("ada", PASSWORD).status_code == 429

    AccessAttempt.objects.update(attempt_time=timezone.now() - timedelta(minutes=16))

    assert signed_in(sign_in("ada", PASSWORD))


def test_a_successful_sign_in_starts_the_count_again():
    UserFactory(username="ada")
    for _ in range(4):
        sign_in("ada", "guess")
    assert signed_in(sign_in("ada", PASSWORD))

    for _ in range(4):
        sign_in("ada", "guess")

    assert signed_in(sign_in("ada", PASSWORD))


def test_refused_tries_are_audited_as_such():
    UserFactory(username="ada")
    for _ in range(6):
        sign_in("ada", "guess")

    last = AuditEntry.objects.filter(action="login.failed").first()
    assert last.message == "Too many failed sign-ins, refused for a while."


def test_the_admin_s_sign_in_is_throttled_alike():
    UserFactory(username="ada")
    for _ in range(5):
        sign_in("ada", "guess", path="/admin/login/")

    assert sign_in("ada", PASSWORD, path="/admin/login/").status_code == 429
    assert sign_in("ada", PASSWORD).status_code == 429
