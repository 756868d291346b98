"""The agent as the console meets it: a command line speaking JSON lines, run
from the source tree and from a zipapp, including the heartbeat daemon end to
end against a local HTTP server."""

import ast
import http.server
import json
import os
import secrets
import shutil
import stat
import subprocess
import sys
import threading
import time
import zipapp

import pytest

from fadenstack_agent import beat as beat_module

HERE = os.path.dirname(os.path.abspath(__file__))
AGENT_DIR = os.path.join(os.path.dirname(os.path.dirname(HERE)), "agent")
PACKAGE_DIR = os.path.join(AGENT_DIR, "fadenstack_agent")
FIXTURES = os.path.join(HERE, "fixtures")
with open(os.path.join(PACKAGE_DIR, "VERSION")) as _fh:
    VERSION = _fh.read().strip()


# ------------------------------------------------------------------ helpers


@pytest.fixture
def env(tmp_path):
    """Environment for agent runs: its own home, no machine config, source on PYTHONPATH."""
    e = dict(os.environ)
    e.update(PYTHONPATH=AGENT_DIR, FADEN_AGENT_HOME=str(tmp_path / "home"),
             FADEN_AGENT_CONFIG=str(tmp_path / "agent.json"),
             FADEN_AGENT_STORE=str(tmp_path / "home" / "store"))
    return e


def run_agent(args, env, python=None, program=None, stdin=b"", timeout=60):
    """Run the agent; (exit status, events, stderr).  Checks every line is JSON and
    that exactly one final result / error line ends the output."""
    cmd = [python or sys.executable] + (program or ["-m", "fadenstack_agent"]) + list(args)
    proc = subprocess.run(cmd, input=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env=env, timeout=timeout)
    lines = proc.stdout.decode().splitlines()
    events = [json.loads(line) for line in lines]
    finals = [e for e in events if e["event"] in ("result", "error")]
    assert len(finals) == 1 and events[-1] is finals[0], proc.stdout
    assert "Traceback" not in proc.stderr.decode()
    return proc.returncode, events, proc.stderr.decode()


def final(events):
    return events[-1]


def gone(pid):
    try:
        with open("/proc/%d/stat" % pid) as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def wait_for(predicate, timeout=8.0, step=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    return predicate()


def build_zip(tmp_path, name="app.pyz", version=None):
    """What the server does: zip a copy of agent/ with main fadenstack_agent.__main__:main."""
    src = tmp_path / ("src-" + name)
    shutil.copytree(AGENT_DIR, str(src), ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if version:
        (src / "fadenstack_agent" / "VERSION").write_text(version + "\n")
    target = tmp_path / name
    zipapp.create_archive(source=str(src), target=str(target), main="fadenstack_agent.__main__:main")
    return str(target)


class _Recorder(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
        if self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", "/landing")
        else:
            self.send_response(204)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    srv.requests = []
    srv.url = "http://127.0.0.1:%d" % srv.server_address[1]
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def daemons(env):
    """Pids to kill at the end whatever happens (the test should have stopped them)."""
    pids = []
    yield pids
    subprocess.run([sys.executable, "-m", "fadenstack_agent", "heartbeat", "stop"], env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
    for pid in pids:
        if not gone(pid):
            os.kill(pid, 9)


def beats_with(server, token):
    return [r for r in server.requests if r["headers"].get("Authorization") == "Bearer " + token]


# ------------------------------------------------------------------ protocol and bad input


@pytest.mark.parametrize("args, words", [
    (["bogus"], "unknown command 'bogus'"),
    ([], "no command given"),
    (["heartbeat"], "heartbeat needs an action"),
    (["heartbeat", "fly"], "unknown command 'fly'"),
    (["heartbeat", "start"], "required: --url"),
    (["heartbeat", "start", "--url", "ftp://example.org/x"], "--url must be an http"),
    (["heartbeat", "start", "--url", "http://h/x", "--interval", "soon"], "--interval"),
    (["facts", "--nope"], "unrecognized arguments: --nope"),
    (["version", "extra"], "unrecognized arguments: extra"),
])
def test_bad_input_is_a_readable_error(env, machine_python, args, words):
    code, events, stderr = run_agent(args, env, python=machine_python)
    assert code == 2
    assert len(events) == 1
    assert set(events[0]) == {"event", "kind", "message"}
    assert events[0]["event"] == "error" and events[0]["kind"] == "bad_input"
    assert words in events[0]["message"]
    assert stderr == ""


def test_start_without_a_token_on_stdin(env):
    code, events, _ = run_agent(["heartbeat", "start", "--url", "http://127.0.0.1:9/hb"], env)
    assert code == 2 and final(events)["kind"] == "bad_input"
    assert "stdin" in final(events)["message"]


def test_version(env, machine_python):
    code, events, _ = run_agent(["version"], env, python=machine_python)
    assert (code, events) == (0, [{"event": "result", "version": VERSION}])


# ------------------------------------------------------------------ facts on this host


def test_facts_on_this_host(env, machine_python, tmp_path):
    store = tmp_path / "new" / "store"
    code, events, _ = run_agent(["facts", "--store", str(store)], env, python=machine_python)
    assert code == 0
    f = final(events)["facts"]
    assert {"agent_version", "hostname", "arch", "cpu_count", "memory_mib", "store", "accelerators",
            "interfaces", "container_runtime", "warnings"} <= set(f)
    assert f["agent_version"] == VERSION
    assert f["arch"] == os.uname().machine
    assert f["cpu_count"] >= 1 and f["memory_mib"] > 0
    assert store.is_dir()
    assert f["store"]["path"] == str(store)
    assert 0 < f["store"]["free_bytes"] <= f["store"]["total_bytes"]
    assert isinstance(f["accelerators"], list)
    kinds = {"physical", "bridge", "vpn", "loopback", "virtual"}
    for iface in f["interfaces"]:
        assert set(iface) >= {"name", "kind", "mac", "mtu", "state", "addresses", "speed_mbps", "default_route"}
        assert iface["kind"] in kinds
        assert all("/" in a for a in iface["addresses"])
        assert iface["speed_mbps"] is None or iface["speed_mbps"] > 0
    assert any(i["kind"] == "loopback" for i in f["interfaces"])
    assert all(set(w) == {"source", "message"} for w in f["warnings"])


def test_facts_through_the_labs_seams(env, tmp_path):
    """A stub uname and nvidia-smi first in PATH (what the lab does), and agent.json."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "uname").write_text("#!/bin/sh\necho aarch64\n")
    (bindir / "nvidia-smi").write_text("#!/bin/sh\ncat %s\n" % os.path.join(FIXTURES, "nvidia_smi_h100x8.csv"))
    for p in bindir.iterdir():
        p.chmod(0o755)
    (tmp_path / "agent.json").write_text(json.dumps({"runtime_driver": "process"}))
    env["PATH"] = str(bindir) + os.pathsep + env["PATH"]
    code, events, _ = run_agent(["facts"], env)
    f = final(events)["facts"]
    assert code == 0
    assert f["arch"] == "aarch64"
    assert [a["model"] for a in f["accelerators"]] == ["NVIDIA H100 80GB HBM3"] * 8
    assert f["container_runtime"] == {"name": "process", "version": VERSION}
    assert f["store"]["path"] == env["FADEN_AGENT_STORE"]

    (bindir / "nvidia-smi").write_text("#!/bin/sh\ncat %s\nexit 9\n" % os.path.join(FIXTURES, "nvidia_smi_no_driver.txt"))
    code, events, _ = run_agent(["facts"], env)
    f = final(events)["facts"]
    assert code == 0 and f["accelerators"] == []
    assert any(w["source"] == "nvidia-smi" and "NVIDIA driver" in w["message"] for w in f["warnings"])


def test_broken_machine_config_is_not_retryable(env, tmp_path):
    (tmp_path / "agent.json").write_text("{runtime_driver: process")
    code, events, _ = run_agent(["facts"], env)
    assert code == 1 and final(events)["kind"] == "not_retryable"
    assert "agent.json" in final(events)["message"]


# ------------------------------------------------------------------ zipapp


def test_zipapp_runs(tmp_path, env, machine_python):
    app = build_zip(tmp_path)
    code, events, _ = run_agent(["version"], env, python=machine_python, program=[app])
    assert (code, events) == (0, [{"event": "result", "version": VERSION}])
    code, events, _ = run_agent(["bogus"], env, python=machine_python, program=[app])
    assert code == 2 and final(events)["kind"] == "bad_input"   # exit status survives zipapp's main
    code, events, _ = run_agent(["facts", "--store", str(tmp_path / "s")], env, python=machine_python, program=[app])
    assert code == 0 and final(events)["facts"]["agent_version"] == VERSION


def test_zipapp_runs_on_python_3_9(tmp_path, env, oldest_python):
    if not oldest_python:
        pytest.skip("no Python 3.9 on this host")
    app = build_zip(tmp_path)
    code, events, _ = run_agent(["version"], env, python=oldest_python, program=[app])
    assert code == 0 and final(events)["version"] == VERSION
    code, events, _ = run_agent(["facts", "--store", str(tmp_path / "s")], env, python=oldest_python, program=[app])
    assert code == 0 and final(events)["facts"]["interfaces"]


def _modules():
    return sorted(os.path.join(PACKAGE_DIR, n) for n in os.listdir(PACKAGE_DIR) if n.endswith(".py"))


def test_standard_library_only_and_python_3_9_syntax():
    stdlib = set(sys.stdlib_module_names)
    for path in _modules():
        with open(path) as fh:
            source = fh.read()
        tree = ast.parse(source, path, feature_version=(3, 9))
        assert len(source.splitlines()) <= 400, path
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in stdlib, "%s imports %s" % (path, name)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("cmd_"):
                assert ast.get_docstring(node), "%s.%s has no docstring" % (path, node.name)


# ------------------------------------------------------------------ heartbeat


def _start(env, server, token, interval="1", path="/hb", python=None, program=None):
    return run_agent(["heartbeat", "start", "--url", server.url + path, "--interval", interval],
                     env, python=python, program=program, stdin=(token + "\n").encode())


def test_heartbeat_end_to_end(env, server, daemons, machine_python):
    home = env["FADEN_AGENT_HOME"]
    token = "fst_" + secrets.token_hex(16)
    code, events, stderr = _start(env, server, token, python=machine_python)
    result = final(events)
    assert code == 0, events
    assert result["running"] is True and result["restarted"] is False
    pid = result["pid"]
    daemons.append(pid)

    beats = wait_for(lambda: beats_with(server, token), timeout=5)
    assert beats, server.requests
    first = beats[0]
    assert first["path"] == "/hb"
    assert first["headers"]["Content-Type"] == "application/json"
    body = json.loads(first["body"])
    assert set(body) == {"agent_version", "hostname", "uptime_s", "boot_id", "runtime"}
    assert body["runtime"] == {"container": None, "ray": {"role": None, "alive": None, "raylet": False,
                                                          "head_port_open": None}}  # nothing started here
    assert body["agent_version"] == VERSION and body["uptime_s"] >= 0

    with open("/proc/%d/cmdline" % pid, "rb") as fh:
        cmdline = fh.read()
    assert token.encode() not in cmdline
    assert b"heartbeat" in cmdline and b"run" in cmdline
    with open("/proc/%d/environ" % pid, "rb") as fh:
        assert token.encode() not in fh.read()
    assert token not in json.dumps(events) + stderr

    config_path = os.path.join(home, "heartbeat.json")
    assert stat.S_IMODE(os.stat(config_path).st_mode) == 0o600
    with open(config_path) as fh:
        assert json.load(fh) == {"url": server.url + "/hb", "interval": 1, "token": token}
    hook = os.path.join(home, "autostart.d", "heartbeat")
    assert os.access(hook, os.X_OK)
    with open(hook) as fh:
        hook_text = fh.read()
    assert hook_text.startswith("#!/bin/sh") and "heartbeat run" in hook_text and token not in hook_text

    # Same url and token while it runs: a no-op.
    code, events, _ = _start(env, server, token)
    assert (code, final(events)["pid"], final(events)["restarted"]) == (0, pid, False)

    code, events, _ = run_agent(["heartbeat", "status"], env)
    status = final(events)
    assert status["running"] and status["pid"] == pid and status["configured"]
    assert status["url"] == server.url + "/hb" and status["version"] == VERSION
    assert token not in json.dumps(events)
    wait_for(lambda: len(beats_with(server, token)) >= 2, timeout=5)
    assert len(beats_with(server, token)) >= 2     # keeps beating every interval

    # Another interval: the daemon is restarted with it.
    code, events, _ = _start(env, server, token, interval="2")
    assert code == 0 and final(events)["restarted"] is True
    new_pid = final(events)["pid"]
    daemons.append(new_pid)
    assert new_pid != pid and wait_for(lambda: gone(pid))

    code, events, _ = run_agent(["heartbeat", "stop"], env)
    assert code == 0 and final(events) == {"event": "result", "running": False, "stopped": True, "pid": new_pid}
    assert wait_for(lambda: gone(new_pid))
    code, events, _ = run_agent(["heartbeat", "stop"], env)
    assert final(events)["stopped"] is False
    code, events, _ = run_agent(["heartbeat", "status"], env)
    assert final(events)["running"] is False and final(events)["configured"] is True

    with open(os.path.join(home, "heartbeat.log")) as fh:
        log = fh.read()
    assert token not in log
    assert "first heartbeat delivered" in log


def test_heartbeat_failures_are_logged_without_the_token(env, daemons, tmp_path):
    import socket

    with socket.socket() as s:          # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = "fst_" + secrets.token_hex(16)
    code, events, _ = run_agent(["heartbeat", "start", "--url", "http://127.0.0.1:%d/hb" % port,
                                 "--interval", "1"], env, stdin=token.encode())
    assert code == 0, events
    daemons.append(final(events)["pid"])
    log_path = os.path.join(env["FADEN_AGENT_HOME"], "heartbeat.log")

    def failed_line():
        try:
            with open(log_path) as fh:
                return "failed" in fh.read()
        except OSError:
            return False
    assert wait_for(failed_line, timeout=8)
    code, events, _ = run_agent(["heartbeat", "status"], env)
    assert final(events)["consecutive_failures"] >= 1 and final(events)["last_error"]
    run_agent(["heartbeat", "stop"], env)
    with open(log_path) as fh:
        log = fh.read()
    assert token not in log
    assert all(json.loads(line)["event"] in ("log", "result") for line in log.splitlines())


def test_redirects_are_not_followed(server):
    token = "fst_" + secrets.token_hex(8)
    with pytest.raises(beat_module.BeatFailed) as err:
        beat_module.send_beat(beat_module.urllib.request.build_opener(beat_module._NoRedirect),
                              {"url": server.url + "/redirect", "token": token}, beat_module.beat_payload())
    assert "302" in str(err.value)
    assert [r["path"] for r in server.requests] == ["/redirect"]


def test_heartbeat_from_zipapp_upgrade_autostart_and_uninstall(tmp_path, env, server, daemons, machine_python):
    home = env["FADEN_AGENT_HOME"]
    agent_dir = os.path.join(home, "agent")
    os.makedirs(agent_dir)
    os.makedirs(env["FADEN_AGENT_STORE"])
    old = build_zip(tmp_path, "old.pyz")
    old_installed = os.path.join(agent_dir, "fadenstack-agent-%s.pyz" % VERSION)
    shutil.move(old, old_installed)
    token = "fst_" + secrets.token_hex(16)

    code, events, _ = _start(env, server, token, python=machine_python, program=[old_installed])
    assert code == 0, events
    pid = final(events)["pid"]
    daemons.append(pid)
    current = os.path.join(agent_dir, "current.pyz")
    assert os.readlink(current) == old_installed
    with open(os.path.join(home, "autostart.d", "heartbeat")) as fh:
        assert current in fh.read()
    assert wait_for(lambda: beats_with(server, token))

    # A newer agent: same settings, but the daemon moves to the new build.
    new = build_zip(tmp_path, "new.pyz", version="9.9.9")
    new_installed = os.path.join(agent_dir, "fadenstack-agent-9.9.9.pyz")
    shutil.move(new, new_installed)
    code, events, _ = _start(env, server, token, python=machine_python, program=[new_installed])
    assert code == 0 and final(events)["restarted"] is True
    new_pid = final(events)["pid"]
    daemons.append(new_pid)
    assert os.readlink(current) == new_installed
    assert wait_for(lambda: any(json.loads(r["body"])["agent_version"] == "9.9.9"
                                for r in beats_with(server, token)))

    # The boot hook, run the way the lab runs it at boot, brings the daemon back.
    code, events, _ = run_agent(["heartbeat", "stop"], env, python=machine_python, program=[new_installed])
    assert final(events)["stopped"] and wait_for(lambda: gone(new_pid))
    seen = len(server.requests)
    hook_env = {k: v for k, v in env.items() if k not in ("FADEN_AGENT_HOME", "PYTHONPATH")}
    proc = subprocess.Popen([os.path.join(home, "autostart.d", "heartbeat")], env=hook_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    daemons.append(proc.pid)
    try:
        assert wait_for(lambda: len(server.requests) > seen, timeout=8)
        code, events, _ = run_agent(["heartbeat", "status"], env, python=machine_python, program=[new_installed])
        assert final(events)["running"] and final(events)["pid"] == proc.pid

        code, events, _ = run_agent(["uninstall"], env, python=machine_python, program=[new_installed])
        result = final(events)
        assert code == 0 and result["uninstalled"] is True and result["stopped_pid"] == proc.pid
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not os.path.exists(agent_dir)
    assert not os.path.exists(os.path.join(home, "autostart.d"))
    assert not os.path.exists(os.path.join(home, "heartbeat.json"))
    assert os.path.isdir(env["FADEN_AGENT_STORE"]) and result["kept"] == [env["FADEN_AGENT_STORE"]]
    code, events, _ = run_agent(["uninstall"], env, python=machine_python)
    assert code == 0 and final(events)["stopped_pid"] is None
