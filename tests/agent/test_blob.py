"""``blob fetch|verify|list`` and ``blob serve``: the transfer layer for any
content-addressed file, on loopback.  The files here are not runtime images
(random bytes), so nothing image-specific is needed on this path."""

import hashlib
import http.server
import json
import os
import re
import threading

import pytest

from fadenstack_agent import blobstore
from tests.agent.imagehelpers import MiB, Machine, Proxy, make_image, spec_for


def make_blob(size, chunk_size=MiB):
    data = os.urandom(size)
    hashes = [hashlib.sha256(data[i:i + chunk_size]).hexdigest() for i in range(0, len(data), chunk_size)]
    return {"data": data, "digest": hashlib.sha256(data).hexdigest(), "size": size,
            "chunk_size": chunk_size, "chunk_hashes": hashes}


@pytest.fixture(scope="module")
def blob():
    return make_blob(24 * MiB + 12345)


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


def result_of(events):
    assert events[-1]["event"] == "result", events[-1]
    return events[-1]


def sha256_file(path):
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def test_a_blob_is_fetched_from_the_blobs_path_of_another_machines_server(machines, blob):
    a, b = machines("a"), machines("b")
    a.hold(blob)
    served = a.serve()
    assert served["blobs_url"] == "http://127.0.0.1:%d/blobs/" % a.port
    code, events = b.run(["blob", "fetch"], stdin=spec_for(blob, a.url(blob["digest"], "blobs")))
    res = result_of(events)
    assert code == 0 and res["path"] == b.blob(blob["digest"]) and sha256_file(res["path"]) == blob["digest"]
    assert res["bytes_fetched"] == blob["size"] and res["resumed_from"] == 0
    progress = [e for e in events if e["event"] == "progress"]
    assert progress and all(p["digest"] == blob["digest"] and p["total"] == blob["size"] for p in progress)
    code, events = b.run(["blob", "list"])
    assert result_of(events)["blobs"] == [{"digest": blob["digest"], "state": "complete",
                                           "path": b.blob(blob["digest"]), "size": blob["size"],
                                           "verified_bytes": blob["size"]}]


def test_a_cut_blob_fetch_is_listed_partial_and_resumes_at_the_last_verified_chunk(machines, blob):
    a, b = machines("a"), machines("b")
    a.hold(blob)
    a.serve()
    d = blob["digest"]
    proxy = Proxy(a.port, cut_after=7 * MiB + 4000)
    try:
        code, events = b.run(["blob", "fetch"], stdin=spec_for(blob, proxy.url(d, "blobs"), retry_seconds=0))
    finally:
        proxy.close()
    assert code == 1 and events[-1]["kind"] == "unreachable"
    assert events[-1]["message"].startswith("could not get the file %s from " % d[:12])
    assert b.blob_files() == [d + ".part", d + ".state.json"]
    listed = result_of(b.run(["blob", "list"])[1])["blobs"]
    assert [(x["state"], x["verified_bytes"]) for x in listed] == [("partial", 7 * MiB)]
    code, events = b.run(["blob", "verify", "--digest", d])
    assert code == 1 and events[-1]["kind"] == "retryable" and "blob fetch` finishes it" in events[-1]["message"]

    code, events = b.run(["blob", "fetch"], stdin=spec_for(blob, a.url(d, "blobs")))
    res = result_of(events)
    assert res["resumed_from"] == 7 * MiB and res["bytes_fetched"] == blob["size"] - 7 * MiB
    assert sha256_file(b.blob(d)) == d and b.blob_files() == [d]


def test_verify_tells_progress_by_digest_and_removes_a_damaged_blob(machines, blob):
    b = machines("b")
    d = blob["digest"]
    b.hold(blob)
    code, events = b.run(["blob", "verify", "--digest", d])
    assert code == 0 and result_of(events)["ok"] is True and events[-1]["size"] == blob["size"]
    assert all(e["digest"] == d for e in events if e["event"] == "progress")
    damaged = bytearray(blob["data"])
    damaged[MiB] ^= 1
    b.hold(blob, bytes(damaged))
    code, events = b.run(["blob", "verify", "--digest", d])
    assert code == 1 and events[-1]["kind"] == "not_retryable" and "damaged" in events[-1]["message"]
    assert b.blob_files() == []
    code, events = b.run(["blob", "verify", "--digest", d])
    assert code == 1 and events[-1]["kind"] == "not_retryable" and "there is no blob" in events[-1]["message"]


class _RangeSource(http.server.BaseHTTPRequestHandler):
    """Any path: the server's bytes, with ranges (as the console answers)."""

    def do_GET(self):
        data = self.server.data
        m = re.match(r"bytes=(\d+)-(\d*)$", self.headers.get("Range", ""))
        start = int(m.group(1)) if m else 0
        end = int(m.group(2)) + 1 if m and m.group(2) else len(data)
        self.send_response(206)
        self.send_header("Content-Range", "bytes %d-%d/%d" % (start, end - 1, len(data)))
        self.send_header("Content-Length", str(end - start))
        self.end_headers()
        self.wfile.write(data[start:end])

    def log_message(self, *args):
        pass


@pytest.fixture
def source(blob):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RangeSource)
    srv.data = blob["data"]
    srv.url = "http://127.0.0.1:%d/agent/blobs/x/" % srv.server_address[1]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_chunks_that_match_but_a_whole_file_that_does_not_is_removed(machines, blob, source):
    b = machines("b")
    wrong = dict(blob, digest="0" * 64)           # the chunk hashes belong to another file
    code, events = b.run(["blob", "fetch"], stdin=spec_for(wrong, source.url))
    assert code == 1 and events[-1]["kind"] == "not_retryable"
    assert "the spec's chunk hashes belong to another file" in events[-1]["message"]
    assert b.blob_files() == []


def test_no_room_names_the_file_and_writes_nothing(machines, blob, small_fs):
    store = small_fs(8)
    code, events = machines("b").run(["blob", "fetch", "--store", store],
                                     stdin=spec_for(blob, "http://127.0.0.1:9/blobs/x"))
    assert code == 1 and events[-1]["kind"] == "no_room"
    assert events[-1]["message"] == ("Needs 24.0 MiB free in %s for the file %s; 8.0 MiB are free."
                                     % (store, blob["digest"][:12]))
    assert os.listdir(store) == []


def test_a_bad_blob_spec_is_bad_input_in_blob_words(machines, blob):
    spec = spec_for(blob, "http://127.0.0.1:9/blobs/x")
    spec["chunk_hashes"] = spec["chunk_hashes"][:1]
    code, events = machines("b").run(["blob", "fetch"], stdin=spec)
    assert code == 2 and events[-1]["kind"] == "bad_input"
    assert "the blob spec has 1 chunk_hashes, but a blob of" in events[-1]["message"]


def test_a_runtime_image_fetched_as_a_blob_loads_as_an_image(machines, tmp_path):
    image = make_image(tmp_path, size_mib=3, chunk_size=MiB)
    a, b = machines("a"), machines("b")
    a.hold(image)
    a.serve()
    assert b.run(["blob", "fetch"], stdin=spec_for(image, a.url(image["digest"], "blobs")))[0] == 0
    code, events = b.run(["image", "load", "--digest", image["digest"]])
    assert code == 0 and result_of(events)["manifest"] == image["manifest"]
    listed = result_of(b.run(["image", "list"])[1])["images"]
    assert [(x["digest"], x["loaded"]) for x in listed] == [(image["digest"], True)]


# ------------------------------------------------------------------ what an older agent left


def _old_store(store, blob, partial):
    old = os.path.join(store, "images")
    os.makedirs(old)
    with open(os.path.join(old, blob["digest"] + ".img"), "wb") as fh:
        fh.write(blob["data"])
    with open(os.path.join(old, partial["digest"] + ".part"), "wb") as fh:
        fh.write(partial["data"][:2 * MiB])
    with open(os.path.join(old, partial["digest"] + ".state.json"), "w") as fh:
        # What agents before 0.2 wrote after each chunk.
        hashes_id = hashlib.sha256("".join(partial["chunk_hashes"]).encode("ascii")).hexdigest()
        json.dump({"digest": partial["digest"], "size": partial["size"], "chunk_size": MiB, "chunks": 3,
                   "hashes_sha256": hashes_id, "verified_chunks": 2, "verified_bytes": 2 * MiB,
                   "source": "http://198.18.0.1:8000/agent/images/x/", "updated": 1.0}, fh)
    return old


def test_images_an_older_agent_left_become_blobs_in_place(tmp_path, blob):
    store = str(tmp_path)
    partial = make_blob(3 * MiB)
    old = _old_store(store, blob, partial)
    assert sorted(blobstore.adopt_old_images(store)) == sorted([blob["digest"], partial["digest"]])
    assert not os.path.exists(old)
    assert sorted(os.listdir(os.path.join(store, "blobs"))) == sorted(
        [blob["digest"], partial["digest"] + ".part", partial["digest"] + ".state.json"])
    assert blobstore.available(store, partial["digest"])[2:] == (2 * MiB, False)
    assert blobstore.adopt_old_images(store) == []


def test_an_upgraded_machine_serves_and_resumes_what_it_held_before(machines, blob):
    a, b = machines("a"), machines("b")
    partial = make_blob(3 * MiB)
    _old_store(a.store, blob, partial)
    a.serve()                                        # the server moves the old files when it starts
    code, events = b.run(["image", "fetch"], stdin=spec_for(blob, a.url(blob["digest"])))
    assert code == 0 and sha256_file(result_of(events)["path"]) == blob["digest"]
    b.hold(partial)
    b.serve()
    code, events = a.run(["blob", "fetch"], stdin=spec_for(partial, b.url(partial["digest"], "blobs")))
    res = result_of(events)
    assert code == 0 and res["resumed_from"] == 2 * MiB and sha256_file(res["path"]) == partial["digest"]
