"""``faden clusters tunnel`` and ``faden clusters test`` (the client package): over the REST API only, like
``faden ssh`` (tests/unit/test_faden_client.py, whose console, keys and cluster these tests share). The
ssh child is replaced, or a real process where what is tested is its end; the NCCL test is followed
from a scripted API and from the console's own record as its job writes it."""
import json
import os
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import client.api
import client.cli
import client.nccl_test
import client.ssh
import client.tunnel
from console import roles
from tests.unit.test_faden_client import URL, ca_and_runtime_dir, faden, key, room, token_for  # noqa: F401 (fixtures)


# -- faden clusters tunnel --------------------------------------------------------------------------


class FakeSsh:
    """Stands in for the ssh child: records its argv and what the certificate file was while it ran;
    its wait ends as ``ends`` says (an exit status, or KeyboardInterrupt for Ctrl-C)."""

    def __init__(self, ends):
        self.ends, self.runs, self.signals = ends, [], []

    def __call__(self, argv):
        self.argv = list(argv)
        return self

    def wait(self, timeout=None):
        if timeout is not None:  # the wait after Ctrl-C
            return -15
        certificate = Path(self.argv[self.argv.index("-o") + 1].removeprefix("CertificateFile="))
        self.runs.append((certificate, certificate.exists() and stat.S_IMODE(certificate.stat().st_mode)))
        if self.ends is KeyboardInterrupt:
            raise KeyboardInterrupt
        return self.ends

    def terminate(self):
        self.signals.append("TERM")

    def kill(self):
        self.signals.append("KILL")


@pytest.mark.django_db
def test_faden_clusters_tunnel_forwards_the_heads_ray_with_a_certificate_removed_when_ctrl_c_ends_it(
        room, key, monkeypatch, capsys):
    ssh_child = FakeSsh(ends=KeyboardInterrupt)
    monkeypatch.setattr(client.tunnel, "_spawn", ssh_child)

    status = faden("clusters", "tunnel", "gpu-room", "--key", str(key), token=token_for())

    assert status == 0
    ((certificate, mode_while_running),) = ssh_child.runs
    assert mode_while_running == 0o600 and not certificate.exists()
    assert ssh_child.signals == ["TERM"]
    assert ssh_child.argv == ["ssh", "-i", str(key), "-o", f"CertificateFile={certificate}", "-o", "IdentitiesOnly=yes",
                              "-N", "-o", "ExitOnForwardFailure=yes", "-L", "127.0.0.1:8265:127.0.0.1:8265",
                              "-L", "127.0.0.1:10001:127.0.0.1:10001", "--", "root@198.18.0.11"]
    said = capsys.readouterr()
    assert "Ray's dashboard:  http://127.0.0.1:8265" in said.out
    assert ("ray job submit --address http://127.0.0.1:8265 --working-dir . --runtime-env-json"
            """ '{"env_vars": {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}}' -- python3 train.py""") in said.out
    assert "for node-0 (lab-a)" in said.err and "Tunnel closed." in said.err


@pytest.mark.django_db
def test_a_tunnel_whose_ssh_fails_says_so_and_still_removes_the_certificate(room, key, monkeypatch, capsys):
    ssh_child = FakeSsh(ends=255)
    monkeypatch.setattr(client.tunnel, "_spawn", ssh_child)

    status = faden("clusters", "tunnel", "gpu-room", "-i", str(key), "--local-port", "18265", token=token_for())

    assert status == 1
    ((certificate, mode_while_running),) = ssh_child.runs
    assert mode_while_running == 0o600 and not certificate.exists() and not ssh_child.signals
    assert "127.0.0.1:18265:127.0.0.1:8265" in ssh_child.argv
    err = capsys.readouterr().err
    assert "faden clusters tunnel: The tunnel closed: ssh exited with status 255" in err


@pytest.mark.django_db
def test_a_tunnel_refused_by_the_console_runs_no_ssh_and_leaves_no_certificate(room, key, monkeypatch, capsys, tmp_path):
    ssh_child = FakeSsh(ends=0)
    monkeypatch.setattr(client.tunnel, "_spawn", ssh_child)

    status = faden("clusters", "tunnel", "gpu-room", "-i", str(key), token=token_for(roles.VIEWER, "vic"))

    assert status == 1 and not ssh_child.runs
    assert "The console refused: Your role is Viewer" in capsys.readouterr().err
    assert not list((tmp_path / "run").rglob("*-cert.pub"))


def test_the_tunnels_argv_jumps_when_told_and_names_both_forwards_on_loopback(tmp_path):
    key = client.ssh.Key(identity=tmp_path / "id", public_line="ssh-ed25519 AAAA")
    node = {"ssh_user": "root", "ssh_address": "198.18.0.11", "ssh_port": 2222}

    argv = client.tunnel.tunnel_argv(node, jump="me@console.example.com", key=key, certificate=tmp_path / "c-cert.pub",
                              local_port=9000, client_port=9001)

    assert argv[argv.index("-J") + 1] == "me@console.example.com" and argv[argv.index("-p") + 1] == "2222"
    assert [argv[i + 1] for i, word in enumerate(argv) if word == "-L"] == [
        "127.0.0.1:9000:127.0.0.1:8265", "127.0.0.1:9001:127.0.0.1:10001"]
    assert argv.index("-N") < argv.index("--") and argv[-2:] == ["--", "root@198.18.0.11"]


@pytest.mark.parametrize("port", ["0", "65536", "80a", "-1"])
def test_a_local_port_that_is_not_one_is_refused_before_anything_is_asked(port, capsys):
    with pytest.raises(SystemExit) as ended:
        client.cli.main(["clusters", "tunnel", "gpu-room", "--local-port", port], send=None, environ={})
    assert ended.value.code == 2 and "is not a TCP port" in capsys.readouterr().err


def test_sigterm_ends_the_wait_for_ssh_and_the_child_is_ended_too(monkeypatch):
    # A real child and a real signal: SIGTERM to this process ends the wait as Ctrl-C would.
    children = []
    monkeypatch.setattr(client.tunnel, "_spawn", lambda argv: children.append(subprocess.Popen(argv)) or children[-1])
    before = signal.getsignal(signal.SIGTERM)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        ended = client.tunnel.ssh_until_interrupted([sys.executable, "-c", "import time; time.sleep(60)"])
    finally:
        timer.cancel()
    assert ended is None
    assert children[0].poll() == -signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigint_ends_the_wait_even_when_it_came_ignored(monkeypatch):
    # `faden clusters tunnel &` in a script starts with SIGINT ignored; `kill -INT` must still end it.
    children = []
    monkeypatch.setattr(client.tunnel, "_spawn", lambda argv: children.append(subprocess.Popen(argv)) or children[-1])
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        ended = client.tunnel.ssh_until_interrupted([sys.executable, "-c", "import time; time.sleep(60)"])
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # as it came
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, before)
    assert ended is None and children[0].poll() == -signal.SIGTERM


def test_an_ssh_that_is_not_installed_is_named(monkeypatch):
    monkeypatch.setattr(client.tunnel, "_spawn", lambda argv: (_ for _ in ()).throw(FileNotFoundError(argv[0])))
    with pytest.raises(client.api.ClientError, match="OpenSSH's ssh is not on PATH"):
        client.tunnel.ssh_until_interrupted(["ssh"])


# -- faden clusters test --------------------------------------------------------------------------------


ROWS = [{"size_bytes": 1048576, "time_us": 1234.56, "algbw": 0.85, "busbw": 0.85},
        {"size_bytes": 2097152, "time_us": 2400.0, "algbw": 0.87, "busbw": 0.87},
        {"size_bytes": 4194304, "time_us": 4700.25, "algbw": 0.89, "busbw": 0.89}]


def a_test(state="running", rows=(), **more) -> dict:
    return {"id": 3, "cluster": 7, "state": state, "message": "", "started_by": "ada", "nodes": 2, "gpus": 2,
            "minbytes": 1048576, "maxbytes": 4194304, "iters": 5, "rows": list(rows), "peak": None,
            "avg_busbw": None, "job": 11} | more


class ScriptedConsole:
    """The console's NCCL test REST as protocol.md agrees it: the POST answers ``started`` (or a refusal),
    each GET the next state of the run; it records every request."""

    def __init__(self, states, refusals=()):
        self.states, self.refusals, self.seen = list(states), list(refusals), []

    def __call__(self, method, url, headers, body):
        path = urlsplit(url).path + (f"?{urlsplit(url).query}" if urlsplit(url).query else "")
        self.seen.append((method, path, json.loads(body) if body else None))
        if method == "GET" and path == "/api/clusters/?name=gpu-room":
            return 200, json.dumps({"results": [{"id": 7, "name": "gpu-room"}]}).encode()
        if method == "POST" and path == "/api/clusters/7/tests/":
            if self.refusals:
                status, detail, confirm = self.refusals.pop(0)
                return status, json.dumps({"message": detail, "detail": detail, "confirm": confirm}).encode()
            return 201, json.dumps(self.states.pop(0)).encode()
        if method == "GET" and path == "/api/clusters/7/tests/3/":
            return 200, json.dumps(self.states.pop(0)).encode()
        return 404, b'{"detail": "Not found."}'


@pytest.fixture
def sleeps(monkeypatch):
    waited = []
    monkeypatch.setattr(client.nccl_test, "_sleep", waited.append)
    return waited


SERVING = ("3 copies are serving on gpu-room's GPUs: the test uses every GPU and slows them. "
           "Send confirm: true to run it anyway.")


def test_faden_clusters_test_prints_each_size_as_the_console_records_it_then_the_peak(sleeps, capsys):
    peak = {"size_bytes": 4194304, "busbw": 0.89}
    console = ScriptedConsole([a_test(), a_test(rows=ROWS[:1]), a_test(rows=ROWS[:1]), a_test(rows=ROWS[:2]),
                               a_test("finished", ROWS, peak=peak, avg_busbw=0.87,
                                      message="Peak bus bandwidth 0.89 GB/s at 4 MiB.")])

    status = client.cli.main(["clusters", "test", "gpu-room"], send=console, environ={"FADEN_URL": URL, "FADEN_TOKEN": "t"})

    assert status == 0
    assert console.seen[1] == ("POST", "/api/clusters/7/tests/", {"confirm": False})
    assert [path for _, path, _ in console.seen[2:]] == ["/api/clusters/7/tests/3/"] * 4
    assert sleeps == [1.0] * 4
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "NCCL test 3 on gpu-room: 2 nodes, 2 GPUs, 1048576 to 4194304 bytes."
    assert lines[1:3] == ["#       size        time   algbw   busbw", "#        (B)        (us)  (GB/s)  (GB/s)"]
    assert lines[3:6] == ["     1048576      1234.6    0.85    0.85",
                          "     2097152      2400.0    0.87    0.87",
                          "     4194304      4700.2    0.89    0.89"]
    assert lines[6:] == ["Peak bus bandwidth: 0.89 GB/s at 4194304 bytes.", "Finished: Peak bus bandwidth 0.89 GB/s at 4 MiB."]
    assert all(len(line) == len(lines[1]) for line in lines[1:6])


def test_a_failed_test_prints_why_and_exits_1(sleeps, capsys):
    console = ScriptedConsole([a_test(), a_test("failed", ROWS[:1], message="node-1 (lab-b) did not answer.")])

    status = client.cli.main(["clusters", "test", "gpu-room"], send=console, environ={"FADEN_URL": URL, "FADEN_TOKEN": "t"})

    assert status == 1
    out = capsys.readouterr().out
    assert "     1048576      1234.6    0.85    0.85" in out and out.endswith("Failed: node-1 (lab-b) did not answer.\n")


def test_a_stopped_test_is_not_a_failure(sleeps, capsys):
    console = ScriptedConsole([a_test("stopped", ROWS, message="stopped after 5 sizes: the link between lab-a and "
                                                                "lab-b would take about 14 minutes for the rest")])

    assert client.cli.main(["clusters", "test", "gpu-room"], send=console, environ={"FADEN_URL": URL, "FADEN_TOKEN": "t"}) == 0
    assert sleeps == [] and "Stopped: stopped after 5 sizes" in capsys.readouterr().out


def test_with_copies_serving_it_is_not_started_without_a_yes(sleeps, capsys, monkeypatch):
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False, raising=False)
    console = ScriptedConsole([], refusals=[(409, SERVING, True)])

    status = client.cli.main(["clusters", "test", "gpu-room"], send=console, environ={"FADEN_URL": URL, "FADEN_TOKEN": "t"})

    assert status == 1 and [m for m, *_ in console.seen].count("POST") == 1
    err = capsys.readouterr().err
    assert "3 copies are serving on gpu-room's GPUs: the test uses every GPU and slows them." in err
    assert "faden clusters test: Not started: run it again with --yes to run it anyway." in err


def test_with_copies_serving_a_yes_at_the_question_or_yes_on_the_line_sends_confirm(sleeps, monkeypatch):
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    asked = []
    monkeypatch.setattr(client.nccl_test, "_ask", lambda prompt: asked.append(prompt) or "y")
    answered = ScriptedConsole([a_test("finished", ROWS)], refusals=[(409, SERVING, True)])
    assert client.cli.main(["clusters", "test", "gpu-room"], send=answered, environ={"FADEN_URL": URL, "FADEN_TOKEN": "t"}) == 0
    told = ScriptedConsole([a_test("finished", ROWS)])
    assert client.cli.main(["clusters", "test", "gpu-room", "--yes"], send=told, environ={"FADEN_URL": URL, "FADEN_TOKEN": "t"}) == 0

    assert asked == ["Run it anyway? [y/N] "]
    assert [body for method, _, body in answered.seen if method == "POST"] == [{"confirm": False}, {"confirm": True}]
    assert [body for method, _, body in told.seen if method == "POST"] == [{"confirm": True}]


def test_a_test_already_running_is_refused_in_the_consoles_words_and_not_asked_about(sleeps, capsys, monkeypatch):
    monkeypatch.setattr(client.nccl_test, "_ask", lambda prompt: pytest.fail("asked to confirm a refusal that is not about copies"))
    console = ScriptedConsole([], refusals=[(409, "An NCCL test is already running on gpu-room (started 14:02 by ann).", False)])

    status = client.cli.main(["clusters", "test", "gpu-room"], send=console, environ={"FADEN_URL": URL, "FADEN_TOKEN": "t"})

    assert status == 1
    assert ("faden clusters test: The console refused: An NCCL test is already running on gpu-room (started 14:02 by ann)."
            in capsys.readouterr().err)


@pytest.mark.django_db
def test_faden_clusters_test_follows_the_consoles_own_record_as_the_job_writes_it(room, sleeps, monkeypatch, capsys):
    from clusters import nccl_tests
    from clusters.models import NcclTest, NcclTestState

    def job_step(seconds):
        # Each second the client waits, the job (as clusters/runners/nccl.py does) records one more size.
        sleeps.append(seconds)
        test = NcclTest.objects.get(cluster=room)
        if len(test.rows) < len(ROWS):
            nccl_tests.nccl_test_rows_save(test, ROWS[:len(test.rows) + 1])
        else:
            nccl_tests.nccl_test_end(test, state=NcclTestState.FINISHED, message="Peak 0.89 GB/s at 4 MiB.", avg_busbw=0.87)
    monkeypatch.setattr(client.nccl_test, "_sleep", job_step)

    status = faden("clusters", "test", "gpu-room", token=token_for())

    assert status == 0, capsys.readouterr().err
    out = capsys.readouterr().out.splitlines()
    test = NcclTest.objects.get(cluster=room)
    assert test.state == NcclTestState.FINISHED and test.started_by.username == "ada"
    assert out[0].startswith(f"NCCL test {test.pk} on gpu-room: 2 nodes,")
    assert out[3:6] == ["     1048576      1234.6    0.85    0.85", "     2097152      2400.0    0.87    0.87",
                        "     4194304      4700.2    0.89    0.89"]
    assert out[6:] == ["Peak bus bandwidth: 0.89 GB/s at 4194304 bytes.", "Finished: Peak 0.89 GB/s at 4 MiB."]
    assert len(sleeps) == 4


@pytest.mark.django_db
def test_a_viewer_is_refused_the_test_in_the_consoles_words(room, capsys):
    assert faden("clusters", "test", "gpu-room", token=token_for(roles.VIEWER, "vic")) == 1
    assert "faden clusters test: The console refused: " in capsys.readouterr().err


def test_a_field_error_of_drf_is_said_in_its_words():
    assert client.api.refusal_sentence({"node": ["gpu-room has no node node-9."]}) == "gpu-room has no node node-9."
    assert client.api.refusal_sentence({"detail": "Not every machine is Up."}) == "Not every machine is Up."
    assert client.api.refusal_sentence(["x"]) == ""
