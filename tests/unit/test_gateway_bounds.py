"""The gateway survives a hostile client: its command line from faden serve, with short bounds, against a
256 MiB header, a head that never ends and 1,000 idle connections, while a normal client keeps getting
answers; and the bounds' settings refuse nonsense."""
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from django.core.exceptions import ImproperlyConfigured

from console.management.commands import serve

HEAD_TIMEOUT = 2.0
MAX_CONNECTIONS = 500
MAX_HEAD = 64 * 1024


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gateway")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "FADEN_DATA_DIR": str(tmp), "DATABASE_URL": f"sqlite:///{tmp / 'db.sqlite3'}",
           "DJANGO_SETTINGS_MODULE": "config.settings", "FADEN_GATEWAY_HEAD_TIMEOUT": str(HEAD_TIMEOUT),
           "FADEN_GATEWAY_MAX_CONNECTIONS": str(MAX_CONNECTIONS), "FADEN_GATEWAY_MAX_HEAD": str(MAX_HEAD)}
    process = subprocess.Popen(serve.gateway_argv(sys.executable, bind="127.0.0.1", port=port, workers=1), env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 20
    while True:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
            break
        except httpx.TransportError:
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    yield port
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=10)


@pytest.fixture
def normal_client(gateway):
    """A client asking /health every 20 ms, a connection each time, throughout the test: its answers and failures."""
    answers, failures, done = [], [], threading.Event()

    def ask():
        while not done.is_set():
            started = time.monotonic()
            try:
                response = httpx.get(f"http://127.0.0.1:{gateway}/health", timeout=2)
                (answers if response.status_code == 200 else failures).append(response.status_code)
            except httpx.HTTPError as error:
                failures.append(repr(error))
            done.wait(max(0.0, 0.02 - (time.monotonic() - started)))

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    yield answers, failures
    done.set()
    thread.join(timeout=5)


def answered(answers: list, failures: list, seconds: float = 5.0) -> bool:
    """Whether the normal client got an answer since the attack began (on a loaded host its first request may
    still be on its way: it has ``seconds`` more), and no request of it failed."""
    seen, deadline = len(answers), time.monotonic() + seconds
    while len(answers) <= seen and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not failures, failures
    return len(answers) > seen


def head(host_port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", host_port), timeout=5)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: gateway\r\n")
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return got


def test_a_256_mib_header_is_refused_long_before_it_is_read(gateway, normal_client):
    sock = head(gateway)
    sock.sendall(b"X-Huge: ")
    chunk, sent, limit = b"a" * 65536, 0, 256 * 1024 * 1024
    started = time.monotonic()
    try:
        while sent < limit:
            sock.sendall(chunk)
            sent += len(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass
    took = time.monotonic() - started
    answer = read_until_closed(sock)
    sock.close()
    # What the kernel's buffers took before the gateway closed, not what the gateway read.
    assert sent < 16 * 1024 * 1024 and took < 3, (sent, took)
    assert answer in (b"",) or answer.startswith(b"HTTP/1.1 431 ")
    assert answered(*normal_client)


def test_a_head_just_over_the_bound_is_answered_431(gateway):
    sock = head(gateway)
    sock.sendall(b"X-Big: " + b"b" * MAX_HEAD)  # all of it sent, then the client waits for the answer
    answer = read_until_closed(sock)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]


def test_a_head_that_never_ends_is_closed_after_the_timeout(gateway, normal_client):
    sock, started = head(gateway), time.monotonic()
    sock.settimeout(0.3)
    answer = b""
    while time.monotonic() - started < HEAD_TIMEOUT + 3:
        try:
            sock.sendall(b"X-Drip: 1\r\n")  # a line at a time, never the blank line
            got = sock.recv(65536)
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
        answer += got
        if not got:
            break
    closed_after = time.monotonic() - started
    sock.close()
    assert HEAD_TIMEOUT - 0.2 <= closed_after <= HEAD_TIMEOUT + 1, closed_after
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408 ")
    assert answered(*normal_client)


def test_a_thousand_idle_connections_leave_room_for_a_normal_client(gateway, normal_client):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    idle = []
    try:
        for _ in range(1000):
            idle.append(socket.create_connection(("127.0.0.1", gateway), timeout=5))
        time.sleep(0.5)
        answers, failures = normal_client
        before = len(answers)
        time.sleep(0.5)
        for sock in idle:  # the gateway kept at most its limit: the oldest idle ones were closed
            sock.setblocking(False)
        closed = 0
        for sock in idle:
            try:
                closed += sock.recv(1) == b""
            except BlockingIOError:
                pass
            except ConnectionResetError:
                closed += 1
    finally:
        for sock in idle:
            sock.close()
    assert closed >= 1000 - MAX_CONNECTIONS, closed
    assert len(answers) > before and not failures, failures


@pytest.mark.parametrize(("name", "value", "said"), [
    ("FADEN_GATEWAY_MAX_HEAD", "100", "from 4096"),
    ("FADEN_GATEWAY_HEAD_TIMEOUT", "soon", "must be a number"),
    ("FADEN_GATEWAY_MAX_CONNECTIONS", "0", "from 16"),
    ("FADEN_GATEWAY_KEEPALIVE", "2.5", "whole number"),
])
def test_the_bounds_settings_refuse_nonsense(monkeypatch, name, value, said):
    import config.settings as module

    monkeypatch.setenv(name, value)
    with pytest.raises(ImproperlyConfigured, match=said):
        module._gateway_bound(name, *{
            "FADEN_GATEWAY_MAX_HEAD": (65536, int, 4096, 1 << 20),
            "FADEN_GATEWAY_HEAD_TIMEOUT": (5.0, float, 0.5, 120),
            "FADEN_GATEWAY_MAX_CONNECTIONS": (4096, int, 16, 1_000_000),
            "FADEN_GATEWAY_KEEPALIVE": (5, int, 1, 3600),
        }[name])


def test_a_bad_bound_stops_the_console_with_a_clear_message(tmp_path):
    env = {**os.environ, "FADEN_DATA_DIR": str(tmp_path), "FADEN_GATEWAY_MAX_HEAD": "100"}
    done = subprocess.run([sys.executable, "-c", "import config.settings"], env=env, capture_output=True, text=True)
    assert done.returncode != 0 and "FADEN_GATEWAY_MAX_HEAD must be from 4096 to 1.04858e+06" in done.stderr
