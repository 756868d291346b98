"""Pages for each role: every role reads every page; a Viewer finds nothing there it may press, an
Operator runs clusters but cannot enrol machines; an account without a role reads nothing; the
Django admin is the Administrators'."""
from html import unescape
from html.parser import HTMLParser

import pytest
from django.test import Client
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from clusters.choices import ClusterState
from console import roles
from console.roles import ADMINISTRATOR, OPERATOR, VIEWER
from deployments.gateway_keys import gateway_key_create
from tests.builders import build, cluster_of, gpu_machine
from tests.factories import NO_ROLE, MachineFactory, UserFactory

pytestmark = pytest.mark.django_db


class Pressable(HTMLParser):
    """What a person could press on a page that changes something: an enabled button that submits a
    POST form (other than Log out), an enabled button that opens a confirmation dialog, and a
    button-styled link to an action's own page. Buttons inside a <dialog> open only through one."""

    ACTION_PAGES = ("/add/", "/delete/", "/runtime/switch/", "/clusters/new/", "/network/")

    def __init__(self, html: str):
        super().__init__()
        self.forms: dict[str, dict] = {}
        self.open_forms: list[dict] = []
        self.disabled_fieldsets = 0
        self.in_dialog = 0
        self.buttons: list[tuple[dict, dict | None, bool]] = []  # (attributes, form, disabled)
        self.links: list[str] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "form":
            form = {"method": (a.get("method") or "get").lower(), "action": a.get("action") or ""}
            self.open_forms.append(form)
            if a.get("id"):
                self.forms[a["id"]] = form
        elif tag == "fieldset":
            self.disabled_fieldsets += 1 if "disabled" in a else 0
            self.open_forms.append({"fieldset": "disabled" in a})
        elif tag == "dialog":
            self.in_dialog += 1
        elif tag == "button" and not self.in_dialog:
            form = next((f for f in reversed(self.open_forms) if "method" in f), None)
            self.buttons.append((a, form, "disabled" in a or self.disabled_fieldsets > 0))
        elif tag == "a" and "btn" in (a.get("class") or "").split() and any(p in (a.get("href") or "") for p in self.ACTION_PAGES):
            self.links.append(a["href"])

    def handle_endtag(self, tag):
        if tag in ("form", "fieldset") and self.open_forms:
            closed = self.open_forms.pop()
            self.disabled_fieldsets -= 1 if closed.get("fieldset") else 0
        elif tag == "dialog":
            self.in_dialog -= 1

    def enabled(self) -> list[str]:
        found = list(self.links)
        for a, form, disabled in self.buttons:
            if disabled:
                continue
            if "data-dialog-open" in a:
                found.append(f"dialog {a['data-dialog-open']}")
                continue
            if a.get("type") == "button":
                continue
            form = self.forms.get(a["form"]) if a.get("form") else form
            action = a.get("formaction") or (form or {}).get("action", "")
            if form and form["method"] == "post" and not action.endswith("/logout/"):
                found.append(action)
        return found


@pytest.fixture
def world(machine_offers):
    """Every kind of page with something to press: a running and a stopped cluster with a newer build
    on offer, a free machine, one whose host key waits, and the wizard's network step."""
    older = build("2.1.0")
    build("2.2.0")
    running = cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)], runtime=older)
    stopped = cluster_of([gpu_machine("gpu-d", 14), gpu_machine("gpu-e", 15)], runtime=older, name="parked",
                         state=ClusterState.STOPPED)
    free, spare = gpu_machine("gpu-c", 13), gpu_machine("gpu-g", 17)
    gateway_key_create(name="ops")  # a key to revoke
    awaiting = MachineFactory(awaiting_host_key=True)
    d = stopped.members.order_by("machine__name").first().machine_id
    wizard = f"/clusters/new/?name=new-room&machines={free.pk},{spare.pk}"
    return {
        "dashboard": "/",
        "machines": "/machines/",
        "a machine": f"/machines/{free.pk}/",
        "a machine whose key waits": f"/machines/{awaiting.pk}/",
        "add a machine": "/machines/add/",
        "delete a machine": f"/machines/{spare.pk}/delete/",
        "clusters": "/clusters/",
        "a running cluster": f"/clusters/{running.pk}/",
        "a stopped cluster, a machine selected": f"/clusters/{stopped.pk}/?machine={d}",
        "the wizard's machines": f"{wizard}&step=machines",
        "the wizard's network": f"{wizard}&step=network&head={free.pk}",
        "add machines": f"/clusters/{running.pk}/add/",
        "change the network": f"/clusters/{stopped.pk}/network/",
        "switch the runtime": f"/clusters/{stopped.pk}/runtime/switch/",
        "delete a cluster": f"/clusters/{stopped.pk}/delete/",
        "deployments": "/deployments/",
        "the gateway": "/gateway/",
    }


def signed_in(role) -> Client:
    client = Client()
    client.force_login(UserFactory(username=f"as-{role or 'nobody'}".lower(), role=role or NO_ROLE))
    return client


def pressable(client, url) -> list[str]:
    response = client.get(url)
    assert response.status_code == 200, url
    return Pressable(response.content.decode()).enabled()


def test_a_viewer_reads_every_page_and_finds_nothing_on_them_that_changes_anything(world):
    viewer = signed_in(VIEWER)

    assert {name: pressable(viewer, url) for name, url in world.items()} == {name: [] for name in world}


def test_an_administrator_finds_the_same_pages_full_of_buttons(world):
    """The other side of the Viewer's test: its checker does find what there is to press."""
    administrator = signed_in(ADMINISTRATOR)

    found = {name: pressable(administrator, url) for name, url in world.items()}

    assert all(found[name] for name in ("machines", "a machine", "a machine whose key waits", "add a machine",
                                        "clusters", "a running cluster", "the wizard's network", "switch the runtime",
                                        "the gateway"))


def test_an_operator_runs_clusters_but_cannot_enrol_machines(world):
    operator = signed_in(OPERATOR)

    assert "dialog stop-dialog" in pressable(operator, world["a running cluster"])
    assert any(url.endswith("/refresh/") for url in pressable(operator, world["a machine"]))
    assert not any(url.endswith("/delete/") for url in pressable(operator, world["a machine"]))
    assert pressable(operator, world["a machine whose key waits"]) == []
    assert pressable(operator, world["add a machine"]) == []
    assert pressable(operator, world["machines"]) == []
    assert "/clusters/new/" in pressable(operator, world["clusters"])


@pytest.mark.parametrize(("page", "sentence"), [
    ("machines", "Your role is Viewer: adding a machine needs an Administrator."),
    ("a machine", "Your role is Viewer: refreshing a machine&#x27;s facts needs an Operator."),
    ("a machine whose key waits", "Your role is Viewer: trusting a host key needs an Administrator."),
    ("add a machine", "Your role is Viewer: adding a machine needs an Administrator."),
    ("clusters", "Your role is Viewer: creating a cluster needs an Operator."),
    ("a running cluster", "Your role is Viewer: stopping a cluster needs an Operator."),
    ("a stopped cluster, a machine selected", "Your role is Viewer: removing a machine from a cluster needs an Operator."),
    ("the wizard's network", "Your role is Viewer: testing networks between machines needs an Operator."),
    ("add machines", "Your role is Viewer: adding machines to a cluster needs an Operator."),
])
def test_a_viewers_greyed_out_buttons_say_which_role_they_need(world, page, sentence):
    assert sentence in signed_in(VIEWER).get(world[page]).content.decode()


def test_an_account_without_a_role_is_told_so_on_every_page_and_can_still_sign_out(world):
    nobody = signed_in(None)

    for url in world.values():
        response = nobody.get(url)
        assert response.status_code == 403, url
        assert roles.NO_ROLE in unescape(response.content.decode())
    assert nobody.post("/logout/").status_code == 302


def test_the_side_bar_shows_the_users_role_and_the_users_page_and_admin_to_administrators_only():
    viewer_page = signed_in(VIEWER).get("/").content.decode()
    admin_page = signed_in(ADMINISTRATOR).get("/").content.decode()

    assert 'title="Your role">Viewer<' in viewer_page and 'href="/users/"' not in viewer_page and 'href="/admin/"' not in viewer_page
    assert 'title="Your role">Administrator<' in admin_page and 'href="/users/"' in admin_page and 'href="/admin/"' in admin_page


# -- the API reads --------------------------------------------------------------------------------------


@pytest.mark.parametrize("role", [VIEWER, OPERATOR, ADMINISTRATOR], ids=str)
@pytest.mark.parametrize("url", ["/api/machines/", "/api/clusters/", "/api/schema/"])
def test_every_role_reads_the_api(role, url):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=UserFactory(role=role)).key}")
    assert client.get(url).status_code == 200


def test_an_account_without_a_role_reads_nothing_of_the_api_and_is_told_why():
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=UserFactory(role=NO_ROLE)).key}")

    response = client.get("/api/machines/")

    assert response.status_code == 403
    assert response.json() == {"message": roles.NO_ROLE}


# -- the Django admin -------------------------------------------------------------------------------------


@pytest.mark.parametrize("role", [VIEWER, OPERATOR], ids=str)
def test_the_admin_is_refused_below_administrator_with_the_sentence_and_changes_nothing(role):
    machine = MachineFactory(name="gpu-a")
    client = signed_in(role)

    looked = client.get("/admin/", follow=True)
    changed = client.post(f"/admin/machines/machine/{machine.pk}/change/", {"name": "renamed", "address": machine.address,
                                                                             "ssh_port": 22, "ssh_user": "root"}, follow=True)

    assert looked.status_code == changed.status_code == 403
    assert f"Your role is {role}: using the Django admin needs an Administrator." in unescape(looked.content.decode())
    machine.refresh_from_db()
    assert machine.name == "gpu-a"


def test_an_administrator_by_group_uses_the_admin_with_every_model():
    client = signed_in(ADMINISTRATOR)

    index = client.get("/admin/")

    assert index.status_code == 200
    for model in ("machines/machine", "clusters/cluster", "auth/user", "auth/group", "console/job"):
        assert f'href="/admin/{model}/"' in index.content.decode()
