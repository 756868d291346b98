"""A deployment's charts of the last hour in Chromium, from recorded figures (tests/builders.py): the gateway's
minutes in Redis and the engines' samples in the database, as a deployment under load leaves them. Each chart
draws its lines with its axes and legend; a deployment without figures says so; a sample a check pushes
redraws the engines' side. (The same page from a lab deployment under real load is the lab's test.)

FADEN_SCREENSHOTS=<directory> keeps a picture of each page."""
import os
import time

import pytest
from django.utils import timezone
from playwright.sync_api import expect

from console import live
from deployments.choices import CopyState
from deployments.models import Copy, EngineSample
from tests.builders import cluster_of, deployment_of, engine_samples_recorded, gateway_minutes_recorded, gpu_machine

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

TITLES = ("Requests", "Latency", "Requests in the engines", "Generation", "KV-cache use", "Prefix-cache hits")


@pytest.fixture(scope="module")
def console_options():
    """The suite's consoles read no engine (tests/settings.py); these pages say what a console that reads them says."""
    return {"env": {"FADEN_TEST_ENGINE_METRICS_TIMEOUT": "2"}}


def serving_copies(deployment, count: int) -> list[Copy]:
    return [Copy.objects.create(deployment=deployment, number=n, state=CopyState.SERVING, machine=None,
                                address=f"198.18.1.{10 + n}", port=8100, serving_since=timezone.now()) for n in range(1, count + 1)]


def screenshot(page, name: str) -> None:
    if directory := os.environ.get("FADEN_SCREENSHOTS"):
        page.locator("#deployment-charts").screenshot(path=os.path.join(directory, f"{name}-charts.png"))
        page.screenshot(path=os.path.join(directory, f"{name}.png"), full_page=True)


def test_the_deployment_page_draws_the_gateway_and_the_engines_over_the_last_hour(page, gateway_redis):
    cluster = cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)])
    llama = deployment_of(cluster, name="llama", copies=2)
    copies = serving_copies(llama, 2)
    now = time.time()
    engine_samples_recorded(llama, copies, now=now)
    gateway_minutes_recorded(llama, now=now, client=gateway_redis[0], prefix=gateway_redis[1])

    page.goto(f"/deployments/{llama.pk}/")
    charts = page.locator("#deployment-charts")
    expect(charts.locator("figure.chart")).to_have_count(6)
    for title, figure in zip(TITLES, charts.locator("figure.chart").all()):
        expect(figure.locator(".chart__title")).to_have_text(title)
        assert figure.locator("path.chart__line").count() >= 1, f"{title} draws a line"
        d = figure.locator("path.chart__line").first.get_attribute("d")
        assert d.count(" L") > 20, f"{title}: a point a minute, not {d.count(' L')}"
        expect(figure.locator("text.chart__tick", has_text="1 h ago")).to_have_count(1)
        expect(figure.locator("text.chart__tick", has_text="now")).to_have_count(1)
        expect(figure.locator(".chart__empty")).to_have_count(0)
    gateway, engines = page.locator("#deployment-charts-gateway"), page.locator("#deployment-charts-engine")
    expect(gateway.locator(".chart__key", has_text="Errors")).to_be_visible()
    expect(gateway.locator("text.chart__tick", has_text=" s")).not_to_have_count(0)  # latency's axis in seconds
    expect(engines.locator(".chart__key", has_text="#2")).to_be_visible()  # a KV-cache line per copy
    expect(engines.locator("text.chart__tick", has_text="100%")).to_have_count(2)
    # Copy #2 was not read for a few minutes: its KV-cache line has a gap (two runs of points).
    kv_cache = engines.locator("figure.chart").filter(has=page.locator(".chart__title", has_text="KV-cache use"))
    assert kv_cache.locator("path.chart__line--green").get_attribute("d").count("M") == 2
    assert page.locator(".chart__svg").first.bounding_box()["width"] > 300
    screenshot(page, "deployment-under-load")

    # A check reads the engines again: the pushed part redraws with the new figures.
    expect(page.locator("[data-live-dot]").first).to_have_text("Live", timeout=15000)
    EngineSample.objects.create(deployment=llama, copy_pk=copies[0].pk, copy_number=1, taken_at=timezone.now(),
                                running=57, waiting=3, kv_cache=0.5)
    live.push(f"deployment:{llama.pk}", part="engine")
    expect(engines.locator(".chart__key", has_text="Running").locator("strong")).to_have_text("67", timeout=15000)


def test_a_deployment_without_figures_says_so_in_each_chart(page, gateway_redis):
    cluster = cluster_of([gpu_machine("gpu-a", 11)])
    quiet = deployment_of(cluster, name="quiet", copies=1)
    serving_copies(quiet, 1)

    page.goto(f"/deployments/{quiet.pk}/")
    charts = page.locator("#deployment-charts")
    expect(charts.locator("figure.chart")).to_have_count(6)
    expect(page.locator("#deployment-charts-gateway .chart__empty")).to_have_text(["No requests in the last hour"] * 2)
    expect(page.locator("#deployment-charts-engine .chart__empty")).to_have_text(["No figures from the engines yet"] * 4)
    expect(page.locator("#deployment-charts-engine .charts__note")).to_contain_text("each health check")
    screenshot(page, "deployment-without-figures")
