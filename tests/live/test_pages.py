"""The pages: signed in only, Add a machine in two steps, a machine's page."""
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from console.models import Job
from machines.choices import MachineState
from machines.models import Machine
from tests.factories import AcceleratorFactory, JobFactory, MachineFactory, NetworkInterfaceFactory

pytestmark = pytest.mark.django_db

DETAILS = {"step": "details", "name": "gpu-01", "address": "198.18.0.11", "ssh_port": "22", "ssh_user": "root"}


@pytest.mark.parametrize("path", ["/", "/machines/", "/machines/add/", "/machines/{pk}/", "/machines/{pk}/delete/"])
def test_every_page_sends_an_anonymous_visitor_to_the_login_page(client, path):
    path = path.format(pk=MachineFactory().pk)

    response = client.get(path)

    assert response.status_code == 302
    assert response["Location"] == f"/login/?next={path}"


def test_the_login_page_itself_is_open(client):
    response = client.get("/login/")
    assert response.status_code == 200
    assert b"Sign in to the console" in response.content


def test_posting_a_change_anonymously_changes_nothing(client, no_ssh):
    machine = MachineFactory()
    response = client.post(f"/machines/{machine.pk}/delete/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")
    assert Machine.objects.filter(pk=machine.pk).exists()


def test_the_dashboard_and_the_machine_list_show_the_machines(admin_client):
    MachineFactory(name="h100-node-1")
    assert b"Dashboard" in admin_client.get("/").content
    listing = admin_client.get("/machines/").content.decode()
    assert "h100-node-1" in listing
    assert 'id="machine-rows"' in listing


def test_the_machine_list_costs_the_same_queries_for_ten_machines_as_for_two(admin_client):
    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert admin_client.get("/machines/").status_code == 200
        return len(captured)

    for machine in MachineFactory.create_batch(2):
        AcceleratorFactory.create_batch(2, machine=machine)
    two = queries()
    for machine in MachineFactory.create_batch(8):
        AcceleratorFactory.create_batch(2, machine=machine)
    assert queries() == two


# -- Add a machine -------------------------------------------------------------------------------


def test_add_a_machine_shows_the_consoles_public_key(admin_client):
    from machines import remote

    page = admin_client.get("/machines/add/").content.decode()

    assert 'id="console-public-key"' in page
    assert remote.console_public_key() in page
    assert "ssh-ed25519 " in page


def test_posting_bad_details_shows_each_fields_error_and_creates_nothing(admin_client, no_ssh):
    bad = {**DETAILS, "name": "a;rm -rf /", "address": "$(id)", "ssh_user": "-oProxyCommand=x"}

    response = admin_client.post("/machines/add/", bad)

    assert response.status_code == 200
    page = response.content.decode()
    assert page.count('class="field__error"') == 3
    assert "A machine name uses lowercase letters, digits and hyphens" in page
    assert "Enter an IP address" in page
    assert "A user name starts with a lowercase letter" in page
    assert 'name="step" value="details"' in page
    assert not Machine.objects.exists()


@pytest.mark.parametrize("port", ["0", "70000", "-1", "22; id", ""])
def test_posting_a_port_out_of_range_shows_its_error_and_creates_nothing(admin_client, no_ssh, port):
    page = admin_client.post("/machines/add/", {**DETAILS, "ssh_port": port}).content.decode()

    assert page.count('class="field__error"') == 1
    assert 'name="step" value="details"' in page
    assert not Machine.objects.exists()


def test_posting_details_of_a_machine_that_cannot_be_reached_says_so(admin_client, monkeypatch):
    from machines import remote

    def unreachable(address, port):
        raise remote.RemoteError(f"Could not reach {address} port {port}: No route to host.", kind="unreachable")

    monkeypatch.setattr(remote, "scan_host_key", unreachable)

    page = admin_client.post("/machines/add/", DETAILS).content.decode()

    assert "Could not reach 198.18.0.11 port 22: No route to host." in page
    assert 'name="step" value="details"' in page
    assert not Machine.objects.exists()


def test_posting_good_details_shows_the_host_key_to_confirm(admin_client, machine_offers, offered_fingerprint):
    page = admin_client.post("/machines/add/", DETAILS).content.decode()

    assert machine_offers == [("198.18.0.11", 22)]
    assert offered_fingerprint in page
    assert "Is this gpu-01?" in page
    assert 'name="step" value="confirm"' in page
    assert f'name="host_key_fingerprint" value="{offered_fingerprint}"' in page
    assert not Machine.objects.exists()


def test_confirming_the_host_key_adds_the_machine_and_opens_its_page(
    admin_client, machine_offers, offered_fingerprint, enrol_calls
):
    confirm = {**DETAILS, "step": "confirm", "host_key_fingerprint": offered_fingerprint}

    response = admin_client.post("/machines/add/", confirm)

    machine = Machine.objects.get(name="gpu-01")
    assert response.status_code == 302
    assert response["Location"] == f"/machines/{machine.pk}/"
    assert machine.state == MachineState.ENROLLING
    assert machine.host_key_fingerprint == offered_fingerprint
    assert Job.objects.filter(target_id=machine.pk, kind="machine.enrol").exists()
    assert "gpu-01 is being enrolled." in admin_client.get(response["Location"]).content.decode()


def test_confirming_from_htmx_redirects_the_browser_with_a_header(
    admin_client, machine_offers, offered_fingerprint, enrol_calls
):
    confirm = {**DETAILS, "step": "confirm", "host_key_fingerprint": offered_fingerprint}

    response = admin_client.post("/machines/add/", confirm, headers={"HX-Request": "true"})

    assert response.status_code == 200
    assert response["HX-Redirect"] == Machine.objects.get(name="gpu-01").get_absolute_url()


def test_confirming_when_the_machine_now_offers_another_key_says_so_and_adds_nothing(admin_client, machine_offers, enrol_calls):
    from tests.factories import fingerprint_for

    confirm = {**DETAILS, "step": "confirm", "host_key_fingerprint": fingerprint_for("what the page showed earlier")}

    page = admin_client.post("/machines/add/", confirm).content.decode()

    assert not Machine.objects.exists()
    assert enrol_calls == []
    assert "The machine offered the host key" in page


# -- a machine's page ------------------------------------------------------------------------------


def test_a_machines_page_shows_its_live_cards_and_subscribes_to_them(admin_client):
    machine = MachineFactory(name="h100-node-1", facts_at="2026-01-01T00:00:00Z")
    AcceleratorFactory.create_batch(8, machine=machine)
    JobFactory(target_id=machine.pk, title="Enrol h100-node-1")

    page = admin_client.get(f"/machines/{machine.pk}/").content.decode()

    for card in ("machine-header", "machine-hostkey", "machine-facts", "machine-accelerators", "machine-interfaces",
                 "machine-job", "machine-events"):
        assert f'id="{card}"' in page
    assert "8 x H100 80GB" in page
    assert "Enrol h100-node-1" in page
    assert f"topic=machine:{machine.pk}" in page
    assert 'hx-swap-oob="true"' not in page  # only pushes swap out of band


def test_a_machine_waiting_for_its_host_key_shows_the_key_to_trust(admin_client):
    machine = MachineFactory(awaiting_host_key=True)
    page = admin_client.get(f"/machines/{machine.pk}/").content.decode()
    assert "Confirm the host key" in page
    assert machine.offered_host_key_fingerprint in page


def test_an_interface_that_is_down_is_flagged(admin_client):
    machine = MachineFactory()
    NetworkInterfaceFactory(machine=machine, name="ens2f1", state="down")
    page = admin_client.get(f"/machines/{machine.pk}/").content.decode()
    assert '<span class="tag tag--warn">down</span>' in page


def test_an_interface_that_is_up_as_the_agent_reports_it_is_not_flagged(admin_client):
    machine = MachineFactory()
    NetworkInterfaceFactory(machine=machine, name="ens1f0", state="up")
    page = admin_client.get(f"/machines/{machine.pk}/").content.decode()
    assert 'tag--warn">up<' not in page


def test_trusting_the_wrong_key_on_a_machines_page_says_which_key_was_offered(admin_client, enrol_calls):
    machine = MachineFactory(awaiting_host_key=True)
    from tests.factories import fingerprint_for

    response = admin_client.post(
        f"/machines/{machine.pk}/trust-host-key/", {"fingerprint": fingerprint_for("other")}, follow=True
    )

    assert f"The machine offered {machine.offered_host_key_fingerprint}" in response.content.decode()
    machine.refresh_from_db()
    assert machine.state == MachineState.HOST_KEY


def test_deleting_a_machine_from_its_page_returns_to_the_list(admin_client):
    machine = MachineFactory(name="gpu-gone")

    response = admin_client.post(f"/machines/{machine.pk}/delete/", follow=True)

    assert response.redirect_chain[-1][0] == "/machines/"
    assert "gpu-gone was deleted." in response.content.decode()
    assert not Machine.objects.exists()
