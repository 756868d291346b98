"""Finding machines among many in the browser: the Add machines list filters as one types and pages,
and the machines ticked stay ticked; nothing of it sends the page's CSRF token in a URL."""
import re

import pytest
from playwright.sync_api import expect

from tests.builders import build, cluster_of, gpu_machine

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def crowded():
    """A running cluster and 60 machines outside it."""
    cluster = cluster_of([gpu_machine("lab-a", 11)], runtime=build("2.1.0"))
    for host in range(20, 80):
        gpu_machine(f"spare-{host}", host)
    return cluster


def test_add_machines_filters_as_one_types_pages_and_keeps_the_ticked_machines(page, crowded):
    urls = []
    page.on("request", lambda request: urls.append(request.url))
    page.goto(f"/clusters/{crowded.pk}/add/")
    expect(page.locator("#add-form")).to_contain_text("1–50 of 60")
    page.check("input[aria-label='Add spare-20']")

    page.fill("input[name=q]", "spare-7")
    expect(page.locator("#add-form")).to_contain_text("1–10 of 10 found")  # spare-70 .. spare-79, and spare-20 ticked above them
    expect(page.locator("input[aria-label='Add spare-20']")).to_be_checked()
    page.fill("input[name=q]", "")
    expect(page.locator("#add-form")).to_contain_text("Page 1 of 2")
    page.click("nav.pager button:text('Next')")
    expect(page.locator("#add-form")).to_contain_text("Page 2 of 2")
    expect(page.locator("input[aria-label='Add spare-20']")).to_be_checked()

    assert not [url for url in urls if "csrfmiddlewaretoken" in url]
    assert re.search(r"machines=\d+", page.url)
