"""The lab hub: a stand-in for the Hugging Face Hub, for a lab with no internet.

It answers the part of the Hub's HTTP API that ``huggingface_hub`` uses to look at and download
a model, with ``endpoint=`` (or ``HF_ENDPOINT``) pointed at it:

- ``GET /api/models`` (``list_models``: ``search``, ``author``, ``limit``),
- ``GET /api/models/{repo}[/revision/{rev}]`` (``model_info``; ``?blobs=true`` adds sizes and LFS sha256),
- ``GET /api/models/{repo}/tree/{rev}`` (``list_repo_tree``, which ``snapshot_download`` reads),
- ``HEAD``/``GET /{repo}/resolve/{rev}/{path}`` (``hf_hub_download``), with single ``Range`` requests.

Files are answered directly (no redirect to a CDN, unlike the real hub) with the headers the client
reads: ``ETag`` (git blob id, or sha256 for LFS files), ``X-Repo-Commit``, ``X-Linked-Etag`` and
``X-Linked-Size`` (LFS files), ``Content-Length``. Errors carry the hub's ``X-Error-Code``
(``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``, ``GatedRepo``), from which the client
picks its exception. A gated model's files need ``Authorization: Bearer TOKEN`` with one of the
hub's tokens: none is a 401, another token a 403 (the client raises ``GatedRepoError`` for both).
The models (``hub_models.MODELS``) are made from seeds on first use and streamed from the cache.
"""

from __future__ import annotations

import json
import re
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from .hub_models import (MODELS, ModelPlan, ModelStore, RepoFile, element_count, lfs_pointer_size, safetensors_size,
                         small_files)
from .util import LabError

DEFAULT_PORT = 8090
# A fixed date for every model: the files never change, so neither does their history.
CREATED_AT = "2026-01-01T00:00:00.000Z"
RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


class HubError(Exception):
    """An answer the real hub gives as an error: the status, its ``X-Error-Code`` and message."""

    def __init__(self, status: int, code: str | None, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}


class HubServer(ThreadingHTTPServer):
    """The hub on one address; ``serve_forever()`` answers until ``shutdown()``."""

    daemon_threads = True

    def __init__(self, bind: str = "127.0.0.1", port: int = DEFAULT_PORT, tokens=(),
                 cache_dir: Path | None = None, log=None):
        self.store = ModelStore(cache_dir)
        self.tokens = frozenset(tokens)
        self.log = log  # a file for one line per request, or None
        super().__init__((bind, port), HubHandler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects
    server_version = "fadenstack-lab-hub"
    server: HubServer

    def do_GET(self):
        self._answer(send_body=True)

    def do_HEAD(self):
        self._answer(send_body=False)

    def log_message(self, format, *args):
        if self.server.log:
            print(f"hub: {self.address_string()} {format % args}", file=self.server.log, flush=True)

    def _answer(self, send_body: bool) -> None:
        url = urlsplit(self.path)
        query = {key: values[-1] for key, values in parse_qs(url.query).items()}
        segments = [unquote(segment) for segment in url.path.strip("/").split("/")]
        try:
            if segments[:2] == ["api", "models"]:
                self._send_json(self._api(segments[2:], query), send_body)
            elif len(segments) >= 5 and segments[2] == "resolve":
                self._send_file(_plan(segments[:2]), segments[3], "/".join(segments[4:]), send_body)
            else:
                raise HubError(404, None, "Sorry, we can't find the page you are looking for.")
        except HubError as error:
            body = json.dumps({"error": error.message}).encode()
            self.send_response(error.status)
            if error.code:
                self.send_header("X-Error-Code", error.code)
            self.send_header("X-Error-Message", error.message)
            for name, value in error.headers.items():
                self.send_header(name, value)
            self._send_body(body, "application/json; charset=utf-8", send_body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away mid-answer (a cancelled download)

    # ---- /api/models ----

    def _api(self, rest: list[str], query: dict):
        if not rest:
            return model_list(query)
        plan = _plan(rest[:2])
        rest = rest[2:]
        if not rest:
            return self._model_info(plan, "main", query)
        if rest[0] == "revision" and len(rest) >= 2:
            return self._model_info(plan, "/".join(rest[1:]), query)
        if rest[0] == "tree" and len(rest) >= 2:
            _check_revision(plan, rest[1])
            return self._tree(plan, "/".join(rest[2:]))
        raise HubError(404, None, "Sorry, we can't find the page you are looking for.")

    def _model_info(self, plan: ModelPlan, revision: str, query: dict) -> dict:
        _check_revision(plan, revision)
        info = model_summary(plan)
        sizes = {path: len(content) for path, content in small_files(plan).items()}
        sizes["model.safetensors"] = safetensors_size(plan)
        parameters = sum(element_count(shape) for shape in plan.tensor_shapes().values())
        info |= {
            "author": plan.repo_id.split("/")[0], "sha": plan.commit_sha, "lastModified": CREATED_AT,
            "disabled": False, "cardData": {"license": "apache-2.0", "pipeline_tag": "text-generation"},
            "config": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
            "spaces": [], "usedStorage": sum(sizes.values()),
            "safetensors": {"parameters": {"F16": parameters}, "total": parameters},
            "siblings": [{"rfilename": path} for path in sizes],
        }
        if query.get("blobs", "").lower() == "true":  # files_metadata=True: needs the weights' sha256
            info["siblings"] = [_sibling(file) for file in self.server.store.files(plan).values()]
        return info

    def _tree(self, plan: ModelPlan, folder: str) -> list[dict]:
        files = self.server.store.files(plan)
        if folder and folder not in files:
            raise HubError(404, "EntryNotFound", f"{folder} does not exist on \"main\"",
                           {"X-Repo-Commit": plan.commit_sha})
        entries = []
        for file in files.values():
            if folder and file.path != folder:
                continue
            entry = {"type": "file", "oid": file.blob_id, "size": file.size, "path": file.path}
            if file.lfs:
                entry["lfs"] = {"oid": file.sha256, "size": file.size, "pointerSize": lfs_pointer_size(file)}
            entries.append(entry)
        return entries

    # ---- /{repo}/resolve/{revision}/{path} ----

    def _send_file(self, plan: ModelPlan, revision: str, path: str, send_body: bool) -> None:
        _check_revision(plan, revision)
        if plan.gated:
            self._check_access(plan)
        file = self.server.store.files(plan).get(path)
        if file is None:
            raise HubError(404, "EntryNotFound", f"{path} does not exist on \"{revision}\"",
                           {"X-Repo-Commit": plan.commit_sha})
        start, end = _byte_range(self.headers.get("Range"), file.size)
        partial = (start, end) != (0, file.size - 1)
        self.send_response(206 if partial else 200)
        etag = f'"{file.sha256 if file.lfs else file.blob_id}"'
        self.send_header("ETag", etag)
        self.send_header("X-Repo-Commit", plan.commit_sha)
        if file.lfs:
            self.send_header("X-Linked-Etag", etag)
            self.send_header("X-Linked-Size", str(file.size))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Disposition", f"inline; filename*=UTF-8''{Path(path).name}; "
                                                f'filename="{Path(path).name}"')
        if partial:
            self.send_header("Content-Range", f"bytes {start}-{end}/{file.size}")
        self.send_header("Content-Type", _content_type(path))
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        if send_body and end >= start:
            with open(file.local_path, "rb") as source:  # from disk, never the whole file in memory
                self.connection.sendfile(source, offset=start, count=end - start + 1)

    def _check_access(self, plan: ModelPlan) -> None:
        authorization = self.headers.get("Authorization", "")
        token = authorization[len("Bearer "):].strip() if authorization.startswith("Bearer ") else ""
        if not token:
            raise HubError(401, "GatedRepo", f"Access to model {plan.repo_id} is restricted. You must have "
                                             "access to it and be authenticated to access it. Please log in.")
        if token not in self.server.tokens:
            raise HubError(403, "GatedRepo", f"Access to model {plan.repo_id} is restricted and you are not "
                                             "in the authorized list.")

    # ---- answers ----

    def _send_json(self, value, send_body: bool) -> None:
        self.send_response(200)
        self._send_body(json.dumps(value).encode(), "application/json; charset=utf-8", send_body)

    def _send_body(self, body: bytes, content_type: str, send_body: bool) -> None:
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)


def model_summary(plan: ModelPlan) -> dict:
    """What ``/api/models`` says of a model (``model_info`` says more)."""
    return {
        "_id": plan.commit_sha[:24], "id": plan.repo_id, "modelId": plan.repo_id, "likes": 0,
        "trendingScore": 0, "private": False, "gated": "manual" if plan.gated else False, "downloads": 0,
        "tags": ["transformers", "safetensors", "llama", "text-generation", "fadenstack-lab"],
        "pipeline_tag": "text-generation", "library_name": "transformers", "createdAt": CREATED_AT,
    }


def model_list(query: dict) -> list[dict]:
    plans = [plan for plan in MODELS.values()
             if query.get("search", "").lower() in plan.repo_id.lower()
             and (not query.get("author") or plan.repo_id.split("/")[0] == query["author"])]
    if query.get("limit", "").isdigit():
        plans = plans[:int(query["limit"])]
    return [model_summary(plan) for plan in plans]


def _plan(repo: list[str]) -> ModelPlan:
    plan = MODELS.get("/".join(repo))
    if plan is None:
        raise HubError(404, "RepoNotFound", "Repository not found")
    return plan


def _check_revision(plan: ModelPlan, revision: str) -> None:
    if revision not in ("main", plan.commit_sha):
        raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")


def _sibling(file: RepoFile) -> dict:
    sibling = {"rfilename": file.path, "size": file.size, "blobId": file.blob_id}
    if file.lfs:
        sibling["lfs"] = {"sha256": file.sha256, "size": file.size, "pointerSize": lfs_pointer_size(file)}
    return sibling


def _byte_range(header: str | None, size: int) -> tuple[int, int]:
    """The first and last byte asked for: one range (``a-b``, ``a-``, ``-n``); anything else is the whole."""
    match = RANGE.match(header.strip()) if header else None
    if not match or match.groups() == ("", ""):
        return 0, size - 1
    first, last = match.groups()
    if first == "":
        start, end = max(0, size - int(last)), size - 1
    else:
        start, end = int(first), min(int(last), size - 1) if last else size - 1
    if start >= size or start > end:
        raise HubError(416, None, "Requested range not satisfiable", {"Content-Range": f"bytes */{size}"})
    return start, end


def _content_type(path: str) -> str:
    if path.endswith(".json"):
        return "application/json; charset=utf-8"
    if path.endswith((".md", ".gitattributes")):
        return "text/plain; charset=utf-8"
    return "application/octet-stream"


def read_token_file(path: str) -> list[str]:
    """The tokens in a file, one a line (``--token-file``: a token kept off every command line)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise LabError(f"token file {path}: {exc.strerror or exc}") from exc
    tokens = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    if not tokens:
        raise LabError(f"token file {path}: holds no token")
    return tokens


def serve(bind: str, port: int, tokens: list[str], log=sys.stderr) -> None:
    """``faden lab hub``: serve until interrupted, saying where on stdout."""
    # Stopped by SIGINT or SIGTERM, even when started with them ignored (a background job of a script).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    server = HubServer(bind, port, tokens, log=log)
    print(f"lab hub: {server.url} (models: {', '.join(MODELS)}; cache {server.store.cache_dir})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:  # the way to stop it: not a failure
        print("lab hub: stopped", file=sys.stderr)
    finally:
        server.server_close()
