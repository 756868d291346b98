"""The gateway against real upstreams: small OpenAI-like engines on 127.0.0.1 (tests/upstreams.py), the
gateway's ASGI application under uvicorn in this process, its routes read from the test database and
its figures and failure reports written to Redis (REDIS_URL) under a prefix of each test's own."""
import json
import socket
import threading
import time
import uuid

import httpx
import pytest
import uvicorn
from django.utils import timezone

from deployments import gateway_keys
from deployments.choices import CopyState
from deployments.gateway import failures, traffic
from deployments.gateway.app import Gateway
from deployments.gateway.background import GatewayConfig
from deployments.gateway.protocol import BoundedHttpToolsProtocol
from deployments.gateway.routes import CopyRoute, DeploymentRoute, RouteTable, Snapshot
from deployments.models import Copy, GatewayKey
from tests.builders import cluster_of, deployment_of, gpu_machine, ready_model
from tests.upstreams import Upstream

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/v1/chat/completions"


def wait_for(predicate, *, timeout: float = 5.0, every: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := predicate():
            return found
        time.sleep(every)
    raise AssertionError(f"not within {timeout} s: {predicate}")


class RunningGateway:
    """The gateway under uvicorn (httptools in the gateway's protocol, as faden serve runs it) on a free port, in a
    thread."""

    def __init__(self, app: Gateway, http=BoundedHttpToolsProtocol):
        self.app = app
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, http=http, lifespan="on", log_level="warning",
                                                    access_log=False, proxy_headers=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, timeout=10)

    def client(self, secret: str | None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=10)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


@pytest.fixture
def redis(settings):
    prefix = f"test-gateway-{uuid.uuid4().hex[:10]}"
    client = traffic.redis_client(settings.REDIS_URL)
    yield client, prefix
    names = list(client.scan_iter(f"{prefix}:*"))
    if names:
        client.delete(*names)


@pytest.fixture
def start_gateway(redis):
    client, prefix = redis
    running = []

    def start(http=BoundedHttpToolsProtocol, **overrides) -> RunningGateway:
        config = GatewayConfig(**{"redis_url": _url(client), "prefix": prefix,
                                  "refresh_every": 0.1, "probe_every": 0.2, "connect_timeout": 1.0, **overrides})
        gateway = RunningGateway(Gateway(config), http)
        running.append(gateway)
        return gateway

    yield start
    for gateway in running:
        gateway.stop()


def _url(client) -> str:
    kwargs = client.connection_pool.connection_kwargs
    return f"redis://{kwargs.get('host', '127.0.0.1')}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"


@pytest.fixture
def upstreams():
    made = []

    def make(name: str, **options) -> Upstream:
        upstream = Upstream(name, **options)
        made.append(upstream)
        return upstream

    yield make
    for upstream in made:
        upstream.close()


@pytest.fixture
def cluster():
    return cluster_of([gpu_machine("gpu-a", 11)])


def serving(deployment, upstream: Upstream | int, number: int = 1, *, state=CopyState.SERVING) -> Copy:
    port = upstream if isinstance(upstream, int) else upstream.port
    return Copy.objects.create(deployment=deployment, number=number, state=state, address="127.0.0.1", port=port,
                               serving_since=timezone.now() if state == CopyState.SERVING else None)


def a_key(**options) -> str:
    return gateway_keys.gateway_key_create(name=options.pop("name", "tests"), **options)[1]


def chat(client: httpx.Client, model: str, content: str = "hello", **extra) -> httpx.Response:
    return client.post(CHAT, json={"model": model, "messages": [{"role": "user", "content": content}], **extra})


def answered_by(response: httpx.Response) -> str:
    return response.json()["id"].split("-")[1]


def closed_port() -> int:
    """A port on 127.0.0.1 where nothing listens: connecting is refused."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


# -- routing -----------------------------------------------------------------------------------------------


def test_a_request_goes_to_a_copy_of_the_deployment_its_model_names(cluster, upstreams, start_gateway):
    llama_a, llama_b, qwen = upstreams("llama_a"), upstreams("llama_b"), upstreams("qwen")
    llama = deployment_of(cluster, name="llama")
    serving(llama, llama_a, 1)
    serving(llama, llama_b, 2)
    serving(deployment_of(cluster, ready_model("org/qwen"), name="qwen"), qwen)
    secret = a_key()
    client = start_gateway().client(secret)

    by_llama = {answered_by(chat(client, "llama")) for _ in range(4)}
    by_qwen = {answered_by(chat(client, "qwen")) for _ in range(3)}
    completion = client.post("/v1/completions", json={"model": "qwen", "prompt": "hi"})
    queried = client.post("/v1/completions?tag=a%20b", json={"model": "qwen", "prompt": "hi"})
    embedding = client.post("/v1/embeddings", json={"model": "llama", "input": "hi"})

    assert by_llama == {"llama_a", "llama_b"} and by_qwen == {"qwen"}
    assert completion.status_code == 200 and completion.json()["choices"][0]["text"]
    assert embedding.status_code == 200 and embedding.json()["data"][0]["embedding"] == [0.1, 0.2, 0.3]
    assert qwen.arrived("/v1/completions") == 1
    assert qwen.requests[-1]["path"] == "/v1/completions?tag=a%20b", "the query string is passed on as it came"
    assert queried.status_code == 404, "and the copy's answer (this one knows no query) as it came"
    sent = llama_a.requests[0]["headers"]
    assert "Authorization" not in sent and "authorization" not in sent, "the key stays at the gateway"
    assert json.loads(llama_a.requests[0]["body"])["model"] == "llama"
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["llama", "qwen"]
    assert client.get("/v1/models/qwen").json()["id"] == "qwen"


def test_the_copy_with_the_fewest_requests_in_flight_gets_the_next_one(cluster, upstreams, start_gateway):
    slow, fast = upstreams("slow"), upstreams("fast")
    slow.hold = threading.Event()  # the slow copy keeps every request it gets until released
    llama = deployment_of(cluster, name="llama")
    serving(llama, slow, 1)
    serving(llama, fast, 2)
    secret = a_key()
    gateway = start_gateway()
    held = []
    thread = threading.Thread(target=lambda: held.append(chat(gateway.client(secret), "llama")))
    thread.start()
    wait_for(lambda: slow.arrived() == 1)  # a tie goes to the copy whose turn it is: the first, the slow one

    answers = [answered_by(chat(gateway.client(secret), "llama")) for _ in range(10)]

    assert answers == ["fast"] * 10, "a copy busy with a request gets no other while another is idle"
    slow.hold.set()
    thread.join(timeout=5)
    assert held[0].status_code == 200 and answered_by(held[0]) == "slow"


def test_ties_take_turns_and_least_in_flight_wins():
    route = DeploymentRoute(id=1, name="llama", copies=[CopyRoute(id=n, number=n, deployment="llama", host="127.0.0.1", port=n, since="")
                                                        for n in (1, 2, 3)])
    assert [route.pick().id for _ in range(6)] == [1, 2, 3, 1, 2, 3]
    route.copies[0].in_flight, route.copies[1].in_flight, route.copies[2].in_flight = 2, 1, 3
    assert {route.pick().id for _ in range(5)} == {2}
    route.copies[1].take_out("Connection refused")
    assert route.pick().id == 1 and route.pick(tried={1}).id == 3 and route.pick(tried={1, 3}) is None


def test_a_refresh_keeps_requests_in_flight_and_rotation_but_a_restarted_copy_comes_back_clean():
    table = RouteTable()
    snapshot = Snapshot(deployments=(("llama", 1, 0),), copies=((7, 1, 1, "a", 1, "t1"), (8, 1, 2, "b", 1, "t1")),
                        keys=(("h", 3, (), False),))
    table.apply(snapshot)
    first, second = table.copies[7], table.copies[8]
    first.in_flight = 4
    second.take_out("Connection refused")
    table.apply(Snapshot(deployments=snapshot.deployments, copies=((7, 1, 1, "a", 1, "t1"), (8, 1, 2, "b", 1, "t2")),
                         keys=snapshot.keys))
    assert table.copies[7] is first and first.in_flight == 4
    assert table.copies[8] is not second and not table.copies[8].out, "started again: in rotation"


# -- streams ----------------------------------------------------------------------------------------------


def test_streamed_chunks_reach_the_client_as_the_copy_sends_them(cluster, upstreams, start_gateway):
    paced = upstreams("paced", tokens=5, pause=0.25)
    serving(deployment_of(cluster, name="llama"), paced)
    secret = a_key()
    client = start_gateway().client(secret)

    arrivals, events = [], []
    started = time.monotonic()
    with client.stream("POST", CHAT, json={"model": "llama", "stream": True, "messages": []}) as response:
        assert response.status_code == 200 and response.headers["content-type"] == "text/event-stream"
        for line in response.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic() - started)
                events.append(line[6:])

    assert events[-1] == "[DONE]" and len(events) == 6
    assert arrivals[0] < 0.2, f"the first token came after {arrivals[0]:.3f} s: held back"
    gaps = [later - earlier for earlier, later in zip(arrivals, arrivals[1:4])]
    assert all(0.15 < gap < 0.4 for gap in gaps), f"tokens arrived in a lump, not as sent: {arrivals}"
    assert arrivals[0] < arrivals[-1] - 0.8, "the first token arrived before the copy had finished"


def test_a_client_that_leaves_a_stream_makes_the_gateway_leave_the_copy_too(cluster, upstreams, start_gateway):
    long = upstreams("long", tokens=200, pause=0.02)
    serving(deployment_of(cluster, name="llama"), long)
    secret = a_key()
    client = start_gateway().client(secret)

    with client.stream("POST", CHAT, json={"model": "llama", "stream": True, "messages": []}) as response:
        for _ in zip(range(3), response.iter_lines()):
            pass

    wait_for(lambda: long.aborted == 1, timeout=3)


@pytest.mark.parametrize("http", [BoundedHttpToolsProtocol, "httptools"], ids=["gateway-protocol", "uvicorn-httptools"])
def test_a_client_that_leaves_while_a_whole_answer_is_made_frees_its_place_at_once(cluster, upstreams, start_gateway,
                                                                                   http):
    """The gateway's protocol cancels the request itself; under another server, a task watches for the disconnect."""
    slow = upstreams("slow")
    slow.hold = threading.Event()
    serving(deployment_of(cluster, name="llama"), slow)
    secret = a_key()
    gateway = start_gateway(http)
    copy = gateway.app.table.deployments["llama"].copies[0]
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{gateway.url}{CHAT}", json={"model": "llama", "messages": []}, timeout=0.3,
                       headers={"Authorization": f"Bearer {secret}"})
        assert slow.arrived() == 1
        wait_for(lambda: copy.in_flight == 0, timeout=1)  # let go of the copy before it answered
    finally:
        slow.hold.set()
    assert not gateway.app.table.out_of_rotation() and chat(gateway.client(secret), "llama").status_code == 200


# -- failures ---------------------------------------------------------------------------------------------


def test_a_copy_that_refuses_is_skipped_taken_out_of_rotation_reported_and_back_once_healthy(
        cluster, upstreams, start_gateway, redis):
    client_redis, prefix = redis
    alive = upstreams("alive")
    dead_port = closed_port()
    llama = deployment_of(cluster, name="llama")
    dead = serving(llama, dead_port, 1)
    serving(llama, alive, 2)
    secret = a_key()
    gateway = start_gateway()
    client = gateway.client(secret)

    answers = [chat(client, "llama") for _ in range(6)]

    assert [a.status_code for a in answers] == [200] * 6 and {answered_by(a) for a in answers} == {"alive"}
    reports = wait_for(lambda: failures.failures_take(client=client_redis, prefix=prefix))
    assert len(reports) == 1, "reported once, when it went out of rotation"
    assert reports[0] | {"at": None, "gateway": None} == {
        "copy": dead.pk, "deployment": llama.pk, "name": "llama", "number": 1, "url": f"http://127.0.0.1:{dead_port}",
        "error": "Connection refused", "at": None, "gateway": None}
    assert failures.failures_recent(client=client_redis, prefix=prefix)[0]["copy"] == dead.pk

    revived = upstreams("revived", port=dead_port)  # the copy answers again on its port
    wait_for(lambda: revived.arrived() or answered_by(chat(client, "llama")) == "revived", timeout=3)
    assert not gateway.app.table.out_of_rotation()


def hanging_up(deployment, number: int, taken: list) -> socket.socket:
    """Copy ``number`` of ``deployment``, serving on a listener that reads each request (into ``taken``),
    then closes the connection without a word (an engine dying)."""
    listener = socket.create_server(("127.0.0.1", 0))
    serving(deployment, listener.getsockname()[1], number)

    def take_and_hang_up():
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            taken.append(connection.recv(65536))
            connection.close()

    threading.Thread(target=take_and_hang_up, daemon=True).start()
    return listener


def one_chat(start_gateway, *listeners):
    """A gateway that does not probe, a client with a key, and the answer to one chat with llama; the
    hanging-up listeners closed after it."""
    secret = a_key()  # before the gateway starts: its first tables hold the key
    gateway = start_gateway(probe_every=60)
    client = gateway.client(secret)
    try:
        return gateway, client, chat(client, "llama")
    finally:
        for listener in listeners:
            listener.close()


def test_a_copy_that_closes_the_connection_before_answering_has_the_request_sent_once_more_to_another(
        cluster, upstreams, start_gateway, redis):
    client_redis, prefix = redis
    taken = []
    llama = deployment_of(cluster, name="llama")
    listener = hanging_up(llama, 1, taken)
    other = upstreams("other")
    serving(llama, other, 2)
    gateway, client, answer = one_chat(start_gateway, listener)  # to copy #1: a tie takes the first copy in turn

    assert answer.status_code == 200 and answered_by(answer) == "other"
    assert len(taken) == 1 and other.arrived() == 1
    assert [c.number for c in gateway.app.table.out_of_rotation()] == [1]
    report = wait_for(lambda: failures.failures_take(client=client_redis, prefix=prefix))[0]
    assert report["number"] == 1 and "closed the connection before it answered" in report["error"]


def test_a_request_two_copies_hang_up_on_is_not_sent_to_a_third(cluster, upstreams, start_gateway):
    taken = []
    llama = deployment_of(cluster, name="llama")
    listeners = hanging_up(llama, 1, taken), hanging_up(llama, 2, taken)
    third = upstreams("third")
    serving(llama, third, 3)
    gateway, client, answer = one_chat(start_gateway, *listeners)

    assert answer.status_code == 502 and answer.json()["error"]["code"] == "copy_failed"
    message = answer.json()["error"]["message"]
    assert message.startswith("Copy #1 of 'llama' closed the connection before it answered; sent once more, copy #2 ")
    assert len(taken) == 2 and third.arrived() == 0, "a request that kills engines is not sent to every copy in turn"
    assert sorted(c.number for c in gateway.app.table.out_of_rotation()) == [1, 2]
    assert answered_by(chat(client, "llama")) == "third"


def test_a_stream_the_copy_breaks_off_ends_with_an_error_event_and_the_copy_goes_out_of_rotation(cluster, start_gateway):
    listener = socket.create_server(("127.0.0.1", 0))

    def one_token_then_hang_up():
        connection, _ = listener.accept()
        connection.recv(65536)
        connection.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                           b"10\r\ndata: {\"n\": 1}\n\n\r\n")
        time.sleep(0.1)
        connection.close()

    threading.Thread(target=one_token_then_hang_up, daemon=True).start()
    serving(deployment_of(cluster, name="llama"), listener.getsockname()[1])
    secret = a_key()
    gateway = start_gateway(probe_every=60)
    try:
        with gateway.client(secret).stream("POST", CHAT, json={"model": "llama", "stream": True}) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    finally:
        listener.close()

    assert response.status_code == 200 and events[0] == '{"n": 1}'
    error = json.loads(events[1])["error"]
    assert error["code"] == "copy_failed" and "closed the connection in the middle of its answer" in error["message"]
    assert [c.number for c in gateway.app.table.out_of_rotation()] == [1]


def test_a_copy_slower_than_the_read_timeout_is_answered_504_and_stays_in_rotation(cluster, upstreams, start_gateway):
    slow = upstreams("slow")
    slow.hold = threading.Event()
    serving(deployment_of(cluster, name="llama"), slow)
    secret = a_key()
    gateway = start_gateway(read_timeout=0.3)
    try:
        answer = chat(gateway.client(secret), "llama")
    finally:
        slow.hold.set()

    assert answer.status_code == 504 and answer.json()["error"]["code"] == "copy_timeout"
    assert "did not answer within 0.3 s" in answer.json()["error"]["message"]
    assert not gateway.app.table.out_of_rotation()


def test_a_kept_alive_connection_the_copy_closed_is_replaced_without_the_client_noticing(cluster, upstreams, start_gateway):
    engine = upstreams("engine")
    serving(deployment_of(cluster, name="llama"), engine)
    secret = a_key()
    gateway = start_gateway()
    client = gateway.client(secret)
    assert chat(client, "llama").status_code == 200

    engine.server.close_connections()  # as an engine restarting its listener, or its idle timeout, would
    time.sleep(0.05)
    answers = [chat(client, "llama").status_code for _ in range(3)]

    assert answers == [200, 200, 200] and not gateway.app.table.out_of_rotation()


def test_a_request_whose_copies_all_refuse_is_told_no_copy_is_serving(cluster, start_gateway):
    llama = deployment_of(cluster, name="llama")
    serving(llama, closed_port(), 1)
    serving(llama, closed_port(), 2)
    secret = a_key()
    client = start_gateway(probe_every=60).client(secret)

    refused = chat(client, "llama")

    assert refused.status_code == 503
    error = refused.json()["error"]
    assert error["code"] == "no_copy_serving" and error["type"] == "server_error"
    assert error["message"].startswith("No copy of 'llama' is serving now; the gateway could not reach any of its 2 serving copies")
    assert "Connection refused" in error["message"]
    assert client.get("/v1/models").json()["data"] == [], "a deployment with no copy in rotation is not listed"


def test_a_copy_that_answers_500_is_passed_on_and_counted_as_an_error(cluster, upstreams, start_gateway, redis):
    client_redis, prefix = redis
    llama = deployment_of(cluster, name="llama")
    serving(llama, upstreams("engine"))
    secret = a_key()
    gateway = start_gateway(flush_every=0.2)
    client = gateway.client(secret)

    answers = [chat(client, "llama", content) for content in ("hi", "please fail", "hello", "again")]
    chat(client, "nobody")  # refused by the gateway itself
    figures = wait_for(lambda: (f := traffic.traffic([llama.pk], client=client_redis, prefix=prefix)[llama.pk]).requests == 4 and f)

    assert [a.status_code for a in answers] == [200, 500, 200, 200]
    assert answers[1].json()["error"]["message"] == "the engine failed"
    assert figures.errors == 1 and figures.requests_per_minute == pytest.approx(4 / traffic.WINDOW_MINUTES)
    assert 0 < figures.p50_ms <= figures.p99_ms < 1000 and figures.per_minute[-1] == 4
    assert traffic.gateway_refused(client=client_redis, prefix=prefix) == 1
    assert not gateway.app.table.out_of_rotation(), "an engine's 500 does not take its copy out of rotation"
    processes = traffic.gateway_processes(client=client_redis, prefix=prefix)
    assert len(processes) == 1 and processes[0]["copies"] == 1 and processes[0]["routes_error"] == ""


# -- keys -------------------------------------------------------------------------------------------------


def test_keys_missing_wrong_revoked_and_limited_are_refused_in_words(cluster, upstreams, start_gateway):
    llama = deployment_of(cluster, name="llama")
    serving(llama, upstreams("llama"))
    serving(deployment_of(cluster, ready_model("org/qwen"), name="qwen"), upstreams("qwen"))
    key, secret = gateway_keys.gateway_key_create(name="revoked soon")
    limited = a_key(deployments=["qwen"])
    gateway = start_gateway()

    missing = chat(gateway.client(None), "llama")
    wrong = chat(gateway.client("fs-" + "x" * 43), "llama")
    not_bearer = gateway.client(None).post(CHAT, json={"model": "llama"}, headers={"Authorization": f"Basic {secret}"})
    assert chat(gateway.client(secret), "llama").status_code == 200
    gateway_keys.gateway_key_revoke(key=key)
    revoked = wait_for(lambda: (r := chat(gateway.client(secret), "llama")).status_code == 401 and r, timeout=1)
    other_model = chat(gateway.client(limited), "llama")

    for answer in (missing, wrong, not_bearer, revoked):
        assert answer.status_code == 401
        assert answer.json()["error"]["type"] == "invalid_request_error" and answer.json()["error"]["code"] == "invalid_api_key"
    assert missing.json()["error"]["message"].startswith("You didn't provide an API key.")
    assert wrong.json()["error"]["message"].startswith("Incorrect API key provided: fs-xxxxx…xxxx.")
    assert "revoked" in revoked.json()["error"]["message"] and secret not in revoked.text
    assert other_model.status_code == 403 and other_model.json()["error"] == {
        "message": "This API key may not use the model 'llama': it is limited to qwen. Ask an Operator for a key that may.",
        "type": "invalid_request_error", "param": "model", "code": "model_not_allowed"}
    assert chat(gateway.client(limited), "qwen").status_code == 200
    assert [m["id"] for m in gateway.client(limited).get("/v1/models").json()["data"]] == ["qwen"]


def test_a_keys_last_use_is_written_by_the_gateway(cluster, upstreams, start_gateway):
    serving(deployment_of(cluster, name="llama"), upstreams("llama"))
    key, secret = gateway_keys.gateway_key_create(name="used")
    client = start_gateway().client(secret)

    chat(client, "llama")

    wait_for(lambda: GatewayKey.objects.get(pk=key.pk).last_used_at is not None, timeout=2)


# -- errors -----------------------------------------------------------------------------------------------


def test_the_errors_a_client_can_meet_are_openais_shape_and_say_what_to_do(cluster, upstreams, start_gateway):
    serving(deployment_of(cluster, name="llama"), upstreams("llama"))
    serving(deployment_of(cluster, ready_model("org/qwen"), name="qwen"), upstreams("qwen"))
    starting = deployment_of(cluster, ready_model("org/big"), name="big")
    serving(starting, closed_port(), state=CopyState.STARTING)
    secret = a_key()
    client = start_gateway().client(secret)

    unknown = chat(client, "gpt-4")
    none_serving = chat(client, "big")
    no_model = client.post(CHAT, json={"messages": []})
    not_json = client.post(CHAT, content=b"{not json", headers={"content-type": "application/json"})
    wrong_method = client.get(CHAT)
    wrong_path = client.post("/v1/images/generations", json={"model": "llama"})

    assert unknown.status_code == 404 and unknown.json() == {"error": {
        "message": "The model 'gpt-4' does not exist: the gateway serves llama, qwen.",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
    assert none_serving.status_code == 503 and none_serving.json()["error"]["message"] == (
        "No copy of 'big' is serving now; its copies are queued, starting, stopped or failed: the deployment's page in "
        "the console says which.")
    assert no_model.status_code == 400 and no_model.json()["error"]["param"] == "model"
    assert "You must provide a model parameter" in no_model.json()["error"]["message"]
    assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "invalid_json"
    assert wrong_method.status_code == 405 and wrong_path.status_code == 404
    assert wrong_path.json()["error"]["message"].startswith("Invalid URL (POST /v1/images/generations)")
    assert httpx.get(f"{str(client.base_url).rstrip('/')}/health").json() == {"status": "ok"}, "the gateway's own health needs no key"


def test_a_body_over_the_limit_is_refused_before_it_reaches_a_copy(cluster, upstreams, start_gateway):
    engine = upstreams("llama")
    serving(deployment_of(cluster, name="llama"), engine)
    secret = a_key()
    client = start_gateway(max_body=1000).client(secret)

    refused = chat(client, "llama", "x" * 2000)

    assert refused.status_code == 413 and refused.json()["error"]["code"] == "request_too_large"
    assert engine.arrived() == 0


# -- the route table follows the database ----------------------------------------------------------------


def test_a_new_serving_copy_is_used_within_a_second_and_a_stopped_one_is_dropped(cluster, upstreams, start_gateway):
    first, second = upstreams("first"), upstreams("second")
    llama = deployment_of(cluster, name="llama")
    serving(llama, first, 1)
    secret = a_key()
    gateway = start_gateway(refresh_every=0.5)  # the default: what faden serve runs
    client = gateway.client(secret)
    assert {answered_by(chat(client, "llama")) for _ in range(4)} == {"first"}

    added_at = time.monotonic()
    copy = serving(llama, second, 2)
    wait_for(lambda: answered_by(chat(client, "llama")) == "second", timeout=1.0)
    picked_up = time.monotonic() - added_at
    Copy.objects.filter(pk=copy.pk).update(state=CopyState.STOPPING)
    stopped_at = time.monotonic()
    wait_for(lambda: len(gateway.app.table.deployments["llama"].copies) == 1, timeout=1.0)

    assert picked_up < 1.0 and time.monotonic() - stopped_at < 1.0
    assert {answered_by(chat(client, "llama")) for _ in range(4)} == {"first"}
    qwen = deployment_of(cluster, ready_model("org/qwen"), name="qwen")
    serving(qwen, second, 1)
    wait_for(lambda: chat(client, "qwen").status_code == 200, timeout=1.0)


# -- OpenAI's own client ------------------------------------------------------------------------------------


def test_openais_python_client_works_against_the_gateway(cluster, upstreams, start_gateway):
    import openai

    serving(deployment_of(cluster, name="llama"), upstreams("llama", tokens=4))
    secret = a_key()
    gateway = start_gateway()
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=secret, max_retries=0)

    answer = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}])
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "hi"}], stream=True))
    vectors = client.embeddings.create(model="llama", input="hi")

    assert answer.choices[0].message.content == "the gateway passes each" and streamed == "the gateway passes each "
    assert vectors.data[0].embedding == [0.1, 0.2, 0.3]
    assert [m.id for m in client.models.list()] == ["llama"]
    with pytest.raises(openai.NotFoundError, match="The model 'gpt-4' does not exist: the gateway serves llama."):
        client.chat.completions.create(model="gpt-4", messages=[])
    with pytest.raises(openai.AuthenticationError, match="Incorrect API key provided"):
        openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="fs-" + "z" * 43, max_retries=0).models.list()
