"""The gateway's ASGI application: OpenAI's API in front of every serving copy.

``GET /v1/models``, ``GET /v1/models/<name>``, and ``POST /v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings``, with ``Authorization: Bearer <key>``; ``GET /health`` (no key) for load balancers;
``GET /metrics`` for Prometheus, with the metrics token (``metrics.py``).

A request's ``model`` names a deployment (names are unique across the console). It goes to the copy
with the fewest requests in flight in this process (ties take turns), or for a deployment routed cache-aware to
the copy that served the prompt's prefix (``routes.py``, ``prefix.py``), over keep-alive connections
(``upstream.py``; no read timeout on streams). The answer's status, headers and body are passed on as they
come, chunk by chunk, without buffering. A copy that refuses the connection (or does not accept it
within FADEN_GATEWAY_CONNECT_TIMEOUT) has not seen the body, so the request goes to another copy; that
copy is out of rotation at once and reported (``failures.py``) until its ``/health`` answers again. A
copy that took the request and closed the connection before a byte of its answer (its engine died) is
taken out the same way, and the request is sent once more, to one other copy: generating has no side
effect but the work, and a request that kills engines then kills two, not every copy in turn.

Nothing here touches the database or Redis on a request: the background work (``background.py``) refreshes
the tables in a thread every FADEN_GATEWAY_REFRESH seconds (``routes.py``), writes figures and failure
reports from another every second (``traffic.py``), and probes the copies out of rotation. A key's limits are
decided from memory too (``limits.py``: every process's counts, shared at that flush). Errors are OpenAI's
shape: ``{"error": {"message", "type", "param", "code"}}``.
"""
from __future__ import annotations

import asyncio
import json
import time

from deployments.gateway import keys, upstream
from deployments.gateway.answer import Answer
from deployments.gateway.background import BackgroundWork, GatewayConfig
from deployments.gateway.metrics import GatewayMetrics, MetricsConfig
from deployments.gateway.protocol import CLIENT, Client
from deployments.gateway.routes import CopyRoute, DeploymentRoute, KeyEntry, snapshot_load

FORWARDED = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
# Request headers a copy gets from the client (not the key: the gateway is the one that checks it).
PASSED_UP = frozenset({b"content-type", b"accept", b"accept-encoding", b"user-agent", b"x-request-id"})
# Response headers that are about one connection, not the answer (the server's own come from uvicorn).
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
                        b"transfer-encoding", b"upgrade", b"server", b"date"})
JSON_HEADERS = [(b"content-type", b"application/json")]
NAMES_SHOWN = 20  # deployments named in an error at most
SEEN_KEYS = 1024  # keys' entries kept by their Authorization header (forgotten all at once past this)


class ClientGone(Exception):
    """The client closed its connection before the gateway had read its request."""


class Gateway:
    """The ASGI application (one per process): the request path. ``load`` reads the tables (the database by default)."""

    def __init__(self, config: GatewayConfig, *, load=snapshot_load, metrics: MetricsConfig | None = None):
        self.config = config
        self.background = BackgroundWork(config, load=load)
        self.table = self.background.table  # read here on each request, refreshed in place by the background work
        self.pool: upstream.Pool | None = None
        self.metrics = GatewayMetrics(self.table, metrics)  # GET /metrics (metrics.py)
        self._seen: dict[bytes, KeyEntry] = {}  # Authorization header -> the key's entry in ``_seen_table``
        self._seen_table: dict | None = None

    @classmethod
    def from_settings(cls) -> Gateway:
        return cls(GatewayConfig.from_settings(), metrics=MetricsConfig.from_settings())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            await self.http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self.lifespan(receive, send)

    # -- start and stop -----------------------------------------------------------------------------------

    async def lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.start()
                except Exception as exc:  # the server says so and exits
                    await send({"type": "lifespan.startup.failed", "message": f"The gateway did not start: {exc}"})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def start(self) -> None:
        """The connection pool, then the background work: the first tables (so the first request finds its
        routes) and the loops."""
        self.pool = upstream.Pool(connect_timeout=self.config.connect_timeout)
        await self.background.start(self.pool)
        self.metrics.start()

    async def stop(self) -> None:
        await self.metrics.stop()
        await self.background.stop()
        if self.pool is not None:
            self.pool.close()

    # -- requests ------------------------------------------------------------------------------------------

    async def http(self, scope, receive, send) -> None:
        path = scope["path"]
        if path == "/health":
            await _answer(send, 200, b'{"status":"ok"}')
            return
        if path == "/metrics":  # for Prometheus, with the metrics token rather than a key
            await self.metrics.scrape(scope, send)
            return
        key = self.authenticate(scope["headers"])
        if not isinstance(key, KeyEntry):
            self.background.counts.refused += 1
            self.metrics.refused("invalid_api_key")
            await _error(send, 401, key, code="invalid_api_key")
            return
        self.background.keys_used[key.id] = time.time()
        method = scope["method"]
        if path in FORWARDED:
            if method != "POST":
                await self._refuse(send, 405, f"{path} takes POST, not {method}.", code="method_not_allowed")
                return
            await self.forward(scope, receive, send, key)
        elif path == "/v1/models" and method == "GET":
            await _answer_json(send, 200, {"object": "list", "data": [_model(route) for route in self.table.serving(key)]})
        elif path.startswith("/v1/models/") and method == "GET":
            name = path[len("/v1/models/"):]
            route = self.table.deployments.get(name)
            if route is None or not route.in_rotation or not key.may_use(name):
                await self._refuse(send, 404, self._unknown_model(name, key), code="model_not_found", param="model")
            else:
                await _answer_json(send, 200, _model(route))
        else:
            await self._refuse(send, 404, f"Invalid URL ({method} {path}): the gateway answers GET /v1/models and POST "
                                          f"{', '.join(sorted(FORWARDED))}.", code="unknown_url")

    def authenticate(self, headers) -> KeyEntry | str:
        """The key's entry, or why it is refused (in words, never with the key in full). The entries of the keys
        presented lately are kept by their header's value, for as long as the key table is the same: a key is hashed
        once, not on every request."""
        for name, value in headers:
            if name == b"authorization":
                if self._seen_table is not self.table.keys:
                    self._seen, self._seen_table = {}, self.table.keys
                elif (entry := self._seen.get(value)) is not None:
                    return entry
                scheme, _, secret = value.decode("latin-1").strip().partition(" ")
                secret = secret.strip()
                if scheme.lower() != "bearer" or not secret:
                    return ("The Authorization header is not a Bearer key: send Authorization: Bearer <your key>. "
                            "Operators create keys on the console's Gateway page.")
                entry = self.table.keys.get(keys.key_hash(secret))
                if entry is None:
                    shown = f"{secret[:8]}…{secret[-4:]}" if len(secret) > 16 else "…"
                    return (f"Incorrect API key provided: {shown}. Operators create keys on the console's Gateway "
                            "page; a key made there works within a second.")
                if entry.revoked:
                    return f"The API key {secret[:8]}… was revoked on the console's Gateway page: ask an Operator for another."
                if len(self._seen) >= SEEN_KEYS:
                    self._seen.clear()
                self._seen[value] = entry
                return entry
        return ("You didn't provide an API key. Send it in an Authorization header using Bearer auth "
                "(Authorization: Bearer <your key>); Operators create keys on the console's Gateway page.")

    async def forward(self, scope, receive, send, key: KeyEntry) -> None:
        started = time.perf_counter()
        try:
            body = await _read_body(receive, self.config.max_body)
        except ClientGone:
            return
        if body is None:
            await self._refuse(send, 413, f"The request body is larger than the {self.config.max_body:,} bytes the "
                                          "gateway accepts.", code="request_too_large")
            return
        try:
            request = json.loads(body.decode())  # JSON between systems is UTF-8 (RFC 8259): no guessing of the encoding
        except (ValueError, RecursionError) as exc:
            await self._refuse(send, 400, f"We could not parse the JSON body of your request ({type(exc).__name__}): "
                                          "the gateway expects a JSON object with a \"model\".", code="invalid_json")
            return
        name = request.get("model") if isinstance(request, dict) else None
        if not isinstance(name, str) or not name:
            await self._refuse(send, 400, "You must provide a model parameter: the name of a deployment, as "
                                          "GET /v1/models lists them.", code="missing_model", param="model")
            return
        route = self.table.deployments.get(name)
        if route is None:
            await self._refuse(send, 404, self._unknown_model(name, key), code="model_not_found", param="model")
            return
        if not key.may_use(name):
            await self._refuse(send, 403, f"This API key may not use the model '{name}': it is limited to "
                                          f"{_names(sorted(key.allowed))}. Ask an Operator for a key that may.",
                               code="model_not_allowed", param="model")
            return
        if (refused := self.background.limits.admit(key)) is not None:  # over the key's limits (limits.py): a 429
            self.metrics.limit_refused(refused.kind)
            await _answer(send, 429, refused.body, refused.headers)
            return
        stream = request.get("stream") is True
        keys = route.prompt_keys(request)  # None unless the deployment is routed cache-aware
        # From here on, a client that goes away cancels the request: the copy's connection is closed, so
        # it stops generating for nobody (and a request waiting for its answer does not keep a slot). The gateway's
        # protocol says so (protocol.py); under another server, a task watches for the disconnect.
        task = asyncio.current_task()
        client = scope.get(CLIENT)
        watcher = None
        if client is None:
            client = Client()
            watcher = asyncio.ensure_future(_watch_disconnect(receive, client))
        elif client.gone:
            return  # it left once its body was read
        client.task, client.armed = task, True
        error = True
        answer = Answer(send)  # notes the status, the first chunk and the answer's end (its usage: answer.py)
        try:
            error = await self._send_to_a_copy(scope, receive, answer, route, body, stream, keys)
            client.flush()  # the answer's end to the client before the counting below
        except asyncio.CancelledError:
            if not client.gone:
                raise
            task.uncancel()
            error = False  # the client left: not the copy's error
        finally:
            client.armed = False
            if watcher is not None:
                watcher.cancel()
            self.background.counts.record(route.id, seconds=time.perf_counter() - started, error=error)
            self.metrics.record(route.name, answer, started, error)
            self.background.limits.answered(key, answer.tokens(), error=error)

    async def _send_to_a_copy(self, scope, receive, send, route: DeploymentRoute, body: bytes, stream: bool,
                              keys: list[int] | None = None) -> bool:
        """Forward to the least busy copy, and to the next one while copies refuse the connection (or, once, to
        another when a copy closed the connection before it answered); True for an error."""
        passed = b"".join([name + b": " + value + b"\r\n" for name, value in scope["headers"] if name in PASSED_UP])
        passed += b"Content-Length: %d\r\n\r\n" % len(body)
        query = scope["query_string"]
        path = scope["path"] + "?" + query.decode("latin-1") if query else None  # (a head made each time: not kept)
        timeout = None if stream else self.config.read_timeout
        tried: set[int] = set()
        refused: list[str] = []
        broke: list[str] = []  # copies that took the request and closed the connection without an answer
        while (copy := route.pick(tried, keys)) is not None:
            tried.add(copy.id)
            copy.in_flight += 1
            try:
                start = copy.head(scope["path"]) if path is None else upstream.request_start(
                    "POST", path, copy.host, copy.port, upstream.copy_auth(copy.api_key))
                head = start + passed
                try:
                    response = await self.pool.request(copy.host, copy.port, head, body, timeout=timeout,
                                                       tls=self.background.tls_for(copy))
                except upstream.ConnectFailed as exc:
                    self.background.copy_failed(route, copy, str(exc))
                    refused.append(f"copy #{copy.number}: {exc}")
                    continue
                except upstream.TimedOut as exc:
                    await self._refuse(send, 504, f"Copy #{copy.number} of '{route.name}' {exc}.", code="copy_timeout",
                                       kind="server_error", counted=False)
                    return True
                except upstream.BrokeOff as exc:  # before a byte of its answer: the engine died or was killed
                    self.background.copy_failed(route, copy, f"{exc}")
                    if not broke:  # sent once more, to one other copy (a request that kills engines kills two, not all)
                        broke.append(f"Copy #{copy.number} of '{route.name}' {exc}")
                        continue
                    broke.append(f"copy #{copy.number} {exc}")
                    break
                return await self._pass_on(receive, send, route, copy, response, timeout)
            finally:
                copy.in_flight -= 1
        if broke:
            also = f"; sent once more, {broke[1]}" if len(broke) > 1 else ""
            await self._refuse(send, 502, f"{broke[0]}{also}; out of rotation until a health check passes.",
                               code="copy_failed", kind="server_error", counted=False)
            return True
        if route.copies:
            last = f" ({'; '.join(refused[-3:])})" if refused else ""
            why = (f"the gateway could not reach any of its {len(route.copies)} serving "
                   f"cop{'y' if len(route.copies) == 1 else 'ies'}{last}; they come back as soon as their health check passes")
        else:
            why = "its copies are queued, starting, stopped or failed: the deployment's page in the console says which"
        await self._refuse(send, 503, f"No copy of '{route.name}' is serving now; {why}.", code="no_copy_serving",
                           kind="server_error", counted=False)
        return True

    async def _pass_on(self, receive, send, route: DeploymentRoute, copy: CopyRoute, response: upstream.Response,
                       timeout: float | None) -> bool:
        """The copy's answer to the client, each chunk as it arrives."""
        try:
            await send({"type": "http.response.start", "status": response.status,
                        "headers": [(n, v) for n, v in response.headers if n not in HOP_BY_HOP]})
            try:
                while chunk := await response.read(timeout):
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except upstream.BrokeOff as exc:
                if not isinstance(exc, upstream.TimedOut):
                    self.background.copy_failed(route, copy, str(exc))
                if any(n == b"content-type" and v.startswith(b"text/event-stream") for n, v in response.headers):
                    event = {"error": {"message": f"Copy #{copy.number} of '{route.name}' {exc}.", "type": "server_error",
                                       "param": None, "code": "copy_failed"}}
                    await send({"type": "http.response.body", "body": b"data: " + json.dumps(event).encode() + b"\n\n"})
                # else: returning without the body's end makes the server close the connection: no whole-looking answer
                return True
            await send({"type": "http.response.body", "body": b""})
            return response.status >= 500
        finally:
            response.close()  # an answer cut short (the client left) closes the connection to the copy

    def _unknown_model(self, name: str, key: KeyEntry) -> str:
        serving = [route.name for route in self.table.serving(key)]
        which = f"the gateway serves {_names(serving)}" if serving else "the gateway serves no model now"
        return f"The model '{name}' does not exist: {which}."

    async def _refuse(self, send, status: int, message: str, *, code: str, param: str | None = None,
                      kind: str = "invalid_request_error", counted: bool = True) -> None:
        if counted:
            self.background.counts.refused += 1
            self.metrics.refused(code)
        await _error(send, status, message, code=code, param=param, kind=kind)


# -- small pieces --------------------------------------------------------------------------------------------


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole request body; None when it is larger than ``limit``."""
    message = await receive()
    if message["type"] == "http.disconnect":
        raise ClientGone
    body = message.get("body", b"")
    if not message.get("more_body"):
        return body if len(body) <= limit else None
    chunks, size = [body], len(body)
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


async def _watch_disconnect(receive, client: Client) -> None:
    """Cancel the request's task when its client goes away before the answer ended (the copy then stops): under a
    server other than the gateway's protocol, which tells ``client`` itself."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            client.hung_up()
            return


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:NAMES_SHOWN])
    return shown + (f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else "")


def _model(route: DeploymentRoute) -> dict:
    return {"id": route.name, "object": "model", "created": route.created, "owned_by": "fadenstack"}


async def _answer(send, status: int, body: bytes, headers=JSON_HEADERS) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _answer_json(send, status: int, document) -> None:
    await _answer(send, status, json.dumps(document).encode())


async def _error(send, status: int, message: str, *, code: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
    await _answer_json(send, status, {"error": {"message": message, "type": kind, "param": param, "code": code}})
