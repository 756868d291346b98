"""Helpers for the blob, image and probe tests: machines (a home and a store
each), agent runs as subprocesses, a test image, and a TCP proxy that can cut
or slow a connection."""

import hashlib
import io
import json
import os
import socket
import subprocess
import tarfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
AGENT_DIR = os.path.join(os.path.dirname(os.path.dirname(HERE)), "agent")
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else "python3"
MiB = 1024 * 1024


def make_image(directory, size_mib=40, chunk_size=MiB):
    """A runtime image (a docker-archive: manifest.json, the config with the build's labels, one layer
    holding a random payload.bin) and its spec parts."""
    manifest = {"name": "faden-runtime", "version": "2.0.1", "arch": "x86_64",
                "accelerator_vendor": "none", "certified": True}
    labels = {"org.fadenstack.runtime." + k.replace("_", "-"): str(v).lower() if isinstance(v, bool) else v
              for k, v in manifest.items()}
    layer = io.BytesIO()
    payload = os.urandom(size_mib * MiB - 8 * 1024)
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo("payload.bin")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    layer = layer.getvalue()
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Labels": labels},
                         "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]}})
    index = json.dumps([{"Config": "config.json", "RepoTags": ["localhost/faden-runtime:2.0.1"],
                         "Layers": ["l1/layer.tar"]}])
    path = os.path.join(str(directory), "runtime.img")
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in (("manifest.json", index.encode()), ("config.json", config.encode()), ("l1/layer.tar", layer)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with open(path, "rb") as fh:
        data = fh.read()
    hashes = [hashlib.sha256(data[i:i + chunk_size]).hexdigest() for i in range(0, len(data), chunk_size)]
    return {"path": path, "data": data, "digest": hashlib.sha256(data).hexdigest(), "size": len(data),
            "chunk_size": chunk_size, "chunk_hashes": hashes,
            "manifest": dict(manifest, tag="localhost/faden-runtime:2.0.1", image_id=hashlib.sha256(config.encode()).hexdigest())}


def spec_for(image, url, **extra):
    spec = {k: image[k] for k in ("digest", "size", "chunk_size", "chunk_hashes")}
    spec["source"] = {"url": url}
    spec.update(extra)
    return spec


class Machine:
    """One pretend machine: its agent home and store under a temp dir."""

    def __init__(self, root, name):
        self.name = name
        self.home = os.path.join(str(root), name, "home")
        self.store = os.path.join(str(root), name, "store")
        self.env = dict(os.environ)
        self.env.update(PYTHONPATH=AGENT_DIR, FADEN_AGENT_HOME=self.home, FADEN_AGENT_STORE=self.store,
                        FADEN_AGENT_CONFIG=os.path.join(str(root), name, "agent.json"),
                        PYTHONDONTWRITEBYTECODE="1")
        self.port = None

    def argv(self, args):
        return [PYTHON, "-m", "fadenstack_agent"] + list(args)

    def run(self, args, stdin=b"", timeout=60):
        """(exit status, events); every line must be JSON, one final line."""
        if isinstance(stdin, dict):
            stdin = json.dumps(stdin).encode()
        proc = subprocess.run(self.argv(args), input=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=self.env, timeout=timeout)
        events = [json.loads(line) for line in proc.stdout.decode().splitlines()]
        finals = [e for e in events if e["event"] in ("result", "error")]
        assert len(finals) == 1 and events[-1] is finals[0], proc.stdout
        assert "Traceback" not in proc.stderr.decode(), proc.stderr.decode()
        return proc.returncode, events

    def start(self, args, stdin=None):
        return Running(self, args, stdin)

    def blob(self, digest):
        """Where the store keeps a finished blob."""
        return os.path.join(self.store, "blobs", digest)

    img = blob          # a runtime image is a blob

    def blob_files(self):
        d = os.path.join(self.store, "blobs")
        return sorted(os.listdir(d)) if os.path.isdir(d) else []

    image_files = blob_files

    def serve(self, *extra):
        code, events = self.run(["image", "serve", "start", "--bind", "127.0.0.1", "--port", "0"] + list(extra))
        assert code == 0, events
        self.port = events[-1]["port"]
        return events[-1]

    def url(self, digest, path="images"):
        return "http://127.0.0.1:%d/%s/%s" % (self.port, path, digest)

    def stop(self):
        self.run(["image", "serve", "stop"])

    def hold(self, image, data=None):
        os.makedirs(os.path.join(self.store, "blobs"), exist_ok=True)
        with open(self.blob(image["digest"]), "wb") as fh:
            fh.write(image["data"] if data is None else data)


class Running:
    """An agent command in the background, its lines time-stamped as they come."""

    def __init__(self, machine, args, stdin=None):
        self.proc = subprocess.Popen(machine.argv(args), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=machine.env)
        if stdin is not None:
            self.proc.stdin.write(json.dumps(stdin).encode() if isinstance(stdin, dict) else stdin)
        self.proc.stdin.close()
        self.lines = []                                     # (monotonic time, event)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), json.loads(line)))

    def first(self, predicate, timeout=20.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for stamp, event in list(self.lines):
                if predicate(event):
                    return stamp, event
            time.sleep(0.01)
        raise AssertionError("no such event in %r" % [e for _, e in self.lines])

    def wait(self, timeout=60):
        self.proc.wait(timeout)
        self.thread.join(10)
        err = self.proc.stderr.read().decode()
        assert "Traceback" not in err, err
        return [e for _, e in self.lines]

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Proxy:
    """A TCP proxy on 127.0.0.1: ``cut_after`` drops the first connection after
    that many bytes towards the client; ``rate`` limits bytes/s towards it."""

    def __init__(self, upstream_port, cut_after=None, rate=None):
        self.upstream_port, self.cut_after, self.rate = upstream_port, cut_after, rate
        self.cuts = 0
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, digest, path="images"):
        return "http://127.0.0.1:%d/%s/%s" % (self.port, path, digest)

    def _accept(self):
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def _handle(self, client):
        cut = None
        if self.cut_after is not None and self.cuts == 0:
            self.cuts, cut = 1, self.cut_after
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        except OSError:
            client.close()
            return
        threading.Thread(target=self._pump_up, args=(client, upstream), daemon=True).start()
        sent, started = 0, time.monotonic()
        try:
            while True:
                data = upstream.recv(65536)
                if not data:
                    break
                if cut is not None and sent + len(data) >= cut:
                    client.sendall(data[:cut - sent])
                    break
                client.sendall(data)
                sent += len(data)
                if self.rate:
                    ahead = sent / self.rate - (time.monotonic() - started)
                    if ahead > 0:
                        time.sleep(ahead)
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    @staticmethod
    def _pump_up(client, upstream):
        try:
            while True:
                data = client.recv(65536)
                if not data:
                    break
                upstream.sendall(data)
        except OSError:
            pass

    def close(self):
        self.closed = True
        self.listener.close()
