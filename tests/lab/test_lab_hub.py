"""The lab hub as `faden lab up` starts it: a host of its own at .250 on the management network, reached
by the console (the lab host) and by the machines, and cut off from one machine by `hub-cut`.

Its `down` (no namespace, link or process left) is checked with the rest of the lab's in test_lab.py.
"""
import json
import stat
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import GatedRepoError

from lab.hub_models import MODELS

pytestmark = pytest.mark.lab

HUB = "http://198.18.0.250:8090"
CONSOLE_ADDRESS = "198.18.0.1"
GATED = "fadenstack-lab/gated-chat"

# A GET from inside a machine's network namespace: the JSON it answered, or how it failed and how fast.
PROBE = """
import json, sys, time, urllib.request
started = time.monotonic()
try:
    with urllib.request.urlopen(sys.argv[1], timeout=10) as response:
        print(json.dumps({"status": response.status, "body": json.loads(response.read())}))
except OSError as error:
    error = getattr(error, "reason", error)
    print(json.dumps({"errno": getattr(error, "errno", None), "error": str(error),
                      "seconds": time.monotonic() - started}))
"""


def get_from(machine: str, url: str) -> dict:
    result = subprocess.run(["nsenter", f"--net=/run/netns/fl-{machine}", sys.executable, "-c", PROBE, url],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def hub(lab) -> dict:
    return lab.status()["hub"]


@pytest.fixture
def console_stand_in():
    """Something answering HTTP on the console's address (the lab host's .1 on the management bridge)."""
    class Answer(BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"console": true}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((CONSOLE_ADDRESS, 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://{CONSOLE_ADDRESS}:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def test_status_names_the_hub_on_the_management_network_with_its_models_and_token_file(lab, hub):
    assert {key: hub[key] for key in ("url", "address", "port", "rate_mbit", "netns", "running")} == {
        "url": HUB, "address": "198.18.0.250", "port": 8090, "rate_mbit": 400, "netns": "fl-hub", "running": True}
    assert hub["models"] == list(MODELS) == ["fadenstack-lab/tiny-chat", "fadenstack-lab/medium-chat", GATED]
    token_file = Path(hub["token_file"])
    assert token_file.parent.parent == lab.state_dir
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    assert len(token) > 20
    human = lab.run("status").stdout
    assert f"hub: {HUB} (running, 400 Mbit/s, 3 models; token file {token_file})" in human
    # The token is on no command line and in no output.
    assert token not in Path(f"/proc/{hub['pid']}/cmdline").read_text()
    assert "--token-file" in Path(f"/proc/{hub['pid']}/cmdline").read_text()
    assert token not in human + lab.run("status", "--json").stdout + Path(hub["log"]).read_text()


def test_the_console_lists_the_models_with_huggingface_hub_and_gets_the_gated_one_with_the_token(hub, tmp_path):
    api = HfApi(endpoint=hub["url"])
    assert [model.id for model in api.list_models(token=False)] == hub["models"]
    with pytest.raises(GatedRepoError):
        hf_hub_download(GATED, "config.json", endpoint=hub["url"], cache_dir=tmp_path / "none", token=False)
    token = Path(hub["token_file"]).read_text().strip()
    path = hf_hub_download(GATED, "config.json", endpoint=hub["url"], cache_dir=tmp_path / "with", token=token)
    assert json.loads(Path(path).read_text())["model_type"] == "llama"


def test_the_hubs_link_is_shaped_to_the_specs_rate_both_ways(hub):
    for command in (["tc", "qdisc", "show", "dev", "flh-mgmt"], ["tc", "-n", "fl-hub", "qdisc", "show", "dev", "eth0"]):
        assert "rate 400Mbit" in subprocess.run(command, capture_output=True, text=True).stdout
    token = Path(hub["token_file"]).read_text().strip()
    HfApi(endpoint=hub["url"]).model_info(GATED, files_metadata=True, token=token)  # the weights made: a pure transfer
    request = urllib.request.Request(f"{hub['url']}/{GATED}/resolve/main/model.safetensors",
                                     headers={"Authorization": f"Bearer {token}"})
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=30) as response:
        size = len(response.read())
    mbit_per_second = size * 8 / (time.monotonic() - started) / 1e6
    assert size > 8 * 2**20
    assert mbit_per_second < 400 * 1.15  # unshaped, the bridge carries gigabits


def test_a_machine_lists_the_hubs_models_from_its_own_namespace(hub):
    answer = get_from("lab-e", f"{HUB}/api/models")
    assert answer["status"] == 200
    assert [(model["id"], model["modelId"]) for model in answer["body"]] == [(repo, repo) for repo in hub["models"]]


def test_hub_cut_fails_fast_on_that_machine_only_keeps_the_console_and_lasts_until_hub_restore(lab, console_stand_in):
    lab.fault("lab-a", "hub-cut")
    try:
        assert lab.machine("lab-a")["faults"]["hub_cut"] is True
        assert "hub cut" in next(line for line in lab.run("status").stdout.splitlines() if line.startswith("lab-a"))
        cut = get_from("lab-a", f"{HUB}/api/models")
        assert cut["errno"] == 113, cut  # EHOSTUNREACH: "No route to host", not a time-out
        assert cut["seconds"] < 1
        assert get_from("lab-a", console_stand_in) == {"status": 200, "body": {"console": True}}
        assert get_from("lab-b", f"{HUB}/api/models")["status"] == 200

        lab.fault("lab-a", "reboot")  # a route of the machine's network, like a pulled cable: it stays
        assert get_from("lab-a", f"{HUB}/api/models")["errno"] == 113
        assert lab.machine("lab-a")["faults"]["hub_cut"] is True
    finally:
        lab.fault("lab-a", "hub-restore")
    assert lab.machine("lab-a")["faults"]["hub_cut"] is False
    assert get_from("lab-a", f"{HUB}/api/models")["status"] == 200
