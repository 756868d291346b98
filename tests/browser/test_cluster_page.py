"""A cluster's whole life in Chromium, on the lab, with a real worker and beat: the Create a cluster
wizard (pick, test the networks, create, the bars fill), then its page: a model deployed through the
plan, scaled and deleted; a machine added; stop, change the network and delete from the buttons, every
change arriving live.

One test, because each part needs the cluster the part before it left: a cluster started here costs
the suite some 25 s, and the wizard's start is already one. The machines run the lab's fast `process`
runtime: what this test asserts is the pages. The same life on Podman, with the repairs the console
makes by itself (Ray killed, links cut, the head powered off) and a Start after Stop, is
tests/integration/test_cluster_life_lab.py's; the repairs' live rows use the same push as the
added machine's here."""
import re

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import expect

from clusters.models import Cluster
from machines.models import Machine
from tests.harness import LAB_CONSOLE_ADDRESS, enrol, images_import, leave_nothing_running, phase, ray_runs_on, wait_for

pytestmark = [pytest.mark.browser, pytest.mark.lab, pytest.mark.django_db(transaction=True)]

LIVE = 60000  # ms: what a page waits for a push


@pytest.fixture(scope="module")
def console_options():
    # The probe: the test reads the results, not the rates. The drain's grace: no gateway runs here to say its
    # requests to the old copy are done, so the drain would wait all of it (10 s).
    return {"beat": True, "env": {"FADEN_HEALTH_INTERVAL": "5", "FADEN_HEALTH_LOOK_AGAIN": "3",
                                  "FADEN_PROBE_SECONDS": "1", "FADEN_DRAIN_GRACE": "1"}}


@pytest.fixture
def machines(console, settings, lab):
    """lab-a, lab-b and lab-c (on the `process` runtime) enrolled here, with the lab's runtime image builds
    imported; their heartbeats go to the console's processes, whose beat marks a silent machine Offline.
    Nothing left running after."""
    settings.FADEN_CONSOLE_URL = f"http://{LAB_CONSOLE_ADDRESS}:{console.rsplit(':', 1)[1]}"
    images_import(lab)
    yield enrol(lab, "lab-a", "lab-b", "lab-c")
    lab.heal()
    leave_nothing_running(Machine.objects.all())


def picked(machines) -> re.Pattern:
    """The wizard's URL once it holds these machines (and maybe others)."""
    return re.compile("".join(rf"(?=.*machines=(?:[^&]*(?:,|%2C))?{m.pk}(?:&|,|%2C|$))" for m in machines))


def member_row(page, name: str):
    return page.locator("#cluster-members tbody tr").filter(has=page.get_by_role("link", name=name, exact=True))


def dialog_open(page, button: str, dialog: str) -> None:
    """Click ``button`` until ``dialog`` shows. A live push can swap the header between the mouse's down and up
    (seen once in a whole-suite run): the browser then fires no click, as it would not for a person either,
    who clicks again."""
    for _ in range(3):
        page.click(button)
        try:
            expect(page.locator(dialog)).to_be_visible(timeout=3000)
            return
        except AssertionError:
            continue
    expect(page.locator(dialog)).to_be_visible(timeout=1)


def test_a_cluster_from_the_wizard_to_its_deletion(page, machines):
    with phase("the wizard creates gpu-room, which starts"):
        gpu_room = wizard_creates(page, machines[:2])  # lab-c stays free, to be added later
    with phase("a model deployed, scaled and deleted"):
        deploy_scale_and_delete_a_model(page, gpu_room)
    with phase("a machine added; stop, move and delete"):
        buttons_add_stop_move_and_delete(page, gpu_room)


def wizard_creates(page, pair) -> Cluster:
    page.goto("/clusters/new/")
    page.fill("#cluster-name", "gpu-room")
    page.click("#wizard button[type=submit]")
    for count, machine in enumerate(pair, start=1):
        expect(page.locator(f"input[name=machines][value='{machine.pk}']")).to_be_enabled()
        page.check(f"input[name=machines][value='{machine.pk}']")
        # Each tick's answer is in (its URL pushed, with the machines so far) before the next: a tick
        # replaced in flight pushes nothing, and the back button below needs an earlier selection to go to.
        expect(page).to_have_url(picked(pair[:count]))
    expect(page.locator("#wizard")).to_contain_text("runs NVIDIA x86_64 Runtime 2.x")
    page.go_back()  # the back button shows an earlier selection from the URL, not an empty form
    page.wait_for_load_state("networkidle")  # htmx fetches the earlier step from its URL
    expect(page.locator(".wizard-steps .is-current")).to_have_text("Pick machines")
    expect(page.locator("input[name=machines]:checked").first).to_be_visible()
    for machine in pair:
        page.check(f"input[name=machines][value='{machine.pk}']")
    # Ticks in quick succession: each request carries the whole form and replaces the one in flight.
    expect(page.locator("input[name=machines]:checked")).to_have_count(2)
    expect(page.locator("#wizard")).to_contain_text("Which machine leads the cluster")
    page.click("#wizard button[value=network]")
    expect(page.locator("#wizard")).to_contain_text("The networks both machines share")

    # The test starts by itself; the results stream in and fabric is suggested.
    expect(page.locator("#wizard-networks")).to_contain_text("Network test succeeded", timeout=90000)
    suggested = page.locator("#wizard-networks tr", has=page.locator(".tag", has_text="suggested"))
    expect(suggested).to_contain_text("198.18.1.0/24")
    expect(suggested).to_contain_text("Mbit/s")
    expect(page.locator("#wizard-networks")).to_contain_text("carries management traffic")
    expect(page.locator("#wizard-networks")).to_contain_text("VPN interface")
    page.click("button:text('Create cluster')")

    try:
        page.wait_for_url(re.compile(r"/clusters/\d+/$"))
    except PlaywrightTimeout as exc:  # seen only in whole-suite runs: say where the browser stood and what it showed
        raise AssertionError(f"Create cluster did not lead to the cluster's page: at {page.url}\n"
                             f"{page.locator('main').inner_text()[:2000]}") from exc
    expect(page.locator("#cluster-header .badge")).to_have_text(re.compile("Starting|Running"))
    expect(page.locator("#cluster-members .bar").first).to_be_visible(timeout=30000)
    expect(page.locator("#cluster-members")).to_contain_text("from the server")
    expect(page.locator("#cluster-header .badge")).to_have_text("Running", timeout=180000)
    expect(page.locator("#cluster-status")).to_contain_text("16")
    expect(page.locator("#cluster-members .image-percent").first).to_have_text("100%")
    # A new cluster starts encrypted: the encryption card reads so on both lines, with its certificates' expiry.
    card = page.locator("#cluster-encryption")
    expect(card).to_contain_text("Ray token on")
    expect(card).to_contain_text("TLS on")
    expect(card).to_contain_text("Mutual TLS on")
    expect(card).to_contain_text("Valid until")
    expect(card).not_to_contain_text("not encrypted")
    assert all(ray_runs_on(machine) for machine in pair)
    return Cluster.objects.get(name="gpu-room")


def buttons_add_stop_move_and_delete(page, gpu_room) -> None:
    page.goto(f"/clusters/{gpu_room.pk}/")
    header = page.locator("#cluster-header")
    expect(header.locator(".badge").first).to_have_text("Running")
    wiring = page.locator("#cluster-members")
    expect(wiring.locator("svg.wire")).to_contain_text("lab-a")
    expect(wiring.locator("svg.wire")).to_contain_text("lab-b")

    # Add lab-c: it gets the image from a machine of the cluster and the totals grow, live.
    page.click("a:text-is('Add machines')")
    page.check("input[name=machines]:not([disabled])")
    page.click("button:text-is('Add')")
    page.wait_for_url(re.compile(rf"/clusters/{gpu_room.pk}/"))
    expect(member_row(page, "lab-c")).to_contain_text("Up", timeout=LIVE * 2)
    expect(member_row(page, "lab-c")).to_contain_text(re.compile("from lab-[ab]"))
    expect(member_row(page, "lab-c")).to_contain_text("198.18.1.13")
    expect(page.locator("#cluster-status")).to_contain_text("3")

    # Stop, through its confirmation: it arrives live.
    dialog_open(page, "#cluster-header button:text-is('Stop')", "#stop-dialog")
    page.click("#stop-dialog button:text('Stop the cluster')")
    expect(header.locator(".badge").first).to_have_text("Stopped", timeout=LIVE)

    # Move it to the management network while it is stopped: nothing restarts, and each machine is at
    # its address on it (a Start would bring it up there).
    page.goto(f"/clusters/{gpu_room.pk}/network/")
    page.check("input[name=network][value='198.18.0.0/24']")
    page.click("button:text-is('Apply')")
    page.click("button:text-is('Change the network')")
    page.wait_for_url(re.compile(rf"/clusters/{gpu_room.pk}/$"))
    expect(header).to_contain_text("198.18.0.0/24")
    expect(header.locator(".badge").first).to_have_text("Stopped")
    expect(member_row(page, "lab-b")).to_contain_text("198.18.0.12")

    # Delete: its row leaves the list by itself.
    page.click("#cluster-header a:text-is('Delete')")
    page.click("button:text('Delete gpu-room')")
    page.wait_for_url(re.compile(r"/clusters/$"))
    expect(page.locator("main table")).not_to_contain_text("gpu-room", timeout=LIVE)
    expect(page.locator("main table")).to_contain_text("No clusters yet")
    wait_for(lambda: not Cluster.objects.exists(), timeout=30, what="gpu-room's record to go")
    assert Machine.objects.filter(membership__isnull=True).count() == 3


def deploy_scale_and_delete_a_model(page, gpu_room) -> None:
    """Deploy a model from the cluster's page through the plan, watch its copies come to Serving, scale
    it, delete it: every change arrives live."""
    model = tiny_model()
    page.goto(f"/clusters/{gpu_room.pk}/")
    page.click("#cluster-header a:text-is('Deploy a model')")
    page.select_option("#deploy-model", str(model.pk))
    expect(page.locator("#deploy-kind")).to_contain_text("H100 80GB · x86_64")
    expect(page.locator("#deploy-name")).to_have_value("tiny-chat")
    page.click("#plan-button")
    plan = page.locator("#deploy-plan")
    expect(plan).to_contain_text("1 of 1 copy placed")
    expect(plan).to_contain_text(re.compile(r"lab-[ab] GPU 0 \(a quarter\) · port 8100"))
    page.click("#deploy-plan button:text-is('Deploy')")
    page.wait_for_url(re.compile(r"/deployments/\d+/$"))
    copies = page.locator("#deployment-copies")
    expect(copies).to_contain_text("Serving", timeout=LIVE)
    expect(page.locator("#deployment-header h1 .badge")).to_have_text("Serving")

    page.fill("#scale-copies", "2")
    page.click("#deployment-scale button:text-is('Scale')")
    expect(copies.locator("tbody tr")).to_have_count(2)
    expect(copies.locator(".badge:text-is('Serving')")).to_have_count(2, timeout=LIVE)
    with phase("a serving machine drained, then its drain stopped"):
        drain_a_serving_machine_and_stop_the_drain(page, gpu_room)

    page.goto(f"/clusters/{gpu_room.pk}/")
    expect(page.locator("#cluster-models")).to_contain_text("2 of 2 serving")
    page.locator("#cluster-models").get_by_role("link", name="tiny-chat", exact=True).click()
    dialog_open(page, "#deployment-header button:text-is('Delete')", "#delete-dialog")
    page.click("#delete-dialog button:text('Delete the deployment')")
    expect(page.locator("#deployment-header")).to_contain_text("This deployment was deleted", timeout=LIVE)
    page.goto(f"/clusters/{gpu_room.pk}/")
    expect(page.locator("#cluster-models")).to_contain_text("No models are deployed on this cluster yet.")


def drain_a_serving_machine_and_stop_the_drain(page, gpu_room) -> None:
    """Select the worker that serves a copy, read its drain plan (the copy moves to the head, which holds the
    model's files), Drain: its state comes live to the cluster's page (Drained), the copies keep serving;
    Stop drain takes the machine out of Ray and back in, and the drain's state goes."""
    members = gpu_room.members.select_related("machine")
    head, worker = (next(m.machine for m in members if (m.role == "head") == lead) for lead in (True, False))
    page.goto(f"/clusters/{gpu_room.pk}/?machine={worker.pk}")
    page.locator(f"#machine-panel-{worker.pk}").get_by_role("link", name="Drain", exact=True).click()
    card = page.locator("#drain-plan")
    expect(card).to_contain_text(re.compile(r"tiny-chat #\d"))
    expect(card).to_contain_text(re.compile(rf"Moves to {head.name} \(GPU \d, a quarter · port 81\d\d\)"))
    card.locator("button:text-is('Drain')").click()
    page.wait_for_url(re.compile(rf"/clusters/{gpu_room.pk}/$"))
    with phase("Drain to Drained"):
        expect(member_row(page, worker.name)).to_contain_text("Drained", timeout=LIVE)
    page.goto(f"/clusters/{gpu_room.pk}/?machine={worker.pk}")
    page.locator(f"#machine-panel-{worker.pk}").locator("button:text-is('Stop drain')").click()
    page.wait_for_url(re.compile(rf"/clusters/{gpu_room.pk}/$"))
    row = member_row(page, worker.name)
    expect(row).not_to_contain_text(re.compile("Drained|Stopping the drain"), timeout=LIVE)
    expect(row).to_contain_text("Up", timeout=LIVE)


def tiny_model():
    """The lab hub's small model, imported into the server's store from the hub's files on this host."""
    from deployments.store import downloads
    from lab import hub_models

    store = hub_models.ModelStore(hub_models.default_cache_dir())
    plan = hub_models.MODELS["fadenstack-lab/tiny-chat"]
    store.files(plan)
    return downloads.model_import(directory=store.model_dir(plan) / "files", repo=plan.repo_id)
