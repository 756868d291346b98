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


# Logs every Content-Security-Policy violation of every document the page opens (an init script runs
# outside the page's policy), so that the test sees those the browser reports only as events.
REPORT_VIOLATIONS = """document.addEventListener("securitypolicyviolation", (e) =>
  console.error(`CSP violation: ${e.violatedDirective} blocked ${e.blockedURI || "inline"} in ${e.sourceFile}:${e.lineNumber}`));"""


def test_every_page_the_swagger_page_and_the_live_bars_work_under_the_content_security_policy(page):
    from clusters.choices import ClusterState, MemberState
    from clusters.models import Transfer
    from console import live
    from tests.builders import build, cluster_of, gpu_machine

    machine = gpu_machine("gpu-a", 11)
    cluster = cluster_of([machine, gpu_machine("gpu-b", 12)], state=ClusterState.STARTING, runtime=build("2.1.0"))
    member = cluster.members.get(machine=machine)
    cluster.members.update(state=MemberState.IMAGE)
    Transfer.objects.create(member=member, digest="a" * 64, what="the runtime image", source="the server",
                            bytes_done=420, bytes_total=1000)
    problems = []
    page.on("console", lambda message: problems.append(f"{message.text} ({message.location['url']})") if message.type == "error" else None)
    page.on("pageerror", lambda error: problems.append(str(error)))
    page.on("response", lambda response: problems.append(f"{response.status} {response.url}") if response.status >= 400 else None)
    page.add_init_script(REPORT_VIOLATIONS)

    for path in ("/", "/machines/", f"/machines/{machine.pk}/", "/machines/add/", "/clusters/", "/clusters/new/",
                 f"/clusters/{cluster.pk}/", f"/clusters/{cluster.pk}/add/", "/deployments/", "/admin/",
                 "/admin/machines/machine/", f"/admin/machines/machine/{machine.pk}/change/", "/api/machines/"):
        response = page.goto(path)
        assert response.status == 200, path
        assert "script-src 'self'" in response.headers["content-security-policy"]
        page.wait_for_load_state("networkidle")
    page.goto(f"/clusters/{cluster.pk}/")
    expect(page.locator("[data-live-dot]")).to_have_text("Live")
    bar = f"#member-{member.pk} .bar__fill"
    assert page.locator(bar).evaluate("el => el.style.width") == "42%"
    Transfer.objects.filter(member=member).update(bytes_done=770)
    live.push(f"cluster:{cluster.pk}", "members")  # as the start's ProgressBoard does
    expect(page.locator(f"#member-{member.pk} .image-percent")).to_have_text("77%")
    assert page.locator(bar).evaluate("el => el.style.width") == "77%"
    page.goto("/machines/")
    page.select_option("select[name=state]", "healthy")  # submits its form by itself
    page.wait_for_url("**/machines/?*state=healthy*")
    page.goto("/api/schema/swagger/")
    expect(page.locator('.opblock-summary-path[data-path="/api/machines/"]').first).to_be_visible()

    assert problems == [], "\n".join(problems)
