"""A running cluster's page in Chromium, on the lab, with a real worker and beat: Ray killed on a
worker and the page saying what the console does until it is back by itself; stop, start, add a
machine, change the network and delete from the buttons, every change arriving live."""
import re

import pytest
from playwright.sync_api import expect

from clusters import services
from clusters.choices import ClusterState
from clusters.models import Cluster
from machines.models import Machine
from tests.harness import FABRIC, LAB_CONSOLE_ADDRESS, enrol, images_import, leave_nothing_running, wait_for

pytestmark = [pytest.mark.browser, pytest.mark.lab, pytest.mark.django_db(transaction=True)]

LIVE = 60000  # ms: what a page waits for a push


@pytest.fixture(scope="module")
def console_options():
    return {"beat": True, "env": {"FADEN_HEALTH_INTERVAL": "5", "FADEN_HEALTH_LOOK_AGAIN": "3"}}


@pytest.fixture
def gpu_room(console, settings, lab):
    """lab-a and lab-b running as gpu-room (started in this process), lab-c enrolled and free."""
    settings.FADEN_CONSOLE_URL = f"http://{LAB_CONSOLE_ADDRESS}:{console.rsplit(':', 1)[1]}"  # heartbeats reach the console
    images_import(lab)
    machines = enrol(lab, "lab-a", "lab-b", "lab-c")
    cluster = services.cluster_create(name="gpu-room", machine_ids=[m.pk for m in machines[:2]], head_id=machines[0].pk,
                                      network=FABRIC)
    cluster.refresh_from_db()
    assert cluster.state == ClusterState.RUNNING, cluster.state_reason
    yield cluster
    lab.heal()
    leave_nothing_running(Machine.objects.all())


def member_row(page, name: str):
    return page.locator("#cluster-members tbody tr").filter(has=page.get_by_role("link", name=name, exact=True))


def test_the_page_says_what_the_console_does_about_a_killed_worker_and_its_buttons_work(page, gpu_room, lab):
    page.goto(f"/clusters/{gpu_room.pk}/")
    header = page.locator("#cluster-header")
    expect(header.locator(".badge").first).to_have_text("Running")
    wiring = page.locator("#cluster-members")
    expect(wiring.locator("svg.wire")).to_contain_text("lab-a")
    expect(wiring.locator("svg.wire")).to_contain_text("lab-b")

    # Ray killed on a worker: nobody presses a button; the page says what is found and done.
    lab.fault("lab-b", "ray-kill")
    expect(member_row(page, "lab-b")).to_contain_text(re.compile("Out of the cluster|Joining again"), timeout=LIVE)
    expect(member_row(page, "lab-b")).to_contain_text("Up", timeout=LIVE * 2)
    expect(page.locator("#cluster-status")).to_contain_text("2")
    page.click("#advanced summary")
    expect(page.locator("#cluster-checks")).to_contain_text("Taking lab-b out of Ray", timeout=LIVE)

    # Stop, through its confirmation: it arrives live.
    page.click("button:text-is('Stop')")
    page.click("#stop-dialog button:text('Stop the cluster')")
    expect(header.locator(".badge").first).to_have_text("Stopped", timeout=LIVE)

    # Move it to the management network while it is stopped (lab-c has no second fabric): nothing
    # restarts; Start brings it up there, each machine at its address on it.
    page.goto(f"/clusters/{gpu_room.pk}/network/")
    page.check("input[name=network][value='198.18.0.0/24']")
    page.click("button:text-is('Apply')")
    page.click("button:text-is('Change the network')")
    page.wait_for_url(re.compile(rf"/clusters/{gpu_room.pk}/$"))
    expect(header).to_contain_text("198.18.0.0/24")
    expect(header.locator(".badge").first).to_have_text("Stopped")
    page.click("#cluster-header button:text-is('Start')")
    expect(header.locator(".badge").first).to_have_text("Running", timeout=LIVE * 2)
    expect(member_row(page, "lab-b")).to_contain_text("198.18.0.12")

    # Add lab-c: it gets the image from a machine of the cluster and the totals grow.
    page.click("a:text-is('Add machines')")
    page.check("input[name=machines]:not([disabled])")
    page.click("button:text-is('Add')")
    page.wait_for_url(re.compile(rf"/clusters/{gpu_room.pk}/"))
    expect(member_row(page, "lab-c")).to_contain_text("Up", timeout=LIVE * 2)
    expect(member_row(page, "lab-c")).to_contain_text(re.compile("from lab-[ab]"))
    expect(member_row(page, "lab-c")).to_contain_text("198.18.0.13")
    expect(page.locator("#cluster-status")).to_contain_text("3")

    # Delete: a running cluster is stopped first; its row leaves the list by itself.
    page.click("#cluster-header a:text-is('Delete')")
    page.click("button:text('Delete gpu-room')")
    page.wait_for_url(re.compile(r"/clusters/$"))
    expect(page.locator("main table")).not_to_contain_text("gpu-room", timeout=LIVE)
    expect(page.locator("main table")).to_contain_text("No clusters yet")
    wait_for(lambda: not Cluster.objects.exists(), timeout=30, what="gpu-room's record to go")
    assert Machine.objects.filter(membership__isnull=True).count() == 3
