"""The first run's admin: FADEN_ADMIN_PASSWORD must pass the password validators; a generated password
is shown on the terminal once and is never written to stdout, stderr or the log."""
import io
import logging

import pytest
from django.contrib.auth import get_user_model
from django.core.management.base import CommandError

from console.management.commands import serve

pytestmark = pytest.mark.django_db


@pytest.fixture
def terminal(monkeypatch):
    """What the command writes to the terminal itself (None: no terminal attached)."""
    shown = []
    monkeypatch.setattr(serve, "show_on_terminal", lambda text: shown.append(text) or True)
    return shown


def ensure_admin() -> str:
    """Run the command's first-admin step; what it wrote to stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    command = serve.Command(stdout=out, stderr=err)
    command._ensure_admin()
    return out.getvalue() + err.getvalue()


@pytest.mark.parametrize("weak, why", [("a", "too short"), ("password", "too common"), ("admin123", "too similar"), ("83920174", "entirely numeric")])
def test_a_weak_faden_admin_password_is_refused_and_no_admin_is_made(monkeypatch, weak, why):
    monkeypatch.setenv("FADEN_ADMIN_PASSWORD", weak)

    with pytest.raises(CommandError, match="FADEN_ADMIN_PASSWORD is refused") as refused:
        ensure_admin()

    assert why in str(refused.value)
    assert not get_user_model().objects.exists()


def test_a_strong_faden_admin_password_makes_the_admin_without_saying_it(monkeypatch, terminal):
    monkeypatch.setenv("FADEN_ADMIN_PASSWORD", "violet-harbour-engine-42")

    said = ensure_admin()

    assert get_user_model().objects.get(username="admin").check_password("violet-harbour-engine-42")
    assert "violet-harbour-engine-42" not in said
    assert terminal == []


def test_a_generated_password_is_shown_on_the_terminal_only(monkeypatch, terminal, caplog):
    monkeypatch.delenv("FADEN_ADMIN_PASSWORD", raising=False)
    caplog.set_level(logging.DEBUG)

    said = ensure_admin()

    [shown] = terminal
    password = shown.split("the password ")[1].split(" ")[0]
    assert get_user_model().objects.get(username="admin").check_password(password)
    assert password not in said and "shown on the terminal" in said
    assert password not in caplog.text


def test_without_a_terminal_a_generated_password_is_shown_nowhere_and_the_way_to_set_one_is(monkeypatch, caplog):
    monkeypatch.delenv("FADEN_ADMIN_PASSWORD", raising=False)
    monkeypatch.setattr(serve, "show_on_terminal", lambda text: False)

    said = ensure_admin()

    assert get_user_model().objects.filter(username="admin", is_superuser=True).exists()
    assert "faden changepassword admin" in said
    assert "the password " not in said


def test_an_existing_superuser_is_left_alone(monkeypatch, admin_user, terminal):
    monkeypatch.setenv("FADEN_ADMIN_PASSWORD", "a")

    assert ensure_admin() == ""
    assert terminal == []
