"""The machine and model pages in Chromium: they change while you watch, without a reload."""
import re

import pytest
from playwright.sync_api import expect

from machines import services
from machines.choices import MachineState
from tests.factories import MachineFactory

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def mark_page(page) -> None:
    """Leave a mark in the page's JavaScript state: a reload would wipe it."""
    page.evaluate("window.__notReloaded = true")


def assert_not_reloaded(page) -> None:
    assert page.evaluate("window.__notReloaded === true"), "the page was reloaded"


def wait_until_live(page) -> None:
    expect(page.locator(".live-dot--on")).to_be_visible()


def test_a_state_change_shows_in_the_machine_list_without_a_reload(page):
    machine = MachineFactory(name="gpu-01")
    page.goto("/machines/")
    wait_until_live(page)
    mark_page(page)
    row = page.locator(f"#machine-row-{machine.pk}")
    expect(row.locator(".badge")).to_have_text("Healthy")

    services.machine_transition(machine=machine, to=MachineState.OFFLINE, reason="No heartbeat for 31 s.")

    expect(row.locator(".badge")).to_have_text("Offline")
    expect(row).to_contain_text("No heartbeat for 31 s.")
    expect(page.locator("#machine-summary")).to_contain_text("Need attention")
    assert_not_reloaded(page)


@pytest.mark.lab
def test_adding_a_lab_machine_in_the_browser_shows_it_healthy_live(page, lab_machine):
    spec = lab_machine("lab-a")
    page.goto("/machines/add/")
    page.fill("input[name=name]", "lab-a")
    page.fill("input[name=address]", spec["address"])
    page.click("#add-machine button[type=submit]")

    expect(page.locator(".fingerprint")).to_have_text(spec["host_key_fingerprint"])
    page.click("#add-machine >> text=Trust and enrol")

    page.wait_for_url(re.compile(r"/machines/\d+/$"))
    wait_until_live(page)
    mark_page(page)
    header = page.locator("#machine-header")
    expect(header.locator(".badge")).to_have_text("Healthy", timeout=30000)
    expect(header).to_contain_text("8 x H100 80GB")
    expect(page.locator("#machine-job")).to_contain_text("Start the heartbeat")
    expect(page.locator("#machine-interfaces")).to_contain_text("VPN-like")
    assert_not_reloaded(page)

    page.goto("/machines/")
    expect(page.locator("#machine-rows")).to_contain_text("8 x H100 80GB")


def test_the_dashboards_summary_changes_live_and_nothing_it_is_sent_misses_its_place(page):
    machine = MachineFactory(name="gpu-01")
    errors = []
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.goto("/")
    wait_until_live(page)
    mark_page(page)
    healthy, attention = (page.locator(f"#machine-summary .stat:nth-child({n}) .stat__value") for n in (2, 3))
    expect(healthy).to_have_text("1")

    services.machine_transition(machine=machine, to=MachineState.OFFLINE, reason="No heartbeat for 31 s.")

    expect(attention).to_have_text("1")
    expect(healthy).to_have_text("0")
    assert_not_reloaded(page)
    assert not [e for e in errors if "oobErrorNoTarget" in e]


def test_ticked_machines_wake_update_agent_and_stay_ticked_when_their_row_changes_live(page):
    old = MachineFactory(name="gpu-01", agent_version="0.0.1")
    MachineFactory(name="gpu-02")
    page.goto("/machines/")
    wait_until_live(page)
    button = page.locator("button[data-needs-selection=machines]", has_text="Update agent")
    expect(page.locator(f"#machine-row-{old.pk}")).to_contain_text("update available")
    expect(button).to_be_disabled()

    page.check(f"#machine-row-{old.pk} input[name=machines]")

    expect(button).to_be_enabled()
    expect(page.locator("[data-selection-count=machines]")).to_have_text("1 selected")
    services.machine_transition(machine=old, to=MachineState.OFFLINE, reason="No heartbeat for 31 s.")
    expect(page.locator(f"#machine-row-{old.pk} .badge")).to_have_text("Offline")
    expect(page.locator(f"#machine-row-{old.pk} input[name=machines]")).to_be_checked()
    expect(page.locator(f"#machine-row-{old.pk}")).to_have_class(re.compile("is-selected"))


def test_a_filtered_list_takes_the_changes_of_its_rows_and_quietly_skips_those_of_rows_it_does_not_show(page):
    shown = MachineFactory(name="gpu-01", state=MachineState.HEALTHY)
    hidden = MachineFactory(name="gpu-02", state=MachineState.OFFLINE)
    errors = []
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.goto("/machines/?state=healthy")
    wait_until_live(page)
    mark_page(page)
    expect(page.locator(f"#machine-row-{hidden.pk}")).to_have_count(0)

    services.machine_transition(machine=hidden, to=MachineState.HEALTHY, reason="")  # not on this page: skipped
    services.machine_transition(machine=shown, to=MachineState.OFFLINE, reason="No heartbeat for 31 s.")

    expect(page.locator(f"#machine-row-{shown.pk} .badge")).to_have_text("Offline")
    expect(page.locator(f"#machine-row-{hidden.pk}")).to_have_count(0)
    assert_not_reloaded(page)
    assert errors == []


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
