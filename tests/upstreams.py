"""A small OpenAI-like engine on 127.0.0.1, for the gateway's tests and benchmark: the standard library's
threaded HTTP server, keep-alive (HTTP/1.1), answering as vLLM's server does.

- ``GET /health`` (200), ``GET /v1/models``;
- ``POST /v1/chat/completions`` and ``/v1/completions``: ``tokens`` words, streamed as server-sent
  events (``stream: true``: one event per token, each written and flushed on its own, ``pause``
  seconds apart, then a chunk with the usage when the body asks ``stream_options: {"include_usage": true}``,
  then ``data: [DONE]``) or in one JSON answer with its usage (after ``tokens`` x ``pause`` seconds);
  a prompt containing "fail" gets a 500;
- ``POST /v1/embeddings``: a small vector.

Each answer's ``id`` names the upstream (``chatcmpl-<name>-<n>``), so a test knows which copy answered.
``hold`` (a threading.Event) makes requests wait until it is set; ``requests`` records what arrived;
``aborted`` counts streams whose client went away. ``close()`` stops listening: its port then refuses
connections, as a dead copy's does.

    python -m tests.upstreams --port 8100 --name bench --tokens 16 --pause 0    # the benchmark's engine
"""
from __future__ import annotations

import argparse
import json
import signal
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

WORDS = ("the", "gateway", "passes", "each", "token", "on", "as", "it", "comes", "from", "a", "copy")


class Upstream:
    def __init__(self, name: str, *, port: int = 0, tokens: int = 5, pause: float = 0.0, model: str = "any",
                 tls: ssl.SSLContext | None = None):
        self.name, self.tokens, self.pause, self.model = name, tokens, pause, model
        self.hold: threading.Event | None = None
        self.requests: list[dict] = []
        self.aborted = 0
        self.refused_tls = 0  # TLS handshakes it refused (no client certificate of its authority)
        self.lock = threading.Lock()
        self.server = _Server(("127.0.0.1", port), _Handler)
        self.server.upstream = self
        self.server.tls = tls  # a server context: HTTPS, as a copy behind mutual TLS serves (handshakes in the thread)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"{'https' if self.server.tls else 'http'}://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.server.close_connections()
        self.thread.join(timeout=5)

    def arrived(self, path: str | None = None) -> int:
        with self.lock:
            return sum(1 for r in self.requests if path is None or r["path"] == path)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, *args, **kwargs):
        self.open_sockets: set = set()
        super().__init__(*args, **kwargs)

    def process_request(self, request, client_address):
        self.open_sockets.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request):
        self.open_sockets.discard(request)
        super().shutdown_request(request)

    def finish_request(self, request, client_address):
        if self.tls is None:
            return super().finish_request(request, client_address)
        request.settimeout(10)
        try:
            conn = self.tls.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            with self.upstream.lock:
                self.upstream.refused_tls += 1
            return
        conn.settimeout(None)
        self.open_sockets.add(conn)
        try:
            self.RequestHandlerClass(conn, client_address, self)
        finally:
            self.open_sockets.discard(conn)
            conn.close()

    def handle_error(self, request, client_address):
        """A client (the gateway) that closed its connection while an answer was written: counted, not printed."""
        import sys

        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            with self.upstream.lock:
                self.upstream.aborted += 1
            return
        super().handle_error(request, client_address)

    def close_connections(self) -> None:
        """Kept-alive connections close too: a copy that stopped answers nothing at all."""
        import socket

        for sock in list(self.open_sockets):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "upstream"
    disable_nagle_algorithm = True  # headers and body go in separate writes: no 40 ms wait for an ACK between them

    def log_message(self, format, *args):  # quiet
        pass

    @property
    def upstream(self) -> Upstream:
        return self.server.upstream

    def do_GET(self):
        if self.path == "/health":
            self._json(200, {})
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": self.upstream.model, "object": "model"}]})
        else:
            self._json(404, {"error": {"message": f"no {self.path}", "type": "NotFoundError"}})

    def do_POST(self):
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length)
        up = self.upstream
        with up.lock:
            up.requests.append({"path": self.path, "body": raw, "headers": dict(self.headers), "at": time.monotonic()})
            number = len(up.requests)
        if up.hold is not None:
            up.hold.wait(timeout=30)
        body = json.loads(raw or b"{}")
        if self.path == "/v1/embeddings":
            self._json(200, {"object": "list", "model": body.get("model"),
                             "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2, 0.3]}]})
            return
        if self.path not in ("/v1/chat/completions", "/v1/completions"):
            self._json(404, {"error": {"message": f"no {self.path}", "type": "NotFoundError"}})
            return
        if "fail" in raw.decode(errors="replace"):
            self._json(500, {"error": {"message": "the engine failed", "type": "InternalServerError"}})
            return
        chat = self.path == "/v1/chat/completions"
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{up.name}-{number}"
        words = [WORDS[i % len(WORDS)] for i in range(up.tokens)]
        if body.get("stream") is True:
            options = body.get("stream_options")
            self._stream(ident, chat, body.get("model"), words,
                         usage=isinstance(options, dict) and options.get("include_usage") is True)
        else:
            if up.pause:
                time.sleep(up.pause * len(words))  # the whole answer is ready when its last token is
            text = " ".join(words)
            choice = {"index": 0, "finish_reason": "length",
                      **({"message": {"role": "assistant", "content": text}} if chat else {"text": text})}
            self._json(200, {"id": ident, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": body.get("model"), "choices": [choice],
                             "usage": {"prompt_tokens": 3, "completion_tokens": len(words), "total_tokens": 3 + len(words)}})

    def _stream(self, ident: str, chat: bool, model, words: list[str], *, usage: bool = False) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        try:
            for index, word in enumerate(words):
                if index and self.upstream.pause:
                    time.sleep(self.upstream.pause)
                delta = {"delta": {"content": word + " "}} if chat else {"text": word + " "}
                event = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion",
                         "created": int(time.time()), "model": model, "choices": [{"index": 0, **delta, "finish_reason": None}]}
                self._chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
            if usage:
                event = {"id": ident, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
                         "model": model, "choices": [],
                         "usage": {"prompt_tokens": 3, "completion_tokens": len(words), "total_tokens": 3 + len(words)}}
                self._chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")
        except (BrokenPipeError, ConnectionResetError):
            with self.upstream.lock:
                self.upstream.aborted += 1
            self.close_connection = True

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _json(self, status: int, document) -> None:
        data = json.dumps(document).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def server_context(directory: str) -> ssl.SSLContext:
    """A copy's mutual TLS from the files of its machine's TLS directory: its certificate, and client
    certificates of the authority required."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(f"{directory}/copy.pem", f"{directory}/copy.key")
    context.load_verify_locations(f"{directory}/ca.pem")
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def main() -> None:
    parser = argparse.ArgumentParser(description="A small OpenAI-like engine (the gateway's tests and benchmark).")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="engine")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--pause", type=float, default=0.0, help="seconds between two streamed tokens")
    parser.add_argument("--tls-dir", help="serve mutual TLS as a copy does: ca.pem, copy.pem, copy.key in it")
    args = parser.parse_args()
    upstream = Upstream(args.name, port=args.port, tokens=args.tokens, pause=args.pause,
                        tls=server_context(args.tls_dir) if args.tls_dir else None)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(f"listening on {upstream.url}", flush=True)
    stop.wait()
    upstream.close()


if __name__ == "__main__":
    main()
