"""The Models pages in Chromium: a model added from the page downloads while you watch, without a reload."""
import threading

import pytest
from playwright.sync_api import expect

from lab import hub_models
from lab.hub import HubServer
from tests.browser.test_machines_live import assert_not_reloaded, mark_page, wait_until_live

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture(scope="module")
def console_options():
    """The console's worker downloads from a lab hub on loopback (the namespaces' lab is not needed)."""
    server = HubServer("127.0.0.1", 0, cache_dir=hub_models.default_cache_dir())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield {"env": {"FADEN_TEST_HF_ENDPOINT": server.url}}
    server.shutdown()
    server.server_close()


def test_a_model_added_on_the_page_downloads_live_and_shows_what_its_files_say(page):
    page.goto("/models/")
    expect(page.locator(".empty__title")).to_have_text("No models yet")
    page.fill("#model-repo", "fadenstack-lab/tiny-chat")
    page.click("#add-model button[type=submit]")

    expect(page.locator(".page-header__title")).to_contain_text("fadenstack-lab/tiny-chat")
    wait_until_live(page)
    mark_page(page)
    expect(page.locator(".page-header__title .badge")).to_have_text("Ready", timeout=60000)
    facts = page.locator("#model-facts")
    expect(facts).to_contain_text("LlamaForCausalLM")
    expect(facts).to_contain_text("weights + 20 % for the KV cache")
    expect(page.locator("#model-files")).to_contain_text("model.safetensors")
    assert_not_reloaded(page)

    page.goto("/models/")
    expect(page.locator("#model-rows")).to_contain_text("Ready")
    page.fill("#model-repo", "fadenstack-lab/tiny-chat")
    page.click("#add-model button[type=submit]")
    expect(page.locator(".messages, [role=alert]").first).to_contain_text("has fadenstack-lab/tiny-chat already")
