"""``image fetch|verify|load|list`` and ``image serve`` on loopback: agents run
as subprocesses on /usr/bin/python3, each "machine" a temp home and store."""

import hashlib
import http.client
import http.server
import json
import os
import re
import threading
import time

import pytest

from tests.agent.imagehelpers import MiB, Machine, Proxy, make_image, spec_for


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    return make_image(tmp_path_factory.mktemp("image"), size_mib=40, chunk_size=MiB)


@pytest.fixture
def machines(tmp_path):
    made = {}

    def machine(name):
        if name not in made:
            made[name] = Machine(tmp_path, name)
        return made[name]

    yield machine
    for m in made.values():
        if m.port:
            m.stop()


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(MiB), b""):
            h.update(block)
    return h.hexdigest()


def result_of(events):
    assert events[-1]["event"] == "result", events[-1]
    return events[-1]


# ------------------------------------------------------------------ fetch


def test_fetch_from_another_machines_server(machines, image):
    a, b = machines("a"), machines("b")
    a.hold(image)
    a.serve()
    code, events = b.run(["image", "fetch"], stdin=spec_for(image, a.url(image["digest"])))
    res = result_of(events)
    assert code == 0
    assert res["path"] == b.img(image["digest"]) and sha256_file(res["path"]) == image["digest"]
    assert res["bytes_fetched"] == image["size"] and res["resumed_from"] == 0
    assert b.image_files() == [image["digest"]]                      # no .part, no state left
    progress = [e for e in events if e["event"] == "progress"]
    assert progress and set(progress[0]) == {"event", "digest", "bytes", "total", "rate", "resumed_at"}
    assert all(p["total"] == image["size"] and 0 < p["bytes"] <= image["size"] for p in progress)
    assert {p["digest"] for p in progress} == {image["digest"]}

    code, events = b.run(["image", "fetch"], stdin=spec_for(image, a.url(image["digest"])))
    assert code == 0 and result_of(events)["bytes_fetched"] == 0 and events[-1]["already_complete"]


def test_chain_forwards_while_receiving(machines, image):
    """A holds the image; B fetches from A (slowed to ~20 MB/s); C fetches
    from B while B is still receiving."""
    a, b, c = machines("a"), machines("b"), machines("c")
    a.hold(image)
    a.serve()
    b.serve()
    slow = Proxy(a.port, rate=20 * 1000 * 1000)
    try:
        fetch_b = b.start(["image", "fetch"], stdin=spec_for(image, slow.url(image["digest"])))
        fetch_b.first(lambda e: e["event"] == "progress")
        fetch_c = c.start(["image", "fetch"], stdin=spec_for(image, b.url(image["digest"])))
        events_b, events_c = fetch_b.wait(), fetch_c.wait()
    finally:
        slow.close()
    res_b, res_c = result_of(events_b), result_of(events_c)
    c_first, _ = fetch_c.first(lambda e: e["event"] == "progress" and e["bytes"] > 0)
    b_done, _ = fetch_b.first(lambda e: e["event"] == "result")
    assert c_first < b_done, "C only got bytes after B had finished"
    for m, res in ((b, res_b), (c, res_c)):
        assert res["bytes_fetched"] == image["size"]
        assert sha256_file(m.img(image["digest"])) == image["digest"]


def test_a_cut_connection_resumes_at_the_last_verified_chunk(machines, image):
    a, b = machines("a"), machines("b")
    a.hold(image)
    a.serve()
    proxy = Proxy(a.port, cut_after=10 * MiB + 300 * 1024)
    try:
        code, events = b.run(["image", "fetch"], stdin=spec_for(image, proxy.url(image["digest"])))
    finally:
        proxy.close()
    res = result_of(events)
    assert code == 0 and proxy.cuts == 1
    assert image["size"] < res["bytes_fetched"] <= image["size"] + image["chunk_size"]
    assert any(e["event"] == "log" and "trying again from byte %d" % (10 * MiB) in e["message"] for e in events)
    assert sha256_file(res["path"]) == image["digest"]


class _FlakySource(http.server.BaseHTTPRequestHandler):
    """Serves the image with ranges; damages chunk 5 in the first N answers."""

    def do_GET(self):
        srv = self.server
        m = re.match(r"bytes=(\d+)-(\d*)$", self.headers.get("Range", ""))
        start = int(m.group(1)) if m else 0
        end = int(m.group(2)) + 1 if m and m.group(2) else len(srv.data)
        srv.starts.append(start)
        body = bytearray(srv.data[start:end])
        bad = 5 * MiB + 17
        if srv.damage > 0 and start <= bad:
            srv.damage -= 1
            body[bad - start] ^= 0xFF
        self.send_response(206)
        self.send_header("Content-Range", "bytes %d-%d/%d" % (start, end - 1, len(srv.data)))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def flaky(image):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FlakySource)
    srv.data, srv.starts, srv.damage = image["data"], [], 0
    srv.url = "http://127.0.0.1:%d/images/%s" % (srv.server_address[1], image["digest"])
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_a_damaged_chunk_is_fetched_again(machines, image, flaky):
    flaky.damage = 1
    code, events = machines("b").run(["image", "fetch"], stdin=spec_for(image, flaky.url))
    res = result_of(events)
    # The first request, the damaged chunk again, then the rest of the image in windows after it.
    assert code == 0 and flaky.starts[:2] == [0, 5 * MiB] and all(s > 5 * MiB for s in flaky.starts[2:])
    assert res["bytes_fetched"] == image["size"] + image["chunk_size"]
    assert any("chunk 5" in e.get("message", "") for e in events if e["event"] == "log")


def test_a_source_that_keeps_sending_a_damaged_chunk_is_reported(machines, image, flaky):
    flaky.damage = 99
    b = machines("b")
    code, events = b.run(["image", "fetch"], stdin=spec_for(image, flaky.url))
    assert code == 1 and events[-1]["kind"] == "retryable"
    assert "chunk 5 " in events[-1]["message"] and "4 times" in events[-1]["message"]
    assert flaky.starts == [0] + [5 * MiB] * 3
    assert b.image_files() == [image["digest"] + ".part", image["digest"] + ".state.json"]


def test_an_unreachable_source_leaves_a_resumable_partial_copy(machines, image):
    a, b = machines("a"), machines("b")
    a.hold(image)
    a.serve()
    proxy = Proxy(a.port, cut_after=12 * MiB + 5000)
    try:
        code, events = b.run(["image", "fetch"],
                             stdin=spec_for(image, proxy.url(image["digest"]), retry_seconds=0))
    finally:
        proxy.close()
    assert code == 1 and events[-1]["kind"] == "unreachable"
    assert "at byte %d" % (12 * MiB) in events[-1]["message"]
    d = image["digest"]
    assert b.image_files() == [d + ".part", d + ".state.json"]
    with open(os.path.join(b.store, "blobs", d + ".state.json")) as fh:
        state = json.load(fh)
    assert state["verified_chunks"] == 12 and state["size"] == image["size"]

    code, events = b.run(["image", "fetch"], stdin=spec_for(image, a.url(d)))
    res = result_of(events)
    assert res["resumed_from"] == 12 * MiB and res["bytes_fetched"] == image["size"] - 12 * MiB
    assert [e["resumed_at"] for e in events if e["event"] == "progress"][0] == 12 * MiB
    assert sha256_file(b.img(d)) == d


def test_no_room_writes_nothing(machines, image, small_fs):
    store = small_fs(8)
    b = machines("b")
    code, events = b.run(["image", "fetch", "--store", store], stdin=spec_for(image, "http://127.0.0.1:9/x"))
    assert code == 1 and events[-1]["kind"] == "no_room"
    assert events[-1]["message"] == ("Needs 40.0 MiB free in %s for the runtime image; 8.0 MiB are free."
                                     % store)
    assert os.listdir(store) == []


def test_the_room_check_counts_the_partial_copy(machines, image, small_fs):
    """20 MiB already here in a 48 MiB file system: the other 20 MiB fit, the whole 40 would not."""
    store = small_fs(48)
    a, b = machines("a"), machines("b")
    a.hold(image)
    a.serve()
    proxy = Proxy(a.port, cut_after=20 * MiB + 5000)
    spec = spec_for(image, proxy.url(image["digest"]), retry_seconds=0)
    try:
        code, events = b.run(["image", "fetch", "--store", store], stdin=spec)
    finally:
        proxy.close()
    assert events[-1]["kind"] == "unreachable"
    code, events = b.run(["image", "fetch", "--store", store], stdin=spec_for(image, a.url(image["digest"])))
    assert code == 0 and result_of(events)["resumed_from"] == 20 * MiB


DROP = object()


@pytest.mark.parametrize("spec, words", [
    (b"not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    ({"digest": DROP}, "has no \"digest\""),
    ({"digest": "zz"}, "64 hex digits"),
    ({"size": -4}, "'size' as a whole number"),
    ({"chunk_hashes": ["00" * 32]}, "has 1 chunk_hashes, but an image of"),
    ({"source": {"url": "ftp://h/x"}}, "source url must look like http://HOST:PORT"),
    ({"source": {"url": "http://h:1/x", "token": "a b"}}, "token must be a non-empty string"),
    ({"source": "http://h/x"}, "needs \"source\""),
])
def test_bad_spec_is_bad_input(machines, image, spec, words):
    if isinstance(spec, dict):
        full = spec_for(image, "http://127.0.0.1:9/images/" + image["digest"])
        full.update(spec)
        spec = {k: v for k, v in full.items() if v is not DROP}
    code, events = machines("b").run(["image", "fetch"], stdin=spec)
    assert code == 2 and events[-1]["kind"] == "bad_input", events
    assert words in events[-1]["message"]
    assert machines("b").image_files() == []


# ------------------------------------------------------------------ verify, load, list


def test_verify_load_and_list(machines, image):
    b = machines("b")
    d = image["digest"]
    code, events = b.run(["image", "verify", "--digest", d])
    assert code == 1 and events[-1]["kind"] == "not_retryable" and "there is no image" in events[-1]["message"]
    b.hold(image)
    code, events = b.run(["image", "verify", "--digest", d])
    assert code == 0 and result_of(events)["ok"] is True
    code, events = b.run(["image", "load", "--digest", d])
    assert code == 0 and result_of(events)["manifest"] == image["manifest"]
    with open(os.path.join(b.store, "runtime", "loaded.json")) as fh:
        loaded = json.load(fh)
    assert loaded["digest"] == d and loaded["manifest"] == image["manifest"]
    code, events = b.run(["image", "list"])
    assert result_of(events)["images"] == [{"digest": d, "state": "complete", "path": b.img(d),
                                            "size": image["size"], "verified_bytes": image["size"],
                                            "loaded": True}]
    damaged = bytearray(image["data"])
    damaged[-1] ^= 1
    b.hold(image, bytes(damaged))
    code, events = b.run(["image", "verify", "--digest", d])
    assert code == 1 and events[-1]["kind"] == "not_retryable" and "damaged" in events[-1]["message"]
    assert b.image_files() == []


def test_load_refuses_a_file_that_is_not_a_runtime_image(machines, image):
    b = machines("b")
    data = b"\0" * 4096
    fake = dict(image, data=data, digest=hashlib.sha256(data).hexdigest())
    b.hold(fake)
    code, events = b.run(["image", "load", "--digest", fake["digest"]])
    assert code == 1 and events[-1]["kind"] == "not_retryable" and "runtime image" in events[-1]["message"]


# ------------------------------------------------------------------ the server


def _request(port, path, method="GET", headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_server_ranges_errors_and_token(machines, image, tmp_path):
    a = machines("a")
    a.hold(image)
    first = a.serve()
    assert first["restarted"] is False and first["url"] == "http://127.0.0.1:%d/images/" % a.port
    d, size, path = image["digest"], image["size"], "/images/" + image["digest"]
    status, headers, body = _request(a.port, path)
    assert status == 200 and hashlib.sha256(body).hexdigest() == d
    status, headers, body = _request(a.port, path, headers={"Range": "bytes=100-199"})
    assert status == 206 and body == image["data"][100:200]
    assert headers["Content-Range"] == "bytes 100-199/%d" % size
    status, headers, body = _request(a.port, path, "HEAD", {"Range": "bytes=%d-" % (size - 10)})
    assert status == 206 and body == b"" and headers["Content-Length"] == "10"
    status, headers, _ = _request(a.port, path, headers={"Range": "bytes=%d-" % size})
    assert status == 416 and headers["Content-Range"] == "bytes */%d" % size
    assert _request(a.port, "/images/" + "0" * 64)[0] == 404
    assert _request(a.port, "/etc/passwd")[0] == 404

    again = a.serve()                                    # idempotent
    assert again["pid"] == first["pid"] and again["restarted"] is False
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    with_token = a.serve("--token-file", str(token))
    assert with_token["restarted"] is True and with_token["pid"] != first["pid"]
    assert _request(a.port, path, "HEAD")[0] == 401
    assert _request(a.port, path, "HEAD", {"Authorization": "Bearer nope"})[0] == 401
    assert _request(a.port, path, "HEAD", {"Authorization": "Bearer s3cret"})[0] == 200
    code, events = a.run(["image", "serve", "status"])
    assert result_of(events)["running"] is True and events[-1]["token"] is True

    other = machines("other")
    code, events = other.run(["image", "serve", "start", "--bind", "127.0.0.1", "--port", str(a.port)])
    assert code == 1 and events[-1]["kind"] == "address_in_use"

    code, events = a.run(["image", "serve", "stop"])
    assert result_of(events)["stopped"] is True
    a.port = None
    assert result_of(a.run(["image", "serve", "status"])[1])["running"] is False


def test_server_sends_only_verified_bytes_and_waits_for_more(machines, image):
    a = machines("a")
    d, chunk = image["digest"], image["chunk_size"]
    images = os.path.join(a.store, "blobs")
    os.makedirs(images)
    with open(os.path.join(images, d + ".part"), "wb") as fh:
        fh.write(image["data"][:2 * chunk] + b"\xee" * chunk)        # chunk 2 not verified yet

    def state(n):
        with open(os.path.join(images, d + ".state.json.tmp"), "w") as fh:
            json.dump({"digest": d, "size": image["size"], "chunk_size": chunk, "verified_chunks": n}, fh)
        os.replace(os.path.join(images, d + ".state.json.tmp"), os.path.join(images, d + ".state.json"))

    state(2)
    a.serve()
    status, headers, body = _request(a.port, "/images/" + d, "HEAD")
    assert status == 200 and headers["X-Faden-Verified-Bytes"] == str(2 * chunk)
    assert headers["X-Faden-Complete"] == "0"

    def later():
        time.sleep(0.6)
        with open(os.path.join(images, d + ".part"), "r+b") as fh:
            fh.seek(2 * chunk)
            fh.write(image["data"][2 * chunk:3 * chunk])
        state(3)

    threading.Thread(target=later, daemon=True).start()
    started = time.monotonic()
    status, _, body = _request(a.port, "/images/" + d, headers={"Range": "bytes=%d-%d" % (chunk, 3 * chunk - 1)})
    assert status == 206 and body == image["data"][chunk:3 * chunk]
    assert time.monotonic() - started >= 0.5


# ------------------------------------------------------------------ remove


def test_remove_frees_the_runtime_images_but_the_one_the_runtime_runs_and_never_a_models_file(machines, image):
    b = machines("b")
    d = image["digest"]
    b.hold(image)
    model_file = os.urandom(4096)
    model = dict(image, data=model_file, digest=hashlib.sha256(model_file).hexdigest())
    b.hold(model)
    code, events = b.run(["model", "place"], stdin={"repo": "org/chat", "revision": "abc123", "files": [
        {"path": "model.safetensors", "digest": model["digest"], "size": len(model_file)}]})
    assert code == 0, events
    code, events = b.run(["image", "load", "--digest", d])
    assert code == 0
    state = os.path.join(b.store, "runtime", "state.json")
    with open(state, "w") as fh:
        json.dump({"state": "started", "cluster": "gpu-room", "digest": d}, fh)

    code, events = b.run(["image", "remove"])
    assert code == 0 and result_of(events)["kept"] == [{"digest": d, "why": "the started runtime runs it"}]
    assert result_of(events)["removed"] == [] and os.path.exists(b.img(d))

    with open(state, "w") as fh:
        json.dump({"state": "stopped", "cluster": "gpu-room", "digest": d}, fh)
    code, events = b.run(["image", "remove"])
    res = result_of(events)
    assert code == 0 and res["removed"] == [{"digest": d, "size": image["size"]}] and res["freed"] == image["size"]
    assert not os.path.exists(b.img(d)) and not os.path.exists(os.path.join(b.store, "runtime", "loaded.json"))
    assert os.path.exists(b.blob(model["digest"]))  # the model's file is not an image: it stays
    code, events = b.run(["image", "remove"])
    assert code == 0 and result_of(events)["removed"] == []  # nothing left to free


def test_a_token_sent_on_stdin_is_kept_0600_in_the_home_and_required_a_new_one_without_a_restart(machines, image):
    a = machines("a")
    a.hold(image)
    path = "/images/" + image["digest"]
    token = "cluster-files-" + "t0k3n" * 5
    code, events = a.run(["image", "serve", "start", "--bind", "127.0.0.1", "--port", "0", "--token-stdin"],
                         stdin={"token": token})
    assert code == 0, events
    a.port, pid = events[-1]["port"], events[-1]["pid"]
    kept = os.path.join(a.home, "imageserve.token")
    assert open(kept).read().strip() == token and os.stat(kept).st_mode & 0o077 == 0
    assert _request(a.port, path, "HEAD")[0] == 401
    assert _request(a.port, path, "HEAD", {"Authorization": "Bearer " + token})[0] == 200
    code, events = a.run(["image", "serve", "start", "--bind", "127.0.0.1", "--port", "0", "--token-stdin"],
                         stdin={"token": token + "-2"})
    assert code == 0 and events[-1]["pid"] == pid and events[-1]["restarted"] is False   # read per request
    assert _request(a.port, path, "HEAD", {"Authorization": "Bearer " + token})[0] == 401
    assert _request(a.port, path, "HEAD", {"Authorization": "Bearer " + token + "-2"})[0] == 200
    code, events = a.run(["image", "serve", "start", "--bind", "127.0.0.1", "--port", "0", "--token-stdin"],
                         stdin={"token": "short"})
    assert code != 0 and events[-1]["kind"] == "bad_input"
    a.run(["image", "serve", "stop"])
