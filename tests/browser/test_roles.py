"""Roles in Chromium: a Viewer sees every page with every button that changes something greyed out,
saying which role it needs, also after a live update; an Operator runs clusters but cannot enrol
machines; a page left open follows a new role."""
import pytest
from django.contrib.auth import get_user_model
from playwright.sync_api import expect

from console import users
from console.roles import OPERATOR, VIEWER
from machines import services
from machines.choices import MachineState
from tests.browser.conftest import PASSWORD
from tests.builders import build, cluster_of, gpu_machine
from tests.factories import MachineFactory, UserFactory

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def signed_in_as(sign_in):
    """A page signed in as a new user of ``role``."""

    def signed_in(role):
        user = UserFactory(username=role.slug, role=role)
        user.set_password(PASSWORD)
        user.save()
        return sign_in(user.username)

    return signed_in


def expect_greyed_out(page, name: str, why: str) -> None:
    """The button is there, cannot be pressed, and its hover text says why."""
    button = page.get_by_role("button", name=name, exact=True)
    expect(button).to_be_disabled()
    expect(page.locator(".btn-wrap", has=button)).to_have_attribute("title", why)


def test_a_viewer_sees_every_page_and_every_button_that_changes_something_greyed_out_with_the_reason(signed_in_as):
    room = cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)], runtime=build("2.1.0"))
    free = gpu_machine("gpu-c", 13)
    page = signed_in_as(VIEWER)
    expect(page.locator(".sidebar__role")).to_have_text("Viewer")
    expect(page.get_by_role("link", name="Users")).to_have_count(0)

    page.goto("/machines/")
    expect_greyed_out(page, "Add a machine", "Your role is Viewer: adding a machine needs an Administrator.")

    page.goto(f"/machines/{free.pk}/")
    expect(page.locator(".live-dot--on")).to_be_visible()
    expect_greyed_out(page, "Refresh facts", "Your role is Viewer: refreshing a machine's facts needs an Operator.")
    expect_greyed_out(page, "Delete", "Your role is Viewer: deleting a machine needs an Administrator.")
    # A live update renders the header again, for the Viewer's role.
    services.machine_transition(machine=free, to=MachineState.OFFLINE, reason="No heartbeat for 31 s.")
    expect(page.locator("#machine-header .badge")).to_have_text("Offline")
    expect_greyed_out(page, "Refresh facts", "Your role is Viewer: refreshing a machine's facts needs an Operator.")

    page.goto("/clusters/")
    expect_greyed_out(page, "Create a cluster", "Your role is Viewer: creating a cluster needs an Operator.")

    page.goto(f"/clusters/{room.pk}/")
    expect_greyed_out(page, "Check now", "Your role is Viewer: checking a cluster now needs an Operator.")
    expect_greyed_out(page, "Stop", "Your role is Viewer: stopping a cluster needs an Operator.")
    expect_greyed_out(page, "Add machines", "Your role is Viewer: adding machines to a cluster needs an Operator.")
    expect_greyed_out(page, "Delete", "Your role is Viewer: deleting a cluster needs an Operator.")

    other = gpu_machine("gpu-d", 14)  # gpu-c is offline now: the wizard would not go past it
    page.goto(f"/clusters/new/?name=new-room&machines={other.pk}&step=network")
    expect_greyed_out(page, "Create cluster", "Your role is Viewer: creating a cluster needs an Operator.")


def test_an_operator_runs_clusters_but_cannot_enrol_machines(signed_in_as):
    room = cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)], runtime=build("2.1.0"))
    page = signed_in_as(OPERATOR)

    page.goto(f"/clusters/{room.pk}/")
    page.get_by_role("button", name="Stop", exact=True).click()
    expect(page.get_by_role("dialog")).to_contain_text(f"Stop {room.name}?")

    page.goto("/machines/")
    expect_greyed_out(page, "Add a machine", "Your role is Operator: adding a machine needs an Administrator.")


def test_a_page_left_open_follows_a_new_role_its_live_cards_come_again_rendered_for_it(signed_in_as):
    machine = gpu_machine("gpu-a", 11)
    page = signed_in_as(VIEWER)
    page.goto(f"/machines/{machine.pk}/")
    expect(page.locator(".live-dot--on")).to_be_visible()
    expect_greyed_out(page, "Refresh facts", "Your role is Viewer: refreshing a machine's facts needs an Operator.")

    User = get_user_model()
    users.user_role_change(user=User.objects.get(username="viewer"), role=OPERATOR, by=User.objects.get(username="admin"))

    expect(page.get_by_role("button", name="Refresh facts", exact=True)).to_be_enabled()
    expect(page.locator(".live-dot--on")).to_have_text("Live")


def test_a_machines_buttons_still_post_after_a_live_update_has_rendered_them_again(page):
    """Live cards are rendered without a request, so without a CSRF token: their buttons submit a form
    outside them that holds one."""
    machine = MachineFactory(awaiting_host_key=True, name="gpu-new")
    page.goto(f"/machines/{machine.pk}/")
    expect(page.locator(".live-dot--on")).to_be_visible()
    page.evaluate("document.querySelector('#machine-hostkey').dataset.before = 'push'")

    services.machine_changed(machine)
    expect(page.locator("#machine-hostkey[data-before]")).to_have_count(0)  # swapped for the pushed card
    page.get_by_role("button", name="Trust and enrol").click()

    expect(page.locator(".messages")).to_contain_text("The host key of gpu-new is trusted; enrolling it.")
