"""Deployments on the lab, with a real worker, beat and gateway, on one three-machine cluster ("serve"): the
small lab model deployed as 2 copies of 2 GPUs and called through the gateway; the cluster stopped and
started and the deployment serving again; the console's processes restarted while the copies keep
answering; Encrypt model traffic on the cluster, started as if before model traffic was encrypted, while a
client calls the gateway without pause; a copy over two machines (behind TLS); and a queued copy that starts by itself once another deployment's
delete frees the room; a serving machine drained while a client calls the gateway, then its drain stopped.
Then a person's own job on a GPU of lab-a: its heartbeat brings it to the machine's page, and placement leaves
its GPUs alone. Last, a deployment deleted while lab-b's link is down: its copy there runs on without a
deployment until it is found and taken over. After it, lab-b (serving) is removed from the running cluster
while a client calls and the console's worker is killed in the middle of the drain, and joins a cluster of its own.
Between the first test and the rest: a deployment routed cache-aware keeps a conversation on its copy.

The machines run the lab's `process` runtime: the engines are real processes reading the model's files
from each machine's store. The main path on the real runtime (deploy, the gateway, scale, a killed copy
restarted) runs in Podman's containers in the cluster life module (test_cluster_life_lab.py), on the
cluster it has running already; the agent's copies in Podman alone in tests/lab/test_copies_lab.py."""
import http.client
import json
import os
import re
import ssl
import threading
import time
import urllib.error
import urllib.request

import pytest
from django.test import Client

from clusters import encryption
from clusters.choices import ClusterState
from clusters.models import Cluster, ClusterMember
from clusters.services import cluster_delete, cluster_start, cluster_stop
from console import pki, roles
from console.choices import JOB_TERMINAL, JobState
from console.models import Job
import deployments.serving
from deployments import copy_keys, copy_tls, drain, drain_input, gateway_keys, model_traffic, orphans, placement_input, services
from deployments.choices import CopyState, DrainState, Routing
from deployments.gateway import traffic
from deployments.forms import ask_from
from deployments.models import Copy, Deployment, Drain, EngineSample, KeyUsage
from machines.agent_client import Agent
from machines.choices import MachineState
from machines.models import Accelerator, Machine
from tests.factories import UserFactory
from tests.harness import INTERVALS, all_up, enrol, images_import, leave_nothing_running, running, wait_for
from tests.integration.serve_lab import KIND, Caller, StreamCaller, call, chat, copies_cleared, serving, tiny_model
from tests.processes import console_processes

pytestmark = [pytest.mark.lab]

MACHINES = ("lab-a", "lab-b", "lab-c")


METRICS_TOKEN = "lab-metrics-token-0123456789abcdef"


@pytest.fixture(scope="module")
def console(lab, module_db):
    # Prometheus's token for both /metrics; the health checks read the engines' own (off in the other tests, whose
    # copies' addresses are made up); a cache-aware copy may hold one request more than the least busy one.
    env = {**INTERVALS, "FADEN_METRICS_TOKEN": METRICS_TOKEN, "FADEN_TEST_ENGINE_METRICS_TIMEOUT": "2",
           "FADEN_GATEWAY_PREFIX_BOUND": "1"}
    with console_processes(beat=True, env=env, enqueue=True, gateway=True) as processes:
        yield processes


@pytest.fixture(scope="module")
def machines(console, lab):
    images_import(lab)
    enrolled = {m.name: m for m in enrol(lab, *MACHINES)}
    yield enrolled
    for deployment in Deployment.objects.all():
        Copy.objects.filter(deployment=deployment).delete()
        deployment.delete()
    lab.heal()
    copies_cleared(Machine.objects.filter(name__in=MACHINES))
    leave_nothing_running(Machine.objects.filter(name__in=MACHINES))


@pytest.fixture(scope="module")
def cluster(machines):
    """The module's one cluster, started once: each test leaves it running."""
    return running("serve", [machines[name] for name in MACHINES])


@pytest.fixture(scope="module")
def model(machines):
    return tiny_model()


def test_a_model_deployed_called_stopped_started_and_served_through_restarts(lab, console, cluster, model):
    operator = UserFactory(username="ops-lab", role=roles.OPERATOR)
    # As a cluster started before model traffic was encrypted: its copies serve plain HTTP until Encrypt model traffic.
    Cluster.objects.filter(pk=cluster.pk).update(model_tls=False)
    ask = ask_from({"name": "tiny", "copies": 2, "kind": KIND, "gpu_quarters": 8,
                    "memory_per_gpu_gib": 8, "context_length": 2048}, cluster=cluster, model=model)
    deployment = services.deployment_create(ask=ask, user=operator)
    wait_for(serving(2), timeout=120, what="two copies serving")
    assert len({c.machine_id for c in deployment.copy_rows.all()}) == 2  # spread

    _, key = gateway_keys.gateway_key_create(name="lab", user=operator)
    since = time.time()  # the deployment's first requests (its charts' first minute)
    wait_for(lambda: chat(console, key)[0] != 401, timeout=5, what="the gateway to know the new key", every=0.2)
    status, body = chat(console, key)
    assert status == 200, body
    assert chat(console, "fs-not-a-key")[0] == 401
    # A key limited to 5 requests a minute gets its sixth refused with Retry-After, in OpenAI's shape; the refusal
    # and the requests reach its usage by the hour in the database (beat's copy from Redis).
    limited_key, limited = gateway_keys.gateway_key_create(name="lab-limited", requests_per_minute=5, user=operator)
    wait_for(lambda: chat(console, limited)[0] != 401, timeout=5, what="the gateway to know the limited key", every=0.2)
    assert [chat(console, limited)[0] for _ in range(4)] == [200] * 4  # with the one above, five
    refused = urllib.request.Request(f"{console.gateway_url}/v1/chat/completions", method="POST", data=json.dumps(
        {"model": "tiny", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8}).encode(),
        headers={"Authorization": f"Bearer {limited}", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as sixth:
        urllib.request.urlopen(refused, timeout=10)
    assert sixth.value.code == 429 and 1 <= int(sixth.value.headers["Retry-After"]) <= 120
    error = json.loads(sixth.value.read())["error"]
    assert error["code"] == "rate_limit_exceeded" and "may make 5 requests a minute" in error["message"], error
    wait_for(lambda: KeyUsage.objects.filter(key=limited_key, requests=5, refused=1).exists(), timeout=30, every=0.5,
             what="the limited key's usage copied to the database")
    # Prometheus scrapes the gateway and the console, with the token; the health checks read the engines' figures.
    gateway = scraped(f"{console.gateway_url}/metrics")
    assert gateway["fadenstack_gateway_requests"][("2xx", "tiny")] >= 6, gateway["fadenstack_gateway_requests"]
    assert gateway["fadenstack_gateway_limit_refusals"][("requests",)] == 1
    assert gateway["fadenstack_gateway_time_to_first_token_seconds"][("tiny",)] >= 6  # its count
    ours = scraped(f"{console.url}/metrics")
    assert ours["fadenstack_copies"][("tiny", "serving")] == 2 and ours["fadenstack_clusters"][("running",)] == 1, ours
    wait_for(lambda: set(EngineSample.objects.filter(deployment=deployment, running__isnull=False)
                         .values_list("copy_number", flat=True)) == {1, 2}, timeout=30, what="the engines' figures read")
    # A copy answers only the gateway: called directly, without its own key or with the client's, it refuses.
    copy = deployment.copy_rows.first()
    direct = f"http://{copy.address}:{copy.port}/v1/chat/completions"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8}
    assert call(direct, "", body)[0] == 401 and call(direct, key, body)[0] == 401
    assert call(direct, copy_keys.copy_key_of(copy.pk, copy.api_key_sealed), body)[0] == 200

    # Stop keeps the deployment; Start applies it again.
    cluster_stop(cluster=Cluster.objects.get(pk=cluster.pk))
    wait_for(lambda: Cluster.objects.filter(pk=cluster.pk, state=ClusterState.STOPPED).exists(), timeout=60, what="Stopped")
    assert set(deployment.copy_rows.values_list("state", flat=True)) == {CopyState.STOPPED}
    assert chat(console, key)[0] == 503
    cluster_start(cluster=Cluster.objects.get(pk=cluster.pk))
    wait_for(lambda: all_up("serve", 3), timeout=120, what="Running again")
    wait_for(serving(2), timeout=120, what="the copies serving again after Start")
    # The gateway picks up copies within a second of their Serving.
    wait_for(lambda: chat(console, key)[0] == 200, timeout=3, every=0.2, what="the gateway to route to them again")

    # From here to the charts, two clients call without pause (the figures the charts draw).
    loaded = [Caller(console, key), Caller(console, key)]
    for caller in loaded:
        caller.start()

    # The console's processes restart; the copies (and the gateway) keep answering throughout.
    pids = dict(Copy.objects.filter(deployment=deployment).values_list("number", "pid"))
    caller = Caller(console, key)
    caller.start()
    console.restart("web", "worker", "beat")
    time.sleep(2)
    statuses = caller.stop()
    assert statuses and set(statuses) == {200}, statuses
    assert dict(Copy.objects.filter(deployment=deployment).values_list("number", "pid")) == pids

    # Encrypt model traffic while a client calls the gateway without pause: the copies load again behind TLS one
    # at a time, each replacement serving before the old one stops; no request fails.
    caller = Caller(console, key)
    caller.start()
    assert model_traffic.model_traffic_encrypt(Cluster.objects.get(pk=cluster.pk), user=operator) == ["tiny"]
    wait_for(lambda: serving(2)() and set(Copy.objects.filter(deployment=deployment).values_list("tls", flat=True)) == {True},
             timeout=90, what="both copies replaced behind TLS")
    time.sleep(1)  # the gateway's next refresh: it routes to the new copies only
    statuses = caller.stop()
    assert statuses and set(statuses) == {200}, statuses
    assert set(Copy.objects.filter(deployment=deployment).values_list("number", flat=True)) == {3, 4}
    # Called directly, a copy behind TLS refuses a client without a certificate of the console's authority (and
    # plain HTTP); with the console's client certificate and the copy's own key it answers.
    copy = deployment.copy_rows.first()
    secure = f"https://{copy.address}:{copy.port}/v1/chat/completions"
    own = copy_keys.copy_key_of(copy.pk, copy.api_key_sealed)
    trusting = ssl.create_default_context(cadata=pki.ca_pem())
    for refused in (lambda: call_tls(secure, own, body, trusting), lambda: call(f"http://{copy.address}:{copy.port}/health", own, body)):
        with pytest.raises((ssl.SSLError, OSError, urllib.error.URLError, http.client.HTTPException)):
            refused()
    assert call_tls(secure, own, body, copy_tls.client_context().context)[0] == 200

    # Renew certificates while a client calls: each copy takes its new certificate for new connections, without
    # a restart, and no request fails.
    served = served_serial(copy)
    pids = dict(Copy.objects.filter(deployment=deployment).values_list("number", "pid"))
    caller = Caller(console, key)
    caller.start()
    job = encryption.cluster_certificates_renew(cluster=Cluster.objects.get(pk=cluster.pk))
    done = wait_for(lambda: Job.objects.filter(pk=job.pk, state__in=JOB_TERMINAL).first(), timeout=30, what="the renewal")
    time.sleep(1)
    statuses = caller.stop()
    assert done.state == JobState.SUCCEEDED, (done.error, done.log)
    assert statuses and set(statuses) == {200}, statuses
    assert served_serial(copy) != served
    assert dict(Copy.objects.filter(deployment=deployment).values_list("number", "pid")) == pids

    # The deployment's page under load, in Chromium: its charts draw the gateway's traffic and the engines' figures.
    charts_drawn_under_load(console, deployment, since)
    assert {status for caller in loaded for status in caller.stop()} == {200}

    # A copy larger than any machine (16 GPUs; the machines have 8) spans two machines through a Ray of its
    # own: each pipeline stage on the GPUs the plan gave it there; served through the gateway; deleted, it
    # leaves nothing running on either machine.
    services.deployment_scale(deployment=deployment, copies=0, user=operator)
    wait_for(lambda: not Copy.objects.filter(deployment=deployment).exists(), timeout=60, what="tiny scaled to 0")
    wide = services.deployment_create(ask=ask_from(
        {"name": "tiny-wide", "copies": 1, "kind": "nvidia|H100 80GB|81559|x86_64", "gpu_quarters": 64,
         "memory_per_gpu_gib": 8, "context_length": 2048}, cluster=cluster, model=model), user=operator)
    wait_for(lambda: Copy.objects.filter(deployment=wide, state__in=[CopyState.SERVING, CopyState.FAILED]).exists(),
             timeout=120, what="the copy over two machines serving")
    copy = Copy.objects.get(deployment=wide)
    assert copy.state == CopyState.SERVING, (copy.state_reason, copy.log_tail)
    members = {m.machine_id: m for m in cluster.members.select_related("machine")}
    first, second = (members[slot["machine"]] for slot in copy.slots)
    with Agent.open(first.machine) as agent:
        log = "\n".join(agent.copy_logs(copy.key, lines=200))
    for member in (first, second):  # a stage on each machine, on the 8 GPUs the plan gave it there
        assert re.search(rf"pipeline stage [01] on {re.escape(member.address)}: GPUs 0,1,2,3,4,5,6,7$", log, re.M), log
    def wide_call():
        return call(f"{console.gateway_url}/v1/chat/completions", key,
                    {"model": "tiny-wide", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 4})

    # As above: the gateway routes to a copy within a second or so of its Serving, not at the same instant.
    wait_for(lambda: wide_call()[0] != 503, timeout=3, every=0.2, what="the gateway to route to tiny-wide")
    status, body = wide_call()
    assert status == 200, body
    services.deployment_delete(deployment=wide, user=operator)
    wait_for(lambda: not Deployment.objects.filter(pk=wide.pk).exists(), timeout=60, what="tiny-wide deleted")
    for member in (first, second):
        with Agent.open(member.machine) as agent:
            assert [s.copy for s in agent.copy_list()] == []


PASSWORD = "a-lab-browser-password"


def charts_drawn_under_load(console, deployment: Deployment, since: float) -> None:
    """The deployment's page in Chromium while clients call it (since ``since``): once the gateway has counted a
    whole minute of its traffic and a health check has read an engine with a request running (and the KV cache it
    holds), the six charts draw from those figures: the gateway's requests and latency (its minutes in Redis) and
    the engines' requests, generation and KV cache; a later check, pushed to the page, shows requests running now."""
    from playwright.sync_api import expect, sync_playwright

    from tests import chromium

    viewer = UserFactory(username="lab-viewer", role=roles.VIEWER)
    viewer.set_password(PASSWORD)
    viewer.save()
    wait_for(lambda: time.time() // 60 > since // 60 and traffic.traffic_minutes(
        deployment.pk, [int(since // 60)])[0].requests, timeout=70, every=0.5, what="a whole minute of traffic counted")
    wait_for(lambda: EngineSample.objects.filter(deployment=deployment, running__gte=1, kv_cache__gt=0).exists(),
             timeout=30, every=0.2, what="a health check to read an engine with a request running")
    with sync_playwright() as playwright:
        browser = chromium.launch(playwright)
        try:
            page = chromium.signed_in(browser, console.url, viewer.username, PASSWORD)
            page.goto(f"/deployments/{deployment.pk}/")
            charts = page.locator("#deployment-charts")
            expect(charts.locator("figure.chart")).to_have_count(6)
            # Each check pushes the engines' side again: the generation's rate needs a copy's samples 30 s apart (the
            # copies are new since Encrypt), and one check finds a request running (two clients keep them busy).
            for title, wait in (("Requests", 5000), ("Latency", 5000), ("Requests in the engines", 40000),
                                ("Generation", 40000), ("KV-cache use", 40000)):
                figure = charts.locator("figure.chart").filter(
                    has=page.locator(".chart__title", has_text=re.compile(f"^{re.escape(title)}$")))
                expect(figure.locator(".chart__empty")).to_have_count(0, timeout=wait)
                assert figure.locator("path.chart__line, circle.chart__dot").count() >= 1, f"{title} draws"
            counted = charts.locator("#deployment-charts-gateway .chart__key", has_text="Requests").locator("strong")
            assert int(counted.inner_text().replace(",", "")) >= 1, counted.inner_text()
            running = charts.locator(".chart__key", has_text="Running").locator("strong")
            expect(running).to_have_text(re.compile(r"^[1-9][0-9]*$"), timeout=40000)
            if directory := os.environ.get("FADEN_SCREENSHOTS"):
                page.screenshot(path=os.path.join(directory, "lab-deployment-under-load.png"), full_page=True)
        finally:
            browser.close()


def served_serial(copy: Copy) -> int:
    """The serial number of the certificate ``copy`` presents to a new connection now."""
    import socket

    from cryptography import x509

    context = copy_tls.client_context().context
    context.check_hostname = False
    with socket.create_connection((copy.address, copy.port), timeout=10) as raw:
        with context.wrap_socket(raw) as connection:
            return x509.load_der_x509_certificate(connection.getpeercert(binary_form=True)).serial_number


def call_tls(url: str, key: str, body: dict, context: ssl.SSLContext) -> tuple[int, bytes]:
    import json
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10, context=context) as answer:
        return answer.status, answer.read()


def scraped(url: str) -> dict[str, dict[tuple, float]]:
    """A /metrics page read with the token and parsed as Prometheus parses it: {family: {label values in the labels'
    names' order: value}} (a histogram's buckets and sum are left out: its count is under the family's name)."""
    from prometheus_client.parser import text_string_to_metric_families

    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        text = answer.read().decode()
    families: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        samples = families.setdefault(family.name, {})
        for sample in family.samples:
            if sample.name.endswith(("_bucket", "_sum", "_created")):
                continue
            samples[tuple(v for k, v in sorted(sample.labels.items()))] = sample.value
    return families


def engine_figure(copy: Copy, name: str) -> float:
    """A figure of the copy's engine, as its own /metrics shows it (behind TLS, with the copy's key), summed over
    its labels: ``vllm:request_success_total`` (requests answered), ``vllm:num_requests_running``."""
    request = urllib.request.Request(f"https://{copy.address}:{copy.port}/metrics", headers={
        "Authorization": f"Bearer {copy_keys.copy_key_of(copy.pk, copy.api_key_sealed)}"})
    context = copy_tls.client_context().context
    context.check_hostname = False
    with urllib.request.urlopen(request, timeout=10, context=context) as answer:
        text = answer.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if re.match(rf"{re.escape(name)}[{{ ]", line))


def test_a_conversation_routed_cache_aware_stays_on_its_copy_unless_that_copy_is_busy(console, cluster, model):
    """"tiny-cache", 2 copies, routed cache-aware: the turns of a conversation (a long system prompt, the turns so far)
    all go to one copy; a new conversation goes to the other while the first copy is busy; and a turn that comes while
    the conversation's copy holds more requests than the least busy one by more than the bound (1 here) goes to the
    least busy."""
    operator = UserFactory(username="ops-cache", role=roles.OPERATOR)
    deployment = services.deployment_create(ask=ask_from(
        {"name": "tiny-cache", "copies": 2, "kind": KIND, "gpu_quarters": 8, "memory_per_gpu_gib": 8,
         "context_length": 2048, "routing": Routing.CACHE_AWARE}, cluster=cluster, model=model), user=operator)
    wait_for(serving(2, "tiny-cache"), timeout=60, what="tiny-cache serving")
    assert Deployment.objects.get(pk=deployment.pk).routing == Routing.CACHE_AWARE
    _, key = gateway_keys.gateway_key_create(name="cache", user=operator)
    wait_for(lambda: chat(console, key, model="tiny-cache")[0] == 200, timeout=5, every=0.2, what="the gateway to route")
    copies = list(deployment.copy_rows.order_by("number"))

    def counts() -> list[float]:
        return [engine_figure(copy, "vllm:request_success_total") for copy in copies]

    def turn(messages: list[dict], *, max_tokens: int = 8, stream: bool = False) -> tuple[int, bytes]:
        return call(f"{console.gateway_url}/v1/chat/completions", key, {
            "model": "tiny-cache", "messages": messages, "max_tokens": max_tokens, "stream": stream}, timeout=60)

    system = {"role": "system", "content": "You answer questions about the lab's machines, briefly and exactly. " * 40}
    conversation = [system]
    before = counts()
    for number in range(3):
        conversation.append({"role": "user", "content": f"Question {number}: which machine leads?"})
        status, body = turn(conversation)
        assert status == 200, body
        conversation.append({"role": "assistant", "content": json.loads(body)["choices"][0]["message"]["content"]})
    grew = [after - then for after, then in zip(counts(), before)]
    assert sorted(grew) == [0, 3], grew  # every turn on one copy
    holder = grew.index(3)

    # The holder busy with two long answers of this conversation (more than the least busy copy's 0 + the bound):
    # a new conversation goes to the other copy, and so does this conversation's next turn.
    long_answers = [threading.Thread(target=turn, args=(conversation,), kwargs={"max_tokens": 1200, "stream": True})
                    for _ in range(2)]
    for thread in long_answers:
        thread.start()
    wait_for(lambda: engine_figure(copies[holder], "vllm:num_requests_running") >= 2, timeout=10, every=0.1, what="the holder busy with two answers")
    before = counts()
    other = [{"role": "system", "content": "Another conversation altogether. " * 40}, {"role": "user", "content": "Hi"}]
    assert turn(other)[0] == 200
    assert turn([*conversation, {"role": "user", "content": "And the next?"}])[0] == 200
    grew = [after - then for after, then in zip(counts(), before)]
    assert grew[1 - holder] == 2, (grew, holder)
    for thread in long_answers:
        thread.join(timeout=30)
    services.deployment_delete(deployment=deployment, user=operator)
    wait_for(lambda: not Deployment.objects.filter(pk=deployment.pk).exists(), timeout=60, what="tiny-cache deleted")


def test_a_queued_copy_starts_by_itself_once_another_deployment_is_deleted(cluster, model):
    """The H100s of lab-a and lab-b are taken by "tiny-big" (2 copies of 8 GPUs): "tiny-wait" is queued for
    room. Deleting tiny-big frees them, and tiny-wait's copy starts with nothing asked of tiny-wait."""
    operator = UserFactory(username="ops-room", role=roles.OPERATOR)

    def whole_machines(name: str, copies: int, **options):
        return services.deployment_create(ask=ask_from(
            {"name": name, "copies": copies, "kind": KIND, "gpu_quarters": 32, "memory_per_gpu_gib": 8,
             "context_length": 2048}, cluster=cluster, model=model), user=operator, **options)

    big = whole_machines("tiny-big", 2)
    wait_for(serving(2, "tiny-big"), timeout=120, what="tiny-big serving on every H100")
    waiting = whole_machines("tiny-wait", 1, queue_rest=True)
    queued = waiting.copy_rows.get()
    assert queued.state == CopyState.QUEUED and queued.state_reason.startswith("Waiting for room: "), queued.state_reason
    wait_for(lambda: not Job.objects.filter(target_type="deployment", target_id=waiting.pk, state__in=["queued", "running"])
             .exists(), timeout=30, what="tiny-wait's own apply to end with its copy queued")
    asked = set(Job.objects.filter(target_type="deployment", target_id=waiting.pk).values_list("pk", flat=True))

    services.deployment_delete(deployment=big, user=operator)

    wait_for(serving(1, "tiny-wait"), timeout=120, what="tiny-wait's queued copy serving once tiny-big went")
    assert not Deployment.objects.filter(pk=big.pk).exists()
    woken = Job.objects.filter(target_type="deployment", target_id=waiting.pk).exclude(pk__in=asked)
    assert [(job.kind, job.created_by_id) for job in woken] == [(deployments.serving.KIND, None)]  # nobody asked
    services.deployment_delete(deployment=waiting, user=operator)
    wait_for(lambda: not Deployment.objects.filter(pk=waiting.pk).exists(), timeout=60, what="tiny-wait deleted")


def test_a_serving_machine_drained_while_a_client_calls_loses_no_request_and_stop_drain_brings_it_back(console, cluster,
                                                                                                       model):
    """tiny-drain's 2 copies serve on lab-a (the head) and lab-b. lab-b is drained with its copy moving to lab-a
    (which holds the model's files already) while two clients call the gateway, one streamed: the replacement serves
    before the old copy leaves the rotation, no request fails and no stream is cut short, and lab-b reads Drained
    with nothing on it. Stop drain takes
    lab-b out of Ray and joins it again, and the drain's record goes."""
    operator = UserFactory(username="ops-drain", role=roles.OPERATOR)
    deployment = services.deployment_create(ask=ask_from(
        {"name": "tiny-drain", "copies": 2, "kind": KIND, "gpu_quarters": 8, "memory_per_gpu_gib": 8,
         "context_length": 2048}, cluster=cluster, model=model), user=operator)
    wait_for(serving(2, "tiny-drain"), timeout=120, what="tiny-drain serving")
    head = cluster.members.get(role="head").machine_id
    old = deployment.copy_rows.exclude(machine_id=head).select_related("machine").get()
    drained_machine = old.machine
    _, key = gateway_keys.gateway_key_create(name="drain", user=operator)
    wait_for(lambda: chat(console, key, model="tiny-drain")[0] == 200, timeout=5, every=0.2, what="the gateway to route")

    caller, streamer = Caller(console, key, model="tiny-drain"), StreamCaller(console, key, model="tiny-drain")
    caller.start()
    streamer.start()
    started = time.monotonic()
    drain.drain_start(Cluster.objects.get(pk=cluster.pk), drained_machine,
                      {"moves": [{"copy": old.pk, "to": head, "slots": []}], "stops": []}, user=operator)
    row = wait_for(lambda: Drain.objects.filter(machine=drained_machine, state=DrainState.DRAINED).first(), timeout=60,
                   what=f"{drained_machine.name} Drained")
    seconds = time.monotonic() - started
    time.sleep(1)
    statuses, streamed = caller.stop(), streamer.stop()
    job = Job.objects.get(pk=row.job_id)
    assert statuses and set(statuses) == {200}, (statuses, job.log)
    assert streamed and set(streamed) == {200}, (streamed, job.log)  # no stream cut short either
    assert not Copy.objects.filter(machine=drained_machine).exists()
    assert serving(2, "tiny-drain")() and not deployment.copy_rows.filter(pk=old.pk).exists()
    steps_seconds = {s["name"]: s.get("seconds") for s in job.steps}
    assert job.steps[0]["detail"] == "Ray places nothing new there", job.log  # Ray's own drain took it
    print(f"drain: Drained after {seconds:.1f} s, {len(statuses)} requests and {len(streamed)} streams, none failed; "
          f"steps {steps_seconds}")

    drain.drain_stop(drained_machine, user=operator)
    wait_for(lambda: not Drain.objects.filter(machine=drained_machine).exists(), timeout=90,
             what=f"{drained_machine.name} back in Ray once the drain is stopped")
    assert cluster.members.get(machine=drained_machine).state == "joined"
    try:
        a_drain_where_no_machine_has_room(cluster, model, drained_machine, operator)
    finally:  # the tests after this one need the H100s free
        services.deployment_delete(deployment=deployment, user=operator)
        wait_for(lambda: not Deployment.objects.filter(pk=deployment.pk).exists(), timeout=60, what="tiny-drain deleted")


def a_drain_where_no_machine_has_room(cluster: Cluster, model, machine: Machine, operator) -> None:
    """Both tiny-drain copies are on the head now (4 of its 8 H100s): "tiny-eight" (8 GPUs) can only go to
    ``machine``. Its drain plan stops it, for want of 8 free GPUs; agreed to, the copy reads Queued with the drain's
    words, and once the drain is stopped it starts again there by itself."""
    eight = services.deployment_create(ask=ask_from(
        {"name": "tiny-eight", "copies": 1, "kind": KIND, "gpu_quarters": 32, "memory_per_gpu_gib": 8,
         "context_length": 2048}, cluster=cluster, model=model), user=operator)
    wait_for(serving(1, "tiny-eight"), timeout=60, what="tiny-eight serving")
    copy = eight.copy_rows.get()
    assert copy.machine_id == machine.pk
    plan = drain_input.drain_plan_for(Cluster.objects.get(pk=cluster.pk), [machine.pk])
    reason = "no machine has 8 free H100 80GB (the most free on one is 4, on lab-a)"
    assert (plan.moves, [(s.copy, s.reason) for s in plan.stops]) == ([], [(copy.pk, reason)])
    drain.drain_start(Cluster.objects.get(pk=cluster.pk), machine, drain_input.plan_json(plan), user=operator)
    try:
        wait_for(lambda: Drain.objects.filter(machine=machine, state=DrainState.DRAINED).exists(), timeout=60,
                 what=f"{machine.name} Drained, tiny-eight stopped")
        copy.refresh_from_db()
        assert (copy.state, copy.machine_id) == (CopyState.QUEUED, None)
        assert copy.state_reason.startswith(f"Waiting for room: stopped by the drain of {machine.name}; {reason}"), \
            copy.state_reason
    finally:  # the tests after this one need the machine back
        drain.drain_stop(machine, user=operator)
    wait_for(serving(1, "tiny-eight"), timeout=90, what="tiny-eight serving again once the drain is stopped")
    assert eight.copy_rows.get().machine_id == machine.pk
    services.deployment_delete(deployment=eight, user=operator)
    wait_for(lambda: not Deployment.objects.filter(pk=eight.pk).exists(), timeout=60, what="tiny-eight deleted")


def test_a_gpu_a_persons_own_job_uses_shows_on_its_machine_and_no_copy_is_placed_on_it(lab, console, cluster, machines):
    """On the module's cluster, with tiny scaled to 0 by the first test: a process of lab-a that the console did
    not start declares every GPU of the machine to the lab's nvidia-smi (2 GiB on each). lab-a's heartbeat
    reads it within 10 s; its page names it; tiny scaled to 3 copies, which spread would have put on both
    machines with H100s, goes to lab-b alone. Once the process ends, the next read clears it."""
    operator = UserFactory(username="ops-gpus", role=roles.OPERATOR)
    deployment = Deployment.objects.get(name="tiny")
    a = machines["lab-a"]
    started = lab.ssh(a.address, "FADEN_LAB_GPU_MEMORY_MIB=2048 setsid sleep 600 >/dev/null 2>&1 </dev/null & echo $!")
    assert started.returncode == 0, started.stderr
    pid = int(started.stdout.split()[-1])
    try:
        wait_for(lambda: set(map(tuple, Accelerator.objects.filter(machine=a).values_list("foreign_pids", flat=True)))
                 == {(pid,)}, timeout=20, what="lab-a's heartbeat to report the job on every GPU")
        viewer = Client()
        viewer.force_login(UserFactory(username="viewer-lab", role=roles.VIEWER))
        page = viewer.get(f"/machines/{a.pk}/").content.decode()
        assert f"GPU 3: used by a process the console did not start, pid {pid} (2048 MiB)" in page

        services.deployment_scale(deployment=deployment, copies=3, user=operator)
        wait_for(serving(3), timeout=120, what="three copies serving beside the job")
        # lab-a and lab-b have the H100s (lab-c's are A100s): spread would have put one copy on lab-a at least.
        assert {slot["machine"] for copy in Copy.objects.filter(deployment=deployment) for slot in copy.slots} == {
            machines["lab-b"].pk}
    finally:
        lab.ssh(a.address, f"kill {pid}")
    wait_for(lambda: not Accelerator.objects.filter(machine=a).exclude(foreign_pids=[]).exists(), timeout=20,
             what="lab-a's GPUs free again once the job ended")
    services.deployment_scale(deployment=deployment, copies=0, user=operator)
    wait_for(lambda: not Copy.objects.filter(deployment=deployment).exists(), timeout=60, what="tiny scaled to 0")


def test_a_deployment_deleted_while_a_machine_is_cut_off_runs_on_without_one_until_taken_over(lab, console, cluster, machines,
                                                                                             model):
    """On the module's cluster (its H100s free again): "tiny-left", 2 copies of 8 GPUs, one on lab-a and one on
    lab-b. lab-b's management link goes down and tiny-left is deleted: lab-a's copy stops, lab-b's cannot, so
    it runs on without a deployment, still answering at the gateway over the cluster's network. The link comes
    back: Look for them finds it with its process, Take over keeps it as it runs (same process id), and Delete
    it properly stops it and frees lab-b's GPUs."""
    operator = UserFactory(username="ops-left", role=roles.OPERATOR)
    _, key = gateway_keys.gateway_key_create(name="left", user=operator)
    started = time.monotonic()
    deployment = services.deployment_create(ask=ask_from(
        {"name": "tiny-left", "copies": 2, "kind": KIND, "gpu_quarters": 32, "memory_per_gpu_gib": 8,
         "context_length": 2048}, cluster=cluster, model=model), user=operator)
    wait_for(serving(2, "tiny-left"), timeout=60, what="tiny-left serving on lab-a and lab-b")
    left = Copy.objects.get(deployment=deployment, machine=machines["lab-b"])
    lab.fault("lab-b", "link-down", "mgmt")
    try:
        deleted = services.deployment_delete(deployment=deployment, user=operator)
        wait_for(lambda: Job.objects.filter(pk=deleted.job.pk, state__in=JOB_TERMINAL).exists(), timeout=30,
                 what="the delete to give up on lab-b")
        deployment.refresh_from_db()
        assert deployment.orphaned and list(deployment.copy_rows.values_list("pk", flat=True)) == [left.pk]
        assert not Deployment.objects.shown().filter(name="tiny-left").exists()
        # Still answering at the gateway under its name (the gateway reaches it on the fabric, not the cut link).
        wait_for(lambda: chat(console, key, model="tiny-left")[0] == 200, timeout=5, every=0.2,
                 what="the gateway to route tiny-left to lab-b's copy")
    finally:
        lab.fault("lab-b", "link-up", "mgmt")
    # Back once its heartbeat is: until then lab-b reads Offline, and a check after Keep would place its copy on
    # another machine, as it does for a machine that is gone (a fresh-clone run once moved it to lab-a there).
    wait_for(lambda: Machine.objects.filter(name="lab-b", state=MachineState.HEALTHY).exists(), timeout=30,
             what="lab-b's heartbeat back")

    def job_done(job):
        return wait_for(lambda: Job.objects.filter(pk=job.pk, state__in=JOB_TERMINAL).first(), timeout=30, what=job.title)

    look = job_done(orphans.orphans_look_start(cluster=cluster, user=operator))
    assert look.state == JobState.SUCCEEDED, look.error
    [found] = orphans.orphans_of(cluster)
    assert (found.name, found.known, [e["pid"] for e in found.engines]) == ("tiny-left", True, [left.pid])
    kept = job_done(orphans.orphan_take_over(cluster=cluster, name="tiny-left", keep=True, user=operator))
    assert kept.state == JobState.SUCCEEDED, kept.error
    assert Deployment.objects.shown().filter(name="tiny-left").exists()
    assert list(Copy.objects.filter(deployment=deployment).values_list("pid", "state")) == [(left.pid, CopyState.SERVING)]
    with Agent.open(machines["lab-b"]) as agent:
        assert {s.copy: s.pid for s in agent.copy_list()}[left.key] == left.pid  # the same process: not restarted

    # Left again (a second delete while lab-b is cut off is not needed: the record is marked as a cut would),
    # then deleted properly: the engine stops and lab-b's GPUs are free.
    deployments.serving.deployment_orphan(Deployment.objects.get(pk=deployment.pk), reason="as the test left it.")
    gone = job_done(orphans.orphan_take_over(cluster=cluster, name="tiny-left", keep=False, user=operator))
    assert gone.state == JobState.SUCCEEDED, gone.error
    assert not Deployment.objects.filter(name="tiny-left").exists()
    def listed_on_lab_b() -> set[str]:
        with Agent.open(machines["lab-b"]) as agent:
            return {s.copy for s in agent.copy_list()}

    # The engine was told to stop; its record goes once it has exited, and lab-b's heartbeat then reports its
    # GPUs free of any process the console did not start.
    wait_for(lambda: left.key not in listed_on_lab_b(), timeout=20, what=f"{left.key} gone from lab-b")
    wait_for(lambda: not Accelerator.objects.filter(machine=machines["lab-b"]).exclude(foreign_pids=[]).exists(),
             timeout=20, what="lab-b's GPUs free of the engine in its heartbeat")
    rooms = {room.id: room for room in placement_input.cluster_rooms(Cluster.objects.get(pk=cluster.pk))}
    assert not any(gpu.share_taken for gpu in rooms[machines["lab-b"].pk].gpus)
    print(f"tiny-left deployed, left, found, kept and deleted in {time.monotonic() - started:.1f} s")


def hostfile(lab, machine: Machine) -> list[str]:
    """The addresses ``machine``'s /etc/fadenstack/hostfile lists (the nodes with a GPU free, as of the last write)."""
    read = lab.ssh(machine.address, "cat /etc/fadenstack/hostfile")
    assert read.returncode == 0, read.stderr
    return [line.split()[0] for line in read.stdout.splitlines() if line.strip()]


def hosts(lab, machine: Machine) -> list[str]:
    """The addresses ``machine``'s /etc/hosts names as the cluster's nodes (every member)."""
    read = lab.ssh(machine.address, "sed -n '/# fadenstack cluster nodes: begin/,/# fadenstack cluster nodes: end/p' "
                                    "/etc/hosts")
    assert read.returncode == 0, read.stderr
    return [line.split()[0] for line in read.stdout.splitlines() if line.strip() and not line.startswith("#")]


def drain_picture(deployment: Deployment) -> tuple:
    """What a stuck drain's test says: the deployment's copies and its jobs."""
    copies = list(Copy.objects.filter(deployment=deployment).values_list("pk", "number", "machine__name", "state", "state_reason"))
    jobs = [(j.kind, j.state, j.resumes, j.params, j.log[-600:]) for j in
            Job.objects.filter(target_type="deployment", target_id=deployment.pk).order_by("created_at")]
    return copies, jobs


def test_a_serving_machine_removed_from_the_running_cluster_while_a_client_calls_and_the_worker_is_killed(lab, console,
                                                                                                          cluster, model):
    """Last (lab-b leaves the module's cluster): "tiny-remove", 2 copies of 2 GPUs, serves on lab-a and lab-b
    (the model's kind is H100: lab-c's A100s cannot serve it, so the serving machine removed is lab-b, and its
    copy moves to lab-a). Remove from cluster with the plan read as the card reads it, while a client calls the
    gateway; the console's worker is killed (SIGKILL) while the drain reads Moving copies and a new one
    started. No request fails; the drain reads Leaving the cluster; lab-b leaves the record, its runtime
    stops, it stays enrolled; the others' hostfile and hosts no longer list it; exactly one replacement was
    started: no copy twice; and it starts a cluster of its own."""
    operator = UserFactory(username="ops-remove", role=roles.OPERATOR)
    a, b, c = (Machine.objects.get(name=name) for name in MACHINES)
    # lab-b's link was cut in the test before: placement takes a machine only while it is Up in the cluster (in
    # CI, both copies once went to lab-a while the health check still had lab-b rejoining).
    wait_for(lambda: all_up("serve", len(MACHINES)), timeout=90, what="serve with lab-a, lab-b and lab-c Up")
    deployment = services.deployment_create(ask=ask_from(
        {"name": "tiny-remove", "copies": 2, "kind": KIND, "gpu_quarters": 8, "memory_per_gpu_gib": 8,
         "context_length": 2048}, cluster=cluster, model=model), user=operator)
    wait_for(serving(2, "tiny-remove"), timeout=120, what="tiny-remove serving")
    assert set(deployment.copy_rows.values_list("machine_id", flat=True)) == {a.pk, b.pk}
    old, kept = deployment.copy_rows.get(machine=b), deployment.copy_rows.get(machine=a)
    b_address = cluster.members.get(machine=b).address
    assert all(b_address in hosts(lab, m) for m in (a, c))

    plan = drain_input.drain_plan_for(cluster, [b.pk], remove=True)
    assert ([(m.copy, m.to) for m in plan.moves], plan.stops) == ([(old.pk, a.pk)], [])
    _, key = gateway_keys.gateway_key_create(name="remove", user=operator)
    wait_for(lambda: chat(console, key, model="tiny-remove")[0] == 200, timeout=5, every=0.2, what="the gateway to route")

    caller = Caller(console, key, model="tiny-remove")
    caller.start()
    started = time.monotonic()
    row = drain.machine_remove(Cluster.objects.get(pk=cluster.pk), b, drain_input.plan_json(plan), user=operator)
    job_id, seen, killed = row.job_id, {}, None
    while ClusterMember.objects.filter(machine=b).exists() or Drain.objects.filter(machine=b).exists():
        now = Drain.objects.filter(machine=b).first()
        if now is not None:
            seen.setdefault(now.state, round(time.monotonic() - started, 1))
        if killed is None and now is not None and now.state == DrainState.MOVING and Job.objects.filter(
                pk=job_id, params__moved__has_key=str(old.pk)).exists():
            console.kill_worker()  # as a crash would, its replacement recorded and being started
            killed = round(time.monotonic() - started, 1)
            console.start_worker()
        job = Job.objects.get(pk=job_id)
        assert job.state not in JOB_TERMINAL or job.state == JobState.SUCCEEDED, job.log
        assert time.monotonic() - started < 120, (drain_picture(deployment)[0], seen, job.state, job.log[-800:], drain_picture(deployment)[1])
        time.sleep(0.05)
    gone = time.monotonic() - started
    time.sleep(1)
    statuses = caller.stop()
    job = wait_for(lambda: Job.objects.filter(pk=job_id, state__in=JOB_TERMINAL).first(), timeout=30, what="the drain's job")
    assert job.state == JobState.SUCCEEDED and job.resumes == 1, job.log
    assert killed is not None and DrainState.LEAVING in seen, (seen, job.log)
    assert statuses and set(statuses) == {200}, (statuses, job.log)

    # Exactly one replacement, started once: the deployment's rows are the kept copy and it, and lab-a's agent runs both.
    new = deployment.copy_rows.exclude(pk=kept.pk).get()
    assert job.params["moved"] == {str(old.pk): new.pk} and new.machine_id == a.pk and new.number == 3, job.params
    assert serving(2, "tiny-remove")()
    with Agent.open(a) as agent:
        assert sorted(s.copy for s in agent.copy_list()) == sorted([kept.key, new.key])

    # Out of the cluster, still enrolled, its runtime stopped; the others' hostfile is written without it.
    assert Machine.objects.filter(pk=b.pk).exists() and not ClusterMember.objects.filter(machine=b).exists()
    with Agent.open(b) as agent:
        assert agent.runtime_status().state != "started" and not agent.copy_list()
    wait_for(lambda: all(b_address not in hostfile(lab, m) + hosts(lab, m) and len(hosts(lab, m)) == 2 for m in (a, c)),
             timeout=30, what="lab-a's and lab-c's hostfile and hosts written without lab-b")
    print(f"remove: {seen} (worker killed at {killed} s), out of the cluster after {gone:.1f} s; "
          f"{len(statuses)} requests, none failed; steps {({s['name']: s.get('seconds') for s in job.steps})}")
    services.deployment_delete(deployment=deployment, user=operator)
    wait_for(lambda: not Deployment.objects.filter(pk=deployment.pk).exists(), timeout=60, what="tiny-remove deleted")

    # It can join another cluster: nothing of serve's (its firewall table, its secrets, its node settings) is in
    # the way of one of its own.
    alone = running("lab-b-alone", [Machine.objects.get(pk=b.pk)], timeout=120)
    wait_for(lambda: all_up("lab-b-alone", 1), timeout=60, what="lab-b-alone with lab-b Up")
    cluster_delete(cluster=alone)
    wait_for(lambda: not Cluster.objects.filter(pk=alone.pk).exists(), timeout=60, what="lab-b-alone deleted")
