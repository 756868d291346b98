"""The API's Swagger page in Chromium, with every request that leaves the console refused."""
import pytest
from playwright.sync_api import expect

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_the_swagger_page_shows_the_operations_without_the_internet(page, console):
    left_the_console = []

    def only_the_console(route):
        if route.request.url.startswith(console):
            route.continue_()
        else:
            left_the_console.append(route.request.url)
            route.abort()

    page.route("**/*", only_the_console)
    page.goto("/api/schema/swagger/")

    operation = page.locator('.opblock-summary-path[data-path="/api/machines/"]').first
    expect(operation).to_be_visible()
    expect(page.locator(".opblock-get").first).to_be_visible()
    assert left_the_console == []
