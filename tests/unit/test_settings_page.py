"""The server's Hugging Face token and the Settings page: FADEN_HF_TOKEN wins over the one set on the page;
the page is an Administrator's, says only Set or Not set, and never holds the token, nor does the audit
trail or Django's report of a failed request."""
import logging

import pytest
from django.core.exceptions import PermissionDenied, ValidationError
from django.test import Client
from django.views.debug import ExceptionReporter

from console import roles, secrets
from console.models import AuditEntry, SealedSecret
from console.roles import OPERATOR, VIEWER
from deployments.store import hub_token
from deployments.store.hub_token import hf_token, hf_token_source
from tests.factories import NO_ROLE, UserFactory

pytestmark = pytest.mark.django_db

TOKEN = "hf_PageToken0123456789abcdef"
URL = "/settings/"


@pytest.fixture(autouse=True)
def sealed_here(settings, tmp_path, monkeypatch):
    """A key of the test's own, and no FADEN_HF_TOKEN from the environment the tests run in."""
    settings.FADEN_SECRETS_KEY_PATH = tmp_path / "secrets.key"
    monkeypatch.delenv(hub_token.ENV_VAR, raising=False)


def signed_in(role) -> Client:
    client = Client()
    client.force_login(UserFactory(username=f"as-{role or 'nobody'}".lower(), role=role or NO_ROLE))
    return client


def audit_text() -> str:
    return repr(list(AuditEntry.objects.values()))


# -- the token and where it comes from ----------------------------------------------------------------


def test_no_token_anywhere_is_none_from_nowhere():
    assert (hf_token(), hf_token_source()) == (None, None)


def test_the_token_set_here_is_used_and_the_environments_wins_while_it_is_set(admin_user, monkeypatch):
    hub_token.hf_token_set(token=f"  {TOKEN}\n", by=admin_user)
    assert (hf_token(), hf_token_source()) == (TOKEN, "settings")

    monkeypatch.setenv(hub_token.ENV_VAR, "hf_FromTheEnvironment")
    assert (hf_token(), hf_token_source()) == ("hf_FromTheEnvironment", "environment")

    monkeypatch.setenv(hub_token.ENV_VAR, "  ")  # set but blank is not set
    assert hf_token_source() == "settings"


@pytest.mark.parametrize(("given", "words"), [
    ("", "Enter the token."),
    ("   ", "Enter the token."),
    ("hf_two halves", "no spaces or line breaks inside"),
    ("hf_line\nbreak", "no spaces or line breaks inside"),
    ("hf_tökén_1234", "printable ASCII"),
    ("hf_\x00\x01abcdef", "printable ASCII"),
    ("hf_abc", "8 to 1024 characters long"),
    ("h" * 1025, "8 to 1024 characters long"),
    (12345678, "must be text"),
])
def test_a_token_that_cannot_be_one_is_refused_in_words_without_it(given, words):
    with pytest.raises(ValidationError) as refused:
        hub_token.hf_token_clean(given)
    said = " ".join(refused.value.messages)
    assert words in said
    assert str(given).strip() not in said or not str(given).strip()


def test_a_token_is_trimmed_and_kept_from_8_to_1024_printable_characters():
    assert hub_token.hf_token_clean("  hf_12345 \t") == "hf_12345"
    assert hub_token.hf_token_clean("x" * 1024) == "x" * 1024


@pytest.mark.parametrize("role", [NO_ROLE, VIEWER, OPERATOR], ids=str)
def test_only_an_administrator_sets_or_removes_it(role):
    user = UserFactory(username="someone", role=role)
    with pytest.raises(PermissionDenied):
        hub_token.hf_token_set(token=TOKEN, by=user)
    with pytest.raises(PermissionDenied):
        hub_token.hf_token_remove(by=user)
    assert not SealedSecret.objects.exists()


def test_each_change_is_audited_in_words_without_the_token(admin_user):
    hub_token.hf_token_set(token=TOKEN, by=admin_user)
    hub_token.hf_token_set(token=TOKEN + "2", by=admin_user)
    hub_token.hf_token_remove(by=admin_user)

    said = list(AuditEntry.objects.filter(action="settings.hf_token").order_by("id").values_list("username", "message"))
    assert said == [("admin", "The Hugging Face token was set."), ("admin", "The Hugging Face token was replaced."),
                    ("admin", "The Hugging Face token was removed.")]
    assert TOKEN not in audit_text()


# -- the page -------------------------------------------------------------------------------------------


def test_the_page_says_not_set_then_set_and_never_holds_the_token():
    admin = signed_in(roles.ADMINISTRATOR)
    before = admin.get(URL).content.decode()

    saved = admin.post(f"{URL}hugging-face-token/", {"token": TOKEN}, follow=True)
    after = saved.content.decode()

    assert 'badge--grey">Not set<' in before and ">Save</button>" in before and "Remove" not in before
    assert saved.redirect_chain == [(URL, 302)]
    assert "The Hugging Face token was set." in after
    assert 'badge--green">Set<' in after and ">Replace</button>" in after and 'data-dialog-open="hf-token-remove-dialog"' in after
    assert 'type="password"' in after and 'autocomplete="off"' in after
    assert TOKEN not in after and hf_token() == TOKEN


def test_a_refused_token_is_not_shown_again_on_the_page():
    admin = signed_in(roles.ADMINISTRATOR)
    refused = admin.post(f"{URL}hugging-face-token/", {"token": f"{TOKEN} {TOKEN}"})

    assert refused.status_code == 400
    assert "no spaces or line breaks inside" in refused.content.decode()
    assert TOKEN not in refused.content.decode()
    assert hf_token() is None
    assert TOKEN not in audit_text()


def test_the_page_says_when_the_environment_gives_the_token(monkeypatch):
    monkeypatch.setenv(hub_token.ENV_VAR, "hf_FromTheEnvironment")
    page = signed_in(roles.ADMINISTRATOR).get(URL).content.decode()

    assert "Set, from FADEN_HF_TOKEN" in page and "the environment wins" in page
    assert "hf_FromTheEnvironment" not in page


def test_remove_forgets_the_token_set_here():
    admin = signed_in(roles.ADMINISTRATOR)
    admin.post(f"{URL}hugging-face-token/", {"token": TOKEN})

    removed = admin.post(f"{URL}hugging-face-token/remove/", follow=True).content.decode()

    assert "The Hugging Face token was removed." in removed and 'badge--grey">Not set<' in removed
    assert hf_token() is None


@pytest.mark.parametrize("role", [None, VIEWER, OPERATOR], ids=str)
def test_below_administrator_the_page_and_its_buttons_are_refused_and_change_nothing(role):
    secrets.secret_set(hub_token.SECRET_NAME, TOKEN)
    client = signed_in(role)
    sentence = roles.NO_ROLE if role is None else f"Your role is {role}: changing the console's settings needs an Administrator."

    answers = [client.get(URL), client.post(f"{URL}hugging-face-token/", {"token": "hf_SomethingElse"}),
               client.post(f"{URL}hugging-face-token/", {"token": "not valid"}), client.post(f"{URL}hugging-face-token/remove/")]

    assert [a.status_code for a in answers] == [403] * 4
    assert all(sentence in a.content.decode().replace("&#x27;", "'") for a in answers)
    assert hf_token() == TOKEN


def test_the_side_bar_links_the_settings_page_for_administrators_only():
    assert 'href="/settings/"' in signed_in(roles.ADMINISTRATOR).get("/").content.decode()
    assert 'href="/settings/"' not in signed_in(OPERATOR).get("/").content.decode()


# -- Django's report of a failed request ------------------------------------------------------------------


def reports(records) -> str:
    """What Django's log handlers could write of each request it logged: the line, and the full report
    (POST, locals of every frame) that AdminEmailHandler mails."""
    text = []
    for record in records:
        text.append(logging.Formatter().format(record))
        if getattr(record, "request", None) is not None:
            reporter = ExceptionReporter(record.request, *(record.exc_info or (None, None, None)), is_email=True)
            text += [reporter.get_traceback_text(), reporter.get_traceback_html()]
    return "\n".join(text)


def test_a_failed_request_is_logged_without_the_token(admin_user, api_client, caplog, monkeypatch):
    def broken(name, value):
        raise RuntimeError("the database went away")

    page = Client(raise_request_exception=False)
    page.force_login(admin_user)
    api_client.raise_request_exception = False

    with caplog.at_level(logging.WARNING, logger="django.request"):
        refused = page.post(f"{URL}hugging-face-token/", {"token": f"{TOKEN} x"})
        monkeypatch.setattr(secrets, "secret_set", broken)
        crashed = page.post(f"{URL}hugging-face-token/", {"token": TOKEN})
        crashed_api = api_client.put("/api/settings/hugging-face-token/", {"token": TOKEN}, format="json")

    assert (refused.status_code, crashed.status_code, crashed_api.status_code) == (400, 500, 500)
    logged = reports(caplog.records)
    assert len(caplog.records) == 3 and "the database went away" in logged and "token" in logged
    assert TOKEN not in logged
    assert TOKEN not in audit_text()
