"""faden serve starts the gateway beside web, worker and beat, on its own port, and the gateway's command
line really serves."""
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from django.core.management.base import CommandError

from console.management.commands import serve

pytestmark = pytest.mark.django_db


@pytest.fixture
def spawned(monkeypatch):
    """The processes the command would start, by name, with their command lines (none is started)."""
    started = {}
    monkeypatch.setattr(serve, "call_command", lambda *args, **kwargs: None)
    monkeypatch.setattr(serve.Command, "_ensure_admin", lambda self: None)
    monkeypatch.setattr(serve.Command, "_ensure_redis", lambda self: None)
    monkeypatch.setattr(serve.Command, "_spawn", lambda self, name, argv, restart=False: started.__setitem__(name, (argv, restart)))

    def interrupt(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(serve.time, "sleep", interrupt)
    return started


def test_faden_serve_starts_the_gateway_on_its_own_port_beside_the_others(spawned, settings):
    settings.FADEN_GATEWAY_WORKERS = 2

    with pytest.raises(SystemExit):
        serve.Command().handle(bind="0.0.0.0", port=8000, concurrency=2, gateway_port=8001, gateway_workers=2)

    assert list(spawned) == ["web", "agents", "worker", "beat", "gateway"]
    assert [name for name, (_, restart) in spawned.items() if restart] == ["gateway"]  # the others stop everything
    gateway = spawned["gateway"][0]
    assert gateway[1:4] == ["-m", "uvicorn", "config.gateway_asgi:application"]
    assert gateway[gateway.index("--port") + 1] == "8001" and gateway[gateway.index("--workers") + 1] == "2"
    assert {"uvloop", "deployments.gateway.protocol:BoundedHttpToolsProtocol", "--no-access-log"} <= set(gateway)
    assert gateway[gateway.index("--timeout-keep-alive") + 1] == str(settings.FADEN_GATEWAY_KEEPALIVE)


def test_the_gateway_and_the_web_server_cannot_share_a_port(spawned):
    with pytest.raises(CommandError, match="cannot share port 8000"):
        serve.Command().handle(bind="0.0.0.0", port=8000, concurrency=2, gateway_port=8000, gateway_workers=1)
    assert spawned == {}


def test_the_gateways_command_line_serves_and_stops_on_sigterm(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "FADEN_DATA_DIR": str(tmp_path), "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
           "DJANGO_SETTINGS_MODULE": "config.settings"}
    process = subprocess.Popen(serve.gateway_argv(sys.executable, bind="127.0.0.1", port=port, workers=1), env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.TransportError:
                assert process.poll() is None and time.monotonic() < deadline, process.stderr.read().decode()
                time.sleep(0.1)
        refused = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=15)
        said = process.stderr.read().decode()

    assert health.json() == {"status": "ok"} and "server" not in health.headers
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert "Application shutdown complete." in said, said  # uvicorn then dies of the signal it caught, as told
