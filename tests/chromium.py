"""Headless Chromium for the tests that look at pages: the browser tests' fixtures (tests/browser/conftest.py) and a
lab test that opens a page of its console (tests/integration/test_deployments_lab.py)."""
import shutil

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


def launch(playwright):
    """A headless Chromium (Playwright's sync API)."""
    return playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)


def signed_in(browser, base_url: str, username: str, password: str):
    """A new page (a browser context of its own) on ``base_url``, signed in."""
    page = browser.new_page(viewport={"width": 1440, "height": 900}, base_url=base_url)
    page.set_default_timeout(15000)
    page.goto("/login/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", password)
    page.click("button[type=submit]")
    page.wait_for_url(base_url + "/")
    return page
