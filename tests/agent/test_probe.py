"""``probe serve|send`` on loopback, as subprocesses on /usr/bin/python3."""

import socket

import pytest

from tests.agent.imagehelpers import Machine


@pytest.fixture
def machine(tmp_path):
    return Machine(tmp_path, "m")


def test_serve_and_send(machine):
    serve = machine.start(["probe", "serve", "--bind", "127.0.0.1", "--port", "0", "--seconds", "1.2"])
    try:
        _, listening = serve.first(lambda e: e.get("listening"))
        code, events = machine.run(["probe", "send", "--to", "127.0.0.1", "--port", str(listening["port"]),
                                    "--seconds", "1.2"])
        served = serve.wait(timeout=20)
    finally:
        serve.kill()
    assert code == 0, events
    res = events[-1]
    assert res["event"] == "result" and set(res) == {"event", "mbps", "bytes", "seconds", "sent"}
    assert res["mbps"] > 0 and res["bytes"] == res["sent"] > 0 and res["seconds"] >= 1.2
    progress = [e for e in events if e["event"] == "progress"]
    assert progress and all(e["mbps"] > 0 for e in progress)
    assert served[-1]["event"] == "result" and served[-1]["bytes"] == res["bytes"]
    assert served[-1]["complete"] is True and served[-1]["sender"] == "127.0.0.1"


def test_nobody_listening_is_unreachable(machine):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                     # bound, never listening: refused
        code, events = machine.run(["probe", "send", "--to", "127.0.0.1", "--port", str(port), "--seconds", "1"])
    assert code == 1 and events[-1]["kind"] == "unreachable" and "cannot reach 127.0.0.1" in events[-1]["message"]


def test_a_taken_port_is_address_in_use(machine):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        code, events = machine.run(["probe", "serve", "--bind", "127.0.0.1", "--port", str(s.getsockname()[1])])
    assert code == 1 and events[-1]["kind"] == "address_in_use"


@pytest.mark.parametrize("args, words", [
    (["probe"], "probe needs an action (known: serve, send)"),
    (["probe", "send", "--to", "somewhere", "--seconds", "1"], "--to must be an IP address"),
    (["probe", "send", "--to", "127.0.0.1", "--seconds", "0"], "--seconds: must be a number of seconds"),
    (["probe", "serve", "--bind", "127.0.0.1", "--port", "99999"], "--port: must be a TCP port"),
    (["probe", "serve", "--port", "7471"], "required: --bind"),
])
def test_bad_arguments(machine, args, words):
    code, events = machine.run(args)
    assert code == 2 and events[-1]["kind"] == "bad_input" and words in events[-1]["message"], events
