"""The deployment page's charts of the last hour: the engines' series built from their samples (gauges added up
over copies, rates from counters, a restart's counters, gaps where nothing stands), the gateway's minutes from
Redis (the unfinished minute left out, no latency without requests), the SVG's geometry (a gap breaks a line,
round tops, labels in units) and the page: the gateway's side polled, the engines' side pushed."""
import time

import pytest
from django.test import Client
from django.utils import timezone

from console import charts as drawing
from console import live, roles
from deployments import charts
from deployments.charts import Sample, engine_series
from deployments.choices import CopyState
from deployments.gateway import traffic
from deployments.models import Copy, EngineSample
from tests.builders import cluster_of, deployment_of, engine_samples_recorded, gpu_machine
from tests.factories import UserFactory

from tests.unit.test_gateway_page import gateway_redis  # noqa: F401 (a fixture: figures under a prefix of the test's own)

NOW = 1_800_000_000.0
HOLD = 150.0


def sample(copy: int, ago: float, **figures) -> Sample:
    return Sample(copy_pk=copy, copy_number=copy, at=NOW - ago, **figures)


def at(series, minutes_ago: int):
    """A series' value ``minutes_ago`` (the series hold a point a minute, the oldest first, now last)."""
    return series[len(series) - 1 - minutes_ago]


# -- the engines' series -------------------------------------------------------------------------------


def test_requests_running_and_waiting_add_up_over_the_copies_that_were_read():
    found = engine_series([sample(1, 30, running=5, waiting=1), sample(2, 40, running=7, waiting=0), sample(2, 100, running=1)],
                          now=NOW, hold=HOLD)
    assert len(found.agos) == 61 and found.agos[-1] == 0
    assert (at(found.running, 0), at(found.waiting, 0)) == (12, 1)
    assert at(found.running, 1) == 1  # a minute ago only copy 2's older sample stood


def test_a_copy_not_read_for_longer_than_the_hold_counts_for_nothing_and_no_copy_leaves_a_gap():
    found = engine_series([sample(1, 600, running=4), sample(1, 60 * 59, running=2)], now=NOW, hold=HOLD)
    assert at(found.running, 10) == 4 and at(found.running, 8) == 4  # it stands for HOLD after it was taken
    assert at(found.running, 7) is None and at(found.running, 0) is None  # a gap up to now
    assert at(found.running, 59) == 2 and at(found.running, 60) is None  # before its first sample: nothing


def test_tokens_per_second_come_from_the_counters_difference_added_over_copies():
    found = engine_series([sample(1, 60, generation_tokens=1000), sample(1, 0, generation_tokens=7000),
                           sample(2, 60, generation_tokens=500), sample(2, 0, generation_tokens=3500)], now=NOW, hold=HOLD)
    assert at(found.generation_per_second, 0) == pytest.approx(100 + 50)
    assert at(found.generation_per_second, 1) is None  # one sample each: no rate yet


def test_a_counter_that_went_down_counts_from_zero_since_the_engine_started_again():
    found = engine_series([sample(1, 60, generation_tokens=90_000), sample(1, 0, generation_tokens=1200)], now=NOW, hold=HOLD)
    assert at(found.generation_per_second, 0) == pytest.approx(20)


def test_a_rate_spans_at_least_30_seconds_when_checks_come_more_often():
    samples = [sample(1, ago, generation_tokens=10_000 - 100 * ago - (ago % 10) * 40) for ago in range(0, 120, 5)]
    found = engine_series(samples, now=NOW, hold=HOLD)
    assert at(found.generation_per_second, 1) == pytest.approx(100)  # 60 s and 90 s ago: not 60 s and 65 s ago (120)


def test_the_prefix_cache_hit_rate_is_its_hits_over_its_queries_across_copies_and_none_without_queries():
    found = engine_series([sample(1, 60, prefix_hits=0, prefix_queries=0), sample(1, 0, prefix_hits=300, prefix_queries=1000),
                           sample(2, 60, prefix_hits=50, prefix_queries=100), sample(2, 0, prefix_hits=950, prefix_queries=1100)],
                          now=NOW, hold=HOLD)
    assert at(found.prefix_hit_percent, 0) == pytest.approx(100 * (300 + 900) / (1000 + 1000))
    idle = engine_series([sample(1, 60, prefix_hits=10, prefix_queries=20), sample(1, 0, prefix_hits=10, prefix_queries=20)],
                         now=NOW, hold=HOLD)
    assert at(idle.prefix_hit_percent, 0) is None  # no prompt came: a gap, not 0%


def test_kv_cache_use_is_a_line_per_copy_up_to_four_copies_then_their_mean_and_the_highest():
    two = engine_series([sample(1, 0, kv_cache=0.25), sample(2, 0, kv_cache=0.5)], now=NOW, hold=HOLD)
    assert {name: at(values, 0) for name, values in two.kv_by_copy.items()} == {"#1": 25.0, "#2": 50.0}
    six = engine_series([sample(n, 0, kv_cache=n / 10) for n in range(1, 7)], now=NOW, hold=HOLD)
    assert {name: at(values, 0) for name, values in six.kv_by_copy.items()} == {"mean": pytest.approx(35.0), "highest": 60.0}


# -- drawing -------------------------------------------------------------------------------------------


def test_a_gap_breaks_the_line_and_a_point_alone_is_a_dot():
    points = [(600, 1.0), (540, 2.0), (480, None), (420, 4.0), (360, None), (300, 3.0), (240, 3.0)]
    chart = drawing.line_chart(title="Running", unit="requests", series=[drawing.Series("Running", points)])
    line = chart["lines"][0]
    assert line["d"].count("M") == 2 and line["d"].count("L") == 2
    assert len(line["dots"]) == 1 and line["area"].count("Z") == 2
    assert [g["label"] for g in chart["grid"]] == ["0", "2", "4"]
    assert [t["label"] for t in chart["ticks"]] == ["1 h ago", "45 min", "30 min", "15 min", "now"]
    assert chart["legend"] == [{"name": "Running", "tone": "accent", "latest": "3"}]
    assert chart["empty"] is None and chart["slots"][-1]["title"] == "4 min ago: Running 3"


def test_the_axis_tops_are_round_and_labelled_in_the_charts_unit():
    assert [drawing.round_top(v) for v in (0, 0.7, 3, 7, 42, 1300, 9000)] == [1, pytest.approx(0.8), 3, 8, 50, 2000, 10000]
    latency = drawing.line_chart(title="Latency", unit="per minute", fmt=drawing.ms, series=[drawing.Series("p99", [(60, 1400.0)])])
    assert [g["label"] for g in latency["grid"]] == ["0", "1 s", "2 s"]
    share = drawing.line_chart(title="KV", unit="%", fmt=drawing.percent, top=100, series=[drawing.Series("#1", [(60, 4.5)])])
    assert [g["label"] for g in share["grid"]] == ["0%", "50%", "100%"] and share["legend"][0]["latest"] == "4.5%"
    assert [drawing.number(v) for v in (0, 2.5, 42, 1500, 2000, 3_400_000)] == ["0", "2.5", "42", "1.5 k", "2 k", "3.4 M"]


def test_a_chart_without_values_says_so_and_shows_no_scale():
    chart = drawing.line_chart(title="Generation", unit="tokens per second", series=[drawing.Series("Tokens/s", [(60, None)])],
                               empty="No figures from the engines yet")
    assert chart["empty"] == "No figures from the engines yet" and chart["slots"] == []
    assert [g["label"] for g in chart["grid"]] == ["0", "", ""] and chart["lines"][0]["d"] == ""


# -- from the database and Redis ----------------------------------------------------------------------


@pytest.fixture
def llama(db):
    deployment = deployment_of(cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)]), name="llama", copies=2)
    for number in (1, 2):
        Copy.objects.create(deployment=deployment, number=number, state=CopyState.SERVING, address=f"198.18.1.{10 + number}",
                            port=8100, serving_since=timezone.now())
    return deployment


def test_the_engines_charts_draw_an_hour_of_recorded_samples_with_the_silent_copys_gap(llama, settings):
    settings.FADEN_HEALTH_INTERVAL = 60
    now = time.time()
    engine_samples_recorded(llama, list(llama.copy_rows.all()), now=now)
    drawn = charts.engine_charts(llama, at=now)
    assert drawn["sampled"] and [c["title"] for c in drawn["charts"]] == [
        "Requests in the engines", "Generation", "KV-cache use", "Prefix-cache hits"]
    kv = drawn["charts"][2]
    assert [line["d"].count("M") for line in kv["lines"]] == [1, 2]  # copy #2 was not read for 4 minutes
    assert all(c["empty"] is None for c in drawn["charts"])


def test_the_engines_charts_say_what_is_missing(llama, settings):
    settings.FADEN_ENGINE_METRICS_TIMEOUT = 2
    drawn = charts.engine_charts(llama)
    assert {c["empty"] for c in drawn["charts"]} == {"No figures from the engines yet"} and not drawn["off"]
    EngineSample.objects.create(deployment=llama, copy_pk=1, copy_number=1, taken_at=timezone.now(), running=2, waiting=0)
    drawn = {c["title"]: c["empty"] for c in charts.engine_charts(llama)["charts"]}
    assert drawn == {"Requests in the engines": None, "Generation": "The engine does not report it",
                     "KV-cache use": "The engine does not report it", "Prefix-cache hits": "The engine does not report it"}


def test_the_gateways_charts_leave_out_the_unfinished_minute_and_draw_no_latency_without_requests(llama, gateway_redis):
    client, prefix = gateway_redis
    now = NOW + 30  # half a minute into a minute
    for minutes_ago, requests in ((0, 50), (1, 20), (2, 30), (4, 10)):
        counts = traffic.Counts()
        for n in range(requests):
            counts.record(llama.pk, seconds=0.1, error=n == 0)
        traffic.counts_flush(client, prefix, counts, at=now - 60 * minutes_ago)
    drawn = charts.gateway_charts(llama.pk, at=now, client=client, prefix=prefix)
    counted, latency = drawn["charts"]
    assert counted["legend"] == [{"name": "Requests", "tone": "accent", "latest": "20"}, {"name": "Errors", "tone": "red", "latest": "1"}]
    p50 = latency["lines"][0]
    assert p50["d"].count("M") == 1 and len(p50["dots"]) == 1  # 2 and 1 minute ago a line; 4 minutes ago alone (a gap)
    assert latency["legend"][0]["latest"] == "88 ms" and counted["empty"] is None  # within the histogram's 75-100 ms


def test_the_gateways_charts_say_when_redis_does_not_answer(llama, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    assert charts.gateway_charts(llama.pk) == {"unavailable": True, "charts": []}


# -- the page ----------------------------------------------------------------------------------------------


def signed_in() -> Client:
    client = Client()
    client.force_login(UserFactory(role=roles.VIEWER))
    return client


def test_a_console_that_reads_no_engine_says_so(llama, settings):
    settings.FADEN_ENGINE_METRICS_TIMEOUT = 0
    html = signed_in().get(f"/deployments/{llama.pk}/").content.decode()
    assert "not read: FADEN_ENGINE_METRICS_TIMEOUT is 0" in html.split('id="deployment-charts-engine"')[1]


def test_the_page_polls_the_gateways_side_and_the_fragment_is_that_side_alone(llama, gateway_redis):
    html = signed_in().get(f"/deployments/{llama.pk}/").content.decode()
    card = html.split('id="deployment-charts"')[1]
    assert f'hx-get="/deployments/{llama.pk}/charts/" hx-trigger="every 15s" hx-swap="outerHTML" data-poll' in card
    assert card.count('<figure class="chart">') == 6 and card.count("<svg") == 6
    fragment = signed_in().get(f"/deployments/{llama.pk}/charts/").content.decode()
    assert fragment.lstrip().startswith('<div class="charts" id="deployment-charts-gateway"') and fragment.count("<svg") == 2
    assert signed_in().get("/deployments/999999/charts/").status_code == 286  # gone: htmx stops polling


def test_a_push_of_the_engines_part_renders_only_their_charts_and_never_reads_redis(llama, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # the gateway's side would say it could not read Redis
    EngineSample.objects.create(deployment=llama, copy_pk=1, copy_number=1, taken_at=timezone.now(), running=9, waiting=1)
    [html] = live.render_topic(f"deployment:{llama.pk}", "engine", roles.VIEWER)
    assert html.strip().startswith('<div class="charts" id="deployment-charts-engine" hx-swap-oob="true">')
    assert html.count("<svg") == 4 and "Running <strong>9</strong>" in html and "Redis" not in html
    everything = "".join(live.render_topic(f"deployment:{llama.pk}", "", roles.VIEWER))
    assert "deployment-charts" not in everything  # a copy's change does not redraw the charts
