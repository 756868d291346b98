"""The Gateway page's side of a key's limits and usage: set when the key is made and changed in its row's
dialog (an Operator's), refused in words with nothing changed, and the last 24 hours of each key shown."""
from datetime import UTC, datetime, timedelta
from html import unescape

import pytest
from django.test import Client

from console import roles
from deployments import gateway_keys
from deployments.models import GatewayKey, KeyUsage
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def signed_in(role) -> Client:
    client = Client()
    client.force_login(UserFactory(role=role))
    return client


def row_of(html: str, key: GatewayKey) -> str:
    return html.split(f'id="gateway-key-{key.pk}"')[1].split("</tr>")[0]


def test_a_key_made_on_the_page_gets_the_limits_typed():
    answer = signed_in(roles.OPERATOR).post("/gateway/keys/", {"name": "batch", "requests_per_minute": "60",
                                                                "tokens_per_minute": ""})

    key = GatewayKey.objects.get()
    assert answer.status_code == 201 and (key.requests_per_minute, key.tokens_per_minute) == (60, None)
    assert "Limits: 60 requests a minute." in unescape(answer.content.decode())


def test_a_key_with_bad_limits_is_not_made_and_the_form_keeps_what_was_typed():
    answer = signed_in(roles.OPERATOR).post("/gateway/keys/", {"name": "batch", "requests_per_minute": "-3",
                                                                "tokens_per_minute": "many"})

    html = unescape(answer.content.decode())
    assert answer.status_code == 400 and not GatewayKey.objects.exists()
    assert "Give at least 1 request a minute, or leave it empty for no limit: -3 would refuse every request" in html
    assert "Give the tokens (prompt and completion) a minute as a whole number, such as 60" in html
    assert 'name="requests_per_minute" inputmode="numeric" pattern="[0-9]*" autocomplete="off" placeholder="no limit" value="-3"' in html


def test_an_operator_changes_a_keys_limits_in_its_dialog_and_the_row_shows_them():
    key, _ = gateway_keys.gateway_key_create(name="app", requests_per_minute=10)
    operator = signed_in(roles.OPERATOR)
    html = operator.get("/gateway/").content.decode()
    assert f'data-dialog-open="limits-{key.pk}"' in html and f'action="/gateway/keys/{key.pk}/limits/"' in html
    assert 'id="limits-%d-requests" name="requests_per_minute"' % key.pk in html and 'value="10"' in row_of(html, key)

    answer = operator.post(f"/gateway/keys/{key.pk}/limits/", {"requests_per_minute": "", "tokens_per_minute": "2000"},
                           follow=True)

    html = unescape(answer.content.decode())
    key.refresh_from_db()
    assert (key.requests_per_minute, key.tokens_per_minute) == (None, 2000)
    assert "The key app (" in html and "now has a limit of 2,000 tokens a minute" in html
    assert "2,000 tokens/min" in row_of(html, key) and "requests/min" not in row_of(html, key)


def test_bad_limits_in_the_dialog_change_nothing_and_say_why():
    key, _ = gateway_keys.gateway_key_create(name="app", requests_per_minute=10)

    answer = signed_in(roles.OPERATOR).post(f"/gateway/keys/{key.pk}/limits/", {"requests_per_minute": "0"})

    html = unescape(answer.content.decode())
    assert answer.status_code == 400
    assert "The limits of app stay as they were: Give at least 1 request a minute" in html
    assert GatewayKey.objects.get().requests_per_minute == 10


def test_a_viewer_sees_the_limits_button_greyed_out_with_the_reason_and_cannot_post():
    key, _ = gateway_keys.gateway_key_create(name="app")
    viewer = signed_in(roles.VIEWER)

    html = viewer.get("/gateway/").content.decode()

    assert "Your role is Viewer: changing a gateway key&#x27;s limits needs an Operator." in html
    assert f'data-dialog-open="limits-{key.pk}"' not in html
    assert viewer.post(f"/gateway/keys/{key.pk}/limits/", {"requests_per_minute": "5"}).status_code == 403
    assert GatewayKey.objects.get().requests_per_minute is None


def test_each_key_shows_its_last_24_hours_and_a_bar_per_hour():
    busy, _ = gateway_keys.gateway_key_create(name="busy")
    idle, _ = gateway_keys.gateway_key_create(name="idle")
    this_hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    KeyUsage.objects.create(key=busy, hour=this_hour, requests=1200, errors=3, refused=7, prompt_tokens=50_000,
                            completion_tokens=4_000)
    KeyUsage.objects.create(key=busy, hour=this_hour - timedelta(hours=5), requests=34)
    KeyUsage.objects.create(key=busy, hour=this_hour - timedelta(hours=30), requests=999_999)  # older than a day

    html = unescape(signed_in(roles.VIEWER).get("/gateway/").content.decode())

    shown = row_of(html, busy)
    assert "<strong>1,234</strong> requests" in shown and "54.0 K tokens" in shown
    assert 'title="50,000 in (prompts), 4,000 out (completions)"' in shown
    assert "3 errors" in shown and "7 over the limit" in shown
    assert "1,200 requests this hour" in shown and "34 requests 5 h ago" in shown and shown.count('class="spark__bar"') == 2
    assert "<strong>0</strong> requests" in row_of(html, idle) and "spark" not in row_of(html, idle)
