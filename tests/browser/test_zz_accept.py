"""Throwaway: issue 28's Done-when in the browser on the lab (not committed)."""
import re
import threading
import time

import pytest
from playwright.sync_api import expect

from clusters.models import Cluster
from deployments.models import Copy, Deployment
from machines.models import Machine
from tests.harness import INTERVALS, LAB_CONSOLE_ADDRESS, all_up, enrol, images_import, leave_nothing_running, running, wait_for
from tests.integration.serve_lab import KIND, Caller, chat, serving, tiny_model

pytestmark = [pytest.mark.browser, pytest.mark.lab, pytest.mark.django_db(transaction=True)]
SHOTS = "/work/shots"


@pytest.fixture(scope="module")
def console_options():
    return {"beat": True, "gateway": True, "env": {**INTERVALS, "FADEN_DRAIN_GRACE": "3"}}


@pytest.fixture
def machines(console, settings, lab):
    settings.FADEN_CONSOLE_URL = f"http://{LAB_CONSOLE_ADDRESS}:{console.rsplit(':', 1)[1]}"
    images_import(lab)
    yield enrol(lab, "lab-a", "lab-b", "lab-c")
    lab.heal()
    for d in Deployment.objects.all():
        Copy.objects.filter(deployment=d).delete(); d.delete()
    leave_nothing_running(Machine.objects.all())


def test_accept(page, machines, lab, console_processes_of_module):
    from deployments import gateway_keys
    from tests.factories import UserFactory
    from console import roles
    proc = console_processes_of_module
    cluster = running("serve", machines)
    wait_for(lambda: all_up("serve", 3), timeout=60, what="up")
    model = tiny_model()
    admin = UserFactory(username="ops", role=roles.OPERATOR)
    _, key = gateway_keys.gateway_key_create(name="curl", user=admin)

    # A model left without a deployment: deploy through the form? use the service, then delete it in the browser while lab-b's link is down.
    from deployments import services
    from deployments.forms import ask_from
    left = services.deployment_create(ask=ask_from({"name": "tiny-left", "copies": 2, "kind": KIND, "gpu_quarters": 32,
                                                    "memory_per_gpu_gib": 8, "context_length": 2048}, cluster=cluster, model=model), user=admin)
    wait_for(serving(2, "tiny-left"), timeout=60, what="tiny-left")
    lab.fault("lab-b", "link-down", "mgmt")
    try:
        page.goto(f"/deployments/{left.pk}/")
        page.click("#deployment-header button:text-is('Delete')")
        page.click("#delete-dialog button:text('Delete the deployment')")
        page.wait_for_timeout(8000)
        page.screenshot(path=f"{SHOTS}/1-deleted-while-cut.png", full_page=True)
    finally:
        lab.fault("lab-b", "link-up", "mgmt")
    wait_for(lambda: all_up("serve", 3), timeout=90, what="up again")
    page.goto(f"/clusters/{cluster.pk}/")
    card = page.locator("#cluster-orphans")
    card.locator("button:text-is('Look for them')").click()
    expect(page.locator("#cluster-orphans")).to_contain_text("tiny-left", timeout=60000)
    page.locator("#cluster-orphans").scroll_into_view_if_needed()
    page.screenshot(path=f"{SHOTS}/2-found.png", full_page=True)
    page.locator("#cluster-orphans button:text-is('Keep it')").click()
    wait_for(lambda: Deployment.objects.shown().filter(name="tiny-left").exists(), timeout=60, what="kept")
    page.goto(f"/clusters/{cluster.pk}/")
    page.screenshot(path=f"{SHOTS}/3-kept.png", full_page=True)
    kept = Deployment.objects.get(name="tiny-left")
    services.deployment_delete(deployment=kept, user=admin)
    wait_for(lambda: not Deployment.objects.filter(name="tiny-left").exists(), timeout=60, what="gone")

    # Remove a serving machine while a client calls the gateway.
    d = services.deployment_create(ask=ask_from({"name": "tiny", "copies": 2, "kind": KIND, "gpu_quarters": 8,
                                                 "memory_per_gpu_gib": 8, "context_length": 2048}, cluster=cluster, model=model), user=admin)
    wait_for(serving(2), timeout=60, what="tiny")
    wait_for(lambda: chat(proc, key)[0] == 200, timeout=10, every=0.3, what="route")
    caller = Caller(proc, key)
    caller.start()
    b = Machine.objects.get(name="lab-b")
    page.goto(f"/clusters/{cluster.pk}/?machine={b.pk}")
    page.locator(f"#machine-panel-{b.pk}").get_by_role("link", name="Remove", exact=True).click()
    expect(page.locator("#drain-plan")).to_contain_text("Moves to lab-a")
    page.screenshot(path=f"{SHOTS}/4-remove-plan.png", full_page=True)
    t = time.monotonic()
    page.locator("#drain-plan button:text-is('Remove')").click()
    page.wait_for_url(re.compile(rf"/clusters/{cluster.pk}/$"))
    page.wait_for_timeout(2500)
    page.screenshot(path=f"{SHOTS}/5-removing.png", full_page=True)
    expect(page.locator("#cluster-members")).not_to_contain_text("lab-b", timeout=90000)
    gone = time.monotonic() - t
    time.sleep(1)
    statuses = caller.stop()
    page.screenshot(path=f"{SHOTS}/6-removed.png", full_page=True)
    print(f"\nACCEPT remove: out of the page after {gone:.1f} s; {len(statuses)} requests, statuses {sorted(set(statuses))}")
    assert set(statuses) == {200}
