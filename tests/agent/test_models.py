"""``model place|list|remove|download`` and ``hub check``: the real agent as a subprocess, the lab hub
in this process on 127.0.0.1 (its models are cached under ~/.cache/fadenstack-lab/hub after the first run)."""

import hashlib
import http.server
import json
import os
import re
import socket
import subprocess
import threading

import pytest

from fadenstack_agent import modelstore
from fadenstack_agent.protocol import AgentError
from lab.hub import HubHandler, HubServer
from lab.hub_models import MODELS
from tests.agent.imagehelpers import Machine

TINY, GATED = "fadenstack-lab/tiny-chat", "fadenstack-lab/gated-chat"
TOKEN = "hf_lab_models_token_5f1c"
WEIGHTS = "model.safetensors"


class CountingHandler(HubHandler):
    """The lab hub, counting the file bytes it answers with (Content-Length of each /resolve/ answer)."""

    def send_header(self, keyword, value):
        if keyword == "Content-Length" and "/resolve/" in self.path:
            self.server.file_bytes += int(value)
        super().send_header(keyword, value)


@pytest.fixture(scope="module")
def hub():
    server = HubServer("127.0.0.1", 0, tokens=[TOKEN])
    server.RequestHandlerClass, server.file_bytes = CountingHandler, 0
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def machine(tmp_path):
    return Machine(tmp_path, "gpu-a")


def hub_files(hub, repo) -> dict:
    return hub.store.files(MODELS[repo])


def model_spec(hub, repo, **extra) -> dict:
    """A download spec for a lab model, as the server sends it (add ``endpoint`` for a download)."""
    files = [{"path": path, "digest": f.sha256, "size": f.size} for path, f in hub_files(hub, repo).items()]
    return dict({"repo": repo, "revision": MODELS[repo].commit_sha, "files": files}, **extra)


def download(machine, hub, repo, **extra):
    return machine.run(["model", "download"], stdin=model_spec(hub, repo, endpoint=hub.url, **extra))


def run_raw(machine, args, stdin: dict):
    proc = subprocess.run(machine.argv(args), input=json.dumps(stdin).encode(), capture_output=True, env=machine.env,
                          timeout=60)
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode()


def blob(data: bytes, path: str) -> dict:
    return {"path": path, "digest": hashlib.sha256(data).hexdigest(), "size": len(data), "data": data}


def hold(machine, *blobs) -> None:
    for b in blobs:
        machine.hold(b)


def spec(repo, revision, *files) -> dict:
    return {"repo": repo, "revision": revision, "files": [{k: f[k] for k in ("path", "digest", "size")} for f in files]}


def files_under(root) -> list:
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, _, names in os.walk(root) for n in names)


# ------------------------------------------------------------------ place, list, remove


def test_models_share_blobs_and_removing_one_frees_only_its_own(machine):
    shared, own_a, own_b = blob(b"tokenizer " * 300, "tok.json"), blob(os.urandom(5000), "w/a.bin"), \
        blob(os.urandom(7000), "w/b.bin")
    image = blob(os.urandom(9000), "runtime.img")           # a runtime image lives in the same blob directory
    hold(machine, shared, own_a, own_b, image)
    a, b = spec("org/model-a", "v1", shared, own_a), spec("org/model-b", "main", shared, own_b)

    code, events = machine.run(["model", "place"], stdin=a)
    placed = events[-1]
    assert code == 0 and placed["files"] == 2 and placed["bytes"] == shared["size"] + own_a["size"]
    assert placed["path"] == os.path.join(machine.store, "models", "org--model-a", "v1")
    weights = os.path.join(placed["path"], "w", "a.bin")
    assert os.path.samefile(weights, machine.blob(own_a["digest"]))      # a hard link: no second copy
    assert machine.run(["model", "place"], stdin=a)[1][-1] == placed     # idempotent, same placed_at
    assert machine.run(["model", "place"], stdin=b)[0] == 0

    listed = machine.run(["model", "list"])[1][-1]
    assert [(m["repo"], m["revision"], m["files"]) for m in listed["models"]] == [("org/model-a", "v1", 2),
                                                                                   ("org/model-b", "main", 2)]
    assert listed["free_bytes"] > 0

    code, events = machine.run(["model", "remove", "--repo", "org/model-a", "--revision", "v1"])
    assert (code, events[-1]["freed"]) == (0, own_a["size"])
    assert machine.blob_files() == sorted(x["digest"] for x in (shared, own_b, image))
    assert not os.path.exists(os.path.join(machine.store, "models", "org--model-a"))
    assert os.listdir(os.path.join(machine.store, "models", ".manifests")) == ["org--model-b@main.json"]
    assert machine.run(["model", "remove", "--repo", "org/model-a", "--revision", "v1"])[1][-1]["freed"] == 0


def test_placing_other_files_under_a_revision_replaces_the_tree_and_frees_the_old_blob(machine):
    keep, old, new = blob(b"{}", "config.json"), blob(os.urandom(3000), "old.bin"), blob(os.urandom(4000), "new.bin")
    hold(machine, keep, old, new)
    machine.run(["model", "place"], stdin=spec("org/m", "main", keep, old))

    code, events = machine.run(["model", "place"], stdin=spec("org/m", "main", keep, new))

    assert code == 0 and files_under(events[-1]["path"]) == ["config.json", "new.bin"]
    assert machine.blob_files() == sorted([keep["digest"], new["digest"]])


def test_a_model_whose_blobs_are_missing_is_refused_by_name_and_not_listed(machine):
    here, absent = blob(b"{}", "config.json"), blob(b"weights", "model.safetensors")
    hold(machine, here)
    code, events = machine.run(["model", "place"], stdin=spec("org/m", "main", here, absent))
    assert (code, events[-1]["kind"]) == (1, "not_retryable")
    assert events[-1]["message"] == "org/m at main cannot be placed: 1 of its files are not complete in the store " \
        "%s: model.safetensors (%s); fetch them first" % (machine.store, absent["digest"][:12])
    assert not os.path.exists(os.path.join(machine.store, "models", ".manifests"))


@pytest.mark.parametrize("field, value, words", [
    ("repo", "../etc", "the repo must be"),
    ("repo", "org/name/extra", "the repo must be"),
    ("repo", "org/na--me", "the repo must be"),
    ("revision", "..", "the revision must be"),
    ("revision", "refs/pr/1", "the revision must be"),
    ("path", "../../etc/passwd", "has an empty, '.' or '..' part"),
    ("path", "/etc/passwd", "it is absolute"),
    ("path", "a/./b", "has an empty, '.' or '..' part"),
    ("path", "a\x00b", "control character"),
    ("path", "x" * 1100, "longer than 1024"),
    ("files", [{"path": "a", "digest": "ab" * 32, "size": 1}, {"path": "a/b", "digest": "ab" * 32, "size": 1}],
     "a is listed as a file and as a folder of other files"),
], ids=["repo-dotdot", "repo-three-parts", "repo-double-dash", "revision-dotdot", "revision-slash", "path-up",
        "path-absolute", "path-dot", "path-nul", "path-long", "file-and-folder"])
def test_unsafe_names_are_refused_in_words(field, value, words):
    bad = spec("org/m", "main", blob(b"{}", "config.json"))
    if field == "path":
        bad["files"][0]["path"] = value
    else:
        bad[field] = value
    with pytest.raises(AgentError) as refused:
        modelstore.check_model(bad)
    assert refused.value.kind == "bad_input" and words in refused.value.message


def test_an_unsafe_path_is_bad_input_and_nothing_is_written(machine):
    config = blob(b"{}", "config.json")
    hold(machine, config)
    code, events = machine.run(["model", "place"], stdin=spec("org/m", "main", dict(config, path="../../etc/x")))
    assert (code, events[-1]["kind"]) == (2, "bad_input")
    assert not os.path.exists(os.path.join(machine.store, "models"))


# ------------------------------------------------------------------ download from the hub


def test_a_download_resumes_from_the_part_file_and_asks_the_hub_for_the_rest_only(tmp_path, hub):
    weights = hub_files(hub, TINY)[WEIGHTS]
    first, second = Machine(tmp_path, "first"), Machine(tmp_path, "second")
    before = hub.file_bytes
    code, events = download(first, hub, TINY)
    whole = hub.file_bytes - before
    assert code == 0 and events[-1]["bytes_downloaded"] == whole == events[-1]["bytes"]
    progress = [e for e in events if e["event"] == "progress" and e["file"] == WEIGHTS]
    assert progress[-1] == dict(progress[-1], digest=weights.sha256, bytes=weights.size, total=weights.size)
    assert progress[-1]["rate"] > 0

    held = weights.size // 3
    os.makedirs(os.path.join(second.store, "blobs"))
    with open(weights.local_path, "rb") as source, open(second.blob(weights.sha256) + ".part", "wb") as part:
        part.write(source.read(held))                    # a download cut a third of the way
    before = hub.file_bytes
    code, events = download(second, hub, TINY)
    assert code == 0 and events[-1]["resumed_bytes"] == held
    assert hub.file_bytes - before == whole - held == events[-1]["bytes_downloaded"]
    tree = events[-1]["path"]
    with open(os.path.join(tree, WEIGHTS), "rb") as placed:
        assert hashlib.sha256(placed.read()).hexdigest() == weights.sha256
    assert sorted(second.blob_files()) == sorted({f.sha256 for f in hub_files(hub, TINY).values()})


def test_a_file_whose_sha256_is_not_the_spec_s_is_refused_and_removed(machine, hub):
    wrong = model_spec(hub, GATED, endpoint=hub.url, token=TOKEN)
    config = next(f for f in wrong["files"] if f["path"] == "config.json")
    config["digest"] = "0" * 64
    code, events = machine.run(["model", "download"], stdin=wrong)
    assert (code, events[-1]["kind"]) == (1, "not_retryable")
    assert events[-1]["message"].startswith("config.json of %s from the hub has the sha256 " % GATED)
    assert "0" * 64 + ".part" not in machine.blob_files() and "0" * 64 not in machine.blob_files()
    assert not os.path.exists(os.path.join(machine.store, "models"))


@pytest.mark.parametrize("token, words", [
    (None, "the hub asks for a token for %s (a gated model): set the server's Hugging Face token" % GATED),
    ("hf_not_a_token_of_this_hub", "the token has no access to %s: request access to the model on the hub" % GATED),
], ids=["no-token", "a-token-without-access"])
def test_a_gated_model_is_refused_in_words_and_the_token_is_never_repeated(machine, hub, token, words):
    code, out, err = run_raw(machine, ["model", "download"],
                             model_spec(hub, GATED, endpoint=hub.url, **({"token": token} if token else {})))
    error = json.loads(out.splitlines()[-1])
    assert (code, error["kind"]) == (1, "not_retryable") and error["message"].startswith(words)
    assert token is None or token not in out + err


def test_a_gated_model_downloads_with_the_token_which_shows_nowhere(machine, hub):
    code, out, err = run_raw(machine, ["model", "download"], model_spec(hub, GATED, endpoint=hub.url, token=TOKEN))
    assert code == 0 and json.loads(out.splitlines()[-1])["files"] == len(hub_files(hub, GATED))
    assert TOKEN not in out + err
    for path in files_under(machine.store):
        with open(os.path.join(machine.store, path), "rb") as fh:
            assert TOKEN.encode() not in fh.read(), path


@pytest.mark.parametrize("change, words", [
    ({"repo": "fadenstack-lab/no-such-model"}, "fadenstack-lab/no-such-model is not on the hub at "),
    ({"revision": "v9"}, "%s has no revision v9 on the hub" % TINY),
    ({"files": [{"path": "pytorch_model.bin", "digest": "ab" * 32, "size": 10}]},
     "%s at %s has no file pytorch_model.bin on the hub" % (TINY, MODELS[TINY].commit_sha)),
], ids=["repo", "revision", "file"])
def test_what_the_hub_does_not_hold_is_named(machine, hub, change, words):
    code, events = machine.run(["model", "download"], stdin=dict(model_spec(hub, TINY, endpoint=hub.url), **change))
    assert (code, events[-1]["kind"]) == (1, "not_retryable") and events[-1]["message"].startswith(words)


def test_no_room_is_told_with_both_figures_before_anything_is_written(machine, hub):
    huge = model_spec(hub, TINY, endpoint=hub.url)
    huge["files"][0]["size"] = 1 << 49
    code, events = machine.run(["model", "download"], stdin=huge)
    assert (code, events[-1]["kind"]) == (1, "no_room")
    assert re.fullmatch(r"Needs 524288\.\d GiB free in %s for 7 files of %s at %s; \d+\.\d [GM]iB are free\."
                        % (re.escape(machine.store), TINY, MODELS[TINY].commit_sha), events[-1]["message"])
    assert not os.path.exists(machine.store)


class _Elsewhere(http.server.BaseHTTPRequestHandler):
    """A hub that sends its file to another host (a CDN), or refuses every token."""

    def do_GET(self):
        self.server.seen.append((self.server.server_port, self.path, self.headers.get("Authorization")))
        if self.path.startswith("/refuse/"):
            self.send_response(401)
        elif self.server.cdn is not None:
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.1:%d/cdn/file" % self.server.cdn.server_port)
        else:
            self.send_response(200)
            self.send_header("Content-Length", str(len(self.server.body)))
            self.end_headers()
            self.wfile.write(self.server.body)
            return
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_redirect_to_another_host_gets_no_token_and_a_refused_token_is_said_so(machine):
    seen, body = [], b"weights from the cdn"
    servers = []
    for cdn in (None, "hub"):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Elsewhere)
        server.seen, server.body, server.cdn = seen, body, servers[0] if cdn else None
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
    cdn, hub = servers
    try:
        endpoint = "http://127.0.0.1:%d" % hub.server_port
        got = machine.run(["model", "download"], stdin=dict(spec("org/m", "main", blob(body, "w.bin")),
                                                            endpoint=endpoint, token=TOKEN))
        refused = machine.run(["model", "download"], stdin=dict(spec("org/m", "main", blob(b"x", "w.bin")),
                                                                endpoint=endpoint + "/refuse", token=TOKEN))
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
    assert got[0] == 0 and got[1][-1]["bytes_downloaded"] == len(body)
    assert seen[:2] == [(hub.server_port, "/org/m/resolve/main/w.bin", "Bearer " + TOKEN),
                        (cdn.server_port, "/cdn/file", None)]
    assert refused[1][-1]["message"] == "the hub refused the token for org/m: check the server's Hugging Face token"


# ------------------------------------------------------------------ hub check


def test_hub_check_answers_ok_or_says_why_not(machine, hub):
    code, events = machine.run(["hub", "check", "--url", hub.url])
    assert code == 0 and events[-1] == dict(events[-1], ok=True, status=200) and events[-1]["seconds"] < 5

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    code, events = machine.run(["hub", "check", "--url", "http://127.0.0.1:%d" % port, "--timeout", "2"])
    assert (code, events[-1]["kind"]) == (1, "unreachable")
    assert events[-1]["message"] == "cannot reach the hub at http://127.0.0.1:%d: connection refused" % port
