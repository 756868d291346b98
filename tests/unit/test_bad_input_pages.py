"""Bad input to the pages and the admin: a page in the console's shell that says what was wrong (400,
404, 413), never a traceback, and nothing stored; the admin checks what the services check and
leaves alone what only the console writes."""
import re

import pytest
from django.test import Client

from clusters.models import Cluster, ClusterMember
from console.models import Job
from machines.models import Machine
from tests.builders import NETWORK, build, cluster_of, gpu_machine

pytestmark = pytest.mark.django_db

BEYOND_BIGINT = str(2**63)
LONG_NUMBER = "9" * 5000


@pytest.fixture
def machines():
    return [gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12), gpu_machine("gpu-c", 13)]


@pytest.fixture
def room(machines):
    return cluster_of(machines[:2], runtime=build("2.1.0"))


def counts() -> list[int]:
    return [model.objects.count() for model in (Machine, Cluster, ClusterMember, Job)]


def error_page(response, status: int = 400) -> str:
    """The sentence an error page in the shell shows."""
    assert response.status_code == status
    html = response.content.decode()
    assert 'class="sidebar"' in html and "Traceback" not in html
    return re.search(r"data-error-message>([^<]*)<", html).group(1)


# -- query strings -------------------------------------------------------------------------------------


@pytest.mark.parametrize("query", [
    "step=machines&machines=١٢", "step=machines&machines=²", f"step=machines&machines={BEYOND_BIGINT}",
    f"step=machines&machines={LONG_NUMBER}", "step=machines&machines=3,x", "step=network&name=gpu-room&head=٣",
    "step=network&name=gpu-room&probe=" + LONG_NUMBER, "step=machines&page=٢", "step=machines&page=1&page=2",
])
def test_the_wizard_refuses_ids_and_numbers_that_are_not_digits_or_too_large_with_a_400_page(admin_client, machines, query):
    message = error_page(admin_client.get(f"/clusters/new/?{query}"))
    assert re.match(r"(machines|head|probe|page): Give (a whole number|one value)", message), message


def test_a_number_quoted_in_a_refusal_is_cut_short(admin_client):
    message = error_page(admin_client.get(f"/clusters/new/?step=machines&machines={LONG_NUMBER}"))
    assert "(5,000 characters)" in message and len(message) < 200


@pytest.mark.parametrize("url", ["/machines/?page=٣", f"/machines/?page={LONG_NUMBER}", "/machines/?page=-1"])
def test_the_machines_list_refuses_a_page_that_is_not_a_number(admin_client, url):
    assert error_page(admin_client.get(url)).startswith("page: Give a whole number")


def test_the_machines_list_shows_its_last_page_for_a_page_past_it(admin_client, machines):
    assert admin_client.get(f"/machines/?page={BEYOND_BIGINT[:-1]}").status_code == 200


@pytest.mark.parametrize("query", ["?machine=²", f"?machine={BEYOND_BIGINT}"])
def test_a_clusters_page_refuses_a_selected_machine_that_is_not_an_id(admin_client, room, query):
    assert error_page(admin_client.get(f"/clusters/{room.pk}/{query}")).startswith("machine: Give")


def test_add_machines_refuses_ids_that_are_not_ids(admin_client, room, machines):
    assert error_page(admin_client.get(f"/clusters/{room.pk}/add/?machines=١")).startswith("machines: Give")
    assert error_page(admin_client.get(f"/clusters/{room.pk}/network/?probe={LONG_NUMBER}")).startswith("probe: Give")


# -- forms ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["١٢", BEYOND_BIGINT, LONG_NUMBER, "3;4"])
def test_creating_a_cluster_with_a_bad_machine_id_is_a_400_page_and_stores_nothing(admin_client, machines, bad):
    before = counts()
    form = {"name": "gpu-room", "machines": f"{machines[0].pk},{bad}", "head": str(machines[0].pk), "network": NETWORK}
    assert error_page(admin_client.post("/clusters/new/create/", form)).startswith("machines: Give")
    assert counts() == before


def test_adding_a_machine_whose_id_is_too_large_is_a_400_page_and_adds_nobody(admin_client, room):
    before = counts()
    assert error_page(admin_client.post(f"/clusters/{room.pk}/add/", {"machines": BEYOND_BIGINT})).startswith("machines: Give")
    assert counts() == before


@pytest.mark.parametrize("port", ["٢٢", "²", LONG_NUMBER, "70000", "22.5"])
def test_add_a_machine_refuses_a_port_that_is_not_a_number_from_1_to_65535_before_any_ssh(admin_client, no_ssh, port):
    form = {"name": "gpu-01", "address": "198.18.0.11", "ssh_port": port, "ssh_user": "root"}
    response = admin_client.post("/machines/add/", form)

    assert response.status_code == 200
    assert "Give a whole number from 1 to 65,535 in the digits 0-9" in response.content.decode()
    assert not Machine.objects.exists()


def test_a_network_test_of_machines_that_do_not_exist_names_them_and_starts_nothing(admin_client, machines):
    before = counts()
    form = {"name": "gpu-room", "machines": f"{machines[0].pk},987654", "head": str(machines[0].pk)}
    response = admin_client.post("/clusters/new/probe/", form, follow=True)
    assert "No machine has the id 987654." in response.content.decode()
    assert counts() == before


def test_a_form_larger_than_the_console_reads_is_a_413_page(admin_client, machines, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    before = counts()
    response = admin_client.post("/clusters/new/create/", {"name": "gpu-room", "network": "x" * 2000})
    assert error_page(response, 413) == "The request body is larger than the 1,000 bytes the console accepts."
    assert counts() == before


# -- paths ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("url", [f"/machines/{BEYOND_BIGINT}/", f"/clusters/{LONG_NUMBER[:40]}/", "/clusters/١/",
                                 f"/clusters/1/machines/{BEYOND_BIGINT}/remove/", f"/users/{BEYOND_BIGINT}/role/"])
def test_an_id_in_a_path_no_object_can_have_is_a_404_page(admin_client, url):
    assert error_page(admin_client.get(url), 404).startswith("There is no such page: ")


@pytest.mark.parametrize("url", ["/users/?page=٣", f"/users/?page={LONG_NUMBER}", "/audit/?page=1&page=2"])
def test_the_users_page_and_the_audit_trail_refuse_a_page_that_is_not_a_number(admin_client, url):
    assert error_page(admin_client.get(url)).startswith("page: Give")


def test_an_unknown_machine_is_a_404_page_in_the_shell(admin_client):
    assert error_page(admin_client.get("/machines/987654/"), 404) == "No Machine matches the given query."


def test_a_crash_on_a_page_is_a_plain_500_page_without_a_traceback(admin_user, monkeypatch):
    from machines import views

    monkeypatch.setattr(views, "machine_summary", lambda: 1 / 0)
    client = Client(raise_request_exception=False)
    client.force_login(admin_user)
    response = client.get("/machines/")
    assert response.status_code == 500
    assert b"Something went wrong on the console" in response.content and b"ZeroDivisionError" not in response.content


# -- the admin -----------------------------------------------------------------------------------------


def admin_form(client, url: str, **changes) -> dict:
    """The admin change form's fields as the page gives them (the inlines' management forms too), changed."""
    context = client.get(url).context
    data = {}
    for field in context["adminform"].form:
        value = field.value()
        if value is not None:
            data[field.html_name] = value
    for inline in context["inline_admin_formsets"]:
        for field in inline.formset.management_form:
            data[field.html_name] = field.value()
    return data | changes


def test_the_admin_refuses_a_cluster_name_the_wizard_would_refuse(admin_client, room):
    url = f"/admin/clusters/cluster/{room.pk}/change/"
    response = admin_client.post(url, admin_form(admin_client, url, name="Gpu Room!"))

    assert response.status_code == 200
    assert "A cluster name uses only lowercase letters, digits and hyphens (like gpu-room)." in response.content.decode()
    assert Cluster.objects.get(pk=room.pk).name == "gpu-room"


def test_the_admin_refuses_a_name_another_cluster_has_with_the_wizards_sentence(admin_client, room, machines):
    cluster_of(machines[2:], name="spare-room")
    url = f"/admin/clusters/cluster/{room.pk}/change/"
    response = admin_client.post(url, admin_form(admin_client, url, name="spare-room"))
    assert "There is already a cluster named spare-room; pick another name." in response.content.decode()


def test_the_admin_renames_a_cluster_under_the_rules(admin_client, room):
    url = f"/admin/clusters/cluster/{room.pk}/change/"
    assert admin_client.post(url, admin_form(admin_client, url, name="gpu-hall")).status_code == 302
    assert Cluster.objects.get(pk=room.pk).name == "gpu-hall"


def test_the_admin_leaves_a_clusters_network_and_members_to_the_console(admin_client, room):
    url = f"/admin/clusters/cluster/{room.pk}/change/"
    members = list(ClusterMember.objects.filter(cluster=room).values())
    admin_client.post(url, admin_form(admin_client, url, network="not a subnet", state="stopped",
                                      **{"members-0-address": "x", "members-0-role": "worker"}))

    room.refresh_from_db()
    assert (room.network, room.state) == (NETWORK, "running")
    assert list(ClusterMember.objects.filter(cluster=room).values()) == members
    assert admin_client.get("/admin/clusters/cluster/add/").status_code == 403


def test_the_admin_leaves_a_machines_python_and_facts_to_the_console(admin_client, machines):
    machine = machines[0]
    url = f"/admin/machines/machine/{machine.pk}/change/"
    response = admin_client.post(url, admin_form(admin_client, url, python_path="/tmp/x; rm -rf /", state="failed"))

    assert response.status_code == 302
    machine.refresh_from_db()
    assert (machine.python_path, machine.state) == ("", "healthy")


def test_the_admin_refuses_a_machine_address_add_a_machine_would_refuse(admin_client, machines):
    machine = machines[0]
    url = f"/admin/machines/machine/{machine.pk}/change/"
    response = admin_client.post(url, admin_form(admin_client, url, address="fe80::1%$(id)"))

    assert "Enter an IP address" in response.content.decode()
    assert Machine.objects.get(pk=machine.pk).address == machine.address


@pytest.mark.parametrize("model", ["machines/accelerator", "machines/networkinterface", "machines/machineevent",
                                   "clusters/clustermember", "console/job"])
def test_rows_only_the_console_writes_cannot_be_added_in_the_admin(admin_client, model):
    assert admin_client.get(f"/admin/{model}/add/").status_code == 403
