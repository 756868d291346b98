"""The gateway's GET /metrics: scraped through the application under uvicorn (as tests/unit/test_gateway.py
runs it, with its small engines on 127.0.0.1) and read with prometheus_client's own parser; who may read it;
the figures of workers sharing a port added up through their files. The usage read at an answer's end:
tests/unit/test_gateway_answer.py."""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from console.management.commands import serve
from deployments.gateway import metrics_files
from deployments.gateway.answer import Answer
from deployments.gateway.app import Gateway
from deployments.gateway.background import GatewayConfig
from deployments.gateway.metrics import GatewayMetrics, MetricsConfig, workers_directory
from deployments.gateway.routes import RouteTable, Snapshot
from tests.unit.test_gateway import (CHAT, RunningGateway, _url, a_key, chat, cluster, deployment_of, ready_model,  # noqa: F401
                                     redis, serving, upstreams, wait_for)

ROUTED = pytest.mark.django_db(transaction=True)  # the gateway reads its routes in a thread of its own

TOKEN = "metrics-token-" + "x" * 18
SCRAPE = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def metrics_gateway(redis):
    client, prefix = redis
    running = []

    def start(**metrics) -> RunningGateway:
        config = GatewayConfig(redis_url=_url(client), prefix=prefix, refresh_every=0.1, probe_every=60, connect_timeout=1.0)
        gateway = RunningGateway(Gateway(config, metrics=MetricsConfig(**{"token": TOKEN, **metrics})))
        running.append(gateway)
        return gateway

    yield start
    for gateway in running:
        gateway.stop()


def families(text: str) -> dict:
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(family, **labels) -> float:
    found = [s.value for s in family.samples if s.labels == labels]
    assert len(found) == 1, f"{family.name}{labels}: {[s.labels for s in family.samples]}"
    return found[0]


def sample(family, suffix: str, **labels) -> float:
    found = [s.value for s in family.samples if s.name == family.name + suffix and s.labels == labels]
    assert len(found) == 1, f"{family.name}{suffix}{labels}"
    return found[0]


def scrape(gateway: RunningGateway) -> dict:
    answer = httpx.get(f"{gateway.url}/metrics", headers=SCRAPE)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain; version=0.0.4")
    return families(answer.text)


@ROUTED
def test_the_gateways_metrics_count_requests_errors_latency_first_tokens_tokens_and_refusals(cluster, upstreams,
                                                                                            metrics_gateway):
    llama = deployment_of(cluster, name="llama")
    serving(llama, upstreams("llama", tokens=5))
    serving(deployment_of(cluster, ready_model("org/qwen"), name="qwen"), upstreams("qwen"), 2)
    secret = a_key()
    gateway = metrics_gateway()
    client = gateway.client(secret)

    answers = [chat(client, "llama").status_code, chat(client, "llama").status_code,
               chat(client, "llama", "please fail").status_code]
    with client.stream("POST", CHAT, json={"model": "llama", "stream": True, "messages": []}) as streamed:
        assert [line for line in streamed.iter_lines() if line.startswith("data: ")][-1] == "data: [DONE]"
    chat(client, "gpt-4")  # refused: no such model
    chat(gateway.client("fs-" + "z" * 43), "llama")  # refused: no such key
    found = scrape(gateway)

    assert answers == [200, 200, 500]
    requests = found["fadenstack_gateway_requests"]
    assert requests.type == "counter"
    assert {(s.labels["deployment"], s.labels["code"]): s.value for s in requests.samples} == {
        ("llama", "2xx"): 3, ("llama", "5xx"): 1}, "qwen had no request: no series"
    assert value(found["fadenstack_gateway_errors"], deployment="llama") == 1
    duration = found["fadenstack_gateway_request_duration_seconds"]
    assert duration.type == "histogram" and sample(duration, "_count", deployment="llama") == 4
    assert 0 < sample(duration, "_sum", deployment="llama") < 4
    assert sample(duration, "_bucket", deployment="llama", le="+Inf") == 4
    assert sample(duration, "_bucket", deployment="llama", le="0.001") <= sample(duration, "_bucket", deployment="llama", le="1.0")
    first = found["fadenstack_gateway_time_to_first_token_seconds"]
    assert first.type == "histogram" and sample(first, "_count", deployment="llama") == 3, "2xx answers only"
    assert sample(first, "_sum", deployment="llama") <= sample(duration, "_sum", deployment="llama")
    # The engine's whole answers say 3 prompt and 5 completion tokens; its stream says nothing (no include_usage).
    assert value(found["fadenstack_gateway_prompt_tokens"], deployment="llama") == 6
    assert value(found["fadenstack_gateway_completion_tokens"], deployment="llama") == 10
    assert value(found["fadenstack_gateway_requests_in_flight"], deployment="llama") == 0
    assert value(found["fadenstack_gateway_requests_in_flight"], deployment="qwen") == 0
    copies = found["fadenstack_gateway_copy_requests_in_flight"]
    assert copies.type == "gauge" and {(s.labels["deployment"], s.labels["copy"]) for s in copies.samples} == {
        ("llama", "1"), ("qwen", "2")}
    refusals = found["fadenstack_gateway_refusals"]
    assert {s.labels["code"]: s.value for s in refusals.samples} == {"model_not_found": 1, "invalid_api_key": 1}
    limits = found["fadenstack_gateway_limit_refusals"]
    assert {s.labels["limit"]: s.value for s in limits.samples} == {"requests": 0, "tokens": 0}

    gateway.app.metrics.limit_refused("requests")  # what the key limits call
    assert value(scrape(gateway)["fadenstack_gateway_limit_refusals"], limit="requests") == 1


@ROUTED
def test_the_labels_are_few_and_never_a_key_or_a_clients_words(cluster, upstreams, metrics_gateway):
    serving(deployment_of(cluster, name="llama"), upstreams("llama"))
    secret = a_key()
    gateway = metrics_gateway()
    client = gateway.client(secret)
    chat(client, "llama")
    chat(client, "no-such-model-" + "q" * 20)
    chat(gateway.client("fs-secret-" + "s" * 40), "llama")

    text = httpx.get(f"{gateway.url}/metrics", headers=SCRAPE).text

    assert secret not in text and "fs-secret" not in text and "no-such-model" not in text
    allowed = {"deployment", "code", "copy", "limit", "le"}
    for family in families(text).values():
        assert family.name.startswith("fadenstack_gateway_"), family.name
        for one in family.samples:
            assert set(one.labels) <= allowed, (one.name, one.labels)


@ROUTED
def test_the_copies_requests_in_flight_are_seen_while_they_run(cluster, upstreams, metrics_gateway):
    slow, idle = upstreams("slow"), upstreams("idle")
    slow.hold = threading.Event()
    llama = deployment_of(cluster, name="llama")
    serving(llama, slow, 1)
    serving(llama, idle, 2)
    secret = a_key()
    gateway = metrics_gateway()
    held = threading.Thread(target=lambda: chat(gateway.client(secret), "llama"))
    held.start()
    try:
        wait_for(lambda: slow.arrived() == 1)
        during = scrape(gateway)
    finally:
        slow.hold.set()
        held.join(timeout=5)

    copies = during["fadenstack_gateway_copy_requests_in_flight"]
    assert value(copies, deployment="llama", copy="1") == 1 and value(copies, deployment="llama", copy="2") == 0
    assert value(during["fadenstack_gateway_requests_in_flight"], deployment="llama") == 1
    after = scrape(gateway)
    assert value(after["fadenstack_gateway_requests_in_flight"], deployment="llama") == 0


@ROUTED
def test_metrics_need_the_token_unless_the_operator_opened_them(metrics_gateway):
    closed = metrics_gateway(token="")
    guarded = metrics_gateway()
    opened = metrics_gateway(token="", open=True)
    key = a_key()

    off = httpx.get(f"{closed.url}/metrics", headers=SCRAPE)
    missing = httpx.get(f"{guarded.url}/metrics")
    wrong = httpx.get(f"{guarded.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}x"})
    with_a_key = httpx.get(f"{guarded.url}/metrics", headers={"Authorization": f"Bearer {key}"})
    posted = httpx.post(f"{guarded.url}/metrics", headers=SCRAPE)

    assert off.status_code == 403 and "FADEN_METRICS_TOKEN" in off.json()["error"]["message"]
    for refused in (missing, wrong, with_a_key):
        assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer")
        assert refused.json()["error"]["code"] == "invalid_metrics_token" and TOKEN not in refused.text
    assert posted.status_code == 405
    assert httpx.get(f"{guarded.url}/metrics", headers=SCRAPE).status_code == 200
    assert httpx.get(f"{opened.url}/metrics").status_code == 200


# -- workers sharing a port -------------------------------------------------------------------------------


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def worker(directory, pid: int, table: RouteTable, *, requests: int, in_flight: int) -> GatewayMetrics:
    """A worker's figures written to the shared files: ``requests`` answered by llama, ``in_flight`` going on."""
    metrics = GatewayMetrics(table, MetricsConfig(token=TOKEN, directory=str(directory)))
    metrics.files = metrics_files.SharedFiles(directory, pid)
    for _ in range(requests):
        answer = Answer(lambda message: None)
        answer({"type": "http.response.start", "status": 200, "headers": []})
        answer({"type": "http.response.body", "body": b'{"usage":{"prompt_tokens":2,"completion_tokens":1}}'})
        answer.first_at = 1.0
        metrics.record("llama", answer, 0.5, False)
    metrics.refused("invalid_api_key")
    table.copies[7].in_flight = in_flight
    metrics.files.write(metrics.collect())
    return metrics


def test_workers_sharing_a_port_add_up_and_a_dead_workers_counts_stay_but_not_its_requests_in_flight(tmp_path):
    def table() -> RouteTable:
        made = RouteTable()
        made.apply(Snapshot(deployments=(("llama", 1, 0),), copies=((7, 1, 1, "a", 1, "t"),), keys=()))
        return made

    gone = worker(tmp_path, dead_pid(), table(), requests=5, in_flight=4)  # died with 4 requests going on
    other = worker(tmp_path, os.getppid(), table(), requests=2, in_flight=1)
    mine = worker(tmp_path, os.getpid(), table(), requests=3, in_flight=2)

    found = families(mine.files.exposition().decode())

    assert value(found["fadenstack_gateway_requests"], deployment="llama", code="2xx") == 10
    duration = found["fadenstack_gateway_request_duration_seconds"]
    assert sample(duration, "_count", deployment="llama") == 10 and sample(duration, "_bucket", deployment="llama", le="+Inf") == 10
    assert sample(duration, "_bucket", deployment="llama", le="0.25") == 0
    assert value(found["fadenstack_gateway_completion_tokens"], deployment="llama") == 10
    assert value(found["fadenstack_gateway_refusals"], code="invalid_api_key") == 3
    assert value(found["fadenstack_gateway_copy_requests_in_flight"], deployment="llama", copy="1") == 3, "the live ones"
    assert value(found["fadenstack_gateway_requests_in_flight"], deployment="llama") == 3
    for metrics in (gone, other, mine):
        metrics.files.close()


def test_a_gateways_workers_get_a_directory_of_their_own_and_stopped_gateways_directories_go(tmp_path):
    stopped, running = tmp_path / str(dead_pid()), tmp_path / str(os.getppid())
    stopped.mkdir()
    running.mkdir()
    (stopped / "counter_1.db").write_bytes(b"")

    directory = metrics_files.run_directory(tmp_path, os.getpid())

    assert directory == tmp_path / str(os.getpid()) and directory.is_dir()
    assert not stopped.exists() and running.exists()
    assert workers_directory(tmp_path) is None, "a process serving alone adds up nothing"


def test_two_workers_of_the_gateways_command_line_answer_the_same_sums(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "FADEN_DATA_DIR": str(tmp_path), "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
           "DJANGO_SETTINGS_MODULE": "config.settings", "FADEN_METRICS_TOKEN": TOKEN}
    process = subprocess.Popen(serve.gateway_argv(sys.executable, bind="127.0.0.1", port=port, workers=2), env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        directory = tmp_path / "gateway-metrics" / str(process.pid)
        wait_for(lambda: len(list(directory.glob("counter_*.db"))) == 2, timeout=30)  # each worker's, written every second
        refused = []
        while len(refused) < 300 and not all(refusals_in(path) for path in directory.glob("counter_*.db")):
            # A connection each: the kernel hands them to either worker; sent until both have refused some.
            refused += [httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer fs-nope"}).status_code
                        for _ in range(10)]
            time.sleep(1.1)  # each worker writes its figures every second
        scrapes = [value(families(httpx.get(f"{url}/metrics", headers=SCRAPE).text)["fadenstack_gateway_refusals"],
                         code="invalid_api_key") for _ in range(6)]
        each = sorted(refusals_in(path) for path in directory.glob("counter_*.db"))
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=15)

    assert set(refused) == {401} and each[0] > 0 and sum(each) == len(refused), each
    assert scrapes == [len(refused)] * 6, "whichever worker answers, the sum of both"


def refusals_in(path) -> float:
    """The refusals one worker's file holds."""
    from prometheus_client.multiprocess import MultiProcessCollector

    return sum(s.value for family in MultiProcessCollector.merge([str(path)]) if family.name == "fadenstack_gateway_refusals"
               for s in family.samples)
