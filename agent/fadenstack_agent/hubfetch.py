"""The HTTP client behind ``model download`` and ``hub check``: the Hugging
Face Hub (or the lab's stand-in at ``HF_ENDPOINT``) reached by the machine
itself.

A file is downloaded from ``{endpoint}/{repo}/resolve/{revision}/{path}``
into ``<store>/blobs/<sha256>.part``, resumed with a ``Range`` request from
what the ``.part`` holds, and becomes the blob ``<sha256>`` only when the
whole file's sha256 is the one the spec names.  Redirects are followed (the
hub sends its large files to a CDN), but the token goes only to the
endpoint's own scheme, host and port.  The token is never written anywhere:
``Download`` keeps it to build one header, and every message that could
carry the hub's words goes through ``scrub``.
"""

import errno
import fcntl
import hashlib
import http.client
import os
import re
import socket
import ssl
import time
import urllib.parse

from . import get_version
from .blobstore import BlobFiles
from .files import free_bytes, fsync_dir, human, remove_quietly
from .protocol import BAD_INPUT, NO_ROOM, NOT_RETRYABLE, RETRYABLE, UNREACHABLE, AgentError

CONNECT_TIMEOUT, READ_TIMEOUT = 10.0, 30.0
PROGRESS_EVERY = 0.25
PIECE = 1 << 20
MAX_REDIRECTS = 5
RETRIES, FIRST_PAUSE = 3, 0.5          # tries in a row that bring no byte, before giving up
REDIRECTS = (301, 302, 303, 307, 308)
CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class _Dropped(Exception):
    """The hub went away, or answered something worth asking again."""


def reason(exc, timeout: float, host: str) -> str:
    """Why a connection failed, in words: connection refused, no route to host, timed out after N s, ..."""
    if isinstance(exc, socket.gaierror):
        return "the name %s does not resolve" % host
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return "timed out after %g s" % timeout
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return "its TLS certificate is not trusted (%s)" % (exc.verify_message or exc.reason)
    if isinstance(exc, OSError) and exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return "no route to host"
    if isinstance(exc, ConnectionResetError):
        return "the connection was reset"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "the connection closed before an answer"
    return str(getattr(exc, "strerror", None) or exc or type(exc).__name__)


def scrub(text: str, token) -> str:
    """``text`` without the token (the hub's own words are quoted in errors)."""
    return text.replace(token, "[token]") if token else text


def _origin(url: str) -> tuple:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port or (443 if parts.scheme == "https" else 80)


def check_url(url, what: str) -> str:
    """An http(s) URL without spaces, query or user (it shows in messages), without a trailing '/';
    bad_input names ``what``."""
    from_spec = url if isinstance(url, str) else ""
    try:
        parts = urllib.parse.urlsplit(from_spec)
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:
        parts, port_ok = None, False
    if not parts or parts.scheme not in ("http", "https") or not parts.hostname or not port_ok \
            or parts.query or parts.fragment or "@" in parts.netloc or any(c.isspace() or ord(c) < 32 for c in from_spec):
        raise AgentError(BAD_INPUT, "%s must look like https://huggingface.co or http://HOST:PORT, got %r"
                         % (what, str(url)[:200]))
    return from_spec.rstrip("/")


def get(url: str, headers: dict, *, token=None, token_origin=None, timeout: float, read_timeout=None):
    """GET ``url`` following redirects; ``(connection, response)``.

    ``Authorization`` goes only to ``token_origin`` (the endpoint's scheme,
    host and port).  Connection failures raise ``_Dropped`` with the reason."""
    for _ in range(MAX_REDIRECTS + 1):
        scheme, host, port = _origin(url)
        parts = urllib.parse.urlsplit(url)
        cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
        conn = cls(host, port, timeout=timeout)
        sent = dict(headers, **{"User-Agent": "fadenstack-agent/" + get_version(), "Accept-Encoding": "identity"})
        if token and (scheme, host, port) == token_origin:
            sent["Authorization"] = "Bearer " + token
        limit = timeout
        try:
            conn.connect()
            limit = read_timeout or timeout
            conn.sock.settimeout(limit)
            conn.request("GET", (parts.path or "/") + ("?" + parts.query if parts.query else ""), headers=sent)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise _Dropped(reason(exc, limit, host))
        location = resp.getheader("Location")
        if resp.status not in REDIRECTS or not location:
            return conn, resp
        conn.close()
        url = urllib.parse.urljoin(url, location)
        if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            raise AgentError(NOT_RETRYABLE, "the hub sent a redirect to a URL that is not http(s)")
    raise AgentError(NOT_RETRYABLE, "the hub redirected more than %d times" % MAX_REDIRECTS)


def hub_check(url: str, timeout: float) -> dict:
    """One real GET of ``{url}/api/models?limit=1``; ``unreachable`` in words when it fails."""
    started = time.monotonic()
    host = _origin(url)[1]
    try:
        conn, resp = get(url + "/api/models?limit=1", {"Accept": "application/json"}, timeout=timeout)
        try:
            resp.read(1 << 20)
        finally:
            conn.close()
    except _Dropped as exc:
        raise AgentError(UNREACHABLE, "cannot reach the hub at %s: %s" % (url, exc))
    except (OSError, http.client.HTTPException) as exc:
        raise AgentError(UNREACHABLE, "cannot reach the hub at %s: %s" % (url, reason(exc, timeout, host)))
    if resp.status != 200:
        raise AgentError(UNREACHABLE, "the hub at %s answered HTTP status %d (%s)" % (url, resp.status, resp.reason))
    return {"ok": True, "status": resp.status, "seconds": round(time.monotonic() - started, 3)}


class Download:
    """The files of one model from the hub into the store's blobs: ``run()`` -> counts.

    ``spec``: ``{"endpoint", "repo", "revision", "files", "token"}`` (checked)."""

    def __init__(self, spec: dict, store: str, out):
        self.spec, self.store, self.out = spec, store, out
        self.repo, self.revision, self.token = spec["repo"], spec["revision"], spec.get("token")
        self.origin = _origin(spec["endpoint"])
        self.fetched = self.resumed = self.downloaded = 0
        self.started = time.monotonic()
        self.buf = memoryview(bytearray(PIECE))

    def url(self, path: str) -> str:
        """``{endpoint}/{repo}/resolve/{revision}/{path}``, each part URL-quoted."""
        def quoted(text: str) -> str:
            return "/".join(urllib.parse.quote(part, safe="") for part in text.split("/"))

        return "%s/%s/resolve/%s/%s" % (self.spec["endpoint"], quoted(self.repo), quoted(self.revision), quoted(path))

    def run(self, missing: list) -> dict:
        """Download ``missing`` (files whose blob is not complete) after one room check."""
        self.check_room(missing)
        for f in missing:
            self.one_file(f)
        now = time.monotonic()
        return {"files_downloaded": self.downloaded, "bytes_downloaded": self.fetched, "resumed_bytes": self.resumed,
                "seconds": round(now - self.started, 3), "rate": int(self.fetched / max(now - self.started, 1e-6))}

    def check_room(self, missing: list) -> None:
        need = 0
        for f in missing:
            try:
                need += f["size"] - min(f["size"], os.stat(BlobFiles(self.store, f["digest"]).part).st_size)
            except OSError:
                need += f["size"]
        free = free_bytes(os.path.join(self.store, "blobs"))
        if need > free:
            raise AgentError(NO_ROOM, "Needs %s free in %s for %d files of %s at %s; %s are free."
                             % (human(need), self.store, len(missing), self.repo, self.revision, human(free)))

    # -------------------------------------------------------------- one file

    def one_file(self, f: dict) -> None:
        """Download one file into its ``.part`` (resumed), check its sha256, make it the blob."""
        files = BlobFiles(self.store, f["digest"])
        os.makedirs(files.dir, exist_ok=True)
        part = _Part(os.open(files.part, os.O_RDWR | os.O_CREAT, 0o644), f)
        locked = False
        try:
            try:
                fcntl.flock(part.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise AgentError(RETRYABLE, "another download or fetch of %s is running on this machine" % f["path"])
            locked = True
            if os.path.isfile(files.path):
                return                         # another command finished it while we opened the .part
            remove_quietly(files.state)        # a fetch's chunk record does not describe what we write
            self._resume(part)
            failures, pause = 0, FIRST_PAUSE
            while True:
                before = self.fetched
                try:
                    self._request(part)
                    if part.have >= f["size"]:
                        break
                    continue
                except _Dropped as exc:
                    failures = 0 if self.fetched > before else failures + 1
                    said = scrub(str(exc), self.token)
                    if failures >= RETRIES:
                        raise AgentError(UNREACHABLE, "could not download %s of %s from the hub at %s (at byte %d "
                                                      "of %d): %s" % (f["path"], self.repo, self.spec["endpoint"],
                                                                      part.have, f["size"], said))
                    self.out.log("the hub: %s; trying %s again from byte %d in %.1f s"
                                 % (said, f["path"], part.have, pause))
                    time.sleep(pause)
                    pause *= 2
            self._finish(part, files)
            self.downloaded += 1
        finally:
            if locked and part.have == 0 and os.path.exists(files.part):
                remove_quietly(files.part)     # nothing arrived: leave no empty .part behind
            os.close(part.fd)

    def _resume(self, part) -> None:
        """Hash again what the ``.part`` already holds: the download goes on from there."""
        have = os.fstat(part.fd).st_size
        if have > part.size:
            part.restart()
            return
        while part.have < have:
            data = os.pread(part.fd, min(PIECE, have - part.have), part.have)
            if not data:
                break
            part.whole.update(data)
            part.have += len(data)
        if part.have:
            self.resumed += part.have
            self.out.log("resuming %s at byte %d of %d" % (part.path, part.have, part.size))

    def _request(self, part) -> None:
        """One GET from the first byte the ``.part`` lacks, read to its end (or ``_Dropped``)."""
        f, have = part.f, part.have
        headers = {"Range": "bytes=%d-" % have} if have else {}
        conn, resp = get(self.url(f["path"]), headers, token=self.token, token_origin=self.origin,
                         timeout=CONNECT_TIMEOUT, read_timeout=READ_TIMEOUT)
        try:
            if resp.status == 206:
                m = CONTENT_RANGE.match(resp.getheader("Content-Range") or "")
                if not m or int(m.group(1)) != have:
                    raise AgentError(NOT_RETRYABLE, "the hub answered bytes %r of %s to a request from byte %d"
                                     % (resp.getheader("Content-Range"), f["path"], have))
                self._check_size(f, m.group(3))
            elif resp.status == 200:
                self._check_size(f, resp.getheader("Content-Length") or "*")
                if have:
                    self.out.log("the hub sent %s whole, not from byte %d: starting it over" % (f["path"], have))
                    part.restart()
            elif resp.status == 416 and have:
                self.out.log("the hub has no byte %d of %s (HTTP 416): starting it over" % (have, f["path"]))
                part.restart()                 # the .part holds more than the hub's file: not this file
                return
            else:
                self._refused(resp, f)
            self._body(part, resp)
        finally:
            conn.close()

    def _check_size(self, f: dict, total: str) -> None:
        if total.isdigit() and int(total) != f["size"]:
            raise AgentError(NOT_RETRYABLE, "the hub holds %s bytes for %s of %s at %s, not %d: another file than "
                                            "the spec names" % (total, f["path"], self.repo, self.revision, f["size"]))

    def _refused(self, resp, f: dict) -> None:
        """Raise the hub's refusal in words (``_Dropped`` for what may pass)."""
        status, code = resp.status, resp.getheader("X-Error-Code") or ""
        said = scrub((resp.getheader("X-Error-Message") or resp.reason or "").strip()[:300], self.token)
        repo = self.repo
        if code == "RepoNotFound":
            message = "%s is not on the hub at %s (or it is private)" % (repo, self.spec["endpoint"])
        elif status == 401:
            message = ("the hub refused the token for %s: check the server's Hugging Face token" % repo
                       if self.token else
                       "the hub asks for a token for %s (a gated model): set the server's Hugging Face token" % repo)
        elif status == 403:
            message = ("the token has no access to %s: request access to the model on the hub" % repo
                       if self.token else "the hub refused access to %s (HTTP 403)" % repo)
        elif status == 404 and code == "RevisionNotFound":
            message = "%s has no revision %s on the hub" % (repo, self.revision)
        elif status == 404:
            message = "%s at %s has no file %s on the hub" % (repo, self.revision, f["path"])
        elif status in (408, 429) or status >= 500:
            raise _Dropped("HTTP %d %s" % (status, said))
        else:
            message = "the hub answered HTTP %d for %s of %s" % (status, f["path"], repo)
        raise AgentError(NOT_RETRYABLE, message + (" (the hub said: %s)" % said if said and status != 401 else ""))

    def _body(self, part, resp) -> None:
        last, since, at_start = 0.0, time.monotonic(), part.have
        while part.have < part.size:
            try:
                n = resp.readinto(self.buf[:min(PIECE, part.size - part.have)])
            except (OSError, http.client.HTTPException) as exc:
                raise _Dropped("connection lost at byte %d of %s: %s"
                               % (part.have, part.path, reason(exc, READ_TIMEOUT, self.origin[1])))
            if not n:
                raise _Dropped("connection closed at byte %d of %s" % (part.have, part.path))
            data = self.buf[:n]
            self._write(part, data)
            part.whole.update(data)
            part.have += n
            self.fetched += n
            now = time.monotonic()
            if now - last >= PROGRESS_EVERY or part.have == part.size:
                last = now
                self.out.progress(digest=part.f["digest"], file=part.path, bytes=part.have, total=part.size,
                                  rate=int((part.have - at_start) / max(now - since, 1e-6)))

    def _write(self, part, data) -> None:
        offset = part.have
        try:
            while data:
                written = os.pwrite(part.fd, data, offset)
                data, offset = data[written:], offset + written
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise AgentError(NO_ROOM, "The store %s ran out of room at byte %d of %s; %s are free. What "
                                          "arrived is kept for a later download." % (self.store, offset, part.path,
                                                                                      human(free_bytes(self.store))))
            raise AgentError(RETRYABLE, "cannot write %s: %s" % (part.path, exc.strerror or exc))

    def _finish(self, part, files: BlobFiles) -> None:
        found, f = part.whole.hexdigest(), part.f
        if found != f["digest"]:
            remove_quietly(files.part)
            raise AgentError(NOT_RETRYABLE, "%s of %s from the hub has the sha256 %s, not %s: removed it (the spec "
                                            "or the hub's file is wrong)" % (f["path"], self.repo, found, f["digest"]))
        os.fsync(part.fd)
        os.replace(files.part, files.path)
        fsync_dir(files.dir)


class _Part:
    """A file on its way: the open ``.part``, the bytes it holds and their sha256 so far."""

    def __init__(self, fd: int, f: dict):
        self.fd, self.f, self.path, self.size = fd, f, f["path"], f["size"]
        self.have, self.whole = 0, hashlib.sha256()

    def restart(self) -> None:
        os.ftruncate(self.fd, 0)
        self.have, self.whole = 0, hashlib.sha256()
