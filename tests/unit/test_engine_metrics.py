"""The engines' own figures: vLLM's /metrics text read into the few figures the charts draw, each copy's
engine read by the health check (plain and behind mutual TLS, with the copy's key), a copy that does not
answer costing the check no more than the timeout and failing nothing, and the samples pruned after 75 minutes."""
import datetime
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.utils import timezone

from clusters import health
from clusters.choices import CheckOutcome
from deployments import copy_health, copy_keys, engine_metrics
from deployments.choices import CopyState
from deployments.engine_metrics import EngineFigures, metrics_parse
from deployments.models import Copy, EngineSample
from tests.builders import cluster_of, deployment_of, gpu_machine
from tests.fakes import FakeAgents
from tests.unit.test_deployments import all_well

MODEL = 'model_name="meta-llama/Llama-3.1-8B-Instruct"'

# What vLLM 0.10's server shows at /metrics (V1 engine, one engine), cut short: the process' own metrics,
# the old and new names side by side, counters with their _created gauges, a histogram.
VLLM_0_10 = f"""# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{{generation="0"}} 11296.0
python_gc_objects_collected_total{{generation="1"}} 2531.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 2.358292480e+09
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",{MODEL}}} 12.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",{MODEL}}} 3.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.DEPRECATED: Use vllm:kv_cache_usage_perc instead.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{{engine="0",{MODEL}}} 0.4217
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",{MODEL}}} 0.4217
# HELP vllm:gpu_prefix_cache_queries_total GPU prefix cache queries, in terms of number of queried tokens.DEPRECATED: Use vllm:prefix_cache_queries instead.
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{{engine="0",{MODEL}}} 182736.0
# HELP vllm:gpu_prefix_cache_queries_created GPU prefix cache queries, in terms of number of queried tokens.DEPRECATED: Use vllm:prefix_cache_queries instead.
# TYPE vllm:gpu_prefix_cache_queries_created gauge
vllm:gpu_prefix_cache_queries_created{{engine="0",{MODEL}}} 1.7339124467e+09
# HELP vllm:gpu_prefix_cache_hits_total GPU prefix cache hits, in terms of number of cached tokens.DEPRECATED: Use vllm:prefix_cache_hits instead.
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total{{engine="0",{MODEL}}} 99008.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",{MODEL}}} 182736.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",{MODEL}}} 99008.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",{MODEL}}} 0.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{engine="0",{MODEL}}} 201344.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{engine="0",{MODEL}}} 48213.0
# HELP vllm:generation_tokens_created Number of generation tokens processed.
# TYPE vllm:generation_tokens_created gauge
vllm:generation_tokens_created{{engine="0",{MODEL}}} 1.7339124467e+09
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{{engine="0",finished_reason="stop",{MODEL}}} 311.0
vllm:request_success_total{{engine="0",finished_reason="length",{MODEL}}} 17.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_sum{{engine="0",{MODEL}}} 41.35
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.001",{MODEL}}} 0.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.005",{MODEL}}} 0.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",{MODEL}}} 328.0
vllm:time_to_first_token_seconds_count{{engine="0",{MODEL}}} 328.0
"""


# -- the parser ------------------------------------------------------------------------------------------


def test_vllm_0_10_metrics_give_each_figure_once_under_its_newest_name():
    assert metrics_parse(VLLM_0_10) == EngineFigures(running=12.0, waiting=3.0, kv_cache=0.4217, prefix_hits=99008.0,
                                                     prefix_queries=182736.0, generation_tokens=48213.0)


def test_an_older_vllm_is_read_under_the_names_it_shows():
    older = VLLM_0_10.replace("vllm:kv_cache_usage_perc{", "vllm:other{").replace("vllm:prefix_cache_", "vllm:other_")
    figures = metrics_parse(older)
    assert (figures.kv_cache, figures.prefix_hits, figures.prefix_queries) == (0.4217, 99008.0, 182736.0)


def test_data_parallel_engines_add_up_and_their_kv_cache_use_is_their_mean():
    text = "\n".join([
        f'vllm:num_requests_running{{engine="0",{MODEL}}} 5.0', f'vllm:num_requests_running{{engine="1",{MODEL}}} 7.0',
        f'vllm:kv_cache_usage_perc{{engine="0",{MODEL}}} 0.2', f'vllm:kv_cache_usage_perc{{engine="1",{MODEL}}} 0.6',
        f'vllm:generation_tokens_total{{engine="0",{MODEL}}} 100', f'vllm:generation_tokens_total{{engine="1",{MODEL}}} 50',
    ])
    figures = metrics_parse(text)
    assert (figures.running, figures.kv_cache, figures.generation_tokens) == (12.0, pytest.approx(0.4), 150.0)
    assert figures.waiting is None and figures.prefix_hits is None


def test_the_lab_engines_lines_without_kv_cache_or_prefix_cache_give_what_they_show():
    lab = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="lab-chat"} 2.0\n'
           'vllm:num_requests_waiting{model_name="lab-chat"} 0.0\nvllm:generation_tokens_total{model_name="lab-chat"} 640.0\n')
    assert metrics_parse(lab) == EngineFigures(running=2.0, waiting=0.0, generation_tokens=640.0)


def test_lines_it_cannot_read_are_skipped_and_the_rest_is_read():
    text = "\n".join([
        "vllm:num_requests_running{model_name=\"a } b\",engine=\"0\"} 4 1733912446000",  # a brace in a label, a timestamp
        "vllm:num_requests_waiting",  # no value
        "vllm:num_requests_waiting{engine=\"0\" 3",  # its brace never closed
        "vllm:kv_cache_usage_perc{engine=\"0\"} NaN",
        "vllm:generation_tokens_total{engine=\"0\"} many",
        "vllm:generation_tokens_total 1e3",  # no labels
        "\ufffd\x00 garbage",
    ])
    assert metrics_parse(text) == EngineFigures(running=4.0, generation_tokens=1000.0)
    assert metrics_parse("").empty and metrics_parse("<html>Not Found</html>").empty


# -- a copy's engine, read ------------------------------------------------------------------------------


class FakeEngine:
    """A copy's engine on 127.0.0.1 answering GET /metrics (``text``, ``status``), over TLS with ``tls``;
    ``stall`` makes it accept and never answer. ``asked`` records each request's Authorization."""

    def __init__(self, text: str = VLLM_0_10, *, status: int = 200, tls: ssl.SSLContext | None = None, stall: bool = False):
        engine = self
        self.text, self.status, self.stall, self.asked = text, status, stall, []
        self.release = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                engine.asked.append((self.path, self.headers.get("Authorization")))
                if engine.stall:
                    engine.release.wait(10)
                    return
                body = engine.text.encode()
                self.send_response(engine.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(autouse=True)
def engines_read(settings):
    """The suite's settings read no engine (tests/settings.py): these tests' engines are on loopback."""
    settings.FADEN_ENGINE_METRICS_TIMEOUT = 2.0


@pytest.fixture
def engines():
    started = []

    def start(*args, **kwargs) -> FakeEngine:
        started.append(FakeEngine(*args, **kwargs))
        return started[-1]

    yield start
    for engine in started:
        engine.close()


@pytest.fixture
def gpu_room():
    return cluster_of([gpu_machine("gpu-a", 11)])


def copy_of(deployment, engine: FakeEngine, number: int, *, tls: bool = False, machine=None) -> Copy:
    copy = Copy.objects.create(deployment=deployment, number=number, state=CopyState.SERVING, machine=machine,
                               address="127.0.0.1", port=engine.port, tls=tls, serving_since=timezone.now())
    copy_keys.copy_key_ensure(copy)
    return Copy.objects.select_related("deployment").get(pk=copy.pk)


@pytest.mark.django_db
def test_a_copy_is_read_with_its_own_key_and_its_figures_kept(gpu_room, engines, settings):
    llama = deployment_of(gpu_room, name="llama")
    engine = engines()
    copy = copy_of(llama, engine, 1)

    assert engine_metrics.samples_take([copy]) == 1

    sample = EngineSample.objects.get()
    assert (sample.deployment_id, sample.copy_pk, sample.copy_number) == (llama.pk, copy.pk, 1)
    assert (sample.running, sample.waiting, sample.kv_cache, sample.generation_tokens) == (12.0, 3.0, 0.4217, 48213.0)
    assert engine.asked == [("/metrics", f"Bearer {copy_keys.copy_key_of(copy.pk, copy.api_key_sealed)}")]


@pytest.mark.django_db
def test_a_copy_behind_tls_is_read_with_the_consoles_client_certificate(gpu_room, engines, settings, tmp_path):
    from tests.unit.test_gateway_tls import copy_context

    settings.FADEN_TLS_DIR = tmp_path / "tls"
    llama = deployment_of(gpu_room, name="llama")
    secure = copy_of(llama, engines(tls=copy_context()), 1, tls=True)

    assert engine_metrics.samples_take([secure]) == 1
    assert EngineSample.objects.get().prefix_hits == 99008.0


@pytest.mark.django_db
def test_copies_that_do_not_answer_or_answer_nothing_of_vllms_have_no_sample_and_nothing_fails(gpu_room, engines, caplog):
    llama = deployment_of(gpu_room, name="llama")
    refusing = engines(status=500)
    closed = engines()
    closed.close()
    copies = [copy_of(llama, refusing, 1), copy_of(llama, engines("not vllm 1\n"), 2), copy_of(llama, closed, 3),
              copy_of(llama, engines(), 4)]

    assert engine_metrics.samples_take(copies) == 1
    assert list(EngineSample.objects.values_list("copy_number", flat=True)) == [4]
    assert "llama #1: its engine's figures could not be read: it answered 500" in caplog.text
    assert "llama #2: its engine's figures could not be read: its /metrics shows none of vLLM's figures" in caplog.text


@pytest.mark.django_db
def test_an_engine_that_never_answers_costs_the_machines_check_the_timeout_at_most(gpu_room, engines, settings):
    settings.FADEN_ENGINE_METRICS_TIMEOUT = 0.4
    llama = deployment_of(gpu_room, name="llama")
    stalled = engines(stall=True)
    copies = [copy_of(llama, stalled, 1), copy_of(llama, engines(), 2)]

    started = time.monotonic()
    assert engine_metrics.samples_take(copies) == 0  # the time ran out on the first: the second waits for the next check
    assert time.monotonic() - started < 0.8


@pytest.mark.django_db(transaction=True)  # the check asks its machines from a pool of threads
def test_the_health_check_reads_its_healthy_copies_engines_and_tells_the_page(gpu_room, engines, monkeypatch):
    from console import live

    fakes = FakeAgents().install(monkeypatch)
    all_well(fakes, gpu_room)
    machine = gpu_room.members.get().machine
    llama = deployment_of(gpu_room, name="llama", copies=2)
    healthy, silent = copy_of(llama, engines(), 1, machine=machine), copy_of(llama, engines(), 2, machine=machine)
    fakes.copies["gpu-a"] = {c.key: {"pid": 7 + c.number, "port": c.port} for c in (healthy, silent)}
    fakes.answers["gpu-a"]["copy_silent"] = {silent.key}  # it runs but does not answer its health check
    pushed, looks = [], []
    monkeypatch.setattr(live, "push", lambda topic, part="": pushed.append((topic, part)))
    monkeypatch.setattr(copy_health, "task_enqueue", lambda name, *args, **kw: looks.append(args[0]))

    check = health.cluster_check_run(cluster_id=gpu_room.pk, trigger="schedule")

    assert check.outcome == CheckOutcome.HEALTHY and looks == [silent.pk]  # the silent copy is looked at again, as before
    assert list(EngineSample.objects.values_list("copy_number", "running")) == [(1, 12.0)]  # the unwell copy is not read
    assert (f"deployment:{llama.pk}", "engine") in pushed


@pytest.mark.django_db(transaction=True)
def test_a_check_whose_engines_cannot_be_read_goes_on_as_before(gpu_room, monkeypatch):
    fakes = FakeAgents().install(monkeypatch)
    all_well(fakes, gpu_room)
    machine = gpu_room.members.get().machine
    llama = deployment_of(gpu_room, name="llama")
    copy = Copy.objects.create(deployment=llama, number=1, state=CopyState.SERVING, machine=machine, address="127.0.0.1",
                               port=9, serving_since=timezone.now())  # nothing listens on the discard port
    fakes.copies["gpu-a"] = {copy.key: {"pid": 8, "port": 9}}
    monkeypatch.setattr(EngineSample.objects, "bulk_create", lambda rows: 1 / 0)  # and the database would refuse them

    check = health.cluster_check_run(cluster_id=gpu_room.pk, trigger="schedule")

    assert check.outcome == CheckOutcome.HEALTHY
    assert Copy.objects.get(pk=copy.pk).state == CopyState.SERVING and not EngineSample.objects.exists()


@pytest.mark.django_db
def test_a_timeout_of_0_reads_no_engine(gpu_room, engines, settings):
    settings.FADEN_ENGINE_METRICS_TIMEOUT = 0
    engine = engines()
    assert engine_metrics.samples_take([copy_of(deployment_of(gpu_room, name="llama"), engine, 1)]) == 0
    assert engine.asked == []


# -- pruning ---------------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_samples_older_than_75_minutes_go_when_new_ones_come_and_only_the_sampled_deployments(gpu_room, engines):
    llama = deployment_of(gpu_room, name="llama")
    mistral = deployment_of(gpu_room, llama.model, name="mistral")
    now = timezone.now()
    for deployment in (llama, mistral):
        for minutes in (80, 76, 74, 10):
            EngineSample.objects.create(deployment=deployment, copy_pk=1, copy_number=1,
                                        taken_at=now - datetime.timedelta(minutes=minutes), running=1)

    engine_metrics.samples_take([copy_of(llama, engines(), 1)], now=now)

    kept = {(d, round((now - at).total_seconds() / 60)) for d, at in EngineSample.objects.values_list("deployment__name", "taken_at")}
    assert kept == {("llama", 74), ("llama", 10), ("llama", 0), ("mistral", 80), ("mistral", 76), ("mistral", 74), ("mistral", 10)}
    assert engine_metrics.samples_prune([mistral.pk], now=now) == 2
