"""The page shell in Chromium: the side bar of a page longer than the window."""
import pytest
from playwright.sync_api import expect

from tests.factories import MachineFactory

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

GEOMETRY = """() => {
  const bar = document.querySelector('.sidebar').getBoundingClientRect();
  const held = document.querySelector('.sidebar__inner').getBoundingClientRect();
  return {barTop: bar.top + scrollY, barBottom: bar.bottom + scrollY, heldTop: held.top, heldBottom: held.bottom,
          page: document.documentElement.scrollHeight, window: innerHeight};
}"""


def test_the_side_bar_reaches_the_bottom_of_a_page_longer_than_the_window(page):
    MachineFactory.create_batch(60)
    page.goto("/machines/")
    assert page.evaluate(GEOMETRY)["page"] > 2 * page.evaluate(GEOMETRY)["window"]

    for scroll in ("0", "document.documentElement.scrollHeight / 2", "document.documentElement.scrollHeight"):
        page.evaluate(f"window.scrollTo(0, {scroll})")
        seen = page.evaluate(GEOMETRY)
        # The bar's column runs from the top of the page to its bottom, wherever the window is...
        assert seen["barTop"] == 0
        assert seen["barBottom"] == pytest.approx(seen["page"], abs=1)
        # ...and its links fill the window, wherever it is.
        assert seen["heldTop"] == pytest.approx(0, abs=1)
        assert seen["heldBottom"] == pytest.approx(seen["window"], abs=1)
    expect(page.get_by_role("button", name="Log out")).to_be_in_viewport()
