"""The API under a fuzzer: schemathesis against /api/schema/, bounded, in every run of the suite.

Schemathesis's engine (what its command line runs) generates requests from the schema for every
operation: the schema's examples, then its coverage of each parameter's bounds and types, then
random ones, each both valid and invalid, with values it finds in the console's own source. The
test fails on any 5xx and on any answer the schema does not describe: a status code it does not
list, a body or a content type that does not match. The console answers in this process, through
its WSGI application, signed in with an Administrator's token (a role that may call every operation).

Nothing leaves this host: a machine "answers" the host key scan only at a loopback or lab address
(127.0.0.0/8, 198.18.0.0/15) and SSH refuses everything; jobs are recorded, never sent to a worker;
and any socket to an address other than loopback fails the test.
"""
import ipaddress
import os
import socket
import time

import pytest
import schemathesis
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import strategies as st
from schemathesis import engine
from schemathesis.core import NOT_SET
from schemathesis.engine import events

from console import params
from machines import remote
from tests.builders import build, cluster_of, gpu_machine
from tests.factories import fingerprint_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.fuzz]

# Per operation, for valid and for invalid requests alike (the coverage phase adds its own). The suite's
# run is a bounded one beside the lab's tests (it shares the host's two cores with them); a deeper search
# is its own run: FADEN_FUZZ_EXAMPLES=100 FADEN_FUZZ_SECONDS=300 pytest tests/api/test_fuzz.py
EXAMPLES = int(os.environ.get("FADEN_FUZZ_EXAMPLES", "8"))
TIME_LIMIT = int(os.environ.get("FADEN_FUZZ_SECONDS", "45"))  # the run stops there, and fails if an operation was not reached
SEED = os.environ.get("FADEN_FUZZ_SEED")  # set it to the seed a failure printed, to send the same requests again
MACHINE_ADDRESSES = [ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("198.18.0.0/15")]
CHECKS = ["not_a_server_error", "status_code_conformance", "content_type_conformance", "response_schema_conformance",
          "response_headers_conformance", "negative_data_rejection", "unsupported_method"]


@pytest.fixture
def only_loopback(monkeypatch):
    """No connection to anything but this host; the host key scan and SSH never touch the network."""
    connect = socket.socket.connect

    def guarded(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not _this_host(address[0]):
            pytest.fail(f"the fuzz run opened a connection to {address}")
        return connect(sock, address)

    def scan(address: str, port: int) -> str:
        try:
            reachable = any(ipaddress.ip_address(address) in net for net in MACHINE_ADDRESSES)
        except ValueError:
            reachable = False  # a host name: not resolved, so never reached
        if not reachable:
            raise remote.RemoteError(f"Could not reach {address} port {port}: the fuzz run reaches lab addresses only.",
                                     kind="unreachable")
        return fingerprint_for(address)

    def no_ssh(*args, **kwargs):
        raise remote.RemoteError("The fuzz run opens no SSH connection.", kind="unreachable")

    monkeypatch.setattr(socket.socket, "connect", guarded)
    monkeypatch.setattr(remote, "scan_host_key", scan)
    monkeypatch.setattr(remote, "connect", no_ssh)


def _this_host(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or ip.is_unspecified  # 0.0.0.0 is this host too


@pytest.fixture
def jobs_sent(monkeypatch):
    """Every task a request would send to a worker, recorded instead."""
    import celery.app.task

    sent = []
    monkeypatch.setattr(celery.app.task.Task, "apply_async", lambda task, *args, **kwargs: sent.append(task.name))
    return sent


@pytest.fixture
def console_objects():
    """Machines and clusters for the fuzzer to find: their ids, by path parameter."""
    runtime = build("2.1.0")
    machines = [gpu_machine(f"gpu-{n}", 10 + n) for n in range(4)]
    running = cluster_of(machines[:2], runtime=runtime)
    stopped = cluster_of(machines[2:3], runtime=runtime, name="spare-room", state="stopped")
    return {"id": [m.pk for m in machines] + [running.pk, stopped.pk], "machine_id": [m.pk for m in machines]}


def test_no_operation_answers_a_5xx_or_anything_its_schema_does_not_describe(
        api_token, console_objects, only_loopback, jobs_sent):
    config = schemathesis.Config.from_dict({
        "headers": {"Authorization": f"Token {api_token.key}"},
        "generation": {"mode": "all", "max-examples": EXAMPLES},
        "phases": {"stateful": {"enabled": False}},
        "checks": {"enabled": False, **{name: {"enabled": True} for name in CHECKS}},
        "workers": 2,  # two operations at a time, each in a thread (and a database connection) of its own
        "cache": {"enabled": False},
        **({"seed": int(SEED)} if SEED else {}),
    })
    schema = schemathesis.openapi.from_wsgi("/api/schema/", get_wsgi_application(), config=config)
    schema.hook(_existing_ids(console_objects))
    schema.hook(after_call)

    started = time.monotonic()
    findings, tested, untested = _run(schema, deadline=started + TIME_LIMIT)
    print(f"\nfuzz: {len(tested)} operations in {time.monotonic() - started:.1f} s (seed {config.seed}), "
          f"{len(jobs_sent)} jobs recorded")

    assert not untested, f"The fuzz run passed its {TIME_LIMIT} s before it reached {sorted(untested)}."
    assert not findings, f"seed {config.seed}:\n\n" + "\n\n".join(findings)


def after_call(context, case, response):
    """What Django does when a server closes a response (request_finished), which schemathesis's WSGI
    client does not: the worker thread's database connection closes, so none is left open at the end."""
    close_old_connections()


def _existing_ids(objects: dict[str, list[int]]):
    def flatmap_path_parameters(context, generated):
        """Half the time the ids of objects that exist: otherwise nearly every request with an id is a 404.
        Only in place of valid ids: an id the fuzzer made invalid on purpose stays, since a real id in its
        place makes the request valid while the case still says it is not (its 200: "invalid data accepted")."""
        if not generated or not all(_is_id(value) for value in generated.values()):
            return st.just(generated)
        existing = {name: st.sampled_from(objects[name]) if name in objects else st.just(value) for name, value in generated.items()}
        return st.one_of(st.just(generated), st.fixed_dictionaries(existing))

    return flatmap_path_parameters


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= params.ID_MAX


def _run(schema, *, deadline: float) -> tuple[list[str], set[str], set[str]]:
    """What the run found (each with the request that found it), the operations it tested, and those it
    had not reached when the deadline stopped it."""
    findings, tested = [], set()
    stream = engine.from_schema(schema).execute()
    for event in stream:
        if isinstance(event, events.ScenarioFinished) and event.label:
            tested.add(event.label)
            findings.extend(_failures(event))
        elif isinstance(event, (events.NonFatalError, events.FatalError)):
            findings.append(f"{getattr(event, 'label', 'the run')}: {event.info.title}: {event.info.message}")
        if time.monotonic() > deadline:
            stream.stop()
            everything = {f"{result.ok().method.upper()} {result.ok().path}" for result in schema.get_all_operations()}
            return findings, tested, everything - tested
    return findings, tested, set()


def _failures(event: events.ScenarioFinished) -> list[str]:
    found = []
    for case_id, checks in event.recorder.checks.items():
        for check in checks:
            if check.failure_info is None:
                continue
            case = event.recorder.cases[case_id].value
            interaction = event.recorder.interactions.get(case_id)
            answer = interaction.response if interaction else None
            sent = f" query={case.query}" if case.query else ""
            sent += f" body={str(case.body)[:300]}" if case.body is not NOT_SET else ""
            said = f"\n  -> {answer.status_code} {answer.content[:300]!r}" if answer else ""
            found.append(f"{event.label}: {check.name}: {check.failure_info.failure.title}\n  {check.failure_info.failure.message}\n"
                         f"  {case.method} {case.formatted_path}{sent}{said}")
    return found
