"""A key's limits and usage on the Gateway page in Chromium, as an administrator uses them: a key made with its
limits on the page's own form shows its secret once and its row with the limits; its row's Limits dialog changes
them. Then the key's usage, counted as the gateway processes count it (``UsageCounts`` added to Redis by the
flush's ``usage_add``, two processes in the same hour) and copied to the database by the beat's task
(``gateway_usage_copy``), is shown in its row over the last 24 hours: requests, tokens, errors and requests over
the limit, to the figure, with a bar for each hour that had requests; a key that was not used shows its zeros.

FADEN_SCREENSHOTS=<directory> keeps a picture of each page."""
import os
import re
import time

import pytest
from playwright.sync_api import expect

from deployments import gateway_keys
from deployments.gateway import keys
from deployments.gateway.key_usage import Figures, UsageCounts, hour_of, usage_add
from deployments.models import GatewayKey, KeyUsage
from deployments.tasks import gateway_usage_copy

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

UNKNOWN_KEY = 987_654  # a key this console does not have: the copy leaves it out


@pytest.fixture(scope="module")
def console_options():
    """The page needs the web server only: no worker (nothing is queued), no lab hub."""
    return {"worker": False}


def screenshot(page, name: str) -> None:
    if directory := os.environ.get("FADEN_SCREENSHOTS"):
        page.screenshot(path=os.path.join(directory, f"{name}.png"), full_page=True)


def flushed(client, prefix: str, counts: UsageCounts) -> None:
    """What one gateway process's flush adds to Redis (``limits_write``'s pipeline, its usage part)."""
    pipe = client.pipeline(transaction=False)
    usage_add(pipe, prefix, counts)
    pipe.execute()


def figures_of(page, key: GatewayKey) -> list[str]:
    return page.locator(f"#gateway-key-{key.pk}-usage .key-usage__figures > span").all_inner_texts()


def test_a_key_made_and_limited_on_the_page_shows_its_usage_of_the_last_day(page, gateway_redis):
    idle, _ = gateway_keys.gateway_key_create(name="idle-app")

    # Create a key with both limits on the page's form: its secret is shown once, its row has the limits.
    page.goto("/gateway/")
    form = page.locator("#gateway-create-key")
    form.get_by_label("Name").fill("batch-jobs")
    form.get_by_label("Requests a minute").fill("60")
    form.get_by_label("Tokens a minute").fill("100000")
    form.get_by_role("button", name="Create key").click()

    created = page.locator("#gateway-key-created")
    expect(created.locator(".card__title")).to_have_text("Your new key: batch-jobs")
    key = GatewayKey.objects.get(name="batch-jobs")
    secret = page.locator("#gateway-secret").inner_text()
    assert re.fullmatch(r"fs-[A-Za-z0-9_-]{43}", secret) and keys.key_hash(secret) == key.key_hash, "the real secret"
    expect(page.locator(".message--success")).to_have_text(
        f"Created the key batch-jobs ({key.prefix}…): copy it now, it is shown only this once. "
        "Limits: 60 requests and 100,000 tokens a minute.")
    row = page.locator(f"#gateway-key-{key.pk}")
    expect(row.locator("td").first).to_have_text(f"batch-jobs{key.prefix}…")
    expect(page.locator(f"#gateway-key-{key.pk}-limits")).to_have_text("60 requests/min 100,000 tokens/min",
                                                                      use_inner_text=True)
    # Neither key was used: each says 0 requests and 0 tokens, with no bars.
    for unused in (key, idle):
        assert figures_of(page, unused) == ["0 requests", "0 tokens"]
        expect(page.locator(f"#gateway-key-{unused.pk}-usage svg.spark")).to_have_count(0)
    screenshot(page, "gateway-key-created")

    # Change its limits in its row's dialog: twice the requests, no limit on tokens.
    row.get_by_role("button", name="Limits").click()
    dialog = page.locator(f"#limits-{key.pk}")
    expect(dialog).to_be_visible()
    expect(dialog.get_by_role("heading")).to_have_text("Limits of batch-jobs")
    expect(dialog.get_by_label("Requests a minute")).to_have_value("60")
    expect(dialog.get_by_label("Tokens a minute")).to_have_value("100000")
    dialog.get_by_label("Requests a minute").fill("120")
    dialog.get_by_label("Tokens a minute").fill("")
    dialog.get_by_role("button", name="Save limits").click()

    expect(page.locator(".message--success")).to_have_text(
        f"The key batch-jobs ({key.prefix}…) now has a limit of 120 requests a minute: the gateway holds it to that "
        "within a second.")
    expect(page.locator(f"#gateway-key-{key.pk}-limits")).to_have_text("120 requests/min")
    expect(page.locator("#gateway-secret")).to_have_count(0)  # shown once: not on the page after
    key.refresh_from_db()
    assert (key.requests_per_minute, key.tokens_per_minute) == (120, None)

    # Its usage, as two gateway processes count it and flush it to Redis, copied by the beat's task.
    now = time.time()
    if now % 3600 > 3600 - 30:  # not across the turn of an hour: "this hour" would be "1 h ago" on the page
        time.sleep(3600 - now % 3600 + 1)
        now = time.time()
    hour = hour_of(now)
    client, prefix = gateway_redis
    first, second = UsageCounts(), UsageCounts()
    first.hours[(hour, key.pk)] = Figures(requests=700, errors=2, refused=5, prompt_tokens=30_000, completion_tokens=5_000)
    first.hours[(hour - 3, key.pk)] = Figures(requests=300, prompt_tokens=2_000, completion_tokens=340)
    first.hours[(hour - 30, key.pk)] = Figures(requests=999, errors=9, prompt_tokens=99_999)  # older than a day
    first.hours[(hour, UNKNOWN_KEY)] = Figures(requests=50)
    second.hours[(hour, key.pk)] = Figures(requests=500, errors=1, prompt_tokens=20_000, completion_tokens=4_350)
    flushed(client, prefix, first)
    flushed(client, prefix, second)

    assert gateway_usage_copy() == 3, "the key's three hours; the unknown key's left out"
    assert sorted(KeyUsage.objects.filter(key=key).values_list("requests", flat=True)) == [300, 999, 1200]
    assert not KeyUsage.objects.filter(key=idle).exists()

    page.reload()
    usage = page.locator(f"#gateway-key-{key.pk}-usage")
    # The last 24 hours: 1,200 + 300 requests, 52,000 + 9,690 tokens, the errors and refusals of this hour.
    assert figures_of(page, key) == ["1,500 requests", "61.7 K tokens", "3 errors", "5 over the limit"]
    expect(usage.locator(".cell-sub").first).to_have_attribute(
        "title", "52,000 in (prompts), 9,690 out (completions)")
    expect(usage.locator(".spark__bar title")).to_have_text(["300 requests 3 h ago", "1,200 requests this hour"])
    heights = [float(bar.get_attribute("height")) for bar in usage.locator(".spark__bar").all()]
    assert heights == [6.0, 24.0], "bars in proportion to the hour's requests"
    assert figures_of(page, idle) == ["0 requests", "0 tokens"]
    expect(page.locator(f"#gateway-key-{idle.pk}-usage svg.spark")).to_have_count(0)
    expect(page.locator(f"#gateway-key-{key.pk}-limits")).to_have_text("120 requests/min")
    screenshot(page, "gateway-key-usage")
